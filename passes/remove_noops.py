"""Remove views and copies that change nothing.

Two kinds, both decided from `meta["val"]` (size, stride, storage offset, dtype, device):

1. A *view* whose result is laid out exactly like its input (`aten.view`/`reshape` to the same
   shape, `alias`, `expand` to the same shape, identity `permute`, full `slice`, `.to()` with
   nothing to change, `detach`, `_unsafe_view` of the same shape, ...). Any schema-declared
   view qualifies. The result *is* the input as far as any consumer can tell, so uses are
   pointed at the input: exact, aliasing included.

2. A *copy* (`clone`, `_to_copy`, `.to(copy=True)`, `lift_fresh_copy`) that keeps the layout.
   Replacing it with its source is only exact when nothing can tell the two buffers apart:
   neither the source's storage nor the copy's is written in place anywhere in the graph
   (e.g. the copy is a row about to be `index_copy_`'d into a cache: fine; a copy that is then
   updated in place: kept), and the copy is not returned (an output must not start aliasing an
   input or another output).

Argument and output markers of fusable regions (`aten.alias` nodes annotated by
kernels/region.py) are kept: they are exact no-ops, but the fusion passes read each region's
signature from them (passes/drop_region_markers.py removes whatever no fusion consumed).
"""
from __future__ import annotations

import torch

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.graph_utils import (
    alias_root, alias_source, arg_value, graph_outputs, is_region_marker, is_view, op_name,
    same_layout, schema_of, tensor_val, written_roots)
from dspark_compile.passes.registry import register_pass

aten = torch.ops.aten

_COPY_PACKETS = {"aten::clone", "aten::_to_copy", "aten::lift_fresh_copy", "aten::alias_copy",
                 "aten::view_copy"}
# schema says "new tensor", but it is a view at run time: exact like any view
_RUNTIME_VIEW = "aten::_unsafe_view"
_TO_PACKET = "aten::to"


def _first_tensor_arg(node):
    a = node.args[0] if node.args else None
    return a if isinstance(a, torch.fx.Node) else None


def _is_copy(node) -> bool:
    s = schema_of(node)
    if s is None:
        return False
    if s.name == _TO_PACKET:
        return bool(arg_value(node, "copy", False))
    return s.name in _COPY_PACKETS


def _same(node, src) -> bool:
    a, b = tensor_val(node), tensor_val(src)
    return a is not None and b is not None and same_layout(a, b)


@register_pass(name="remove_noops", stage="cleanup", after=("remove_asserts",))
def remove_noops_pass(gm, ctx) -> PassResult:
    """Replace layout-preserving views and unobservable copies by their input."""
    graph = gm.graph
    written = written_roots(graph)
    removed, kept_copies, kinds = 0, 0, {}
    for node in list(graph.nodes):
        if node.op != "call_function" or schema_of(node) is None or is_region_marker(node):
            continue
        # the aliased input for views (schema alias sets), the copied input for copies
        src = alias_source(node) if is_view(node) else _first_tensor_arg(node)
        if src is None or not _same(node, src):
            continue
        exact = schema_of(node).name == _RUNTIME_VIEW or (is_view(node) and not _is_copy(node))
        if not exact:
            if not _is_copy(node):
                continue
            # a copy: only unobservable when neither buffer is ever written and the copy is
            # not returned (an output must not start aliasing its source)
            returned = any(alias_root(o) is node for o in graph_outputs(graph))
            if returned or node in written or alias_root(src) in written:
                kept_copies += 1
                continue
        kinds[op_name(node)] = kinds.get(op_name(node), 0) + 1
        node.replace_all_uses_with(src)
        graph.erase_node(node)
        removed += 1
    return PassResult(removed, notes={"removed": kinds, "kept_copies": kept_copies})
