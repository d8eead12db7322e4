"""The engine on disk: manifest, programs, shared weights; atomic write, validated load.

    engine/
      manifest.json              what was built, with what, and a checksum of every file
      programs/step_b{B}.pt2     one torch.export program per batch bucket B
      programs/prefill_c{C}.pt2  optional: one prefill program per chunk length C
                                 (models/prefill_chunk.py; manifest `prefill_programs`)
      weights.safetensors        every weight once, shared by all programs
      kernels/sm_XY/...          optional build reports (e.g. kernel resource usage)

Weights. The step module's parameters and buffers are stored once, in weights.safetensors
keyed by their module FQN (the ExportedProgram's `state_dict` / `constants` key), and *not*
inside the .pt2 files: each bucket's program would otherwise carry its own full copy of the
model (N buckets = N copies on disk and N in memory). `save_engine` swaps those entries for
one-element stand-ins while `torch.export.save` runs (the graph keeps their shape/dtype), and
`load_engine` puts the loaded tensors back, the same tensor objects in every bucket's program.
Which entries each program takes from the shared file is listed in the manifest
(`programs[B].shared_weights`). Tensors that are not module weights (constants export lifts out
of `forward`, e.g. `torch.tensor(...)` literals, which may differ per bucket under one name) stay
inside their .pt2. State tensors (caches) are user inputs: the runtime allocates them; they are
not part of the engine. Dtypes safetensors cannot read back (float8_e8m0fnu) are stored as a
uint8 view and viewed back on load (the manifest records the real dtype).

Atomic write. The build writes a temporary directory next to the destination and renames it
into place only when everything, manifest last, is written and fsync'd. An existing engine is
moved aside just before that rename and deleted after it, so a failed build leaves the previous
engine as it was and no partial directory behind. A build killed before its cleanup (SIGKILL)
leaves its temporary, named for its pid; the next build of the same destination removes it
once that process is gone (models/atomic_dir.py).

Validated load. `load_manifest` checks the manifest checksum, format version, toolchain
versions, target SM, pass source hashes, the schemas of the `dspark::` ops the programs call,
any caller expectations, and the size and sha256 of every file; each failure raises
`ArtifactError` naming the field or file. `load_engine` registers the `dspark::` ops (imports
every `dspark_compile.kernels` module) before `torch.export.load`.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import os
import pkgutil
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Iterable, Optional

import torch

from dspark_compile.models.atomic_dir import (
    fsync_dir, move_into_place, remove_stale_temps, replace_refusal, temp_dir)
from dspark_compile.versions import ENV_FIELDS, environment_fields, target_sm

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"
PROGRAM_DIR = "programs"
KERNELS_DIR = "kernels"
COMPILED_DIR = "compiled"     # dspark_compile/compiled.py's artifacts
_EXTRA_DIRS = (KERNELS_DIR, COMPILED_DIR)
_CHUNK = 8 << 20
_ALIGN = 64  # bytes; what torch's allocators give every fresh tensor

# Computed by save_engine; a caller's manifest_fields may not set them.
_COMPUTED = {"format_version", "dspark_compile_version", "torch_version", "triton_version",
             "cuda_version", "buckets", "programs", "prefill_programs", "weights", "files",
             "dspark_ops",
             "graph_memory_bytes", "created_utc", "checksum"}
_REQUIRED = ("model_config_hash", "passes")
# Dtypes safetensors can write but not read back: stored as a same-size integer view.
_BYTE_VIEW = {getattr(torch, n): torch.uint8 for n in ("float8_e8m0fnu", "float4_e2m1fn_x2")
              if hasattr(torch, n)}


class ArtifactError(RuntimeError):
    """An engine directory is missing, corrupted, stale or does not match expectations."""

    def __init__(self, message: str, field: Optional[str] = None, path: Optional[str] = None):
        self.field, self.path = field, path
        super().__init__(message)


def program_path(bucket: int) -> str:
    return f"{PROGRAM_DIR}/step_b{bucket}.pt2"


def prefill_key(chunk: int) -> str:
    """A prefill program's name: its file stem, and its key where programs of both kinds are
    listed together (pass statistics, compile jobs)."""
    return f"prefill_c{chunk}"


def prefill_program_path(chunk: int) -> str:
    return f"{PROGRAM_DIR}/{prefill_key(chunk)}.pt2"


def _program_file(key) -> str:
    """The engine path of a program keyed by bucket (int) or by prefill_key (str)."""
    return f"{PROGRAM_DIR}/{key}.pt2" if isinstance(key, str) else program_path(key)


def _label(key) -> str:
    return key if isinstance(key, str) else f"for bucket {key}"


# --------------------------------------------------------------------------- hashing
def sha256_file(path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _checksum(manifest: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "checksum"})
                          ).hexdigest()


def config_hash(config) -> str:
    """sha256 of a JSON-able model config (dict or object with `to_json_dict()`)."""
    if hasattr(config, "fingerprint"):
        return config.fingerprint()
    if hasattr(config, "to_json_dict"):
        config = config.to_json_dict()
    return hashlib.sha256(_canonical(config)).hexdigest()


# --------------------------------------------------------------------------- ops
def register_kernel_ops() -> list[str]:
    """Import every dspark_compile.kernels module so each `dspark::` op is registered (a .pt2
    calling them cannot be deserialised otherwise)."""
    import dspark_compile.kernels as kernels

    names = []
    for info in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{info.name}")
        names.append(info.name)
    return names


def _dspark_ops(programs: dict) -> dict:
    ops = {}
    for ep in programs.values():
        for n in ep.graph_module.graph.nodes:
            t = n.target
            if n.op == "call_function" and isinstance(t, torch._ops.OpOverload) \
                    and t.namespace == "dspark":
                ops[f"{t._schema.name}.{t._overloadname}"] = str(t._schema)
    return dict(sorted(ops.items()))


# --------------------------------------------------------------------------- weights
def _weight_entries(ep) -> dict:
    """FQN -> (tensor, is_parameter) for the module weights of one program."""
    from torch.export.graph_signature import InputKind

    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            out[spec.target] = (ep.state_dict[spec.target], True)
        elif spec.kind == InputKind.BUFFER:
            src = ep.state_dict if spec.target in ep.state_dict else ep.constants
            out[spec.target] = (src[spec.target], False)
    return out


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return torch.equal(a.detach().cpu(), b.detach().cpu())


def _plan_weights(programs: dict, weights: Optional[dict]):
    """Returns (weights to store, {bucket: [shared names]}); checks programs agree with it."""
    shared = {}
    collected = {} if weights is None else dict(weights)
    for b, ep in programs.items():
        names = []
        for name, (t, _) in _weight_entries(ep).items():
            if name not in collected:
                if weights is not None:
                    raise ArtifactError(f"program {_label(b)} uses weight '{name}', which is "
                                        "not in `weights`", field="weights")
                collected[name] = t
            elif not _same_tensor(collected[name], t):
                raise ArtifactError(
                    f"weight '{name}' of the program {_label(b)} differs from the one being "
                    f"stored ({tuple(t.shape)} {t.dtype} vs {tuple(collected[name].shape)} "
                    f"{collected[name].dtype} or different values)", field="weights")
            names.append(name)
        # constants (lifted literals, plain tensor attributes) are shared only when the caller
        # passed them explicitly and they are identical
        if weights is not None:
            for name, t in ep.constants.items():
                if name not in names and name in collected and isinstance(t, torch.Tensor) \
                        and _same_tensor(collected[name], t):
                    names.append(name)
        shared[b] = sorted(names)
    return collected, shared


def _save_weights(weights: dict, path: Path) -> dict:
    from safetensors.torch import save_file

    stored, summary, seen = {}, {}, set()
    for name in sorted(weights):
        t = weights[name]
        if not isinstance(t, torch.Tensor):
            raise ArtifactError(f"weight '{name}' is a {type(t).__name__}, not a tensor",
                                field="weights")
        c = t.detach().cpu().contiguous()
        if c.untyped_storage().data_ptr() in seen or c.numel() != c.untyped_storage().nbytes() \
                // max(c.element_size(), 1):
            c = c.clone()  # safetensors refuses shared or partial storages
        seen.add(c.untyped_storage().data_ptr())
        stored_dtype = _BYTE_VIEW.get(c.dtype)
        stored[name] = c.view(stored_dtype) if stored_dtype is not None else c
        summary[name] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                         "sha256": tensor_sha256(c)}
        if stored_dtype is not None:
            summary[name]["stored_as"] = str(stored_dtype).replace("torch.", "")
    save_file(stored, str(path))
    return summary


def _load_weights(path: Path, summary: dict, device) -> dict:
    from safetensors.torch import load_file

    raw = load_file(str(path), device=str(device))
    if set(raw) != set(summary):
        missing, extra = sorted(set(summary) - set(raw)), sorted(set(raw) - set(summary))
        raise ArtifactError(f"{WEIGHTS_FILE} does not hold the tensors the manifest lists "
                            f"(missing {missing}, unexpected {extra})", path=WEIGHTS_FILE)
    out = {}
    for name, t in raw.items():
        want = getattr(torch, summary[name]["dtype"])
        if t.dtype != want:
            t = t.view(want)
        if list(t.shape) != summary[name]["shape"]:
            raise ArtifactError(f"weight '{name}' has shape {list(t.shape)}, manifest says "
                                f"{summary[name]['shape']}", path=WEIGHTS_FILE)
        if t.data_ptr() % _ALIGN:
            # safetensors places tensors at arbitrary byte offsets; BLAS and Triton pick other
            # (slower, differently rounded) kernels for misaligned pointers, so the engine
            # would not reproduce the build's numerics bit for bit.
            t = t.clone()
        out[name] = t
    return out


def _stand_in(t: torch.Tensor, is_param: bool):
    """A one-element tensor expanded (stride 0) to `t`'s shape and dtype: what torch.export.save
    writes for it is a single element, through the ordinary tensor path of every torch version
    (meta tensors would rely on how a version treats zero-byte records)."""
    s = torch.zeros((), dtype=t.dtype).expand(t.shape)
    return torch.nn.Parameter(s, requires_grad=False) if is_param else s


def _save_program(ep, path: Path, shared: list) -> None:
    """torch.export.save with the shared weights swapped for stand-ins (restored after)."""
    entries = _weight_entries(ep)
    saved = []
    try:
        for name in shared:
            table = ep.state_dict if name in ep.state_dict else ep.constants
            saved.append((table, name, table[name]))
            table[name] = _stand_in(table[name], entries.get(name, (None, False))[1])
        with warnings.catch_warnings():
            # the stand-ins do not cover their one-element storage; torch warns about that
            warnings.filterwarnings("ignore", message="No complete tensor found")
            torch.export.save(ep, str(path))
    finally:
        for table, name, t in saved:
            table[name] = t


def _attach_weights(ep, shared: list, weights: dict, bucket) -> None:
    """`bucket`: the program's key (a bucket, or a prefill program's prefill_key)."""
    entries = _weight_entries(ep)
    for name in shared:
        if name in ep.state_dict:
            table = ep.state_dict
        elif name in ep.constants:
            table = ep.constants
        else:
            raise ArtifactError(f"program {_label(bucket)} has no weight '{name}' that the "
                                "manifest says it shares", path=_program_file(bucket))
        w = weights[name]
        ref = table[name]
        if tuple(ref.shape) != tuple(w.shape) or ref.dtype != w.dtype:
            raise ArtifactError(f"weight '{name}': program {_label(bucket)} expects "
                                f"{tuple(ref.shape)} {ref.dtype}, {WEIGHTS_FILE} has "
                                f"{tuple(w.shape)} {w.dtype}", path=WEIGHTS_FILE)
        table[name] = torch.nn.Parameter(w, requires_grad=False) if entries.get(
            name, (None, False))[1] else w
    missing = [k for k in _weight_entries(ep) if k not in shared]
    if missing:  # every parameter/buffer is shared at build time; a stand-in must not survive
        raise ArtifactError(f"program {_label(bucket)} has weights {missing} that the "
                            "manifest does not list as shared", path=_program_file(bucket))


# --------------------------------------------------------------------------- files
def _fsync_file(path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def _file_table(root: Path) -> dict:
    table = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(root).as_posix()
            _fsync_file(p)
            digest, size = sha256_file(p)
            table[rel] = {"sha256": digest, "size": size}
    return table


def not_an_engine(dest: Path) -> Optional[str]:
    """Why replacing `dest` would delete something save_engine did not write (None: it may go;
    the hidden files are _write_json_atomic's temporaries)."""
    return replace_refusal(dest, "an engine", MANIFEST, {PROGRAM_DIR, WEIGHTS_FILE, *_EXTRA_DIRS},
                           (rf"\.{MANIFEST}\.\d+\.[0-9a-f]{{8}}\.tmp",))


def _swap_into_place(tmp: Path, dest: Path) -> None:
    why = not_an_engine(dest)
    if why:
        raise ArtifactError(f"refusing to replace {dest}: {why}", path=str(dest))
    move_into_place(tmp, dest)


# --------------------------------------------------------------------------- save
def save_engine(out_dir, programs: dict, weights: Optional[dict] = None,
                manifest_fields: Optional[dict] = None,
                extra_files: Optional[dict] = None,
                prefill_programs: Optional[dict] = None) -> dict:
    """Write an engine directory atomically; returns the manifest.

    programs: {bucket B (int > 0): ExportedProgram}.
    prefill_programs: {chunk length C (int > 0): ExportedProgram} (models/prefill_chunk.py),
        stored like the steps (shared weights, checksummed) and listed under
        `prefill_programs`.
    weights: {FQN: tensor} to store once and share; None = every program's parameters and
        buffers. Every program's parameters/buffers must be in it with identical values.
    manifest_fields: must hold "model_config_hash" (or "model_config", hashed here) and
        "passes" (PassManager.manifest_entries()); may hold "target_sm" (default: that of
        the programs' device, "cpu" for CPU programs), "pass_config_hash", "pass_stats" and any other JSON-able field.
    extra_files: {"kernels/sm_XY/<name>" | "compiled/<name>": bytes | str} build reports and
        compiled programs (dspark_compile/compiled.py).
    """
    out_dir = Path(out_dir).absolute()
    if not programs:
        raise ArtifactError("save_engine needs at least one program", field="programs")
    for b, ep in programs.items():
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ArtifactError(f"bucket keys must be positive ints, got {b!r}", field="buckets")
        if not isinstance(ep, torch.export.ExportedProgram):
            raise ArtifactError(f"program for bucket {b} is a {type(ep).__name__}, not an "
                                "ExportedProgram", field="programs")
    prefill_programs = dict(prefill_programs or {})
    for c, ep in prefill_programs.items():
        if isinstance(c, bool) or not isinstance(c, int) or c <= 0:
            raise ArtifactError(f"prefill chunk keys must be positive ints, got {c!r}",
                                field="prefill_programs")
        if not isinstance(ep, torch.export.ExportedProgram):
            raise ArtifactError(f"prefill program for chunk {c} is a {type(ep).__name__}, not "
                                "an ExportedProgram", field="prefill_programs")
    # one table for the weights and the ops: steps by bucket, prefill programs by prefill_key
    every = {**programs, **{prefill_key(c): ep for c, ep in prefill_programs.items()}}
    fields = dict(manifest_fields or {})
    if "model_config" in fields:
        fields.setdefault("model_config_hash", config_hash(fields["model_config"]))
    # the programs' device decides where the engine runs: a CPU program is "cpu" even when this
    # machine has a GPU
    fields.setdefault("target_sm", target_sm(_programs_device(every)))
    bad = sorted(set(fields) & _COMPUTED)
    if bad:
        raise ArtifactError(f"manifest_fields may not set computed fields {bad}", field=bad[0])
    missing = [f for f in _REQUIRED if f not in fields]
    if missing:
        raise ArtifactError(f"manifest_fields is missing {missing}", field=missing[0])
    extra_files = dict(extra_files or {})
    for rel in extra_files:
        parts = Path(rel).parts
        if not parts or parts[0] not in _EXTRA_DIRS or ".." in parts or Path(rel).is_absolute():
            raise ArtifactError(f"extra file '{rel}' must live under one of "
                                f"{[d + '/' for d in _EXTRA_DIRS]}", path=rel)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir)     # of earlier writes of out_dir that were killed
    tmp = temp_dir(out_dir)
    try:
        store, shared = _plan_weights(every, weights)
        (tmp / PROGRAM_DIR).mkdir()
        buckets = sorted(programs)
        for key, ep in every.items():
            _save_program(ep, tmp / _program_file(key), shared[key])
        tensors = _save_weights(store, tmp / WEIGHTS_FILE)
        for rel, content in extra_files.items():
            p = tmp / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content.encode() if isinstance(content, str) else bytes(content))
        env = environment_fields()
        manifest = {
            "format_version": FORMAT_VERSION,
            **{k: env[k] for k in ENV_FIELDS},
            # a JSON copy; non-JSON values (e.g. in pass notes) are recorded as their str()
            **json.loads(json.dumps(fields, default=str)),
            "buckets": buckets,
            "programs": {str(b): {"path": program_path(b), "shared_weights": shared[b],
                                  "user_inputs": list(programs[b].graph_signature.user_inputs)}
                         for b in buckets},
            "weights": {"file": WEIGHTS_FILE, "tensors": tensors},
            "dspark_ops": _dspark_ops(every),
            "graph_memory_bytes": {str(b): None for b in buckets},
            **({"prefill_programs": {
                str(c): {"path": prefill_program_path(c), "shared_weights": shared[prefill_key(c)],
                         "user_inputs": list(ep.graph_signature.user_inputs)}
                for c, ep in sorted(prefill_programs.items())}} if prefill_programs else {}),
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
        }
        manifest["files"] = _file_table(tmp)
        manifest["checksum"] = _checksum(manifest)
        _write_json_atomic(tmp / MANIFEST, manifest)
        fsync_dir(tmp)
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


# --------------------------------------------------------------------------- load
def _read_manifest(engine_dir: Path) -> dict:
    path = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise ArtifactError(f"engine directory {engine_dir} does not exist", path=str(engine_dir))
    if not path.is_file():
        raise ArtifactError(f"{engine_dir} is not an engine: {MANIFEST} is missing", path=MANIFEST)
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{MANIFEST} is corrupted (not valid JSON: {e})", path=MANIFEST) from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{MANIFEST} is corrupted (not a JSON object)", path=MANIFEST)
    if "checksum" not in manifest:
        raise ArtifactError(f"{MANIFEST} is corrupted (no 'checksum' field)", path=MANIFEST)
    if manifest["checksum"] != _checksum(manifest):
        raise ArtifactError(f"{MANIFEST} is corrupted (checksum mismatch)", path=MANIFEST)
    return manifest


_MISSING = object()


def _field(manifest: dict, field: str):
    """The value at a dotted field path ("build_config.backend"), or _MISSING."""
    node = manifest
    for k in field.split("."):
        if not isinstance(node, dict) or k not in node:
            return _MISSING
        node = node[k]
    return node


def _mismatch(field: str, have, want, env: bool) -> ArtifactError:
    if env:
        msg = f"manifest field '{field}': engine built with {have}, running {want} — rebuild"
    else:
        msg = f"manifest field '{field}': engine has {have!r}, expected {want!r} — rebuild"
    return ArtifactError(msg, field=field)


def _check_passes(manifest: dict) -> None:
    from dspark_compile.passes import REGISTRY

    for entry in manifest.get("passes", []):
        name = entry.get("name")
        if name not in REGISTRY:
            raise ArtifactError(f"manifest field 'passes': engine was built with pass '{name}', "
                                "which is not installed — rebuild", field="passes")
        have, want = entry.get("source_hash"), REGISTRY[name].source_hash
        if have != want:
            raise ArtifactError(
                f"manifest field 'passes': pass '{name}' source hash {str(have)[:12]} in the "
                f"engine, {want[:12]} installed (the pass changed) — rebuild", field="passes")


def _check_ops(manifest: dict) -> None:
    register_kernel_ops()
    for qualname, schema in manifest.get("dspark_ops", {}).items():
        # "dspark::moe_experts.default"
        op_name, _, overload = qualname.split("::", 1)[-1].partition(".")
        try:
            packet = getattr(torch.ops.dspark, op_name)
            current = str(getattr(packet, overload or "default")._schema)
        except (AttributeError, RuntimeError):
            current = None
        if current is None:
            raise ArtifactError(f"manifest field 'dspark_ops': op {qualname} is not registered "
                                "by this dspark_compile — rebuild", field="dspark_ops")
        if current != schema:
            raise ArtifactError(f"manifest field 'dspark_ops': op {qualname} schema changed: "
                                f"engine '{schema}', running '{current}' — rebuild",
                                field="dspark_ops")


def _check_files(engine_dir: Path, manifest: dict) -> None:
    for rel, info in sorted(manifest.get("files", {}).items()):
        p = engine_dir / rel
        if not p.is_file():
            raise ArtifactError(f"engine file '{rel}' is missing", path=rel)
        size = p.stat().st_size
        if size < info["size"]:
            raise ArtifactError(f"engine file '{rel}' is truncated: {size} of {info['size']} "
                                "bytes", path=rel)
        if size != info["size"]:
            raise ArtifactError(f"engine file '{rel}' has the wrong size: {size} bytes, manifest "
                                f"says {info['size']}", path=rel)
        digest, _ = sha256_file(p)
        if digest != info["sha256"]:
            raise ArtifactError(f"engine file '{rel}' is corrupted: sha256 {digest[:12]}…, "
                                f"manifest says {info['sha256'][:12]}…", path=rel)


def _check_structure(manifest: dict) -> None:
    buckets = manifest.get("buckets")
    progs = manifest.get("programs", {})
    if not isinstance(buckets, list) or sorted(map(str, buckets)) != sorted(progs):
        raise ArtifactError(f"manifest field 'buckets': {buckets} does not match the programs "
                            f"listed {sorted(progs)}", field="buckets")
    files = manifest.get("files", {})
    for b, entry in progs.items():
        if entry.get("path") not in files:
            raise ArtifactError(f"manifest field 'programs': bucket {b}'s program "
                                f"'{entry.get('path')}' is not in the file table", field="programs")
    prefill = manifest.get("prefill_programs", {})
    if not isinstance(prefill, dict):
        raise ArtifactError("manifest field 'prefill_programs' is not a table",
                            field="prefill_programs")
    for c, entry in prefill.items():
        if not (isinstance(entry, dict) and c.isdigit() and int(c) > 0
                and entry.get("path") == prefill_program_path(int(c)) and entry["path"] in files):
            raise ArtifactError(f"manifest field 'prefill_programs': chunk {c!r}'s program "
                                f"{entry.get('path') if isinstance(entry, dict) else entry!r} is "
                                "not a prefill program in the file table",
                                field="prefill_programs")
    if manifest.get("weights", {}).get("file") not in files:
        raise ArtifactError("manifest field 'weights': the weights file is not in the file table",
                            field="weights")


def check_state_layout(programs: dict, state: dict) -> None:
    """Every program takes exactly the decode state this dspark_compile allocates (its keys, in
    order): an engine built when the state had other fields (e.g. before `row.verify`, the
    rejection op's per-row verification) is refused naming them, not failed at the first step."""
    want = list(state)
    for b, ep in sorted(programs.items()):
        try:
            have = list(ep.call_spec.in_spec.child(0).child(1).context)
        except (AttributeError, IndexError, TypeError):
            continue                     # not a (rows, state) program: nothing to compare
        if have != want:
            missing = [k for k in want if k not in have]
            extra = [k for k in have if k not in want]
            what = " and ".join(
                ([f"lacks the state fields {missing}"] if missing else [])
                + ([f"takes state fields {extra} this version does not have"] if extra else [])
            ) or "orders the state fields differently"
            raise ArtifactError(f"bucket {b}'s program {what} — rebuild the engine",
                                field="programs")


def _programs_device(programs: dict):
    """The device of the programs' weights and constants (cpu when they hold none)."""
    for ep in programs.values():
        for t in list(ep.state_dict.values()) + list(ep.constants.values()):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                return t.device
    return torch.device("cpu")


def load_manifest(engine_dir, expect: Optional[dict] = None, skip: Iterable[str] = (),
                  check_files: bool = True, device=None) -> dict:
    """Read and validate `engine_dir/manifest.json`; returns it.

    Checked against the running environment: format_version, dspark_compile_version,
    torch_version, triton_version, cuda_version, target_sm, passes (each pass's source hash vs
    the installed pass) and dspark_ops (op schemas vs the registered ops). `expect` adds or
    overrides expectations ({"model_config_hash": ..., "buckets": [...], "target_sm": ...,
    "build_config.backend": ...}: dotted paths name nested fields).
    `skip` names fields not to check. With `check_files`, every file's size and sha256 is
    verified (a truncated or corrupted file is named).
    """
    engine_dir = Path(engine_dir)
    skip = set(skip)
    manifest = _read_manifest(engine_dir)
    if "format_version" not in skip and manifest.get("format_version") != FORMAT_VERSION:
        raise _mismatch("format_version", manifest.get("format_version"), FORMAT_VERSION, True)
    expect = dict(expect or {})
    # target_sm: that of the device the engine will run on; without one, this machine's GPU
    # for a GPU engine and "cpu" for a CPU engine (which runs anywhere)
    if device is None and manifest.get("target_sm") == "cpu":
        device = "cpu"
    env = environment_fields(device)
    for field in ENV_FIELDS:
        if field in skip or field in expect:
            continue
        if manifest.get(field) != env[field]:
            raise _mismatch(field, manifest.get(field), env[field], True)
    for field, want in expect.items():
        if field in skip:
            continue
        have = _field(manifest, field)
        if have is _MISSING:
            raise ArtifactError(f"manifest field '{field}' is missing (expected {want!r})",
                                field=field)
        if have != json.loads(json.dumps(want)):
            raise _mismatch(field, have, want, False)
    _check_structure(manifest)
    if "passes" not in skip:
        _check_passes(manifest)
    if "dspark_ops" not in skip:
        _check_ops(manifest)
    if check_files:
        _check_files(engine_dir, manifest)
    return manifest


def load_engine(engine_dir, expect: Optional[dict] = None, skip: Iterable[str] = (),
                device="cpu", check_files: bool = True):
    """Validate and load an engine: returns (manifest, {bucket: ExportedProgram},
    {FQN: weight tensor}). The weights are loaded once (onto `device`) and the same tensors
    are attached to every program."""
    engine_dir = Path(engine_dir)
    manifest = load_manifest(engine_dir, expect=expect, skip=skip, check_files=check_files,
                             device=device)
    register_kernel_ops()  # before torch.export.load: programs call dspark:: ops
    weights = _load_weights(engine_dir / manifest["weights"]["file"],
                            manifest["weights"]["tensors"], device)
    programs = {b: load_program(engine_dir, manifest, b, weights) for b in manifest["buckets"]}
    return manifest, programs, weights


def load_program(engine_dir, manifest: dict, bucket: int, weights: dict):
    """Bucket's program of a validated manifest, with the shared `weights` attached (the ops
    must be registered: register_kernel_ops)."""
    entry = manifest["programs"][str(bucket)]
    try:
        ep = torch.export.load(str(Path(engine_dir) / entry["path"]))
    except Exception as e:
        raise ArtifactError(f"cannot load program '{entry['path']}': {type(e).__name__}: {e}",
                            path=entry["path"]) from e
    _attach_weights(ep, entry["shared_weights"], weights, bucket)
    return ep


def load_prefill_programs(engine_dir, manifest: dict, weights: dict) -> dict:
    """{chunk length: ExportedProgram} of a validated manifest's prefill programs (none for an
    engine built without them), with the shared `weights` attached."""
    out = {}
    for c, entry in sorted(manifest.get("prefill_programs", {}).items(), key=lambda kv: int(kv[0])):
        try:
            ep = torch.export.load(str(Path(engine_dir) / entry["path"]))
        except Exception as e:
            raise ArtifactError(f"cannot load program '{entry['path']}': {type(e).__name__}: {e}",
                                path=entry["path"]) from e
        _attach_weights(ep, entry["shared_weights"], weights, prefill_key(int(c)))
        out[int(c)] = ep
    return out


def update_manifest_field(engine_dir, field: str, value) -> dict:
    """Set `field` (dotted path, e.g. "graph_memory_bytes.4") to `value` and rewrite the
    manifest atomically (checksum updated). Used to fill per-bucket graph memory at first GPU
    load."""
    engine_dir = Path(engine_dir)
    manifest = _read_manifest(engine_dir)
    keys = field.split(".")
    if keys[0] in ("checksum", "files"):
        raise ArtifactError(f"manifest field '{keys[0]}' is maintained by the build", field=field)
    node = manifest
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            raise ArtifactError(f"manifest field '{field}': '{k}' is not a table", field=field)
        node = node[k]
    node[keys[-1]] = json.loads(json.dumps(value))
    manifest["checksum"] = _checksum(manifest)
    _write_json_atomic(engine_dir / MANIFEST, manifest)
    return manifest
