"""Group the FP8 linears that read one activation into one `dspark::fp8_linear_multi` call.

At batch 1 the small FP8 GEMMs are launch-bound (H200: 53 fp8_linear launches, 359 us a step),
and several read the same quantized activation (x, x_s): attention's wq_a and wkv (target and
draft layers), a C4 layer's wq_b and its indexer's wq_b (the q latent), the shared expert's w1
and w3, the draft layers' context-KV wkv (all read the target's main_x, models/draft.py). Each
such set becomes one launch (kernels/fp8_linear_multi.py), every output bit for bit what its
own call computed:

    a = dspark.fp8_linear(x, x_s, w_a, s_a, 1, bf16)          m = dspark.fp8_linear_multi(
    ...                                                ==>         x, x_s, w_a, s_a, w_b, s_b,
    b = dspark.fp8_linear(x, x_s, w_b, s_b, 1, bf16)               None, None, None, None, bf16)
                                                             a, b = m[0], m[1]

A call takes part when groups == 1 and its weight and scale are graph inputs (placeholders:
parameters and buffers in a torch.export program; get_attr in a plain GraphModule), so the
merged node, placed where the set's first call was, has all its inputs there. Calls group by
(x node, x_s node, out_dtype), in graph order, up to 4 a node. A call whose x, x_s, weight or
scale storage is written in place anywhere in the graph never takes part (moving a read across
the write would change what it reads).

Runs after the fusions and after `cse` (which makes repeated quantizations of one value one
node, so their readers share x); lints come later by stage.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from dspark_compile.kernels import fp8_linear_multi as _multi  # noqa: F401  (registers the op)

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.graph_utils import alias_root, written_roots
from dspark_compile.passes.registry import register_pass

_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "seq_nr")
MAX_GROUP = _multi.MAX_WEIGHTS


def _args(node: Node) -> dict:
    schema = node.target._schema
    named = {a.name: v for a, v in zip(schema.arguments, node.args)}
    named.update(node.kwargs)
    return named


def _is_graph_input(v) -> bool:
    return isinstance(v, Node) and v.op in ("placeholder", "get_attr")


def _key(node: Node, unsafe: set):
    """(x, x_s, out_dtype) of a call that may be grouped, else None."""
    a = _args(node)
    if a.get("groups") != 1 or not (_is_graph_input(a["w"]) and _is_graph_input(a["w_s"])):
        return None
    inputs = [v for v in (a["x"], a["x_s"], a["w"], a["w_s"]) if isinstance(v, Node)]
    if any(alias_root(v) in unsafe for v in inputs):
        return None
    return (a["x"], a["x_s"], a["out_dtype"])


def _merge(graph: torch.fx.Graph, calls: list) -> None:
    """One fp8_linear_multi node before calls[0]; each call's uses read its output."""
    op = torch.ops.dspark.fp8_linear_multi.default
    first = _args(calls[0])
    weights = []
    for c in calls:
        a = _args(c)
        weights += [a["w"], a["w_s"]]
    weights += [None] * (2 * MAX_GROUP - len(weights))
    vals = [c.meta["val"] for c in calls]
    empty = vals[0].new_empty((*vals[0].shape[:-1], 0))
    with graph.inserting_before(calls[0]):
        multi = graph.call_function(op, (first["x"], first["x_s"], *weights, first["out_dtype"]))
        multi.meta.update({k: calls[0].meta[k] for k in _KEPT_META if k in calls[0].meta})
        multi.meta["val"] = tuple(vals) + tuple(empty.clone()
                                                for _ in range(MAX_GROUP - len(calls)))
        multi.meta["custom"] = {"dspark_fused": "fp8_linear_multi"}
    prev = multi
    for j, c in enumerate(calls):
        with graph.inserting_after(prev):
            prev = graph.call_function(operator.getitem, (multi, j))
        prev.meta.update({k: c.meta[k] for k in _KEPT_META if k in c.meta})
        prev.meta["val"] = c.meta["val"]
        c.replace_all_uses_with(prev)
    for c in calls:
        graph.erase_node(c)


def group_fp8_linears(graph: torch.fx.Graph) -> dict:
    """Merge the groupable fp8_linear calls in place; returns {group size: merged nodes}."""
    target = torch.ops.dspark.fp8_linear.default
    unsafe = written_roots(graph)
    sets: dict = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is target:
            key = _key(node, unsafe)
            if key is not None:
                sets.setdefault(key, []).append(node)
    sizes: dict = {}
    for calls in sets.values():
        for i in range(0, len(calls), MAX_GROUP):
            chunk = calls[i:i + MAX_GROUP]
            if len(chunk) > 1:
                _merge(graph, chunk)
                sizes[len(chunk)] = sizes.get(len(chunk), 0) + 1
    return sizes


@register_pass(name="group_fp8_linears", stage="fusion",
               after=("fuse_act_quant", "fuse_mhc", "fuse_qkv_postprocess", "fuse_ring_slots",
                      "fuse_sampler", "drop_region_markers", "cse"))
def group_fp8_linears_pass(gm, ctx) -> PassResult:
    """One fp8_linear_multi launch per set of FP8 linears that read the same activation."""
    sizes = group_fp8_linears(gm.graph)
    return PassResult(sum(n * k for k, n in sizes.items()),
                      notes={"nodes_by_size": sizes,
                             "launches_saved": sum(n * (k - 1) for k, n in sizes.items())})
