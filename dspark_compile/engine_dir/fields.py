"""The two manifest fields a runnable engine needs beyond what the artifact checks:
`model_config` (the checkpoint's config.json) and `build_config` (BuildConfig.to_manifest()).

An engine missing either, or holding one that does not parse, is refused with an ArtifactError
naming the field, before anything is allocated; read by the runtime and by `dspark-compile
run` (which checks the requests against them before loading the programs).

A manifest is checksummed, but a user fixing a path by hand recomputes the checksum, so the two
fields are also checked against what they describe (`check_engine_fields`, called by
load_engine): each build_config field's type, the buckets and prefill chunks against the
programs listed, the weights' shapes against the model `model_config` builds, and the decode
state the two fields size against the state every program takes. A field that does not match
is named; without these checks such an edit failed deep in the load (a shape mismatch against
the exported program, a TypeError, a `load_state_dict` size mismatch)."""
from __future__ import annotations

import dataclasses

from dspark_compile.engine_dir.format import ArtifactError
from dspark_compile.engine_dir.build_config import BuildConfig, NOT_RECORDED
from dspark_compile.models.config import ConfigError, ModelConfig, rope_positions
from dspark_compile.models.state import check_state_fits, state_specs

# build_config field -> (accepted JSON types, what the message says it must be)
_INT, _STR, _BOOL = (int,), (str,), (bool,)
_TYPES = {
    "buckets": ((list,), "a list of positive ints"),
    "max_rows": (_INT, "an int >= 1"),
    "max_seq_len": (_INT, "an int >= 1"),
    "prefill_chunk": (_INT, "an int >= 1"),
    "prefill_chunks": ((list,), "a list of positive ints"),
    "target_programs": (_BOOL, "true or false"),
    "dtype": (_STR, "a dtype name"),
    "act_quant": (_BOOL, "true or false"),
    "kv_fp8": (_BOOL, "true or false"),
    "passes": ((list, type(None)), "a list of pass names or null"),
    "disabled_passes": ((list,), "a list of pass names"),
    "arch": ((str, type(None)), "an arch name or null"),
    "device": (_STR, "a device name"),
    "backend": (_STR, "a backend name"),
    "tp": (_INT, "a rank count >= 1"),
}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(bc: dict) -> None:
    for name, value in bc.items():
        types, what = _TYPES.get(name, ((object,), ""))
        ok = isinstance(value, types) and (bool not in types or isinstance(value, bool))
        if ok and types == _INT:
            ok = _int(value) and value >= 1
        if ok and name in ("buckets", "prefill_chunks"):
            ok = all(_int(x) and x >= 1 for x in value)
        if ok and name in ("passes", "disabled_passes") and value is not None:
            ok = all(isinstance(x, str) for x in value)
        if not ok:
            raise ArtifactError(f"manifest field 'build_config.{name}' must be {what}, got "
                                f"{value!r} — restore it or rebuild", field=f"build_config.{name}")


def engine_configs(manifest: dict):
    """(ModelConfig, BuildConfig) of a validated manifest."""

    for field in ("model_config", "build_config"):
        if field not in manifest:
            raise ArtifactError(f"manifest field '{field}' is missing (not an engine that "
                                "`dspark-compile build` wrote) — rebuild", field=field)
        if not isinstance(manifest[field], dict):
            raise ArtifactError(f"manifest field '{field}' is a {type(manifest[field]).__name__}, "
                                "not a table — rebuild", field=field)
    try:
        cfg = ModelConfig.from_dict(manifest["model_config"])
    except ConfigError as e:
        raise ArtifactError(f"manifest field 'model_config': {e}", field="model_config") from None
    bc = dict(manifest["build_config"])
    # engines written before the field existed ran their exported programs op by op
    bc.setdefault("backend", "aten")
    # engines written before prefill_chunks existed prefill with the eager reference
    bc.setdefault("prefill_chunks", ())
    # and before target_programs existed they had none
    bc.setdefault("target_programs", False)
    # and before tp existed they ran on one device
    bc.setdefault("tp", 1)
    want = [f.name for f in dataclasses.fields(BuildConfig) if f.name not in NOT_RECORDED]
    missing = [k for k in want if k not in bc]
    unknown = sorted(set(bc) - set(want))
    if missing or unknown:
        what = (f"lacks {missing}" if missing else "") + (" and " if missing and unknown else "") \
            + (f"has unknown {unknown}" if unknown else "")
        raise ArtifactError(f"manifest field 'build_config' {what} — rebuild",
                            field=f"build_config.{(missing or unknown)[0]}")
    _check_types({k: list(v) if isinstance(v, tuple) else v for k, v in bc.items()})
    bc["buckets"] = tuple(bc["buckets"])
    bc["prefill_chunks"] = tuple(bc["prefill_chunks"])
    try:
        build = BuildConfig(**bc)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"manifest field 'build_config': {e}", field="build_config") from None
    if not cfg.has_draft:
        raise ArtifactError("manifest field 'model_config': no DSpark draft (dspark_block_size)",
                            field="model_config")
    # the programs' device decided target_sm at the build ("cpu" for CPU programs)
    sm = manifest.get("target_sm")
    cpu_device = str(build.device).split(":")[0] == "cpu"
    if sm is not None and (sm == "cpu") != cpu_device:
        raise ArtifactError(f"manifest field 'build_config.device' is {build.device!r}, the "
                            f"programs were built for target_sm {sm!r} — restore it or rebuild",
                            field="build_config.device")
    return cfg, build


def check_engine_fields(manifest: dict, device=None) -> tuple:
    """model_config and build_config parsed, typed and consistent with the manifest's program
    tables (no program is loaded; check_programs_state and check_weights_table follow), and
    the decode state they size within `device`'s free memory (skipped without a device).
    Returns (ModelConfig, BuildConfig)."""
    cfg, build = engine_configs(manifest)
    buckets = manifest.get("buckets")
    if sorted(build.buckets) != sorted(buckets or ()):
        raise ArtifactError(f"manifest field 'build_config.buckets' is {list(build.buckets)}, "
                            f"the engine's programs are for buckets {buckets} — restore it or "
                            "rebuild", field="build_config.buckets")
    chunks = sorted(int(c) for c in manifest.get("prefill_programs", {}))
    if sorted(build.prefill_chunks) != chunks:
        raise ArtifactError(f"manifest field 'build_config.prefill_chunks' is "
                            f"{list(build.prefill_chunks)}, the engine's prefill programs are for "
                            f"chunks {chunks} — restore it or rebuild",
                            field="build_config.prefill_chunks")
    target = sorted(int(b) for b in manifest.get("target_programs", {}))
    if target != (sorted(build.buckets) if build.target_programs else []):
        raise ArtifactError(f"manifest field 'build_config.target_programs' is "
                            f"{str(build.target_programs).lower()}, the engine has target "
                            f"programs for buckets {target} — restore it or rebuild",
                            field="build_config.target_programs")
    if device is not None:
        try:
            check_state_fits(cfg, build.cache(cfg.dspark_block_size), build.precision(), device,
                             f"the manifest's build_config.max_rows={build.max_rows} and "
                             f"build_config.max_seq_len={build.max_seq_len}")
        except ValueError as e:
            raise ArtifactError(str(e), field="build_config") from None
    return cfg, build


def check_weights_table(cfg, build, tensors: dict) -> None:
    """The weights table against the model model_config builds (on the meta device: shapes
    only, nothing allocated). Called once the programs are loaded: the first meta-device
    module in a process costs seconds of torch's lazy set-up that reading the programs has then
    already done (0.1 s after it)."""
    import torch

    # the reference model imports the kernels, which register the dspark:: ops: importing the
    # format must not (a load registers them itself, after its checks: test_artifact's fresh
    # process), so the model is imported where it is built
    from dspark_compile.models.target import DeepseekV4
    positions = rope_positions(build.max_seq_len, cfg.dspark_block_size)
    with torch.device("meta"):
        if build.tp > 1:
            # one rank's shard (build --tp; every rank's shapes are the same)
            from dspark_compile.models.parallel import ParallelConfig
            from dspark_compile.models.sharding import ParallelDeepseekV4
            model = ParallelDeepseekV4(cfg, ParallelConfig(0, build.tp), build.precision(),
                                       positions)
        else:
            model = DeepseekV4(cfg, build.precision(), positions)
    want = {f"model.{k}": v for k, v in model.state_dict().items()}
    for name, info in sorted(tensors.items()):
        if name not in want:
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        dtype = getattr(torch, str(info.get("dtype")), None) if isinstance(info, dict) else None
        # bytes, not shapes: the build may store a weight in its kernel's layout (the MoE
        # experts: the module's [E, N, K] int8 as [E, n, 1, 64, k] int32 blocks), which keeps
        # the bytes and changes the shape and dtype
        have = _numel(shape) * dtype.itemsize if isinstance(dtype, torch.dtype) else -1
        v = want[name]
        if have != v.numel() * v.element_size():
            raise ArtifactError(f"manifest field 'model_config' does not describe the engine's "
                                f"weights: '{name}' is {shape} {info.get('dtype')} in the "
                                f"weights file, {list(v.shape)} "
                                f"{str(v.dtype).replace('torch.', '')} for model_config — "
                                "restore it or rebuild", field="model_config")
    absent = sorted(set(want) - set(tensors))
    if absent:
        raise ArtifactError(f"manifest field 'model_config' does not describe the engine's "
                            f"weights: its model has {absent[:3]}, which the weights file lacks "
                            "— restore it or rebuild", field="model_config")


def _numel(shape) -> int:
    if not isinstance(shape, list):
        return -1
    n = 1
    for d in shape:
        n *= d if isinstance(d, int) else 0
    return n


def _blame(key: str, dtype, shape, want) -> str:
    """The manifest field that sizes the state dimension where the program's (`dtype`,
    `shape`) and the state spec `want` differ."""
    if dtype != want.dtype:
        return "build_config.dtype"
    if shape[0] != want.shape[0]:
        return "build_config.max_rows"
    if len(shape) == len(want.shape) and tuple(shape[1:2]) != tuple(want.shape[1:2]):
        if ".ckv_" in key or key.endswith(".idx_k"):
            return "build_config.max_seq_len"
        if any(s in key for s in (".swa_", ".cmp_", ".idx_kv", ".idx_score")):
            return "build_config.prefill_chunks"
    return "model_config"


def check_programs_state(cfg, build, programs: dict) -> None:
    """Every program's state inputs have the shapes and dtypes that model_config and
    build_config give the decode state (models/state.py state_specs). Programs whose state
    fields differ by name are left to engine_dir/load.check_state_layout, which names them.
    `programs`: {bucket or ProgramKey: GraphProgram}."""
    specs = state_specs(cfg, build.cache(cfg.dspark_block_size), build.precision())
    for b, program in sorted(programs.items(), key=lambda kv: str(kv[0])):
        if program.state_keys != list(specs):
            continue
        for key, (dtype, shape) in program.state_meta.items():
            spec = specs[key]
            if tuple(shape) != tuple(spec.shape) or dtype != spec.dtype:
                field = _blame(key, dtype, shape, spec)
                what = f"bucket {b}'s" if isinstance(b, int) else f"the {b}"
                raise ArtifactError(
                    f"manifest field '{field}' does not match {what} program: state '{key}' is "
                    f"{list(shape)} {str(dtype).replace('torch.', '')} in the program, "
                    f"{list(spec.shape)} {str(spec.dtype).replace('torch.', '')} from the "
                    "manifest — restore it or rebuild", field=field)
