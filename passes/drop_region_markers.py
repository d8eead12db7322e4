"""Drop what is left of fusable-region annotations once the fusion passes have run.

Every region a fusion replaced is gone; a region that was not fused (its pass disabled, option
`ops` leaving an op out, or a region a pass reported as not replaceable) still has its argument
and output markers: `aten.alias` views the cleanup passes kept on purpose (kernels/region.py).
They are exact no-ops, so this pass points their uses at their input and erases them, and
removes the region annotation from the remaining nodes' meta: the program is then exactly the
unfused reference for those regions, and carries no annotation into the engine.
"""
from __future__ import annotations

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.graph_utils import is_region_marker, region_meta, strip_region_meta
from dspark_compile.passes.registry import register_pass


@register_pass(name="drop_region_markers", stage="fusion",
               after=("fuse_qkv_postprocess", "fuse_act_quant", "fuse_mhc", "fuse_sampler",
                      "fuse_ring_slots"))
def drop_region_markers_pass(gm, ctx) -> PassResult:
    """Erase leftover region markers (identity views) and region annotations."""
    dropped, unannotated = 0, 0
    for node in list(gm.graph.nodes):
        if is_region_marker(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            dropped += 1
        elif region_meta(node):
            strip_region_meta(node.meta)
            unannotated += 1
    return PassResult(dropped, changed=bool(dropped or unannotated),
                      notes={"markers": dropped, "annotated_nodes": unannotated})
