"""Faster `torch.export.load` of the engine's programs.

torch's program deserializer (torch/_export/serde/serialize.py `_dict_to_dataclass`, torch 2.11
and 2.13) rebuilds every node, argument and tensor meta of the program's JSON as a schema
dataclass and calls `typing.get_type_hints(cls, globalns=vars(schema))` for each one: 126k
calls, 14 of the 48 s of a profiled load of the tiny engine's three step programs and one
prefill program on the H200 machine (benchmarks/load_time.py --profile). The hints of a schema
class never change, so inside `faster_deserialization()` the deserializer's `typing` is a
stand-in whose `get_type_hints` remembers its answer per (class, namespace); everything else
is the real module. Outside the block the deserializer is untouched.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import threading
import types
import typing
from dspark_compile.engine_dir.format import ArtifactError, check_digest
from dspark_compile.engine_dir.paths import open_file

_LOCK = threading.RLock()      # re-entered: load_program_file inside Engine.load's block


class _MemoTyping(types.ModuleType):
    """`typing`, with get_type_hints memoised for the calls the deserializer makes."""

    def __init__(self):
        super().__init__("typing")
        self._hints: dict = {}

    def __getattr__(self, name):
        return getattr(typing, name)

    def get_type_hints(self, obj, globalns=None, localns=None, include_extras=False):
        if localns is not None or not isinstance(obj, type):
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        key = (obj, id(globalns), include_extras)
        hints = self._hints.get(key)
        if hints is None:
            hints = self._hints[key] = typing.get_type_hints(obj, globalns, None, include_extras)
        return dict(hints)        # callers may not mutate the remembered answer


@contextlib.contextmanager
def faster_deserialization():
    """torch.export.load inside this block deserializes with memoised type hints."""
    try:
        from torch._export.serde import serialize
    except ImportError:           # another torch layout: load as torch does
        yield
        return
    with _LOCK:
        original = getattr(serialize, "typing", None)
        if original is not typing:     # not the layout measured above: leave it alone
            yield
            return
        serialize.typing = _MemoTyping()
        try:
            yield
        finally:
            serialize.typing = original


# --------------------------------------------------------------------------- untrusted archives
# What loading a program may execute is nothing from the engine: `torch.export.load` unpickles
# (torch.load with weights_only=False) a constant or weight whose config says `use_pickle`, a
# `custom_obj_*` / `opaque_obj_*` constant, the legacy `data/weights/model.pt` and
# `data/constants/model.pt`, and a non-empty `data/sample_inputs/model.pt` (a weights_only load
# that falls back to a full unpickle: torch/_export/serde/serialize.py deserialize_torch_artifact);
# it loads AOTInductor code under `data/aotinductor/`; it resolves each node's target by
# attribute lookups from `torch`, `operator` or `math` (so "torch.os.system" is os.system, called
# when the graph runs); it `sympify`s (an eval) every symbolic expression; and `ep.module()`
# turns `guards_code` into Python it executes (torch/export/_unlift.py). So before torch reads
# the archive, `check_program_archive` reads it through the same zip reader torch uses
# (torch._C.PyTorchFileReader) and refuses, by name, anything but the records below, tensors
# stored as raw bytes, node targets of the allowed namespaces, no symbolic expression and no
# guard code. torch 2.13's archive layout (torch/export/pt2_archive/_package.py).
_FIXED_RECORDS = {"archive_format", "archive_version", "byteorder", ".data/version",
                  ".data/serialization_id", "models/model.json", "data/sample_inputs/model.pt",
                  "data/weights/model_weights_config.json",
                  "data/constants/model_constants_config.json"}
_TENSOR_RECORD = re.compile(r"data/(weights/weight|constants/tensor)_\d+")
_OP_TARGET = re.compile(r"torch\.ops\.(aten|prims|dspark)\.(\w+)\.(\w+)")
_OTHER_TARGETS = {"_operator.getitem"}
_DEVICES = ("cpu", "cuda")


def _refuse(rel: str, why: str):
    return ArtifactError(f"program '{rel}' is refused: {why} (an engine's program holds a graph "
                         "of aten, prims and dspark ops and raw tensor bytes, nothing a load "
                         "would execute)", path=rel)


def _json(reader, name: str, rel: str):
    try:
        return json.loads(reader.get_record(name).decode("utf-8"))
    except (ValueError, RecursionError, RuntimeError) as e:
        raise _refuse(rel, f"its {name} is not readable JSON ({type(e).__name__})") from None


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_tensor(meta, name: str, nbytes: int, rel: str) -> None:
    """A raw tensor record's metadata: known dtype, integer sizes and strides (no symbolic
    expression), a device torch can name, and every element inside the record's bytes."""
    import torch
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    if not isinstance(meta, dict):
        raise _refuse(rel, f"tensor '{name}' has no tensor metadata")
    dtype = _SERIALIZE_TO_TORCH_DTYPE.get(meta.get("dtype")) if _int(meta.get("dtype")) else None
    if dtype is None:
        raise _refuse(rel, f"tensor '{name}' has the unknown dtype {meta.get('dtype')!r}")
    dims = {}
    for key in ("sizes", "strides"):
        vals = meta.get(key)
        if not isinstance(vals, list) or not all(
                isinstance(v, dict) and set(v) == {"as_int"} and _int(v["as_int"])
                and v["as_int"] >= 0 for v in vals):
            raise _refuse(rel, f"tensor '{name}' has {key} that are not plain non-negative ints")
        dims[key] = [v["as_int"] for v in vals]
    off = meta.get("storage_offset")
    if not (isinstance(off, dict) and set(off) == {"as_int"} and _int(off["as_int"])
            and off["as_int"] >= 0):
        raise _refuse(rel, f"tensor '{name}' has a storage offset that is not a plain int")
    if len(dims["sizes"]) != len(dims["strides"]):
        raise _refuse(rel, f"tensor '{name}' has {len(dims['sizes'])} sizes and "
                           f"{len(dims['strides'])} strides")
    dev = meta.get("device")
    if not (isinstance(dev, dict) and dev.get("type") in _DEVICES):
        raise _refuse(rel, f"tensor '{name}' is on the device {dev!r}")
    if meta.get("layout") != 7:         # schema.Layout.Strided
        raise _refuse(rel, f"tensor '{name}' is not a strided tensor")
    item = torch.empty((), dtype=dtype).element_size()
    if 0 in dims["sizes"]:
        return
    # the last element's index + 1: what as_strided reads of the record's storage
    extent = off["as_int"] + sum((s - 1) * st for s, st in zip(dims["sizes"], dims["strides"])) + 1
    if nbytes % item or extent * item > nbytes:
        raise _refuse(rel, f"tensor '{name}' reaches {extent * item} bytes of a {nbytes}-byte "
                           "record")


def _check_payload(reader, records: set, config_name: str, record_dir: str, prefix: str,
                   rel: str) -> None:
    cfg = _json(reader, config_name, rel)
    table = cfg.get("config") if isinstance(cfg, dict) else None
    if not isinstance(table, dict):
        raise _refuse(rel, f"its {config_name} has no 'config' table")
    for name, meta in table.items():
        if not isinstance(meta, dict):
            raise _refuse(rel, f"'{name}' in {config_name} is not an entry")
        path = meta.get("path_name")
        if meta.get("use_pickle") is not False:
            raise _refuse(rel, f"'{name}' is stored as a pickle (use_pickle), not raw tensor bytes")
        if not (isinstance(path, str) and re.fullmatch(prefix + r"_\d+", path)):
            raise _refuse(rel, f"'{name}' is stored as {path!r}, not a raw tensor record "
                               f"({prefix}_N): a custom or opaque object")
        record = f"{record_dir}/{path}"
        if record not in records:
            raise _refuse(rel, f"'{name}' names the record {record}, which the archive lacks")
        _check_tensor(meta.get("tensor_meta"), name, record_size(reader, record), rel)


def _walk_json(obj, rel: str):
    """Every dict inside `obj` (iteratively: a deep document cannot exhaust the stack)."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            yield x
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _check_target(target, rel: str) -> None:
    import torch
    if target in _OTHER_TARGETS:
        return
    m = _OP_TARGET.fullmatch(target) if isinstance(target, str) else None
    op = None
    if m is not None:
        try:
            op = getattr(getattr(getattr(torch.ops, m.group(1)), m.group(2)), m.group(3))
        except (AttributeError, RuntimeError):
            op = None
    if not (isinstance(op, torch._ops.OpOverload) and op.namespace == m.group(1)):
        raise _refuse(rel, f"its graph calls {str(target)[:200]!r}, which is not an aten, prims "
                           "or dspark operator")


def _check_graph_json(model: dict, rel: str) -> None:
    if not isinstance(model, dict) or not isinstance(model.get("graph_module"), dict):
        raise _refuse(rel, "its models/model.json is not an exported program")
    if model.get("guards_code"):
        raise _refuse(rel, "it carries guard code (Python that ep.module() would execute)")
    for d in _walk_json(model, rel):
        if "expr_str" in d:
            raise _refuse(rel, f"it holds the symbolic expression {str(d['expr_str'])[:200]!r} "
                               "(which the loader evaluates as Python)")
        if "as_custom_obj" in d or d.get("custom_obj_values"):
            raise _refuse(rel, "its graph takes a custom object")
        if "as_graph" in d:
            raise _refuse(rel, "its graph holds a subgraph (a higher-order op)")
        if "as_operator" in d:
            _check_target(d["as_operator"], rel)
        if "target" in d and "inputs" in d:      # a node
            _check_target(d["target"], rel)


def record_size(reader, name: str) -> int:
    """The byte size of archive record `name`: PyTorchFileReader.get_record_size where this
    torch has it (2.13), the record's length otherwise (torch 2.11's reader has no size query;
    an engine loaded there failed with AttributeError before this)."""
    size = getattr(reader, "get_record_size", None)
    return size(name) if size is not None else len(reader.get_record(name))


def check_program_archive(data: bytes, rel: str) -> None:
    """Refuse the program archive `data` (engine file `rel`) unless loading it can execute
    nothing from it (the comment above); ArtifactError naming the file and what it holds."""
    import torch
    from torch.export.pt2_archive.constants import ARCHIVE_VERSION_VALUE

    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        names = list(reader.get_all_records())
    except (RuntimeError, ValueError) as e:
        raise _refuse(rel, f"it is not a readable archive ({str(e).splitlines()[0][:200]})") \
            from None
    records = set(names)
    if len(records) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise _refuse(rel, f"the record {dup!r} appears twice")
    other = sorted(n for n in records if n not in _FIXED_RECORDS
                   and not _TENSOR_RECORD.fullmatch(n))
    if other:
        raise _refuse(rel, f"it holds the record {other[0]!r}"
                           + (f" and {len(other) - 1} more" if len(other) > 1 else ""))
    missing = sorted(_FIXED_RECORDS - records - {".data/serialization_id"})
    if missing:
        raise _refuse(rel, f"it lacks the record {missing[0]!r}")
    if reader.get_record("archive_format") != b"pt2" \
            or reader.get_record("archive_version").decode("ascii", "replace") \
            != ARCHIVE_VERSION_VALUE:
        raise _refuse(rel, "it is not a pt2 archive of this torch's version")
    if record_size(reader, "data/sample_inputs/model.pt"):
        raise _refuse(rel, "it holds sample inputs (a pickle)")
    _check_payload(reader, records, "data/weights/model_weights_config.json", "data/weights",
                   "weight", rel)
    _check_payload(reader, records, "data/constants/model_constants_config.json",
                   "data/constants", "tensor", rel)
    _check_graph_json(_json(reader, "models/model.json", rel), rel)


def load_program_file(engine_dir, rel: str, info: dict):
    """The ExportedProgram of the engine file `rel`, whose file-table entry is `info`: read
    once, its sha256 checked against the table, the archive checked (check_program_archive),
    then deserialised from those same bytes by torch's pt2 loader (torch.export.load without
    its fallback to the pre-2.8 format, which unpickles). The `dspark::` ops must be
    registered (register_kernel_ops)."""
    from torch.export.pt2_archive._package import load_pt2

    with open_file(engine_dir, rel) as f:
        check_digest(rel, info, os.fstat(f.fileno()).st_size)
        data = f.read(info["size"] + 1)
    check_digest(rel, info, len(data), hashlib.sha256(data).hexdigest())
    check_program_archive(data, rel)
    try:
        with faster_deserialization():
            contents = load_pt2(io.BytesIO(data))
        return contents.exported_programs["model"]
    except Exception as e:  # noqa: BLE001 -- torch raises anything on a malformed program
        raise ArtifactError(f"cannot load program '{rel}': {type(e).__name__}: "
                            f"{str(e)[:500]}", path=rel) from e
