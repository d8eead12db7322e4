"""Common subexpression elimination of the glue: one node per value computed more than once.

Every attention layer of the step recomputes the same bookkeeping from the batch: the SWA ring
slots (`Batch.ring_slots`: one `dspark::ring_slots` call, or ~11 aten launches unfused), the
flat positions. At flash-slice
those repeats are about a quarter of the aten launches that are left between the `dspark::` ops.
This pass keeps the first node of each repeated computation and points the repeats' uses at it.

Two call nodes compute the same value when they call the same aten or `dspark::` overload (or
`operator.getitem`) on the same arguments. Every `dspark::` op is deterministic (its outputs are
a function of its inputs); one that writes an argument has a side effect and never takes part.
A repeat's uses are redirected as soon as it is found, so whole chains collapse in one sweep. A node takes part only when merging it cannot be
observed:

- it has no side effect and draws no random numbers (`graph_utils.has_side_effects`);
- no input's storage is written in place anywhere in the graph (a read of a cache before and
  after its update are different values, whatever the node looks like);
- its own result is never written in place (a `full_like` buffer that a later `index_put_`
  fills belongs to that write) and is not a graph output (two outputs must not alias).

It runs after the fusions, when the region markers are gone: merging a node of one fusable region
into another would break that region's boundary checks (passes/regions.py).
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.graph_utils import (
    alias_root, graph_outputs, has_side_effects, written_roots)
from dspark_compile.passes.registry import register_pass


class _Unhashable(Exception):
    pass


def _key(value):
    """A hashable key of an argument (a node by identity: repeats are already redirected)."""
    if isinstance(value, Node):
        return ("node", value)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return ("dict",) + tuple((k, _key(v)) for k, v in sorted(value.items()))
    if isinstance(value, float):
        # -0.0 and 0.0 differ as arguments; NaN equals itself here
        return ("float", "nan" if math.isnan(value) else value.hex())
    if isinstance(value, (type(None), bool, int, str, torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return (type(value).__name__, value)
    raise _Unhashable(type(value).__name__)


def _candidate(node: Node, unsafe: set) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    if t is not operator.getitem and not (isinstance(t, torch._ops.OpOverload)
                                          and t.namespace in ("aten", "dspark")):
        return False
    if has_side_effects(node) or alias_root(node) in unsafe:
        return False
    return not any(alias_root(a) in unsafe for a in node.all_input_nodes)


def eliminate_common_subexpressions(graph: torch.fx.Graph) -> dict:
    """Merge repeated pure computations in place; returns {op name: merged count}."""
    unsafe = written_roots(graph) | {alias_root(o) for o in graph_outputs(graph)}
    seen: dict = {}
    merged: dict = {}
    for node in list(graph.nodes):
        if not _candidate(node, unsafe):
            continue
        try:
            key = (node.target, _key(node.args), _key(node.kwargs))
        except _Unhashable:
            continue
        first = seen.setdefault(key, node)
        if first is node:
            continue
        node.replace_all_uses_with(first)
        graph.erase_node(node)
        name = getattr(node.target, "__name__", str(node.target))
        merged[name] = merged.get(name, 0) + 1
    return merged


@register_pass(name="cse", stage="fusion", after=("drop_region_markers",))
def cse_pass(gm, ctx) -> PassResult:
    """Merge repeated side-effect-free aten / dspark computations whose inputs are never written."""
    merged = eliminate_common_subexpressions(gm.graph)
    return PassResult(sum(merged.values()), notes={"merged": merged})
