"""RoPE on the last dims of every head: reference, Triton kernel, `dspark::rope`.

    y = cat(x[..., :D-R], rope_gptj(x[..., D-R:], cos_sin[positions]) rounded to x.dtype)

Two calls a layer are left outside the fused QKV ops: the inverse rotation of the attention
output before wo_a (every target and draft layer) and the indexer's query rotation (C4 layers).
Unfused, each is ~11 aten launches (the table gather, its two casts, four products, a sub, an
add, a stack and a cat over the whole [T, H, D] tensor); fused it is one launch that reads x once
and writes y once (Flash: 64 heads x 512, 64 KB a token in bf16).

The kernel's grid is (token, head block); a program copies the heads' nope columns unchanged
(the reference's cat copies them bit for bit) and rotates the rope pairs in fp32 with the
table's cos / sin (kernels/qkv_postprocess.py `_rotate`), one rounding to x.dtype at the end,
as the reference rounds. `inverse` rotates by -angle. A token's result depends on its own row only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import rope_last
from dspark_compile.kernels.qkv_postprocess import (
    _FLOAT_DTYPES, _cos_sin_row, _rotate, check_rope_table)
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.region import fusable
from dspark_compile.kernels.tl_helpers import (
    compile_config, interpreting, launch, next_pow2, round_to)

# elements of x per program: 4 heads of 512 at Flash dims (kernels/qkv_postprocess.py measured
# that size best for the same per-head copy-and-rotate pattern on the H200)
TILE_ELEMS = 2048
NUM_WARPS = 4


@fusable("rope")
def rope_reference(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor,
                   rope_dim: int, inverse: bool) -> torch.Tensor:
    """x [T, ..., D] -> GPT-J RoPE of the last `rope_dim` dims at `positions` [T] (the inverse
    rotation when `inverse`); the other dims unchanged; result in x.dtype."""
    return rope_last(x, cos_sin, positions, rope_dim, inverse=inverse)


@triton.jit
def _rope_kernel(x_ptr, y_ptr, pos_ptr, cs_ptr, H, max_pos, stride_xt, stride_xh, stride_yt,
                 stride_yh, stride_cs, INVERSE: tl.constexpr, D: tl.constexpr,
                 ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_R: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    NOPE: tl.constexpr = D - ROPE
    dt = y_ptr.dtype.element_ty
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    x_rows = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
    y_rows = y_ptr + t * stride_yt + offs_h[:, None] * stride_yh
    if NOPE > 0:
        offs_d = tl.arange(0, BLOCK_D)
        m = hmask[:, None] & (offs_d[None, :] < NOPE)
        tl.store(y_rows + offs_d[None, :], tl.load(x_rows + offs_d[None, :], mask=m), mask=m)

    cs_row = _cos_sin_row(cs_ptr, pos_ptr, t, max_pos, stride_cs)
    offs_p = tl.arange(0, BLOCK_R)
    m2 = hmask[:, None] & (offs_p[None, :] < ROPE // 2)
    ev = NOPE + 2 * offs_p[None, :]
    xe = tl.load(x_rows + ev, mask=m2, other=0.0).to(tl.float32)
    xo = tl.load(x_rows + ev + 1, mask=m2, other=0.0).to(tl.float32)
    if INVERSE:
        # by -angle: (e c + o s, o c - e s) is the forward rotation of (e, -o) with its odd
        # output negated; both negations are exact
        oe, oo = _rotate(xe, -xo, cs_row, ROPE, BLOCK_R)
        oo = -oo
    else:
        oe, oo = _rotate(xe, xo, cs_row, ROPE, BLOCK_R)
    tl.store(y_rows + ev, round_to(oe, dt, SOFT).to(dt), mask=m2)
    tl.store(y_rows + ev + 1, round_to(oo, dt, SOFT).to(dt), mask=m2)


def _check(x, cos_sin, positions, rope_dim):
    if x.dim() < 2:
        raise ValueError(f"rope: x must be [T, ..., D], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"rope: x must be bf16/fp16/fp32/fp64, got {x.dtype}")
    R = check_rope_table(positions, cos_sin, x.shape[0], x.shape[-1])
    if rope_dim != R:
        raise ValueError(f"rope: rope_dim={rope_dim} must equal cos_sin.shape[1]={R} (cos for "
                         f"the first half of the columns, sin for the second)")


def rope_launch(x, cos_sin, positions, rope_dim, inverse, block_h=None):
    _check(x, cos_sin, positions, rope_dim)
    if x.dtype == torch.float64 or cos_sin.dtype == torch.float64:
        return rope_reference(x, cos_sin, positions, rope_dim, inverse)
    T, D = x.shape[0], x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    x3 = x.reshape(T, -1, D)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    y3 = y.view(T, -1, D)
    H = x3.shape[1]
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    kernel = _rope_kernel
    block_d = next_pow2(D)
    if block_h is None:
        # the interpreter pays per operation, not per element: one program takes all heads
        block_h = next_pow2(H) if interpreting(kernel) else max(1, TILE_ELEMS // block_d)
    block_h = max(1, min(next_pow2(H), block_h))
    launch(kernel)[(T, triton.cdiv(H, block_h))](
        x3, y3, positions, cos_sin, H, cos_sin.shape[0], x3.stride(0), x3.stride(1),
        y3.stride(0), y3.stride(1), cos_sin.stride(0), INVERSE=bool(inverse), D=D,
        ROPE=rope_dim, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_R=next_pow2(rope_dim // 2),
        SOFT=interpreting(kernel), num_warps=NUM_WARPS)
    return y


def _rope_fake(x, cos_sin, positions, rope_dim, inverse):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@dspark_op("rope", reference=rope_reference, fake=_rope_fake)
def rope(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, rope_dim: int,
         inverse: bool) -> torch.Tensor:
    return rope_launch(x, cos_sin, positions, rope_dim, inverse)


# SM12x readiness: Flash dims, the output's inverse rotation (64 heads x 512, rope 64) and the
# indexer's query (64 heads x 128, rope 64); bf16 x, fp32 table, int64 positions
_D16 = "i32:16"
_TYPES = dict(x_ptr="*bf16", y_ptr="*bf16", pos_ptr="*i64", cs_ptr="*fp32", H=_D16, max_pos="i32",
              stride_xt=_D16, stride_xh=_D16, stride_yt=_D16, stride_yh=_D16, stride_cs=_D16)
add_compile_configs("rope", [
    compile_config(_rope_kernel, _TYPES, dict(INVERSE=True, D=512, ROPE=64, BLOCK_H=4, BLOCK_D=512,
                                              BLOCK_R=32, SOFT=False), NUM_WARPS),
    compile_config(_rope_kernel, _TYPES, dict(INVERSE=False, D=128, ROPE=64, BLOCK_H=16, BLOCK_D=128,
                                              BLOCK_R=32, SOFT=False), NUM_WARPS)])
