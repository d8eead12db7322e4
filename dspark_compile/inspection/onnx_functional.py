"""Mutating `dspark::` ops as functional calls, for ONNX export only.

torch.onnx.export runs `run_decompositions` first, which functionalises the program: an in-place
aten op on a state input (`index_copy_`) becomes its functional form plus a graph output holding
the input's new value. A custom op with `mutates_args` would become an `auto_functionalized_v2`
call instead, which torch.onnx cannot translate. So before export each such call

    dspark::qkv_postprocess(q, ..., cache_nope, cache_scale, cache_rope, eps) -> out

is rewritten to its *functional twin* plus in-place copies that functionalisation understands:

    out, nope', scale', rope' = dspark_onnx::qkv_postprocess(q, ..., cache_nope, ..., eps)
    cache_nope.copy_(nope'); cache_scale.copy_(scale'); cache_rope.copy_(rope')

The twin (namespace `dspark_onnx`, defined once per process on first use) has the op's
arguments without their write annotations and returns the op's outputs, then one new value per
mutated argument: it runs the op on clones. The ONNX translation of the twin is the same
`dspark.<op>` node (dspark_compile/inspection/onnx_domain.py). The programs the runtime loads never see it.
"""
from __future__ import annotations

import json
import operator

import torch

TWIN_NAMESPACE = "dspark_onnx"
_LIB = None
_TWINS: dict = {}        # op name -> twin overload


def _default(a) -> str:
    v = a.default
    if isinstance(v, str):
        return json.dumps(v)
    return "None" if v is None else repr(v)


def twin_schema(spec) -> str:
    """`name(args without write annotations) -> (returns, then each mutated argument)`."""
    args = ", ".join(f"{a.type} {a.name}" + (f"={_default(a)}" if a.has_default else "")
                     for a in spec.args)
    n = spec.returns + len(spec.mutated)
    rets = "Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")"
    return f"{spec.name}({args}) -> {rets}"


def _twin_impl(spec):
    def impl(*args, **kwargs):
        bound = spec.bind(args, kwargs)
        fresh = {m: bound[m].clone() for m in spec.mutated}
        out = spec.overload(**{**bound, **fresh})
        out = () if out is None else tuple(out) if isinstance(out, (tuple, list)) else (out,)
        res = (*out, *fresh.values())
        return res[0] if len(res) == 1 else res
    return impl


def functional_twin(spec):
    """The `dspark_onnx::<op>` overload of a mutating op (defined on first use)."""
    global _LIB
    if spec.name in _TWINS:
        return _TWINS[spec.name]
    if _LIB is None:
        _LIB = torch.library.Library(TWIN_NAMESPACE, "FRAGMENT")
    _LIB.define(twin_schema(spec))
    impl = _twin_impl(spec)
    _LIB.impl(spec.name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{TWIN_NAMESPACE}::{spec.name}", impl, lib=_LIB)
    _TWINS[spec.name] = getattr(getattr(torch.ops, TWIN_NAMESPACE), spec.name).default
    return _TWINS[spec.name]


def _value(graph, node, val, inserting_after):
    with graph.inserting_after(inserting_after):
        n = graph.call_function(operator.getitem, (node, val[0]))
    n.meta["val"] = val[1]
    return n


def _rewrite_call(graph, node, spec, twin) -> None:
    bound = spec.bind(node.args, node.kwargs)
    with graph.inserting_after(node):
        new = graph.call_function(twin, tuple(bound[a.name] for a in spec.args))
    orig = node.meta.get("val")
    orig = () if orig is None else tuple(orig) if isinstance(orig, (tuple, list)) else (orig,)
    vals = [*orig, *(bound[m].meta["val"] for m in spec.mutated)]
    new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    new.meta["val"] = vals[0] if len(vals) == 1 else tuple(vals)
    if len(vals) == 1:
        outs, last = [new], new
    else:
        outs, last = [], new
        for i, v in enumerate(vals):
            last = _value(graph, new, (i, v), last)
            outs.append(last)
    if spec.returns == 1:
        node.replace_all_uses_with(outs[0])
    else:
        for user in list(node.users):      # getitem(node, i)
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    for m, value in zip(spec.mutated, outs[spec.returns:]):
        with graph.inserting_after(last):
            last = graph.call_function(torch.ops.aten.copy_.default, (bound[m], value))
        last.meta["val"] = bound[m].meta["val"]
    graph.erase_node(node)


def functionalize_dspark_calls(ep, specs: dict) -> dict:
    """Rewrite every call of a mutating `dspark::` op in `ep` (in place) to its twin plus
    copies; returns {op name: calls rewritten}."""
    graph = ep.graph_module.graph
    counts: dict = {}
    for node in list(graph.nodes):
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) \
                or t.namespace != "dspark":
            continue
        spec = specs[t._schema.name.split("::", 1)[-1]]
        if spec.mutated:
            _rewrite_call(graph, node, spec, functional_twin(spec))
            counts[spec.name] = counts.get(spec.name, 0) + 1
    graph.lint()
    ep.graph_module.recompile()
    return counts
