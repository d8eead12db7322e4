"""Fuse QKV post-processing: each `qkv_postprocess` / `qkv_rope` / `context_kv_store` region of
the step becomes one `dspark::` op call (kernels/qkv_postprocess.py), and so does each `rope`
region (kernels/rope.py: the attention output's inverse rotation, the indexer's query).

Unfused (per target layer, what `qkv_postprocess_reference` exports to; ~100 aten nodes):

    q ─ to(f32) ─ pow ─ mean ─ add ─ rsqrt ─ mul ─ to(dtype) ─┬─ slice[:nope] ───────┐
                                                             └─ slice[nope:] ─ RoPE ┴─ cat ─► q'
    kv ─ slice[nope:] ─ RoPE (cos_sin[positions], unflatten, mul, sub, add, stack) ─ cat ─► kv'
    kv' ─ slice[:nope] ─ unflatten(64) ─ abs ─ amax ─ log2 ─ ceil ─ exp2 ─ div ─ to(fp8) ─┐
    slots ─ where(slot < 0 → scratch) ──────────── index_put_(cache_nope / _scale / _rope) ◄┘

Fused:

    q', = dspark.qkv_postprocess(q, kv, positions, cos_sin, slots, cache_nope, cache_scale,
                                 cache_rope, eps)          # writes the three cache views in place

Draft layers: `dspark.qkv_rope(q, kv, positions, cos_sin, eps) -> (q', kv')` (no store) and, per
draft layer, `dspark.context_kv_store(kv, positions, cos_sin, slots, cache)` (RoPE + store of the
accepted rows into the context ring; rejected rows have slot -1 and write nothing).

Memory traffic per token at Flash dims (H = 64, D = 512, bf16): eager aten makes ~10 passes over
q (half of them in fp32: about 1 MB) and materialises every intermediate of kv and its quant;
the fused op reads q (64 KB) and kv (1 KB) once and writes q' (64 KB) and one 584-byte cache
row, in one launch instead of ~40. Inductor fuses the q chain into about one read and one write
as well, but not the three scatters and the quant, so the gain over Inductor is launches and the
kv intermediates; `--disable-pass fuse_qkv_postprocess` leaves the region to the graph.

The caches stay in place: the op declares them `mutates_args` and receives the same views of the
state inputs the reference wrote through, so no whole cache is copied (check_state_in_place).
Option `ops`: the subset of the three ops to fuse (`PassConfig.options`).
"""
from __future__ import annotations

from dspark_compile.kernels import qkv_postprocess as _kernels  # noqa: F401  (registers the ops)
from dspark_compile.kernels import rope as _rope  # noqa: F401  (registers dspark::rope)

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.regions import fuse_regions
from dspark_compile.passes.registry import register_pass

OPS = ("qkv_postprocess", "qkv_rope", "context_kv_store", "rope")


@register_pass(name="fuse_qkv_postprocess", stage="fusion", expect_match=True)
def fuse_qkv_postprocess_pass(gm, ctx) -> PassResult:
    """Replace qkv_postprocess / qkv_rope / context_kv_store / rope regions by their dspark:: ops."""
    return fuse_regions(gm, OPS, ctx)
