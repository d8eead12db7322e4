"""Validated load of an engine directory.

`load_manifest` checks, first, that every path the manifest names stays inside the engine
directory and that nothing in it is a link or a special file (dspark_compile/engine_dir/paths.py),
then the manifest checksum, format version, toolchain versions, target SM, pass source hashes,
the schemas of the `dspark::` ops the programs call, any caller expectations, and the size and
sha256 of every file; each failure raises `ArtifactError` naming the field or file.
`load_engine` refuses an engine whose programs are code unless trusted (check_code_trust),
registers the `dspark::` ops (imports every `dspark_compile.kernels` module), reads each program
as data (dspark_compile/engine_dir/graph_read.py: no pickle, no code, every op on an allowlist),
checks it against its manifest entry, and binds it to the shared weights
(dspark_compile/engine_dir/weights.py). An engine of the old format (torch.export archives) is
refused with the build command that replaces it.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Optional

import torch

from dspark_compile.engine_dir.format import (
    COMPILED_DIR, FORMAT_VERSION, MANIFEST, PREFILL, PROGRAM_TABLES, STEP, TARGET, VARIANTS,
    ArtifactError, ProgramKey, _checksum, check_digest, register_kernel_ops, sha256_stream,
    unique_keys)
from dspark_compile.engine_dir.graph_read import GraphProgram, read_program
from dspark_compile.engine_dir.paths import check_engine, open_file, read_file
from dspark_compile.engine_dir.weights import _load_weights
from dspark_compile.engine_dir.versions import ENV_FIELDS, environment_fields
from dspark_compile.engine_dir.fields import (check_engine_fields, check_programs_state,
    check_weights_table)
from dspark_compile.passes import REGISTRY


MAX_MANIFEST_BYTES = 64 << 20   # the tiny engine's is 0.2 MB; a real model's a few MB


def _read_manifest(engine_dir: Path) -> dict:
    path = engine_dir / MANIFEST
    if not engine_dir.exists():
        raise ArtifactError(f"engine directory {engine_dir} does not exist", path=str(engine_dir))
    if not engine_dir.is_dir():
        raise ArtifactError(f"engine directory {engine_dir} is not a directory (an engine is a "
                            "directory that `dspark-compile build --out` wrote)",
                            path=str(engine_dir))
    if not path.exists() and not path.is_symlink():
        raise ArtifactError(f"{engine_dir} is not an engine: {MANIFEST} is missing", path=MANIFEST)
    if path.is_symlink() or not path.is_file():
        what = "a symbolic link" if path.is_symlink() else "not a file"
        raise ArtifactError(f"{engine_dir} is not an engine: {MANIFEST} is {what}",
                            path=MANIFEST)
    try:
        text = read_file(engine_dir, MANIFEST, MAX_MANIFEST_BYTES).decode("utf-8")
        manifest = json.loads(text, object_pairs_hook=unique_keys)
    except ArtifactError as e:
        raise ArtifactError(f"{MANIFEST}: {e}", path=MANIFEST) from None
    except (ValueError, RecursionError) as e:   # JSONDecodeError, UnicodeDecodeError, digits
        raise ArtifactError(f"{MANIFEST} is corrupted (not valid JSON: "
                            f"{type(e).__name__}: {str(e)[:200]})", path=MANIFEST) from None
    except OSError as e:
        raise ArtifactError(f"{engine_dir / MANIFEST} cannot be read ({e.strerror or e})",
                            path=MANIFEST) from e
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


def _check_files(engine_dir: Path, manifest: dict, skip: frozenset = frozenset()) -> None:
    """Every file of the table but those in `skip` has its size and sha256 (the paths were
    checked first)."""
    for rel, info in sorted(manifest.get("files", {}).items()):
        if rel in skip:
            continue
        with open_file(engine_dir, rel) as f:
            check_digest(rel, info, os.fstat(f.fileno()).st_size)
            digest = sha256_stream(f)
        check_digest(rel, info, info["size"], digest)


def _table(manifest: dict, field: str, what: str, check) -> dict:
    """manifest[field] as a table whose every entry passes `check(key, value)`; the field named
    otherwise (a hand-edited table failed with a TypeError or AttributeError)."""
    table = manifest.get(field, {})
    if not isinstance(table, dict):
        raise ArtifactError(f"manifest field '{field}' is a {type(table).__name__}, not a table "
                            f"of {what}", field=field)
    for k, v in table.items():
        if not check(k, v):
            raise ArtifactError(f"manifest field '{field}': entry {k!r} is not {what}: {v!r}",
                                field=f"{field}.{k}")
    return table


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(manifest: dict) -> None:
    """The shapes of the tables the load reads: files, programs, weights, buckets."""
    _table(manifest, "files", "a file entry (sha256 text, size in bytes)",
           lambda k, v: isinstance(v, dict) and isinstance(v.get("sha256"), str)
           and _is_int(v.get("size")) and v["size"] >= 0)
    _table(manifest, "programs", "a program entry (path, shared_weights)",
           lambda k, v: isinstance(v, dict) and isinstance(v.get("path"), str)
           and isinstance(v.get("shared_weights", {}), (dict, list)))
    weights = manifest.get("weights", {})
    if not (isinstance(weights, dict) and isinstance(weights.get("file"), str)
            and isinstance(weights.get("tensors", {}), dict)):
        raise ArtifactError(f"manifest field 'weights' is not a table with 'file' and 'tensors': "
                            f"{str(weights)[:80]!r}", field="weights")
    buckets = manifest.get("buckets")
    if not isinstance(buckets, list) or not all(_is_int(b) and b > 0 for b in buckets):
        raise ArtifactError(f"manifest field 'buckets' must be a list of positive ints, got "
                            f"{buckets!r}", field="buckets")


def _check_structure(manifest: dict) -> None:
    _check_types(manifest)
    buckets = manifest.get("buckets")
    progs = manifest.get("programs", {})
    if not isinstance(buckets, list) or sorted(map(str, buckets)) != sorted(progs):
        raise ArtifactError(f"manifest field 'buckets': {buckets} does not match the programs "
                            f"listed {sorted(progs)}", field="buckets")
    files = manifest.get("files", {})
    for kind in (STEP, PREFILL, TARGET):
        table = ProgramKey(kind, 1).table
        entries = manifest.get(table, {})
        if not isinstance(entries, dict):
            raise ArtifactError(f"manifest field '{table}' is not a table", field=table)
        for k, entry in entries.items():
            _check_entry_files(table, kind, k, entry, files)
            if kind == TARGET and k not in progs:
                raise ArtifactError(f"manifest field '{table}': bucket {k} is not a step "
                                    "bucket", field=table)
    if manifest.get("weights", {}).get("file") not in files:
        raise ArtifactError("manifest field 'weights': the weights file is not in the file table",
                            field="weights")


def _check_entry_files(table: str, kind: str, k, entry, files: dict) -> None:
    """A program entry names exactly its ProgramKey's files (graph, constants, variants), each
    in the file table: a hand-edited entry cannot make the load read another file."""
    key = ProgramKey(kind, int(k)) if isinstance(k, str) and k.isdigit() and int(k) > 0 \
        else None
    what = "chunk" if kind == PREFILL else "bucket"
    if key is None or not isinstance(entry, dict):
        raise ArtifactError(f"manifest field '{table}': entry {k!r} is not a program of a "
                            f"{what} size", field=table)
    # the size's own program, or the one program of its kind serving every size
    shared = entry.get("path") == key.shared_path
    want = [("path", entry.get("path"), key.shared_path if shared else key.path)]
    if entry.get("constants") is not None:
        want.append(("constants", entry["constants"],
                     key.shared_constants_path if shared else key.constants_path))
    variants = entry.get("variants", {})
    if not isinstance(variants, dict):
        raise ArtifactError(f"manifest field '{table}.{k}.variants' is not a table",
                            field=table)
    for v, rel in variants.items():
        if v not in VARIANTS or v == "full":
            raise ArtifactError(f"manifest field '{table}.{k}.variants': {v!r} is not a "
                                "program variant", field=table)
        vkey = key.with_variant(v)
        want.append((f"variants.{v}", rel, vkey.shared_path if shared else vkey.path))
    for name, have, path in want:
        if have != path or path not in files:
            raise ArtifactError(f"manifest field '{table}.{k}.{name}': {what} {k}'s file "
                                f"{str(have)[:120]!r} is not {path} in the file table",
                                field=table)


def check_state_layout(programs: dict, state: dict) -> None:
    """Every program takes exactly the decode state this dspark_compile allocates (its keys, in
    order): an engine built when the state had other fields (e.g. before `row.verify`, the
    rejection op's per-row verification) is refused naming them, not failed at the first step."""
    want = list(state)
    for b, program in sorted(programs.items()):
        have = program.state_keys
        if have is None:
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
    # before any other file is opened or even looked at: an engine names only files inside
    # itself (dspark_compile/engine_dir/paths.py)
    check_engine(engine_dir, manifest)
    if "format_version" not in skip and manifest.get("format_version") != FORMAT_VERSION:
        raise _old_format(engine_dir, manifest)
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


def _old_format(engine_dir: Path, manifest: dict) -> ArtifactError:
    """The one-line refusal of an engine of another format version, with the build command
    that replaces it (its checkpoint is not recorded in the manifest: the user names it)."""
    have = manifest.get("format_version")
    bc = manifest.get("build_config") if isinstance(manifest.get("build_config"), dict) else {}
    flags = []
    for field, flag in (("buckets", "--buckets"), ("max_seq_len", "--max-seq-len"),
                        ("dtype", "--dtype"), ("device", "--device")):
        v = bc.get(field)
        if isinstance(v, list) and all(_is_int(x) for x in v):
            flags.append(f"{flag} {','.join(map(str, v))}")
        elif isinstance(v, (int, str)) and not isinstance(v, bool) and str(v).isprintable() \
                and len(str(v)) < 40:
            flags.append(f"{flag} {v}")
    what = ("its programs are torch.export archives, which this dspark-compile no longer loads"
            if have == 1 else f"this dspark-compile reads format {FORMAT_VERSION}")
    return ArtifactError(
        f"engine {engine_dir} has format_version {str(have)[:20]} ({what}) — rebuild it: "
        f"dspark-compile build CHECKPOINT --out {engine_dir} {' '.join(flags)} --overwrite",
        field="format_version")


TRUST_FLAG = "--trust-engine-code"


def check_code_trust(manifest: dict, trust_code: bool) -> None:
    """An engine whose programs are code (`--backend inductor`: the Python and the kernels
    Inductor generated, in compiled/) loads only when the caller trusts its author; an aten
    engine's load executes nothing from the directory (dspark_compile/engine_dir/graph_read.py)."""
    bc = manifest.get("build_config")
    backend = bc.get("backend", "aten") if isinstance(bc, dict) else "aten"
    if backend != "aten" and not trust_code:
        raise ArtifactError(
            f"manifest field 'build_config.backend' is {backend!r}: loading this engine runs the "
            f"Python code in its {COMPILED_DIR}/ directory, so it loads only for an engine you "
            f"built or trust: pass {TRUST_FLAG} (Engine.load(trust_code=True)), or load an engine "
            "built with --backend aten, which executes nothing from its directory",
            field="build_config.backend")


def load_engine(engine_dir, expect: Optional[dict] = None, skip: Iterable[str] = (),
                device="cpu", check_files: bool = True, trust_code: bool = False):
    """Validate and load an engine: returns (manifest, {bucket: GraphProgram} of the steps,
    {FQN: weight tensor}). The weights are loaded once (onto `device`) and every program is
    bound to the same tensors. `trust_code`: load an engine whose programs are code
    (check_code_trust); refused otherwise."""
    engine_dir = Path(engine_dir)
    manifest = load_manifest(engine_dir, expect=expect, skip=skip, check_files=False,
                             device=device)
    if check_files:
        # a program's files are hashed where they are read (_read_checked), so the table check
        # leaves them out: each is read and hashed once
        _check_files(engine_dir, manifest, _program_paths(manifest))
    check_code_trust(manifest, trust_code)
    configs = _engine_fields(manifest, device)
    register_kernel_ops()  # before a program is read: its ops are resolved by name
    weights = _load_weights(engine_dir / manifest["weights"]["file"],
                            manifest["weights"]["tensors"], device)
    cache: dict = {}
    programs = {b: load_program(engine_dir, manifest, b, weights, cache)
                for b in manifest["buckets"]}
    if configs is not None:
        check_weights_table(*configs, manifest["weights"].get("tensors", {}))
        check_programs_state(*configs, programs)
    return manifest, programs, weights


def _engine_fields(manifest: dict, device=None):
    """(ModelConfig, BuildConfig) of an engine `dspark-compile build` wrote, checked against
    the manifest's tables and the device's free memory (dspark_compile/engine_dir/fields.py);
    None for an engine without those fields (save_engine alone writes such engines)."""
    if "model_config" not in manifest or "build_config" not in manifest:
        return None
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and not torch.cuda.is_available():
        dev = None
    return check_engine_fields(manifest, dev)


def _program_paths(manifest: dict) -> frozenset:
    """The files of a validated manifest's program tables (graphs, constants, variants)."""
    out = set()
    for table in PROGRAM_TABLES:
        for entry in manifest.get(table, {}).values():
            out.add(entry["path"])
            out.update(entry.get("variants", {}).values())
            if entry.get("constants") is not None:
                out.add(entry["constants"])
    return frozenset(out)


def _read_checked(engine_dir: Path, manifest: dict, rel: str) -> bytes:
    """Engine file `rel` of a validated manifest, read once and checked against its file-table
    entry (size, sha256) on those same bytes."""
    info = manifest["files"][rel]
    with open_file(engine_dir, rel) as f:
        check_digest(rel, info, os.fstat(f.fileno()).st_size)
        data = f.read(info["size"] + 1)
    check_digest(rel, info, len(data), hashlib.sha256(data).hexdigest())
    return data


def load_program(engine_dir, manifest: dict, key, weights: dict,
                 cache: Optional[dict] = None) -> GraphProgram:
    """Program `key` (a ProgramKey, or a bucket: its step) of a validated manifest, read as data
    (engine_dir/graph_read.py), checked against its manifest entry (the weights it shares, its
    inputs) and bound to the engine's `weights` (the dspark:: ops must be registered:
    register_kernel_ops). `cache`: {file: GraphProgram} of this load, so one program serving
    several sizes is read once."""
    key = key if isinstance(key, ProgramKey) else ProgramKey(STEP, int(key))
    engine_dir = Path(engine_dir)
    entry = manifest[key.table][str(key.size)]
    rel = entry["path"] if key.variant == "full" else entry.get("variants", {}).get(key.variant)
    if rel is None:
        raise ArtifactError(f"program {key} is not in the engine (manifest field "
                            f"'{key.table}.{key.size}.variants')", field=key.table)
    if cache is not None and rel in cache:
        return cache[rel]
    consts = entry.get("constants")
    program = read_program(_read_checked(engine_dir, manifest, rel),
                           _read_checked(engine_dir, manifest, consts) if consts else None, rel)
    shared = entry.get("shared_weights")
    if not isinstance(shared, list) or sorted(program.weight_names) != sorted(shared):
        raise ArtifactError(f"program '{rel}' takes the weights {sorted(program.weight_names)[:4]}"
                            f"... ({len(program.weight_names)}), its manifest entry lists "
                            f"{len(shared) if isinstance(shared, list) else shared!r}",
                            path=rel)
    users = [i.name for i in program.inputs if i.kind == "user"]
    if entry.get("user_inputs", users) != users:
        raise ArtifactError(f"program '{rel}' takes the inputs {users[:4]}..., its manifest "
                            "entry lists others", path=rel)
    program.bind(weights)
    if cache is not None:
        cache[rel] = program
    return program


def program_variants(manifest: dict, key: ProgramKey) -> list:
    """The variants of program `key` the validated manifest lists, "full" first."""
    entry = manifest[key.table][str(key.size)]
    return ["full", *sorted(entry.get("variants", {}))]


def _load_table(engine_dir, manifest: dict, weights: dict, kind: str) -> dict:
    """{size: GraphProgram} of the validated manifest's programs of `kind` (its table), bound
    to the shared `weights`."""
    out, cache = {}, {}
    for k in sorted(manifest.get(ProgramKey(kind, 1).table, {}), key=int):
        out[int(k)] = load_program(engine_dir, manifest, ProgramKey(kind, int(k)), weights,
                                   cache)
    configs = _engine_fields(manifest)
    if configs is not None:
        check_programs_state(*configs, {ProgramKey(kind, k): p for k, p in out.items()})
    return out


def load_prefill_programs(engine_dir, manifest: dict, weights: dict) -> dict:
    """{chunk length: GraphProgram} of a validated manifest's prefill programs (none for an
    engine built without them), bound to the shared `weights`."""
    return _load_table(engine_dir, manifest, weights, PREFILL)


def load_target_programs(engine_dir, manifest: dict, weights: dict) -> dict:
    """{bucket: GraphProgram} of a validated manifest's target-only programs (none for an
    engine built without them), bound to the shared `weights`."""
    return _load_table(engine_dir, manifest, weights, TARGET)
