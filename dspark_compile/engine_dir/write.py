"""The engine on disk: manifest, programs, shared weights; atomic write, validated load.

    engine/
      manifest.json              what was built, with what, and a checksum of every file
      programs/step_b{B}.json    one program per batch bucket B, a graph as data
                                 (dspark_compile/engine_dir/graph_format.py)
      programs/step_b{B}_greedy.json   its greedy sampler variant (runtime/variants.py),
                                 derived at build
      programs/step_b{B}.constants.safetensors   its own lifted constants, when it has any
      programs/prefill_c{C}.json optional: one prefill program per chunk length C
                                 (models/prefill_chunk.py; manifest `prefill_programs`)
      programs/target_b{B}.json  optional: the target-only program of bucket B (one token
                                 per row, models/step.py TargetStep; `target_programs`)
      weights.safetensors        every weight once, shared by all programs
      kernels/sm_XY/...          optional build reports (e.g. kernel resource usage)
      tokenizer.json             optional: the checkpoint's tokenizer, copied as it is

This module writes an engine (`save_engine`, `update_manifest_field`); the rest lives beside
it, one concept a module:
dspark_compile/engine_dir/format.py (the paths, `ArtifactError`, hashes, the manifest checksum,
the `dspark::` ops), dspark_compile/engine_dir/weights.py (every weight stored once and shared by
the programs) and dspark_compile/engine_dir/load.py (`load_manifest`, `load_engine`: the validated
load, each failure naming the field or file).

Atomic write. The build writes a temporary directory next to the destination and renames it
into place only when everything, manifest last, is written and fsync'd. An existing engine is
moved aside just before that rename and deleted after it, so a failed build leaves the previous
engine as it was and no partial directory behind. A build killed before its cleanup (SIGKILL)
leaves its temporary, named for its pid; the next build of the same destination removes it
once that process is gone (dspark_compile/atomic_dir.py).

One build a destination: save_engine (and build_engine, from its checks on) holds the
destination's lock (`.<name>.lock` beside it, dspark_compile/atomic_dir.py output_lock), so a second
build of the same output is refused at once, naming the first's pid, host and start time; a
lock left by a killed build is free again (the kernel drops it with its holder). With
`overwrite=False` an output that holds anything, or one that appears during the write, is
refused, never replaced.

Disk space. Before anything is written the engine's size is estimated (engine_bytes: the
weights' bytes, the extra files, ENGINE_PROGRAM_BYTES_PER_NODE a program node, the manifest)
and compared with the free space of the output's file system; after the programs are written
the rest is checked again with their real sizes. A write that still runs out of space (or
quota, or finds the file system read-only) fails as one NoSpaceError naming the output and the
bytes it needs, its temporary removed.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Optional

import torch

from dspark_compile.engine_dir.format import (
    ArtifactError, _checksum, config_hash, _dspark_ops,
    _EXTRA_DIRS, FORMAT_VERSION, MANIFEST, PREFILL, PROGRAM_DIR, ProgramKey, sha256_file, STEP,
    TARGET, TOKENIZER_FILE, TOKENIZER_FILES, WEIGHTS_FILE)
from dspark_compile.engine_dir.load import _read_manifest
from dspark_compile.engine_dir.graph_format import dump_program
from dspark_compile.engine_dir.weights import _plan_weights, _programs_device, _save_weights
from dspark_compile.atomic_dir import (
    canonical, check_free_space, disk_errors, fsync_dir, move_into_place, needed_bytes,
    output_lock, remove_stale_temps, replace_refusal, temp_dir)
from dspark_compile.engine_dir.versions import ENV_FIELDS, environment_fields, target_sm
from dspark_compile.engine_dir.load import MAX_MANIFEST_BYTES
from dspark_compile.engine_dir.paths import check_rel, read_file

# Computed by save_engine; a caller's manifest_fields may not set them.
_COMPUTED = {"format_version", "dspark_compile_version", "torch_version", "triton_version",
             "cuda_version", "buckets", "programs", "prefill_programs", "target_programs",
             "weights", "files",
             "dspark_ops",
             "graph_memory_bytes", "created_utc", "checksum"}
_REQUIRED = ("model_config_hash", "passes")


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
    """Why replacing `dest` would delete something save_engine did not write (None: it may go).
    What it wrote is its manifest's file table (every file but the manifest, the whole tree)
    plus the manifest and _write_json_atomic's hidden temporaries; a manifest that cannot be
    read cannot say which files are the engine's, so the directory is refused, and so is one
    whose file table names a path outside it (dspark_compile/engine_dir/paths.py) or `dest`
    itself when it is a symbolic link (replacing it would not rebuild what it points to)."""
    dest = Path(dest)
    if dest.is_symlink():
        return "it is a symbolic link: build to the directory it points to"
    allowed: set[str] = set()
    path = dest / MANIFEST
    if dest.is_dir() and path.is_file() and not path.is_symlink():
        try:
            manifest = json.loads(read_file(dest, MANIFEST, MAX_MANIFEST_BYTES).decode("utf-8"))
        except (ArtifactError, OSError, ValueError, RecursionError) as e:
            return (f"its {MANIFEST} cannot be read ({type(e).__name__}), so which files are "
                    "the engine's cannot be told")
        files = manifest.get("files") if isinstance(manifest, dict) else None
        allowed = set(files) if isinstance(files, dict) else set()
        for rel in allowed:
            try:
                check_rel(rel, "files")
            except ArtifactError as e:
                return f"its {MANIFEST} names a file outside it ({e})"
    return replace_refusal(dest, "an engine", MANIFEST, allowed,
                           (rf"\.{MANIFEST}\.\d+\.[0-9a-f]{{8}}\.tmp",))


def _swap_into_place(tmp: Path, dest: Path, overwrite: bool) -> None:
    why = not_an_engine(dest)
    if why:
        raise ArtifactError(f"refusing to replace {dest}: {why}", path=str(dest))
    move_into_place(tmp, dest, replace=overwrite)


def occupied(dest: Path) -> Optional[str]:
    """Why writing `dest` without overwrite would replace something (None: absent or empty)."""
    dest = Path(dest)
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        return "exists and is not a directory"
    if dest.is_dir() and any(dest.iterdir()):
        return ("already holds an engine" if (dest / MANIFEST).is_file()
                else "exists and is not empty")
    return None


# --------------------------------------------------------------------------- size
# A program's bytes per graph node: the tiny model's bucket-2 step (1,141 nodes after the passes)
# is 179 KB of graph JSON (157 bytes a node); with its greedy variant and its constants, 2 KB a
# node bounds larger models' longer names and literals from above.
ENGINE_PROGRAM_BYTES_PER_NODE = 2048
# The manifest's bytes: the tiny engine's (371 weights, one program) was 120,660 bytes, ~150
# a weight (its sha256, dtype, shape) and ~15,000 a program (file entry, pass stats); these
# are about three times that.
MANIFEST_BYTES_PER_WEIGHT, MANIFEST_BYTES_PER_PROGRAM = 512, 1 << 16
# The safetensors header's bytes a tensor (its name, dtype, shape and offsets as JSON).
HEADER_BYTES_PER_TENSOR = 256


def tensor_bytes(tensors) -> int:
    """Bytes of `tensors` (an iterable), each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def engine_bytes(weight_bytes: int, n_weights: int, program_nodes: list[int],
                 extra_bytes: int = 0) -> int:
    """What an engine of these parts takes on disk, estimated from above (module comment
    "Disk space"); dspark_compile/atomic_dir.py needed_bytes adds the file system's share."""
    files = weight_bytes + HEADER_BYTES_PER_TENSOR * n_weights + extra_bytes \
        + ENGINE_PROGRAM_BYTES_PER_NODE * sum(program_nodes) \
        + MANIFEST_BYTES_PER_WEIGHT * n_weights + MANIFEST_BYTES_PER_PROGRAM * len(program_nodes)
    return needed_bytes(files, len(program_nodes) + 2 + n_weights // 1000)


# --------------------------------------------------------------------------- save
def _tables(every: dict, files: dict, shared: dict, *tables: str) -> dict:
    """The manifest's program tables named (those with programs): {str(size): its files
    (`_write_program`), its shared weights, its inputs} per ProgramKey of `every`."""
    out = {}
    for key, ep in sorted(every.items()):
        if key.table in tables:
            out.setdefault(key.table, {})[str(key.size)] = {
                **files[key], "shared_weights": shared[key],
                "user_inputs": list(ep.graph_signature.user_inputs)}
    return out


def _manifest(fields: dict, every: dict, files: dict, shared: dict, tensors: dict) -> dict:
    """The manifest of the written engine, less its file table and checksum."""
    buckets = sorted(k.size for k in every if k.kind == STEP)
    env = environment_fields()
    return {
        "format_version": FORMAT_VERSION,
        **{k: env[k] for k in ENV_FIELDS},
        # a JSON copy; non-JSON values (e.g. in pass notes) are recorded as their str()
        **json.loads(json.dumps(fields, default=str)),
        "buckets": buckets,
        **_tables(every, files, shared, "programs"),
        "weights": {"file": WEIGHTS_FILE, "tensors": tensors},
        "dspark_ops": _dspark_ops(every),
        "graph_memory_bytes": {str(b): None for b in buckets},
        **_tables(every, files, shared, "prefill_programs", "target_programs"),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"),
    }


def save_engine(out_dir, programs: dict, weights: Optional[dict] = None,
                manifest_fields: Optional[dict] = None,
                extra_files: Optional[dict] = None,
                prefill_programs: Optional[dict] = None,
                target_programs: Optional[dict] = None, overwrite: bool = True,
                free_bytes: Optional[Callable[[Path], int]] = None,
                variant_graphs: Optional[dict] = None) -> dict:
    """Write an engine directory atomically; returns the manifest.

    programs: {bucket B (int > 0): ExportedProgram}.
    prefill_programs: {chunk length C (int > 0): ExportedProgram} (models/prefill_chunk.py),
        stored like the steps (shared weights, checksummed) and listed under
        `prefill_programs`.
    target_programs: {bucket B (one of `programs`' keys): ExportedProgram} (models/step.py
        TargetStep), stored the same way and listed under `target_programs`.
    weights: {FQN: tensor} to store once and share; None = every program's parameters and
        buffers. Every program's parameters/buffers must be in it with identical values.
    manifest_fields: must hold "model_config_hash" (or "model_config", hashed here) and
        "passes" (PassManager.manifest_entries()); may hold "target_sm" (default: that of
        the programs' device, "cpu" for CPU programs), "pass_config_hash", "pass_stats" and any other JSON-able field.
    extra_files: {"kernels/sm_XY/<name>" | "compiled/<name>" | "tokenizer.json": bytes | str}
        build reports, compiled programs (dspark_compile/build/inductor.py) and the checkpoint's
        tokenizer, checksummed like every file.
    overwrite: replace an engine at `out_dir` (never a directory holding other files); False:
        refuse any `out_dir` that is not absent or empty, before writing and at the rename.
    free_bytes: the free bytes of a path's file system (default: shutil.disk_usage's); the
        tests' seam for a full disk.
    variant_graphs: {ProgramKey with a variant other than "full": torch.fx.Graph} the graph of
        a program's variant (the greedy step, runtime/variants.py), same inputs and outputs as
        the program; written beside it and listed in its entry's `variants`.
    Holds `out_dir`'s lock while it writes (a concurrent writer: OutputLocked, naming it).
    """
    out_dir = canonical(Path(out_dir).absolute())
    every = _program_table(programs, prefill_programs or {}, target_programs or {})
    variants = _variant_table(every, variant_graphs or {})
    fields = _checked_fields(manifest_fields or {}, every)
    extra_files = dict(extra_files or {})
    _check_extra_files(extra_files)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out_dir, "build"):
        why = None if overwrite else occupied(out_dir)
        if why:
            raise ArtifactError(f"{out_dir} {why}; pass overwrite=True to replace an engine",
                                path=str(out_dir))
        remove_stale_temps(out_dir)     # of earlier writes of out_dir that were killed
        return _write(out_dir, every, variants, weights, fields, extra_files, overwrite,
                      free_bytes)


def _program_table(programs: dict, prefill_programs: dict, target_programs: dict) -> dict:
    """save_engine's programs checked, as one table {ProgramKey: ExportedProgram}: the weights,
    the ops and the manifest's tables read it."""
    if not programs:
        raise ArtifactError("save_engine needs at least one program", field="programs")
    for b, ep in programs.items():
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ArtifactError(f"bucket keys must be positive ints, got {b!r}", field="buckets")
        if not isinstance(ep, torch.export.ExportedProgram):
            raise ArtifactError(f"program for bucket {b} is a {type(ep).__name__}, not an "
                                "ExportedProgram", field="programs")
    for c, ep in prefill_programs.items():
        if isinstance(c, bool) or not isinstance(c, int) or c <= 0:
            raise ArtifactError(f"prefill chunk keys must be positive ints, got {c!r}",
                                field="prefill_programs")
        if not isinstance(ep, torch.export.ExportedProgram):
            raise ArtifactError(f"prefill program for chunk {c} is a {type(ep).__name__}, not "
                                "an ExportedProgram", field="prefill_programs")
    for b, ep in target_programs.items():
        if b not in programs:
            raise ArtifactError(f"target program for bucket {b!r}: not one of the step buckets "
                                f"{sorted(programs)}", field="target_programs")
        if not isinstance(ep, torch.export.ExportedProgram):
            raise ArtifactError(f"target program for bucket {b} is a {type(ep).__name__}, not "
                                "an ExportedProgram", field="target_programs")
    return {**{ProgramKey(STEP, b): ep for b, ep in programs.items()},
            **{ProgramKey(PREFILL, c): ep for c, ep in prefill_programs.items()},
            **{ProgramKey(TARGET, b): ep for b, ep in target_programs.items()}}


def _variant_table(every: dict, graphs: dict) -> dict:
    """save_engine's variant graphs checked, grouped by program: {ProgramKey (full): {ProgramKey
    (variant): torch.fx.Graph}}."""
    out: dict = {}
    for key, graph in graphs.items():
        if not isinstance(key, ProgramKey) or key.variant == "full" \
                or key.with_variant("full") not in every:
            raise ArtifactError(f"variant graph {key!s}: not a variant of one of the programs "
                                f"{sorted(map(str, every))}", field="variants")
        if not isinstance(graph, torch.fx.Graph):
            raise ArtifactError(f"variant graph {key!s} is a {type(graph).__name__}, not a "
                                "torch.fx.Graph", field="variants")
        out.setdefault(key.with_variant("full"), {})[key] = graph
    return out


def is_dynamic(ep) -> bool:
    """The program takes inputs of a dynamic size (one program for every batch or chunk size
    of its kind, build/pipeline.py)."""
    return any(isinstance(d, torch.SymInt) for n in ep.graph.nodes if n.op == "placeholder"
               for d in getattr(n.meta.get("val"), "shape", ()))


def _write_program(root: Path, key: ProgramKey, ep, shared: list, variants: dict) -> dict:
    """Program `key` (and its variants' graphs) in the engine's graph format under `root`;
    returns its manifest entry's files: its graph, its constants (None without any), its
    variants' graphs. A dynamic program is written at its kind's shared paths
    (ProgramKey.shared_path), once for every size it serves (`_write`)."""
    dynamic = is_dynamic(ep)
    path_of = (lambda k: k.shared_path) if dynamic else (lambda k: k.path)
    graph, constants = dump_program(ep, set(shared))
    (root / path_of(key)).write_bytes(graph)
    entry = {"path": path_of(key), "constants": None, "variants": {}}
    if constants is not None:
        rel = key.shared_constants_path if dynamic else key.constants_path
        (root / rel).write_bytes(constants)
        entry["constants"] = rel
    for vkey, g in sorted(variants.items()):
        (root / path_of(vkey)).write_bytes(dump_program(ep, set(shared), graph=g)[0])
        entry["variants"][vkey.variant] = path_of(vkey)
    return entry


def _checked_fields(manifest_fields: dict, every: dict) -> dict:
    """The caller's manifest fields, with the model config's hash and the target SM filled
    in; ArtifactError for a computed field set or a required one missing."""
    fields = dict(manifest_fields)
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
    return fields


def _check_extra_files(extra_files: dict) -> None:
    for rel in extra_files:
        parts = Path(rel).parts
        if rel in TOKENIZER_FILES:
            continue
        if not parts or parts[0] not in _EXTRA_DIRS or ".." in parts or Path(rel).is_absolute():
            raise ArtifactError(f"extra file '{rel}' must live under one of "
                                f"{[d + '/' for d in _EXTRA_DIRS]} (or be {TOKENIZER_FILE})",
                                path=rel)


def _write(out_dir: Path, every: dict, variants: dict, weights, fields: dict,
           extra_files: dict, overwrite: bool, free_bytes) -> dict:
    """save_engine's write, under out_dir's lock: programs, weights, extra files and manifest
    into a temporary directory, then renamed into place."""
    store, shared = _plan_weights(every, weights)
    sizes = (tensor_bytes(store.values()), len(store))
    extra = sum(len(c.encode() if isinstance(c, str) else c) for c in extra_files.values())
    nodes = [len(ep.graph.nodes) * (1 + len(variants.get(k, {}))) for k, ep in every.items()]
    need = engine_bytes(*sizes, nodes, extra)
    check_free_space(out_dir, need, "the engine", free_bytes)
    with disk_errors(out_dir, "the engine", need):
        tmp = temp_dir(out_dir)
        try:
            (tmp / PROGRAM_DIR).mkdir()
            files, written = {}, {}      # one program object serving several sizes: once
            for key, ep in sorted(every.items()):
                if id(ep) not in written:
                    written[id(ep)] = _write_program(tmp, key, ep, shared[key],
                                                     variants.get(key, {}))
                files[key] = written[id(ep)]
            # the programs are on disk: the rest (weights, extra files, manifest) again
            check_free_space(out_dir, engine_bytes(*sizes, [0] * len(every), extra),
                             "the rest of the engine", free_bytes)
            tensors = _save_weights(store, tmp / WEIGHTS_FILE)
            for rel, content in extra_files.items():
                p = tmp / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(content.encode() if isinstance(content, str) else bytes(content))
            manifest = _manifest(fields, every, files, shared, tensors)
            manifest["files"] = _file_table(tmp)
            manifest["checksum"] = _checksum(manifest)
            _write_json_atomic(tmp / MANIFEST, manifest)
            fsync_dir(tmp)
            _swap_into_place(tmp, out_dir, overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return manifest


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
