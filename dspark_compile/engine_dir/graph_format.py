"""The engine's own program format: a post-pass program's graph as data, read back into a
runnable module without executing anything from the file.

`torch.export.load` spends most of an engine's load in its JSON deserializer and `ep.module()`'s
unlift (19.5 s + 5.3 s of a 31 s cold load of the tiny engine on an H100, issue 52), and it can
unpickle, `sympify` and run guard code from the archive (engine_dir/programs.py). This format
holds what the runtime runs and nothing else; the reader builds the module `ep.module()` would
(same graph, same call `fn(rows, state)`, the state updated in place the same way), and refuses,
naming it, anything it does not know.

A program is two byte strings: its graph (JSON, below) and its own constants (a safetensors
file; None when it has none). Weights are not in either: they come from the engine's
weights.safetensors by name.

    {"format": "dspark-graph", "version": 1,
     "arg_names": ["rows", "state"],             # forward's parameters, in order
     "in_spec":  {"tuple": [{"tuple": ["*", {"dict": [["layers.0.swa_nope", "*"], ...]}]},
                            {"dict": []}]},      # ((rows, state), {}): "*" is a tensor
     "out_spec": {"tuple": ["*", "*"]},          # specs: "*", null (None), {"tuple": [..]},
                                                 # {"list": [..]}, {"dict": [[str key, spec]..]}
     "inputs": [                                 # the graph's placeholders, in order
        {"name": "b_model_embed_weight", "kind": "buffer", "target": "model.embed.weight",
         "stored": "weights", "persistent": true, "dtype": "float32", "shape": [512, 64]},
        {"name": "c_lifted_tensor_0", "kind": "constant", "target": "lifted_tensor_0",
         "stored": "program", "dtype": "int64", "shape": [4]},
        {"name": "rows", "kind": "user", "dtype": "int64", "shape": [2]}, ...],
     "nodes": [                                  # call_function nodes in graph order
        {"name": "view", "op": "aten.view.default", "args": [{"node": "x"}, [2, 32]],
         "kwargs": {}, "part": 1}, ...],           # part: optional, an index into "parts"
     "parts": ["step", "layers.0", ...],         # optional: the model parts the nodes name
     "outputs": [                                # the graph's flat outputs, in order
        {"kind": "user", "value": {"node": "getitem_3"}},
        {"kind": "user_input_mutation", "target": "state_row_tokens", "value": {"node": "x"}}]}

A value (an argument, a keyword argument, an output) is JSON null / true / false / an int / a
float / a string as itself, a list as a JSON array, and otherwise an object of one key:
{"node": name} (a placeholder or an earlier node), {"tuple": [...]}, {"dtype": "float32"},
{"device": "cuda:0"}, {"layout": "strided"}, {"memory_format": "contiguous_format"},
{"float": "inf" | "-inf" | "nan"}. An op is "operator.getitem" or "<ns>.<op>.<overload>" of the
aten, prims and dspark namespaces, resolved to a registered operator overload, or one of the
functional collectives of `COLLECTIVES` (a tensor-parallel rank's program, models/parallel.py):
"_c10d_functional.all_gather_into_tensor.default" (tensor, group_size, group_name) and
"_c10d_functional.wait_tensor.default" (tensor). Their process group is named by a string
literal (`group_name`, checked against `GROUP_NAME`; the runtime checks at load that it names
its own group of group_size ranks, dspark_compile/runtime/ranks.py): a name, never code.

`kind` is "user" (an argument of forward, one per leaf of in_spec, in order), "parameter",
"buffer" or "constant" (lifted: `target` is the tensor's name; "stored" says whether it comes
from the engine's weights or the program's constants). A program exported with a dynamic batch
has "sizes": {"s0": [1, 64]} (each symbol's range) and user inputs whose shape names a symbol
(["s0"]); its size arithmetic is nodes of `SIZE_OPS` (operator.mul, ...) and aten.sym_size.
Lifted tensors' shapes are static. Outputs of kind
"user_input_mutation" / "buffer_mutation" / "parameter_mutation" are copied into their target
(a user input's placeholder name, a buffer's or parameter's name) at the end of the call, as
`ep.module()` does; the rest is the call's result, shaped by out_spec.

This module holds the format's tables and its writer (`dump_program`); the reader, which checks
a program as data and builds its module, is dspark_compile/engine_dir/graph_read.py.
"""
from __future__ import annotations

import json
import math
import operator
import re
from typing import Optional

import torch

from dspark_compile.engine_dir.parts import node_part

FORMAT, VERSION = "dspark-graph", 1
# a literal's nesting below a node's argument tuple: aten's deepest is a list of optional
# tensors (index.Tensor, depth 2); twice that leaves room and bounds the reader's recursion
MAX_DEPTH = 4
NAMESPACES = ("aten", "prims", "dspark")
# the functional collectives a rank's program may call (models/parallel.py gathers, then sums in
# rank order: no all_reduce), each with the position of its process group's name (None: none)
COLLECTIVES = {"_c10d_functional.all_gather_into_tensor.default": 2,
               "_c10d_functional.wait_tensor.default": None}
# a process group's name as torch.distributed makes it ("0", "1", ...) or a user's group_desc
GROUP_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
GETITEM = "operator.getitem"
DTYPES = {n: getattr(torch, n) for n in (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex64",
    "complex128", "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64",
    "bool") if isinstance(getattr(torch, n, None), torch.dtype)}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {n: getattr(torch, n) for n in ("contiguous_format", "preserve_format",
                                                 "channels_last", "channels_last_3d")}
SPECIAL_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
# integer arithmetic on sizes, in a program exported with a dynamic batch size
# (build/pipeline.py): the only Python functions a graph may call besides getitem, each with
# its arity
SIZE_OPS = {f"operator.{n}": (getattr(operator, n), 2) for n in (
    "add", "sub", "mul", "floordiv", "mod", "eq", "ne", "lt", "le", "gt", "ge")}
SIZE_OPS.update({"operator.neg": (operator.neg, 1), "torch.sym_max": (torch.sym_max, 2),
                 "torch.sym_min": (torch.sym_min, 2)})
SIZE_OP_NAMES = {fn: name for name, (fn, _) in SIZE_OPS.items()}


# --------------------------------------------------------------------------- write
def dump_program(ep: torch.export.ExportedProgram, shared: Optional[set] = None,
                 graph: Optional[torch.fx.Graph] = None) -> tuple[bytes, Optional[bytes]]:
    """(graph JSON, constants safetensors or None) of `ep`. `shared`: the names of the lifted
    tensors the engine stores in weights.safetensors (default: every parameter and buffer);
    the other lifted tensors are the program's own constants. `graph`: a variant of ep's graph
    to write instead (same placeholders and outputs: runtime/variants.py's greedy step).
    ValueError naming the node for anything the format does not hold (another op, a symbolic
    size, an unknown literal)."""
    from safetensors.torch import save
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    graph = ep.graph if graph is None else graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sig.input_specs):
        raise ValueError(f"{len(placeholders)} placeholders, {len(sig.input_specs)} input specs")
    kinds = {InputKind.USER_INPUT: "user", InputKind.PARAMETER: "parameter",
             InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant"}
    inputs, constants, sizes = [], {}, _sizes(ep)
    for node, spec in zip(placeholders, sig.input_specs):
        kind = kinds.get(spec.kind)
        if kind is None:
            raise ValueError(f"input '{node.name}' is a {spec.kind.name}, not a tensor")
        entry = {"name": node.name, "kind": kind, **_tensor_meta(node, sizes)}
        if kind != "user" and any(isinstance(d, str) for d in entry["shape"]):
            raise ValueError(f"the lifted tensor '{node.name}' has a symbolic size")
        if kind != "user":
            if shared is None:
                stored = "program" if kind == "constant" else "weights"
            else:
                stored = "weights" if spec.target in shared else "program"
            entry.update(target=spec.target, stored=stored)
            if kind == "buffer":
                entry["persistent"] = bool(spec.persistent)
            if stored == "program":
                table = ep.constants if spec.target in ep.constants else ep.state_dict
                constants[spec.target] = table[spec.target].detach().cpu().contiguous()
        inputs.append(entry)
    nodes, parts = [], {}
    for n in graph.nodes:
        if n.op == "call_function":
            # the model part, for tools (engine_dir/parts.py): an index into the doc's "parts"
            part = parts.setdefault(n.meta.get("dspark_part") or node_part(n), len(parts))
            nodes.append({"name": n.name, "op": _op_name(n), "args": [_enc(a, n) for a in n.args],
                          "kwargs": {k: _enc(v, n) for k, v in n.kwargs.items()},
                          "part": part})
        elif n.op not in ("placeholder", "output"):
            raise ValueError(f"node '{n.name}' is a {n.op} node; the format holds call_function "
                             "nodes only")
    out_kinds = {OutputKind.USER_OUTPUT: "user", OutputKind.USER_INPUT_MUTATION:
                 "user_input_mutation", OutputKind.BUFFER_MUTATION: "buffer_mutation",
                 OutputKind.PARAMETER_MUTATION: "parameter_mutation"}
    flat = list(graph.output_node().args[0])
    if len(flat) != len(sig.output_specs):
        raise ValueError(f"{len(flat)} outputs, {len(sig.output_specs)} output specs")
    outputs = []
    for value, spec in zip(flat, sig.output_specs):
        kind = out_kinds.get(spec.kind)
        if kind is None:
            raise ValueError(f"output {spec.arg} is a {spec.kind.name}")
        outputs.append({"kind": kind, "value": _enc(value, graph.output_node()),
                        **({} if kind == "user" else {"target": spec.target})})
    call = ep.module_call_graph[0].signature
    in_spec = ep.call_spec.in_spec
    names = list(call.forward_arg_names) if call is not None and call.forward_arg_names else \
        [f"arg{i}" for i in range(in_spec.child(0).num_children)]
    doc = {"format": FORMAT, "version": VERSION, "arg_names": names,
           "in_spec": _spec_enc(in_spec), "out_spec": _spec_enc(ep.call_spec.out_spec),
           "inputs": inputs, "nodes": nodes, "outputs": outputs, "parts": list(parts),
           **({"sizes": sizes} if sizes else {})}
    data = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return data, (save(constants) if constants else None)


def _tensor_meta(node, sizes: dict) -> dict:
    """A placeholder's dtype and shape; a symbolic dimension is its symbol's name, its range
    recorded in `sizes` ({name: [min, max]}, from the program's range constraints)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"placeholder '{node.name}' has no tensor meta")
    if val.dtype not in DTYPE_NAMES:
        raise ValueError(f"placeholder '{node.name}' has the dtype {val.dtype}")
    shape = []
    for d in val.shape:
        if isinstance(d, torch.SymInt):
            name = str(d.node.expr)
            if name not in sizes:
                raise ValueError(f"placeholder '{node.name}' has the size {name}, which is not "
                                 "one symbol of the program's ranges")
            shape.append(name)
        else:
            shape.append(int(d))
    return {"dtype": DTYPE_NAMES[val.dtype], "shape": shape}


def _sizes(ep: torch.export.ExportedProgram) -> dict:
    """{symbol: [min, max]} of the program's dynamic sizes (its range constraints)."""
    out = {}
    for sym, r in ep.range_constraints.items():
        lo, hi = int(r.lower), r.upper
        if not getattr(sym, "is_Symbol", False) or not math.isfinite(float(hi)):
            raise ValueError(f"the program's size range {sym} in [{r.lower}, {r.upper}] is not "
                             "one symbol with a finite range")
        out[str(sym)] = [lo, int(hi)]
    return out


def _op_name(n) -> str:
    t = n.target
    if t is operator.getitem:
        return GETITEM
    if t in SIZE_OP_NAMES:
        return SIZE_OP_NAMES[t]
    if isinstance(t, torch._ops.OpOverload):
        name = f"{t._schema.name.replace('::', '.')}.{t._overloadname}"
        if t.namespace in NAMESPACES or name in COLLECTIVES:
            return name
    raise ValueError(f"node '{n.name}' calls {t}, not an aten, prims or dspark operator or a "
                     f"functional collective of {sorted(COLLECTIVES)}")


def _enc(v, node, depth: int = 1):
    if isinstance(v, torch.fx.Node):
        return {"node": v.name}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": "nan" if v != v else
                                           ("inf" if v > 0 else "-inf")}
    if depth > MAX_DEPTH:
        raise ValueError(f"node '{node.name}' nests an argument deeper than {MAX_DEPTH}")
    if isinstance(v, list):
        return [_enc(x, node, depth + 1) for x in v]
    if isinstance(v, tuple):
        return {"tuple": [_enc(x, node, depth + 1) for x in v]}
    if isinstance(v, torch.dtype) and v in DTYPE_NAMES:
        return {"dtype": DTYPE_NAMES[v]}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    for tag, table in (("layout", LAYOUTS), ("memory_format", MEMORY_FORMATS)):
        for name, x in table.items():
            if v is x:
                return {tag: name}
    raise ValueError(f"node '{node.name}' takes a {type(v).__name__} ({str(v)[:80]}), which "
                     "the format cannot hold")


def _spec_enc(spec):
    if spec.is_leaf():
        return "*"
    if spec.type is type(None):
        return None
    kids = [_spec_enc(c) for c in spec.children()]
    if spec.type is tuple:
        return {"tuple": kids}
    if spec.type is list:
        return {"list": kids}
    if spec.type is dict and all(isinstance(k, str) for k in spec.context):
        return {"dict": [[k, c] for k, c in zip(spec.context, kids)]}
    raise ValueError(f"a program's inputs and outputs are tuples, lists, dicts of str keys "
                     f"and tensors, not {spec.type.__name__}")
