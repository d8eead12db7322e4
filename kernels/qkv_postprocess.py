"""QKV post-processing of DeepSeek-V4 attention: reference, Triton kernels, `dspark::` ops.

Unfused, per attention layer and step (T tokens, H heads, head dim D, rope dim R, nope = D - R):

    q  = rmsnorm(q, weight=None)                 # per head, fp32 math, rounded to q.dtype
    q[..., nope:] = rope_gptj(q[..., nope:], t)  # rounded to q.dtype
    kv[..., nope:] = rope_gptj(kv[..., nope:], t)
    nope8, scale = fp8 e4m3 quant of kv[..., :nope] in groups of 64 (UE8M0 scales)
    cache_nope[slot], cache_scale[slot], cache_rope[slot] = nope8, exponent bytes, bf16 rope part

Three entry points, all sharing the same math:
- `qkv_postprocess_reference`: target layers with the FP8 (fp8_ds_mla-style) SWA cache;
- `qkv_rope_reference`: no store (draft block KV is consumed directly; exact-precision mode);
- `context_kv_store_reference`: draft context ring (no quant), writes only rows whose slot >= 0
  (the step gives rejected rows slot -1).

Cache convention: slot = flat row index into the cache viewed as [S, ...]; -1 writes nothing
(see kernels.common.masked_row_write). Bytes per token that must move (Flash: H=64, D=512):
read q 64 KB + kv 1 KB (bf16), write q 64 KB + 584 B cache row.

Kernels (one launch per op): the grid is (token, head block + 1); programs with a head-block
index normalise and rotate BLOCK_H heads of q, the extra program per token handles kv. Everything
is computed in fp32 from the loaded values; q is rounded to q.dtype after the norm and again after
the rotation, exactly where the reference rounds. A row whose slot is < 0 (padding, rejected
drafts) or >= the cache size writes nothing at all: the kernels skip it with store masks and never
touch the scratch last slot that the fixed-shape reference redirects it to.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import (
    fp8_group_quant, masked_row_write, rmsnorm, rope_last, scale_to_e8m0_byte)
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.region import fusable
from dspark_compile.kernels.tl_helpers import (
    compile_config, exp2_int, fp8e4m3_bits, interpreting, launch, next_pow2, round_to,
    ue8m0_exponent)

KV_QUANT_GROUP = 64


def _q_norm_rope(q, positions, cos_sin, eps):
    rope_dim = cos_sin.shape[-1]
    qn = rmsnorm(q, None, eps)
    return rope_last(qn, cos_sin, positions, rope_dim)


@fusable("qkv_rope")
def qkv_rope_reference(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                       cos_sin: torch.Tensor, eps: float):
    """q [T,H,D] -> per-head weightless RMSNorm + RoPE; kv [T,D] -> RoPE. Returns (q', kv')."""
    rope_dim = cos_sin.shape[-1]
    return _q_norm_rope(q, positions, cos_sin, eps), rope_last(kv, cos_sin, positions, rope_dim)


def kv_quant_reference(kv_roped: torch.Tensor, nope: int):
    """Split a RoPE'd kv row into (fp8 nope, uint8 exponent bytes, bf16 rope) as the cache holds it."""
    q8, scale = fp8_group_quant(kv_roped[..., :nope], KV_QUANT_GROUP)
    return q8, scale_to_e8m0_byte(scale), kv_roped[..., nope:].to(torch.bfloat16)


@fusable("qkv_postprocess")
def qkv_postprocess_reference(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                              cos_sin: torch.Tensor, slots: torch.Tensor, cache_nope: torch.Tensor,
                              cache_scale: torch.Tensor, cache_rope: torch.Tensor,
                              eps: float) -> torch.Tensor:
    """Target layers: returns q'; writes the FP8 KV row of every token with slot >= 0."""
    q_out, kv_out = qkv_rope_reference(q, kv, positions, cos_sin, eps)
    nope = cache_nope.shape[-1]
    q8, sbytes, rope = kv_quant_reference(kv_out, nope)
    masked_row_write(cache_nope, slots, q8)
    masked_row_write(cache_scale, slots, sbytes)
    masked_row_write(cache_rope, slots, rope)
    return q_out


@fusable("context_kv_store")
def context_kv_store_reference(kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                               slots: torch.Tensor, cache: torch.Tensor) -> None:
    """Draft context: RoPE kv [T,D] at its position and store rows with slot >= 0 (no quant)."""
    rope_dim = cos_sin.shape[-1]
    masked_row_write(cache, slots, rope_last(kv, cos_sin, positions, rope_dim))


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _cos_sin_row(cs_ptr, pos_ptr, t, max_pos, stride_cs):
    """Row of the cos/sin table for token t. Negative positions index from the end, as the
    reference's `cos_sin[positions]` does; anything still out of range is clamped (the reference
    raises there; a kernel must not read outside the table)."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.where(pos < 0, pos + max_pos, pos)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    return cs_ptr + pos * stride_cs


@triton.jit
def _rotate(xe, xo, cs_row, ROPE: tl.constexpr, BLOCK_R: tl.constexpr):
    """GPT-J rotation of the pairs (xe[p], xo[p]) by angle p; fp32, same op order as rope_gptj."""
    offs_p = tl.arange(0, BLOCK_R)
    pmask = offs_p < ROPE // 2
    c = tl.load(cs_row + offs_p, mask=pmask, other=0.0).to(tl.float32)
    s = tl.load(cs_row + ROPE // 2 + offs_p, mask=pmask, other=0.0).to(tl.float32)
    return xe * c - xo * s, xo * c + xe * s


@triton.jit
def _q_heads(q_ptr, qo_ptr, t, hb, H, stride_qt, stride_qh, stride_ot, stride_oh, cs_row, eps,
             D: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_R: tl.constexpr, SOFT: tl.constexpr):
    """q[t, heads of block hb]: weightless RMSNorm (rounded to q.dtype), then RoPE on the last
    ROPE dims (rounded again). The whole head is loaded once as a [BLOCK_H, BLOCK_D] tile (wide,
    coalesced loads); the rope pairs are re-read as even/odd vectors, which hit L1."""
    NOPE: tl.constexpr = D - ROPE
    dt = qo_ptr.dtype.element_ty
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    o_rows = qo_ptr + t * stride_ot + offs_h[:, None] * stride_oh

    x = tl.load(q_rows + offs_d[None, :], mask=hmask[:, None] & (offs_d[None, :] < D),
                other=0.0).to(tl.float32)
    # reference: xf * rsqrt(mean(xf^2) + eps), mean = sum / D; IEEE-rounded division and sqrt
    # (plain `/` and tl.sqrt are approximate on the GPU). Only the summation order differs.
    ms = tl.math.div_rn(tl.sum(x * x, axis=1), D * 1.0)
    rstd = tl.math.div_rn(tl.full([BLOCK_H], 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    y = round_to(x * rstd[:, None], dt, SOFT)
    tl.store(o_rows + offs_d[None, :], y.to(dt), mask=hmask[:, None] & (offs_d[None, :] < NOPE))

    offs_p = tl.arange(0, BLOCK_R)
    m2 = hmask[:, None] & (offs_p[None, :] < ROPE // 2)
    ev = NOPE + 2 * offs_p[None, :]
    ye = round_to(tl.load(q_rows + ev, mask=m2, other=0.0).to(tl.float32) * rstd[:, None], dt, SOFT)
    yo = round_to(tl.load(q_rows + ev + 1, mask=m2, other=0.0).to(tl.float32) * rstd[:, None], dt,
                  SOFT)
    oe, oo = _rotate(ye, yo, cs_row, ROPE, BLOCK_R)
    tl.store(o_rows + ev, round_to(oe, dt, SOFT).to(dt), mask=m2)
    tl.store(o_rows + ev + 1, round_to(oo, dt, SOFT).to(dt), mask=m2)


@triton.jit
def _kv_rope_row(kv_row, out_row, cs_row, ok, D: tl.constexpr, ROPE: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, SOFT: tl.constexpr):
    """out_row = rope_last(kv_row) rounded to kv's dtype, then cast to out's dtype; stored only
    where `ok` (a scalar predicate: the draft context skips rows whose slot is < 0)."""
    NOPE: tl.constexpr = D - ROPE
    kdt = kv_row.dtype.element_ty
    odt = out_row.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < NOPE
    x = tl.load(kv_row + offs_d, mask=dmask, other=0.0).to(tl.float32)
    tl.store(out_row + offs_d, round_to(x, odt, SOFT).to(odt), mask=ok & dmask)
    offs_p = tl.arange(0, BLOCK_R)
    pmask = offs_p < ROPE // 2
    ev = NOPE + 2 * offs_p
    xe = tl.load(kv_row + ev, mask=pmask, other=0.0).to(tl.float32)
    xo = tl.load(kv_row + ev + 1, mask=pmask, other=0.0).to(tl.float32)
    oe, oo = _rotate(xe, xo, cs_row, ROPE, BLOCK_R)
    tl.store(out_row + ev, round_to(round_to(oe, kdt, SOFT), odt, SOFT).to(odt), mask=ok & pmask)
    tl.store(out_row + ev + 1, round_to(round_to(oo, kdt, SOFT), odt, SOFT).to(odt),
             mask=ok & pmask)


@triton.jit
def _kv_quant_store(kv_row, cs_row, ok, nope_row, scale_row, rope_row, D: tl.constexpr,
                    ROPE: tl.constexpr, NG_P2: tl.constexpr, BLOCK_R: tl.constexpr,
                    SOFT: tl.constexpr):
    """One FP8 cache row: kv[:nope] in groups of 64 -> e4m3 bytes + UE8M0 exponent bytes;
    the rope part rotated, rounded to kv's dtype, stored bf16. Nothing is stored unless `ok`."""
    NOPE: tl.constexpr = D - ROPE
    NG: tl.constexpr = NOPE // 64
    kdt = kv_row.dtype.element_ty
    offs_g = tl.arange(0, NG_P2)
    gmask = offs_g < NG
    cols = offs_g[:, None] * 64 + tl.arange(0, 64)[None, :]
    x = tl.load(kv_row + cols, mask=gmask[:, None], other=0.0).to(tl.float32)
    e = ue8m0_exponent(tl.max(tl.abs(x), axis=1))
    # x / 2^e is exact as x * 2^-e (power of two), so this equals the reference's division.
    xq = tl.minimum(tl.maximum(x * exp2_int(-e)[:, None], -448.0), 448.0)
    tl.store(nope_row + cols, fp8e4m3_bits(xq, SOFT), mask=ok & gmask[:, None])
    tl.store(scale_row + offs_g, (e + 127).to(tl.uint8), mask=ok & gmask)

    offs_p = tl.arange(0, BLOCK_R)
    pmask = offs_p < ROPE // 2
    ev = NOPE + 2 * offs_p
    xe = tl.load(kv_row + ev, mask=pmask, other=0.0).to(tl.float32)
    xo = tl.load(kv_row + ev + 1, mask=pmask, other=0.0).to(tl.float32)
    oe, oo = _rotate(xe, xo, cs_row, ROPE, BLOCK_R)
    rdt = rope_row.dtype.element_ty
    tl.store(rope_row + 2 * offs_p, round_to(round_to(oe, kdt, SOFT), rdt, SOFT).to(rdt),
             mask=ok & pmask)
    tl.store(rope_row + 2 * offs_p + 1, round_to(round_to(oo, kdt, SOFT), rdt, SOFT).to(rdt),
             mask=ok & pmask)


@triton.jit
def _qkv_postprocess_kernel(q_ptr, kv_ptr, pos_ptr, cs_ptr, slot_ptr, qo_ptr, nope_ptr, scale_ptr,
                            rope_ptr, H, S, max_pos, stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_kvt, stride_cs, stride_n, stride_s, stride_r, eps,
                            D: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, NG_P2: tl.constexpr,
                            SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cs_row = _cos_sin_row(cs_ptr, pos_ptr, t, max_pos, stride_cs)
    if hb < tl.num_programs(1) - 1:
        _q_heads(q_ptr, qo_ptr, t, hb, H, stride_qt, stride_qh, stride_ot, stride_oh, cs_row, eps,
                 D, ROPE, BLOCK_H, BLOCK_D, BLOCK_R, SOFT)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        ok = (slot >= 0) & (slot < S)
        _kv_quant_store(kv_ptr + t * stride_kvt, cs_row, ok, nope_ptr + slot * stride_n,
                        scale_ptr + slot * stride_s, rope_ptr + slot * stride_r, D, ROPE, NG_P2,
                        BLOCK_R, SOFT)


@triton.jit
def _qkv_rope_kernel(q_ptr, kv_ptr, pos_ptr, cs_ptr, qo_ptr, kvo_ptr, H, max_pos, stride_qt,
                     stride_qh, stride_ot, stride_oh, stride_kvt, stride_kvot, stride_cs, eps,
                     D: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cs_row = _cos_sin_row(cs_ptr, pos_ptr, t, max_pos, stride_cs)
    if hb < tl.num_programs(1) - 1:
        _q_heads(q_ptr, qo_ptr, t, hb, H, stride_qt, stride_qh, stride_ot, stride_oh, cs_row, eps,
                 D, ROPE, BLOCK_H, BLOCK_D, BLOCK_R, SOFT)
    else:
        _kv_rope_row(kv_ptr + t * stride_kvt, kvo_ptr + t * stride_kvot, cs_row, True, D, ROPE,
                     BLOCK_D, BLOCK_R, SOFT)


@triton.jit
def _context_kv_store_kernel(kv_ptr, pos_ptr, cs_ptr, slot_ptr, cache_ptr, S, max_pos, stride_kvt,
                             stride_cs, stride_c, D: tl.constexpr, ROPE: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cs_row = _cos_sin_row(cs_ptr, pos_ptr, t, max_pos, stride_cs)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = (slot >= 0) & (slot < S)
    _kv_rope_row(kv_ptr + t * stride_kvt, cache_ptr + slot * stride_c, cs_row, ok, D, ROPE,
                 BLOCK_D, BLOCK_R, SOFT)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
# q elements per program: 4 heads of 512. Measured on the H200
# (benchmarks/results/h200_qkv_act_quant_2026-11-29/, benchmarks/results/README.md):
# 4 heads beat 2 at every B (B=64: 15.8 vs 26.0 us, 76 % vs 46 % of copy bandwidth).
Q_TILE_ELEMS = 2048
NUM_WARPS = 4


def _fp64(*tensors) -> bool:
    """Exact-precision (fp64) model runs have no kernel: launchers hand them to the reference."""
    return any(t.dtype == torch.float64 for t in tensors)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_inputs(q, kv, positions, cos_sin, check_q=True):
    """Validate the shared arguments; returns (T, H, D, R)."""
    if kv.dim() != 2:
        raise ValueError(f"kv must be [T, D], got shape {tuple(kv.shape)}")
    T, D = kv.shape
    H = 0
    if check_q:
        if q.dim() != 3 or q.shape[0] != T or q.shape[2] != D:
            raise ValueError(f"q must be [T, H, D] = [{T}, H, {D}] (from kv), got {tuple(q.shape)}")
        H = q.shape[1]
        if q.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"q must be bf16/fp16/fp32, got {q.dtype}")
    if kv.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"kv must be bf16/fp16/fp32, got {kv.dtype}")
    return T, H, D, check_rope_table(positions, cos_sin, T, D)


def check_rope_table(positions, cos_sin, T: int, D: int) -> int:
    """positions [T] int32/int64 and a cos/sin table [max_pos, R] for D-wide rows; returns R."""
    if positions.shape != (T,) or positions.dtype not in _INT_DTYPES:
        raise ValueError(f"positions must be int32/int64 [{T}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if cos_sin.dim() != 2 or not cos_sin.dtype.is_floating_point:
        raise ValueError(f"cos_sin must be a float [max_pos, R] table, got {cos_sin.dtype} "
                         f"{tuple(cos_sin.shape)}")
    R = cos_sin.shape[1]
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"cos_sin.shape[1] (rope dim {R}) must be even and in (0, D={D}]")
    return R


def _check_slots(slots, T, name="slots"):
    if slots.shape != (T,) or slots.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must be int32/int64 [{T}], got {slots.dtype} "
                         f"{tuple(slots.shape)}")


def _q_blocks(H, D, kernel, block_h=None):
    """Heads per program: Q_TILE_ELEMS worth on a GPU (4 heads of 512 at Flash dims). Triton's
    interpreter pays per operation, not per element: there one program takes all heads.
    `block_h` overrides (tests)."""
    block_d = next_pow2(D)
    if block_h is None:
        block_h = next_pow2(H) if interpreting(kernel) else Q_TILE_ELEMS // block_d
        block_h = max(1, min(next_pow2(H), block_h))
    return block_h, block_d, triton.cdiv(H, block_h)


def qkv_postprocess_launch(q, kv, positions, cos_sin, slots, cache_nope, cache_scale, cache_rope,
                           eps, block_h=None):
    if _fp64(q, kv, cos_sin):
        return qkv_postprocess_reference(q, kv, positions, cos_sin, slots, cache_nope, cache_scale,
                                         cache_rope, eps)
    T, H, D, R = _check_inputs(q, kv, positions, cos_sin)
    _check_slots(slots, T)
    nope = D - R
    if nope % KV_QUANT_GROUP:
        raise ValueError(f"kv nope dims D - R = {nope} must be a multiple of {KV_QUANT_GROUP}")
    S = cache_nope.shape[0]
    for name, c, width, dtype in (("cache_nope", cache_nope, nope, torch.float8_e4m3fn),
                                  ("cache_scale", cache_scale, nope // KV_QUANT_GROUP, torch.uint8),
                                  ("cache_rope", cache_rope, R, torch.bfloat16)):
        if c.dim() != 2 or c.shape != (S, width) or c.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} [{S}, {width}], got {c.dtype} "
                             f"{tuple(c.shape)}")
        if c.stride(1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (it is written in place)")
    q, kv, cos_sin = (_last_dim_contiguous(t) for t in (q, kv, cos_sin))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    kernel = _qkv_postprocess_kernel
    block_h, block_d, n_hb = _q_blocks(H, D, kernel, block_h)
    launch(kernel)[(T, n_hb + 1)](
        q, kv, positions, cos_sin, slots, q_out, cache_nope.view(torch.uint8), cache_scale,
        cache_rope, H, S, cos_sin.shape[0], q.stride(0), q.stride(1), q_out.stride(0),
        q_out.stride(1), kv.stride(0), cos_sin.stride(0), cache_nope.stride(0),
        cache_scale.stride(0), cache_rope.stride(0), float(eps),
        D=D, ROPE=R, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_R=next_pow2(R // 2),
        NG_P2=next_pow2(nope // KV_QUANT_GROUP), SOFT=interpreting(kernel), num_warps=NUM_WARPS)
    return q_out


def qkv_rope_launch(q, kv, positions, cos_sin, eps, block_h=None):
    if _fp64(q, kv, cos_sin):
        return qkv_rope_reference(q, kv, positions, cos_sin, eps)
    T, H, D, R = _check_inputs(q, kv, positions, cos_sin)
    q, kv, cos_sin = (_last_dim_contiguous(t) for t in (q, kv, cos_sin))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kv_out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    if T == 0:
        return q_out, kv_out
    kernel = _qkv_rope_kernel
    block_h, block_d, n_hb = _q_blocks(H, D, kernel, block_h)
    launch(kernel)[(T, n_hb + 1)](
        q, kv, positions, cos_sin, q_out, kv_out, H, cos_sin.shape[0], q.stride(0), q.stride(1),
        q_out.stride(0), q_out.stride(1), kv.stride(0), kv_out.stride(0), cos_sin.stride(0),
        float(eps), D=D, ROPE=R, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_R=next_pow2(R // 2),
        SOFT=interpreting(kernel), num_warps=NUM_WARPS)
    return q_out, kv_out


def context_kv_store_launch(kv, positions, cos_sin, slots, cache):
    if _fp64(kv, cos_sin, cache):
        return context_kv_store_reference(kv, positions, cos_sin, slots, cache)
    T, _, D, R = _check_inputs(None, kv, positions, cos_sin, check_q=False)
    _check_slots(slots, T)
    if cache.dim() != 2 or cache.shape[1] != D or cache.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"cache must be a bf16/fp16/fp32 [S, {D}] ring, got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    if cache.stride(1) != 1:
        raise ValueError("cache must have a contiguous last dim (it is written in place)")
    if T == 0:
        return
    kv, cos_sin = _last_dim_contiguous(kv), _last_dim_contiguous(cos_sin)
    kernel = _context_kv_store_kernel
    launch(kernel)[(T,)](
        kv, positions, cos_sin, slots, cache, cache.shape[0], cos_sin.shape[0], kv.stride(0),
        cos_sin.stride(0), cache.stride(0), D=D, ROPE=R, BLOCK_D=next_pow2(D),
        BLOCK_R=next_pow2(R // 2), SOFT=interpreting(kernel), num_warps=NUM_WARPS)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _qkv_postprocess_fake(q, kv, positions, cos_sin, slots, cache_nope, cache_scale, cache_rope,
                          eps):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _qkv_rope_fake(q, kv, positions, cos_sin, eps):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(kv, memory_format=torch.contiguous_format))


def _context_kv_store_fake(kv, positions, cos_sin, slots, cache):
    return None


@dspark_op("qkv_postprocess", reference=qkv_postprocess_reference, fake=_qkv_postprocess_fake,
           mutates_args={"cache_nope", "cache_scale", "cache_rope"})
def qkv_postprocess(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, slots: torch.Tensor, cache_nope: torch.Tensor,
                    cache_scale: torch.Tensor, cache_rope: torch.Tensor,
                    eps: float) -> torch.Tensor:
    return qkv_postprocess_launch(q, kv, positions, cos_sin, slots, cache_nope, cache_scale,
                                  cache_rope, eps)


@dspark_op("qkv_rope", reference=qkv_rope_reference, fake=_qkv_rope_fake)
def qkv_rope(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return qkv_rope_launch(q, kv, positions, cos_sin, eps)


@dspark_op("context_kv_store", reference=context_kv_store_reference, fake=_context_kv_store_fake,
           mutates_args={"cache"})
def context_kv_store(kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                     slots: torch.Tensor, cache: torch.Tensor) -> None:
    context_kv_store_launch(kv, positions, cos_sin, slots, cache)


# SM12x readiness: the launch configurations used at Flash dims (H=64, D=512, rope 64), bf16
# activations, fp32 cos/sin table, int64 positions/slots (tests/kernels/test_sm12x_resources.py).
_FLASH = dict(D=512, ROPE=64, BLOCK_D=512, BLOCK_R=32, SOFT=False)
_D16 = "i32:16"  # multiples of 16 at Flash dims: the JIT specialises them, the check must too
add_compile_configs("qkv_postprocess", [compile_config(
    _qkv_postprocess_kernel,
    dict(q_ptr="*bf16", kv_ptr="*bf16", pos_ptr="*i64", cs_ptr="*fp32", slot_ptr="*i64",
         qo_ptr="*bf16", nope_ptr="*u8", scale_ptr="*u8", rope_ptr="*bf16", H=_D16, S="i32",
         max_pos="i32", stride_qt=_D16, stride_qh=_D16, stride_ot=_D16, stride_oh=_D16,
         stride_kvt=_D16, stride_cs=_D16, stride_n=_D16, stride_s="i32", stride_r=_D16,
         eps="fp32"),
    dict(_FLASH, BLOCK_H=4, NG_P2=8), NUM_WARPS)])
add_compile_configs("qkv_rope", [compile_config(
    _qkv_rope_kernel,
    dict(q_ptr="*bf16", kv_ptr="*bf16", pos_ptr="*i64", cs_ptr="*fp32", qo_ptr="*bf16",
         kvo_ptr="*bf16", H=_D16, max_pos="i32", stride_qt=_D16, stride_qh=_D16,
         stride_ot=_D16, stride_oh=_D16, stride_kvt=_D16, stride_kvot=_D16, stride_cs=_D16,
         eps="fp32"),
    dict(_FLASH, BLOCK_H=4), NUM_WARPS)])
add_compile_configs("context_kv_store", [compile_config(
    _context_kv_store_kernel,
    dict(kv_ptr="*bf16", pos_ptr="*i64", cs_ptr="*fp32", slot_ptr="*i64", cache_ptr="*bf16",
         S="i32", max_pos="i32", stride_kvt=_D16, stride_cs=_D16, stride_c=_D16),
    dict(_FLASH), NUM_WARPS)])
