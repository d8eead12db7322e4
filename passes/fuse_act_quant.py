"""Fuse activation quantization in front of FP8 GEMMs and the RMSNorms: each `rmsnorm_quant` /
`swiglu_quant` / `act_quant` / `rmsnorm` region becomes one `dspark::` op call
(kernels/act_quant.py).

Unfused (what the references export to; `act_quant` alone is ~20 aten nodes):

    act_quant      x ─ unflatten(128) ─ abs ─ amax ─ clamp_min(1e-4) ─ div(448) ─ log2 ─ ceil ─
                     exp2 ─┬────────────────────────────────────────────────────────► scale
                           └─ div(x groups) ─ clamp(±448) ─ to(fp8) ─ flatten ──────► q
    swiglu_quant   g, u ─ to(f32) ─ clamp ─ silu ─ mul ─ to(dtype) ─ [act_quant]      ─► q, scale
    rmsnorm_quant  x ─ to(f32) ─ pow ─ mean ─ add ─ rsqrt ─ mul ─ to ─ mul(w) ─ to ─► y
                                                                 └─ [act_quant] ─► q, scale

Fused:

    q, scale    = dspark.act_quant(x)
    q, scale    = dspark.swiglu_quant(g, u, limit)      # shared experts
    y, q, scale = dspark.rmsnorm_quant(x, weight, eps)  # norms whose output feeds an FP8 GEMM
    y           = dspark.rmsnorm(x, weight, eps)        # the others (kv, context kv, final norm)

Memory traffic per token at Flash dims (bf16 activations): eager aten reads and writes every
intermediate (the group view, |x|, the scales, x / scale in fp32, the clamp, the cast): about
8 passes over the row, half in fp32. Fused: act_quant reads x (8 KB at K = 4096) and writes
4 KB fp8 + 128 B scales; swiglu_quant reads g and u (8 KB at I = 2048) and writes 2 KB + 64 B
instead of materialising h in fp32 and in bf16 first; rmsnorm_quant reads x once and writes y,
q and the scales (the norm's output is read by the compressor/router unquantized, so y stays).
Inductor can fuse the elementwise chain too; where it wins, `--disable-pass fuse_act_quant`
(or option `ops`, the subset of the four ops to fuse) leaves it alone -- at the price of batch
invariance for `rmsnorm`, whose glue mean a GPU reduction tiles by the row count.
"""
from __future__ import annotations

from dspark_compile.kernels import act_quant as _kernels  # noqa: F401  (registers the ops)

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.regions import fuse_regions
from dspark_compile.passes.registry import register_pass

OPS = ("rmsnorm_quant", "swiglu_quant", "act_quant", "rmsnorm")


@register_pass(name="fuse_act_quant", stage="fusion", expect_match=True)
def fuse_act_quant_pass(gm, ctx) -> PassResult:
    """Replace rmsnorm_quant / swiglu_quant / act_quant / rmsnorm regions by their dspark:: ops."""
    return fuse_regions(gm, OPS, ctx)
