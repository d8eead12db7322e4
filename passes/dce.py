"""Dead code elimination that never deletes a side effect.

A node is removed when nothing uses its value and it has no side effect. Side effects, read
from the operator schema (passes/graph_utils.py): writing an argument in place (`index_copy_`,
`index_put_`, a `dspark::` op declared with `mutates_args`, anything `Tensor(a!)`), a mutable
schema, drawing from torch's RNG (dropping an unused `rand` would shift every later draw),
assertions (removing those is `remove_asserts`' decision, not an accident of DCE), and any
callable whose schema we cannot read. torch.fx's own `eliminate_dead_code` is close, but its
notion of impurity has changed between torch versions; this one is explicit and tested.

Walking the graph backwards removes whole dead chains in one sweep.
"""
from __future__ import annotations

import torch

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.graph_utils import has_side_effects
from dspark_compile.passes.registry import register_pass


def eliminate_dead_code(graph: torch.fx.Graph) -> int:
    """Remove dead, side-effect-free call nodes; returns how many. Fusion passes call this to
    clean up after themselves."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and not has_side_effects(node):
            graph.erase_node(node)
            removed += 1
    return removed


@register_pass(name="dce", stage="cleanup", after=("remove_asserts", "remove_noops"))
def dce_pass(gm, ctx) -> PassResult:
    """Remove unused nodes that have no side effect."""
    return PassResult(eliminate_dead_code(gm.graph))
