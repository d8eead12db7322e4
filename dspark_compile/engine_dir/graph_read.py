"""The reader of the engine's program format (dspark_compile/engine_dir/graph_format.py says
what a program holds): `read_program` checks a program's graph and constants as data and
returns a `GraphProgram` (engine_dir/graph_program.py), whose `module(weights)` builds the
module `ep.module()` would, by torch.fx from the checked data alone: no pickle, no eval, no name from the file looked up anywhere but the
operator table of the aten, prims and dspark namespaces, the format's own tables and its
functional collectives (graph_format.COLLECTIVES, each process group named by a checked string
literal).
"""
from __future__ import annotations

import builtins
import json
import keyword
import operator
import re
from typing import Optional

import torch
from torch.utils import _pytree as pytree

from dspark_compile.engine_dir.format import ArtifactError, unique_keys
from dspark_compile.engine_dir.graph_program import GraphProgram, _Input, _Ref, _refuse
from dspark_compile.engine_dir.graph_format import (
    COLLECTIVES, DTYPES, FORMAT, GETITEM, GROUP_NAME, LAYOUTS, MAX_DEPTH, MEMORY_FORMATS,
    NAMESPACES, SIZE_OPS, SPECIAL_FLOATS, VERSION)

_TOP = {"format", "version", "arg_names", "in_spec", "out_spec", "inputs", "nodes", "outputs"}
_NODE = {"name", "op", "args", "kwargs"}
# a model part's name (engine_dir/parts.py): layers.3, mtp.0, draft.context, step ...
_PART_NAME = re.compile(r"[a-z][a-z0-9_.]{0,39}")
_LIFTED = ("parameter", "buffer", "constant")
_MUTATIONS = {"user_input_mutation": "user", "buffer_mutation": "buffer",
              "parameter_mutation": "parameter"}
_OP = re.compile(r"([a-z]+)\.(\w+)\.(\w+)")
# node and placeholder names become Python identifiers in the module's generated code
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
# a weight's name: module path components (a list index is digits), each emitted into the
# generated code as an attribute (torch.fx's _format_target quotes a non-identifier unescaped)
_PART = re.compile(r"[A-Za-z0-9_]{1,100}")
_DEVICE = re.compile(r"(cpu|cuda|meta)(?::(\d{1,3}))?")
# globals of the module's generated code, which forward's parameter names would shadow
_RESERVED_ARGS = frozenset({"self", "torch", "fx_pytree", "pytree", "device", "inf", "nan"})


class _Reader:
    """One graph document's checks, each failure an ArtifactError naming the program and what
    it holds."""

    def __init__(self, rel: str):
        self.rel = rel
        self.defined: set = set()
        self.ops: dict = {}
        self.sizes: dict = {}          # symbol -> (min, max): the program's dynamic sizes

    def fail(self, why: str) -> ArtifactError:
        return _refuse(self.rel, why)

    def fields(self, obj, want: set, optional: set, what: str) -> dict:
        if not isinstance(obj, dict):
            raise self.fail(f"{what} is not an object")
        extra = sorted(set(obj) - want - optional)
        if extra:
            raise self.fail(f"{what} has the unknown field {extra[0][:80]!r}")
        missing = sorted(want - set(obj))
        if missing:
            raise self.fail(f"{what} lacks the field {missing[0]!r}")
        return obj

    def name(self, v, what: str) -> str:
        if not (isinstance(v, str) and _NAME.fullmatch(v)) or keyword.iskeyword(v):
            raise self.fail(f"{what} has the name {str(v)[:80]!r}, not an identifier")
        return v

    def arg_name(self, v) -> str:
        """forward's parameter names are not renamed by torch.fx: one that is a name the
        generated code uses (torch, a builtin) would shadow it."""
        name = self.name(v, "an argument")
        if name in _RESERVED_ARGS or hasattr(builtins, name):
            raise self.fail(f"an argument is named {name!r}, a name the module's code uses")
        return name

    def define(self, v, what: str) -> str:
        name = self.name(v, what)
        if name in self.defined:
            raise self.fail(f"the name {name!r} is defined twice")
        self.defined.add(name)
        return name

    def target(self, v, what: str) -> str:
        if not isinstance(v, str) or not all(_PART.fullmatch(p) for p in v.split(".")):
            raise self.fail(f"{what} has the target {str(v)[:80]!r}, not a dotted name of "
                            "letters, digits and underscores")
        return v

    def tensor_meta(self, entry: dict, what: str, symbolic: bool = False) -> tuple:
        """(dtype, shape); with `symbolic` a dimension may name one of the program's sizes."""
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise self.fail(f"{what} has the unknown dtype {str(entry['dtype'])[:40]!r}")
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(
                (_is_int(d) and d >= 0) or (symbolic and d in self.sizes) for d in shape):
            raise self.fail(f"{what} has a shape that is not a list of non-negative ints"
                            + (" or the program's sizes" if symbolic else ""))
        return dtype, tuple(shape)

    def read_sizes(self, v) -> dict:
        """The program's dynamic sizes {symbol: [min, max]}: identifiers, 1 <= min <= max."""
        if not isinstance(v, dict) or len(v) > 16:
            raise self.fail("its sizes are not a table of at most 16 symbols")
        for name, r in v.items():
            self.name(name, "a size")
            if not (isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r)
                    and 1 <= r[0] <= r[1] < 2 ** 31):
                raise self.fail(f"its size {name!r} has the range {str(r)[:40]}, not "
                                "[min, max] with 1 <= min <= max < 2^31")
        self.sizes = {k: tuple(r) for k, r in v.items()}
        return self.sizes

    def op(self, v, what: str):
        if v == GETITEM:
            return operator.getitem
        if v in SIZE_OPS:
            return SIZE_OPS[v][0]
        if v in self.ops:
            return self.ops[v]
        if v in COLLECTIVES:
            return self.collective(v)
        m = _OP.fullmatch(v) if isinstance(v, str) else None
        op = None
        if m is not None and m.group(1) in NAMESPACES:
            try:
                op = getattr(getattr(getattr(torch.ops, m.group(1)), m.group(2)), m.group(3))
            except (AttributeError, RuntimeError):
                op = None
        if not (isinstance(op, torch._ops.OpOverload) and op.namespace == m.group(1)
                and op._schema.name == f"{m.group(1)}::{m.group(2)}"
                and op._overloadname == m.group(3)):
            raise self.fail(f"{what} calls {str(v)[:120]!r}, which is not a registered aten, "
                            "prims or dspark operator")
        self.ops[v] = op
        return op

    def collective(self, v: str):
        """A functional collective of COLLECTIVES, resolved in torch.ops._c10d_functional (a
        torch built without distributed lacks it: the program cannot run here)."""
        ns, name, overload = v.split(".")
        try:
            op = getattr(getattr(getattr(torch.ops, ns), name), overload)
        except (AttributeError, RuntimeError):
            op = None
        if not isinstance(op, torch._ops.OpOverload):
            raise self.fail(f"it calls the collective {v!r}, which this torch does not register "
                            "(a build without torch.distributed?)")
        self.ops[v] = op
        return op

    def value(self, v, what: str, depth: int = 1):
        if v is None or isinstance(v, (bool, str, float)):
            return v
        if _is_int(v):
            if not -2 ** 63 <= v < 2 ** 64:
                raise self.fail(f"{what} holds the int {str(v)[:40]}, outside 64 bits")
            return v
        if depth > MAX_DEPTH:
            raise self.fail(f"{what} nests an argument deeper than {MAX_DEPTH}")
        if isinstance(v, list):
            return [self.value(x, what, depth + 1) for x in v]
        if not (isinstance(v, dict) and len(v) == 1):
            raise self.fail(f"{what} holds a {type(v).__name__} literal the format does not "
                            "know")
        (tag, x), = v.items()
        if tag == "node":
            if not isinstance(x, str) or x not in self.defined:
                raise self.fail(f"{what} refers to {str(x)[:80]!r}, which names no placeholder "
                                "or earlier node")
            return _Ref(x)
        if tag == "tuple" and isinstance(x, list):
            return tuple(self.value(y, what, depth + 1) for y in x)
        if tag == "dtype" and x in DTYPES:
            return DTYPES[x]
        if tag == "device" and isinstance(x, str) and _DEVICE.fullmatch(x):
            return torch.device(x)
        if tag == "layout" and x in LAYOUTS:
            return LAYOUTS[x]
        if tag == "memory_format" and x in MEMORY_FORMATS:
            return MEMORY_FORMATS[x]
        if tag == "float" and x in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[x]
        raise self.fail(f"{what} holds the literal {json.dumps(v)[:80]}, which the format does "
                        "not know")

    def spec(self, v, what: str, depth: int = 0):
        """The skeleton of a pytree spec: tensors are 0, read back by tree_structure."""
        if depth > MAX_DEPTH:
            raise self.fail(f"its {what} nests deeper than {MAX_DEPTH}")
        if v == "*":
            return 0
        if v is None:
            return None
        if isinstance(v, dict) and len(v) == 1:
            (tag, x), = v.items()
            if tag in ("tuple", "list") and isinstance(x, list):
                kids = [self.spec(c, what, depth + 1) for c in x]
                return tuple(kids) if tag == "tuple" else kids
            if tag == "dict" and isinstance(x, list) and all(
                    isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in x):
                out = {k: self.spec(c, what, depth + 1) for k, c in x}
                if len(out) != len(x):
                    raise self.fail(f"its {what} gives a dict key twice")
                return out
        raise self.fail(f"its {what} holds {json.dumps(v)[:80]}, not a tuple, list, dict of "
                        "str keys or tensor")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")     # json.loads would read NaN, Infinity


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_program(graph: bytes, constants: Optional[bytes] = None,
                 rel: str = "program") -> GraphProgram:
    """The program whose graph JSON is `graph` and own constants `constants` (safetensors
    bytes, or None), checked: ArtifactError naming `rel` (its engine path) and what it holds
    for anything but the format above. The `dspark::` ops must be registered."""
    r = _Reader(rel)
    try:
        doc = json.loads(graph, object_pairs_hook=unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise r.fail(f"its graph is not readable JSON ({type(e).__name__}: "
                     f"{str(e)[:120]})") from None
    r.fields(doc, _TOP, {"sizes", "parts"}, "its graph")
    parts = doc.get("parts", [])
    if not (isinstance(parts, list) and len(parts) <= 4096 and all(
            isinstance(p, str) and _PART_NAME.fullmatch(p) for p in parts)):
        raise r.fail("its parts are not a list of model part names")
    sizes = r.read_sizes(doc.get("sizes", {}))
    if doc["format"] != FORMAT or not _is_int(doc["version"]) or doc["version"] != VERSION:
        raise r.fail(f"it is format {str(doc['format'])[:40]!r} version "
                     f"{str(doc['version'])[:20]}, this reader reads {FORMAT!r} version "
                     f"{VERSION} — rebuild the engine")
    names = doc["arg_names"]
    if not isinstance(names, list) or not names:
        raise r.fail("its arg_names is not a list of names")
    names = [r.arg_name(n) for n in names]
    if len(set(names)) != len(names):
        raise r.fail("its arg_names repeat a name")
    in_spec = pytree.tree_structure(r.spec(doc["in_spec"], "in_spec"))
    out_spec = pytree.tree_structure(r.spec(doc["out_spec"], "out_spec"))
    if not (in_spec.type is tuple and in_spec.num_children == 2
            and in_spec.child(0).type is tuple and in_spec.child(1).type is dict
            and in_spec.child(1).num_children == 0):
        raise r.fail("its in_spec is not ((arguments...), {}): the engine's programs take "
                     "positional arguments only")
    if in_spec.child(0).num_children != len(names):
        raise r.fail(f"its in_spec has {in_spec.child(0).num_children} arguments, arg_names "
                     f"{len(names)}")
    inputs = _read_inputs(r, doc["inputs"])
    nodes, node_parts = _read_nodes(r, doc["nodes"], parts)
    outputs = _read_outputs(r, doc["outputs"], inputs)
    n_user = sum(i.kind == "user" for i in inputs)
    if n_user != in_spec.num_leaves:
        raise r.fail(f"it has {n_user} user inputs, its in_spec {in_spec.num_leaves} tensors")
    n_out = sum(k == "user" for k, _, _ in outputs)
    if n_out != out_spec.num_leaves:
        raise r.fail(f"it has {n_out} user outputs, its out_spec {out_spec.num_leaves}")
    program = GraphProgram(rel, names, in_spec, out_spec, inputs, nodes, outputs,
                           _read_constants(r, constants, inputs))
    program.sizes = sizes
    program.parts = node_parts
    return program


def _read_inputs(r: _Reader, entries) -> list:
    if not isinstance(entries, list):
        raise r.fail("its inputs are not a list")
    out, targets = [], set()
    for k, e in enumerate(entries):
        what = f"input {k}"
        kind = e.get("kind") if isinstance(e, dict) else None
        if kind == "user":
            r.fields(e, {"name", "kind", "dtype", "shape"}, set(), what)
            symbolic = True
        elif kind in _LIFTED:
            r.fields(e, {"name", "kind", "dtype", "shape", "target", "stored"},
                     {"persistent"} if kind == "buffer" else set(), what)
            symbolic = False
        else:
            raise r.fail(f"{what} has the kind {str(kind)[:40]!r}, not user, parameter, "
                         "buffer or constant")
        name = r.define(e["name"], what)
        dtype, shape = r.tensor_meta(e, f"input '{name}'", symbolic)
        i = _Input(name, kind, dtype, shape)
        if kind != "user":
            i.target = r.target(e["target"], f"input '{name}'")
            if i.target in targets:
                raise r.fail(f"the tensor '{i.target}' is taken by two inputs")
            targets.add(i.target)
            if e["stored"] not in ("weights", "program"):
                raise r.fail(f"input '{name}' is stored in {str(e['stored'])[:40]!r}, not "
                             "'weights' or 'program'")
            i.stored = e["stored"]
            i.persistent = e.get("persistent", True)
            if not isinstance(i.persistent, bool):
                raise r.fail(f"input '{name}' has a persistent flag that is not a bool")
        out.append(i)
    return out


def _read_nodes(r: _Reader, entries, parts: list) -> tuple:
    """(nodes, {node name: its model part}) of the graph's node list."""
    if not isinstance(entries, list):
        raise r.fail("its nodes are not a list")
    out, named = [], {}
    for k, e in enumerate(entries):
        r.fields(e, _NODE, {"part"}, f"node {k}")
        if "part" in e:
            if not (_is_int(e["part"]) and 0 <= e["part"] < len(parts)):
                raise r.fail(f"node {k} names the part {str(e['part'])[:20]}, not an index "
                             "into its parts")
            named[e["name"]] = parts[e["part"]]
        what = f"node '{str(e['name'])[:80]}'"
        op = r.op(e["op"], what)
        if not isinstance(e["args"], list) or not isinstance(e["kwargs"], dict):
            raise r.fail(f"{what} has args that are not a list or kwargs not an object")
        args = tuple(r.value(a, what) for a in e["args"])
        kwargs = {key: r.value(v, what) for key, v in e["kwargs"].items()}
        _check_call(r, op, args, kwargs, what)
        out.append((r.define(e["name"], f"node {k}"), op, args, kwargs))
    return out, named


def _check_call(r: _Reader, op, args: tuple, kwargs: dict, what: str) -> None:
    """The call fits its operator's schema: getitem(node, int); an op's positional arguments
    no more than its schema's, its keywords among the schema's names."""
    if op is operator.getitem:
        if len(args) != 2 or kwargs or not isinstance(args[0], _Ref) or not _is_int(args[1]):
            raise r.fail(f"{what} calls getitem with other than (a node, an int)")
        return
    arity = next((n for fn, n in SIZE_OPS.values() if fn is op), None)
    if arity is not None:
        if len(args) != arity or kwargs or not all(isinstance(a, _Ref) or _is_int(a)
                                                   for a in args):
            raise r.fail(f"{what} calls {op.__name__} with other than {arity} sizes or ints")
        return
    schema = op._schema.arguments
    name = f"{op._schema.name.replace('::', '.')}.{op._overloadname}"
    if name in COLLECTIVES:
        _check_collective(r, op, name, args, kwargs, what)
    positional = sum(not a.kwarg_only for a in schema)
    if len(args) > positional:
        raise r.fail(f"{what} passes {len(args)} positional arguments to {op}, which takes "
                     f"{positional}")
    names = {a.name for a in schema}
    bad = sorted(k for k in kwargs if k not in names)
    if bad:
        raise r.fail(f"{what} passes the keyword {bad[0][:40]!r}, which {op} does not take")


def _check_collective(r: _Reader, op, name: str, args: tuple, kwargs: dict, what: str) -> None:
    """A collective's call: every argument positional, a node for each tensor, an int >= 1 for
    a group size, and its process group named by a GROUP_NAME string literal."""
    schema = op._schema.arguments
    if kwargs or len(args) != len(schema):
        raise r.fail(f"{what} calls {name} with other than its {len(schema)} positional "
                     "arguments")
    group = COLLECTIVES[name]
    for k, (a, s) in enumerate(zip(args, schema)):
        if k == group:
            if not (isinstance(a, str) and GROUP_NAME.fullmatch(a)):
                raise r.fail(f"{what} names the process group {str(a)[:40]!r}, not a name of "
                             "letters, digits and underscores")
        elif s.type.kind() == "TensorType":
            if not isinstance(a, _Ref):
                raise r.fail(f"{what} passes {s.name!r} to {name} as a literal, not a node")
        elif not (_is_int(a) and 1 <= a <= 1 << 16):
            raise r.fail(f"{what} passes {s.name!r} = {str(a)[:20]} to {name}, not a rank count")


def _read_outputs(r: _Reader, entries, inputs: list) -> list:
    if not isinstance(entries, list):
        raise r.fail("its outputs are not a list")
    kinds = {i.name: i.kind for i in inputs}
    lifted = {i.target: i.kind for i in inputs if i.target is not None}
    out, seen = [], set()
    for k, e in enumerate(entries):
        kind = e.get("kind") if isinstance(e, dict) else None
        what = f"output {k}"
        if kind == "user":
            r.fields(e, {"kind", "value"}, set(), what)
            out.append(("user", None, r.value(e["value"], what)))
            continue
        if kind not in _MUTATIONS:
            raise r.fail(f"{what} has the kind {str(kind)[:40]!r}")
        r.fields(e, {"kind", "value", "target"}, set(), what)
        target = e["target"]
        have = (kinds if kind == "user_input_mutation" else lifted).get(target) \
            if isinstance(target, str) else None
        if have != _MUTATIONS[kind]:
            raise r.fail(f"{what} mutates {str(target)[:80]!r}, which is not a "
                         f"{_MUTATIONS[kind]} input")
        if target in seen:
            raise r.fail(f"{what} mutates {target!r} a second time")
        seen.add(target)
        value = r.value(e["value"], what)
        if not isinstance(value, _Ref):
            raise r.fail(f"{what} copies a literal, not a node, into {target!r}")
        out.append((kind, target, value))
    return out


def _read_constants(r: _Reader, data: Optional[bytes], inputs: list) -> dict:
    want = {i.target: i for i in inputs if i.stored == "program"}
    if data is None:
        if want:
            raise r.fail(f"it takes {len(want)} constants of its own (first "
                         f"'{next(iter(want))}') and has no constants file")
        return {}
    from safetensors.torch import load
    try:
        tensors = load(bytes(data))
    except Exception as e:  # noqa: BLE001 -- SafetensorError, and torch's errors
        raise r.fail(f"its constants are not a readable safetensors file "
                     f"({type(e).__name__}: {str(e)[:120]})") from None
    if set(tensors) != set(want):
        missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
        raise r.fail(f"its constants file holds other tensors than its graph takes (missing "
                     f"{missing[:3]}, unexpected {extra[:3]})")
    for name, t in tensors.items():
        i = want[name]
        if t.dtype != i.dtype or tuple(t.shape) != i.shape:
            raise r.fail(f"its constant '{name}' is {t.dtype} {list(t.shape)}, its graph says "
                         f"{i.dtype} {list(i.shape)}")
    return tensors
