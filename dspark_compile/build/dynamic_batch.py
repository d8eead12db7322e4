"""A program exported once for every batch size: its symbolic sizes computed up front.

An export with a dynamic batch (build/pipeline.py `_export_rows(dynamic=True)`) holds, besides
the tensor ops, the integer arithmetic of its sizes: `sym_size_int` of an input and the
`mul` / `add` / `floordiv` nodes the references' shape code made of it (6 B tokens of a
6-token verify step, B K of a flattened row block...). Tracing creates each such node where its
value is first needed and reuses it afterwards, so a node created inside one `@fusable`
region (kernels/region.py) feeds the regions after it: the fusion passes cannot replace a
region whose nodes are used outside it (passes/regions.py `_check_closed`).

`hoist_sizes` moves every such node, with the size nodes it reads, to the top of the graph (after
the placeholders) and drops the region annotation it carries: a size depends on the inputs'
shapes alone, never on a value computed inside a region, so it may be computed first.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from dspark_compile.passes.graph_utils import strip_region_meta

_SYM_TYPES = (torch.SymInt, torch.SymBool, torch.SymFloat)


def is_size_node(n: Node) -> bool:
    """A call computing a symbolic scalar (a size or an expression of sizes)."""
    return n.op == "call_function" and isinstance(n.meta.get("val"), _SYM_TYPES)


def hoist_sizes(gm: torch.fx.GraphModule) -> int:
    """Move the size nodes that read only placeholders and other size nodes behind the last
    placeholder, in their order, without region annotation; returns how many were moved.

    A size node reading an intermediate tensor (`sym_size_int` of a value computed in the
    graph) stays where it is, and so does everything computed from it: ValueError names it,
    since a region around it could not be fused."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1]
    hoisted: set = set()
    stuck = []
    for n in list(graph.nodes):
        if not is_size_node(n):
            continue
        if all(i.op == "placeholder" or i in hoisted for i in n.all_input_nodes):
            anchor.append(n)
            anchor = n
            hoisted.add(n)
            strip_region_meta(n.meta)
        else:
            stuck.append(n)
    if stuck:
        reads = [i.name for i in stuck[0].all_input_nodes if i not in hoisted]
        raise ValueError(f"{len(stuck)} size node(s) read a computed value, e.g. "
                         f"'{stuck[0].name}' ({stuck[0].target}) reads {reads}: a symbolic "
                         "size must depend on the program's inputs only")
    graph.lint()
    gm.recompile()
    return len(hoisted)
