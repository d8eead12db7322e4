"""Fuse the ring-slot bookkeeping: each `ring_slots` region (`Batch.ring_slots`: the SWA insert
of every attention layer, every compressor's ring, the draft context) becomes one
`dspark::ring_slots` call (kernels/ring_slots.py).

Unfused, per call (~11 aten launches, integer math on [B, T]):

    rows ─ mul(ring) ─┐
    pos ─ remainder ──┴─ add ─► slots          valid ─ expand ─ and(write) ─► ok
    where(ok, pos, -1) ─ amax ─ sub(ring) ─ gt ─ and ─► ok'     where(ok', slots, -1) ─► out

Fused: `dspark.ring_slots(rows, pos, valid, write, ring)`, one program a batch row. The calls of
one ring then compute the same value from the same inputs, and the `cse` pass keeps one of them.
"""
from __future__ import annotations

from dspark_compile.kernels import ring_slots as _kernels  # noqa: F401  (registers the op)

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.regions import fuse_regions
from dspark_compile.passes.registry import register_pass


@register_pass(name="fuse_ring_slots", stage="fusion", expect_match=True)
def fuse_ring_slots_pass(gm, ctx) -> PassResult:
    """Replace ring_slots regions by dspark::ring_slots."""
    return fuse_regions(gm, ("ring_slots",), ctx)
