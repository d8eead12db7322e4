"""Activation quantization in front of FP8 block-scaled GEMMs: reference, Triton kernels, ops.

Per token, groups of 128 along K, float8_e4m3fn with power-of-two (UE8M0) scales
`2^ceil(log2(max(amax, 1e-4) / 448))`.

- `swiglu_quant_reference`: SwiGLU with clamp (gate clamped above at `limit`, up clamped to
  [-limit, limit]; fp32 math, h rounded to the input dtype) then the quant. Shared experts.
- `rmsnorm_quant_reference`: weighted RMSNorm (fp32 math, rounded to the input dtype) then the
  quant; returns the normed activations too because other consumers (compressor, router, routed
  experts) read them unquantized.
- `act_quant_reference`: the quant alone.
- `rmsnorm_reference`: the weighted RMSNorm alone, for norms whose output feeds no FP8 GEMM (the
  attention's kv, the draft's context kv, the final norm). It is an op of its own, not glue,
  because a glue mean is batch dependent on the GPU: aten's and Inductor's reductions pick
  their block shapes by the row count, so one token's norm would change with the step's size.

Bytes per token that must move (Flash shared expert, I = 2048): read g, u 8 KB (bf16), write
2 KB fp8 + 64 B scales. rmsnorm_quant (hidden 4096): read x 8 KB + weight (cached), write y 8 KB +
4 KB fp8 + 128 B scales.

Kernels (one launch per op, fp32 math from the loaded values): act_quant and swiglu_quant tile a
token's row into BLOCK_G groups of 128 per program, grid (token, group block); rmsnorm_quant needs
the whole row for its mean and runs one program per token. FP8 and scale bytes are computed with
the exact helpers of kernels/tl_helpers.py, so given the same activations they equal the
reference's bytes; swiglu's exp and rmsnorm's summation order can move an activation by one ulp
of its dtype before the quant (see the tests for the bounds).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark_compile.kernels.common import fp8_group_quant, rmsnorm, simd_pointwise, upcast
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.region import fusable
from dspark_compile.kernels.tl_helpers import (
    compile_config, exp2_int, fp8e4m3_bits, interpreting, launch, next_pow2, round_to,
    ue8m0_exponent)

ACT_QUANT_GROUP = 128


@fusable("act_quant")
def act_quant_reference(x: torch.Tensor):
    """x [T, K] -> (q float8_e4m3fn [T, K], scale fp32 [T, K/128])."""
    return fp8_group_quant(x, ACT_QUANT_GROUP)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, -limit, limit) in fp32, rounded to g's dtype (limit 0 = off)."""
    gf, uf = upcast(g), upcast(u)
    if limit > 0:
        gf = gf.clamp(max=limit)
        uf = uf.clamp(-limit, limit)
    return (simd_pointwise(F.silu, gf) * uf).to(g.dtype)


@fusable("swiglu_quant")
def swiglu_quant_reference(g: torch.Tensor, u: torch.Tensor, limit: float):
    return act_quant_reference(swiglu(g, u, limit))


@fusable("rmsnorm_quant")
def rmsnorm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (y = rmsnorm(x) in x.dtype, q, scale)."""
    y = rmsnorm(x, weight, eps)
    q, s = act_quant_reference(y)
    return y, q, s


@fusable("rmsnorm")
def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """rmsnorm(x) in x.dtype, weighted."""
    return rmsnorm(x, weight, eps)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _quant_groups(h, q_row, s_row, offs_g, gmask, cols, SOFT: tl.constexpr):
    """h [BLOCK_G, 128] fp32 (values of the activation dtype) -> e4m3 bytes + fp32 2^e scales."""
    e = ue8m0_exponent(tl.max(tl.abs(h), axis=1))
    # h / 2^e is exact as h * 2^-e (power of two): the reference's division, bit for bit.
    hq = tl.minimum(tl.maximum(h * exp2_int(-e)[:, None], -448.0), 448.0)
    tl.store(q_row + cols, fp8e4m3_bits(hq, SOFT), mask=gmask[:, None])
    tl.store(s_row + offs_g, exp2_int(e), mask=gmask)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, NG, stride_xt, stride_qt, stride_st,
                      BLOCK_G: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = offs_g < NG
    cols = offs_g[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + t * stride_xt + cols, mask=gmask[:, None], other=0.0).to(tl.float32)
    _quant_groups(x, q_ptr + t * stride_qt, s_ptr + t * stride_st, offs_g, gmask, cols, SOFT)


@triton.jit
def _swiglu_quant_kernel(g_ptr, u_ptr, q_ptr, s_ptr, h_ptr, NG, stride_gt, stride_ut, stride_qt,
                         stride_st, stride_ht, limit, BLOCK_G: tl.constexpr,
                         STORE_H: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = offs_g < NG
    cols = offs_g[:, None] * 128 + tl.arange(0, 128)[None, :]
    g = tl.load(g_ptr + t * stride_gt + cols, mask=gmask[:, None], other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_ut + cols, mask=gmask[:, None], other=0.0).to(tl.float32)
    clamp = limit > 0
    g = tl.where(clamp, tl.minimum(g, limit), g)
    u = tl.where(clamp, tl.minimum(tl.maximum(u, -limit), limit), u)
    # torch's CPU silu is x / (1 + exp(-x)); only exp's last-ulp rounding can differ.
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    dt = g_ptr.dtype.element_ty
    h = round_to(silu * u, dt, SOFT)
    if STORE_H:  # test hook: expose the rounded activation the quant consumed
        tl.store(h_ptr + t * stride_ht + cols, h.to(h_ptr.dtype.element_ty), mask=gmask[:, None])
    _quant_groups(h, q_ptr + t * stride_qt, s_ptr + t * stride_st, offs_g, gmask, cols, SOFT)


@triton.jit
def _rmsnorm_quant_kernel(x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, K, stride_xt, stride_yt, stride_qt,
                          stride_st, eps, NG_P2: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, NG_P2)
    gmask = offs_g < K // 128
    cols = offs_g[:, None] * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + t * stride_xt + cols, mask=gmask[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=gmask[:, None], other=0.0).to(tl.float32)
    # reference: (xf * rsqrt(mean(xf^2) + eps)) * w, mean = sum / K, IEEE division and sqrt
    ms = tl.math.div_rn(tl.sum(tl.sum(x * x, axis=1), axis=0), K * 1.0)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    dt = y_ptr.dtype.element_ty
    y = round_to((x * rstd) * w, dt, SOFT)
    tl.store(y_ptr + t * stride_yt + cols, y.to(dt), mask=gmask[:, None])
    _quant_groups(y, q_ptr + t * stride_qt, s_ptr + t * stride_st, offs_g, gmask, cols, SOFT)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, K, stride_xt, stride_yt, eps, BLOCK_K: tl.constexpr,
                    SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    m = cols < K
    x = tl.load(x_ptr + t * stride_xt + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    ms = tl.math.div_rn(tl.sum(x * x, axis=0), K * 1.0)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    dt = y_ptr.dtype.element_ty
    tl.store(y_ptr + t * stride_yt + cols, round_to((x * rstd) * w, dt, SOFT).to(dt), mask=m)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SM_COUNT_HINT = 132        # H200; only shapes the group-block heuristic
RMSNORM_MAX_K = 16384      # one program holds a whole row


def _rows(x: torch.Tensor, name: str, grouped: bool = True):
    """x [..., K] -> ([T, K] view with a contiguous last dim, leading shape, K); K a multiple
    of the quant group unless not `grouped`."""
    if x.dim() < 1 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a bf16/fp16/fp32 [..., K] tensor, got {x.dtype} "
                         f"{tuple(x.shape)}")
    K = x.shape[-1]
    if grouped and K % ACT_QUANT_GROUP:
        raise ValueError(f"{name}.shape[-1] = {K} must be a multiple of {ACT_QUANT_GROUP}")
    x2 = x.reshape(-1, K)
    if K and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, x.shape[:-1], K


def _outputs(lead, K, device):
    T = 1
    for n in lead:
        T *= n
    q = torch.empty((T, K), dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty((T, K // ACT_QUANT_GROUP), dtype=torch.float32, device=device)
    return q, s, T


def _group_block(T, NG, kernel, block_g):
    """Groups of 128 per program. GPU: 1 while that leaves under ~8 programs per SM (spread the
    few tokens of small batches over the chip), else 4. Triton's interpreter pays per operation,
    not per element, so there one program takes a whole row. `block_g` overrides (tests)."""
    if block_g is not None:
        return block_g
    if interpreting(kernel):
        return next_pow2(NG)
    return 1 if T * NG < 8 * SM_COUNT_HINT else 4


def _shaped(q, s, lead, K):
    return q.reshape(*lead, K), s.reshape(*lead, K // ACT_QUANT_GROUP)


def act_quant_launch(x, block_g=None):
    if x.dtype == torch.float64:  # exact-precision model runs: no kernel, the reference
        return act_quant_reference(x)
    x2, lead, K = _rows(x, "x")
    q, s, T = _outputs(lead, K, x.device)
    NG = K // ACT_QUANT_GROUP
    if T and NG:
        kernel = _act_quant_kernel
        bg = _group_block(T, NG, kernel, block_g)
        launch(kernel)[(T, triton.cdiv(NG, bg))](
            x2, q.view(torch.uint8), s, NG, x2.stride(0), q.stride(0), s.stride(0),
            BLOCK_G=bg, SOFT=interpreting(kernel), num_warps=min(bg, 4))
    return _shaped(q, s, lead, K)


def swiglu_quant_launch(g, u, limit, h_out=None, block_g=None):
    """`h_out` (test hook, [T, K] of g's dtype) receives the activation before the quant."""
    if g.dtype == torch.float64 and h_out is None:
        return swiglu_quant_reference(g, u, limit)
    if g.shape != u.shape or g.dtype != u.dtype:
        raise ValueError(f"g and u must have one shape and dtype, got {g.dtype} {tuple(g.shape)} "
                         f"and {u.dtype} {tuple(u.shape)}")
    g2, lead, K = _rows(g, "g")
    u2, _, _ = _rows(u, "u")
    q, s, T = _outputs(lead, K, g.device)
    NG = K // ACT_QUANT_GROUP
    if T and NG:
        kernel = _swiglu_quant_kernel
        bg = _group_block(T, NG, kernel, block_g)
        h = g2 if h_out is None else h_out   # unused unless STORE_H; g's type keeps one compile
        launch(kernel)[(T, triton.cdiv(NG, bg))](
            g2, u2, q.view(torch.uint8), s, h, NG, g2.stride(0), u2.stride(0), q.stride(0),
            s.stride(0), h.stride(0), float(limit), BLOCK_G=bg, STORE_H=h_out is not None,
            SOFT=interpreting(kernel), num_warps=min(bg, 4))
    return _shaped(q, s, lead, K)


def rmsnorm_quant_launch(x, weight, eps):
    if x.dtype == torch.float64:
        return rmsnorm_quant_reference(x, weight, eps)
    x2, lead, K = _rows(x, "x")
    weight = _norm_weight(weight, K, "rmsnorm_quant")
    q, s, T = _outputs(lead, K, x.device)
    y = torch.empty((T, K), dtype=x.dtype, device=x.device)
    if T and K:
        ng_p2 = next_pow2(K // ACT_QUANT_GROUP)
        kernel = _rmsnorm_quant_kernel
        launch(kernel)[(T,)](
            x2, weight, y, q.view(torch.uint8), s, K, x2.stride(0), y.stride(0), q.stride(0),
            s.stride(0), float(eps), NG_P2=ng_p2, SOFT=interpreting(kernel),
            num_warps=_rmsnorm_warps(ng_p2))
    q, s = _shaped(q, s, lead, K)
    return y.reshape(*lead, K), q, s


def rmsnorm_launch(x, weight, eps):
    if x.dtype == torch.float64:
        return rmsnorm_reference(x, weight, eps)
    x2, _, K = _rows(x, "x", grouped=False)
    weight = _norm_weight(weight, K, "rmsnorm")
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] and K:
        block = next_pow2(K)
        kernel = _rmsnorm_kernel
        launch(kernel)[(x2.shape[0],)](x2, weight, y, K, x2.stride(0), y.stride(0),
                                       float(eps), BLOCK_K=block, SOFT=interpreting(kernel),
                                       num_warps=_rmsnorm_warps(block // ACT_QUANT_GROUP))
    return y.reshape(x.shape)


def _norm_weight(weight, K, op):
    """The norm's weight, checked against the row width K (a program holds a whole row)."""
    if weight.shape != (K,) or not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a float [{K}] vector, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if K > RMSNORM_MAX_K:
        raise ValueError(f"{op} holds a row per program: K = {K} > {RMSNORM_MAX_K}")
    return weight.contiguous()


def _rmsnorm_warps(ng_p2):
    return max(1, min(16, ng_p2 // 4))  # 4 groups of 128 per warp: 16 fp32 per thread


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _quant_fake(x):
    K = x.shape[-1]
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((*x.shape[:-1], K // ACT_QUANT_GROUP), dtype=torch.float32))


def _swiglu_quant_fake(g, u, limit):
    return _quant_fake(g)


def _rmsnorm_quant_fake(x, weight, eps):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),) + _quant_fake(x)


@dspark_op("act_quant", reference=act_quant_reference, fake=_quant_fake)
def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return act_quant_launch(x)


@dspark_op("swiglu_quant", reference=swiglu_quant_reference, fake=_swiglu_quant_fake)
def swiglu_quant(g: torch.Tensor, u: torch.Tensor,
                 limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_quant_launch(g, u, limit)


@dspark_op("rmsnorm_quant", reference=rmsnorm_quant_reference, fake=_rmsnorm_quant_fake)
def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rmsnorm_quant_launch(x, weight, eps)


@dspark_op("rmsnorm", reference=rmsnorm_reference,
           fake=lambda x, weight, eps: torch.empty_like(x, memory_format=torch.contiguous_format))
def rmsnorm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rmsnorm_launch(x, weight, eps)


# SM12x readiness: every (BLOCK_G, num_warps) the launchers pick, bf16 activations; rmsnorm_quant
# at the Flash rows it normalises before an FP8 GEMM (q_lora 1024, hidden 4096).
_D16 = "i32:16"  # multiples of 16 at these shapes: the JIT specialises them, the check must too
_STRIDES = dict(stride_qt=_D16, stride_st=_D16)
for _bg in (1, 4):
    add_compile_configs("act_quant", [compile_config(
        _act_quant_kernel,
        dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", NG=_D16, stride_xt=_D16, **_STRIDES),
        dict(BLOCK_G=_bg, SOFT=False), _bg)])
    add_compile_configs("swiglu_quant", [compile_config(
        _swiglu_quant_kernel,
        dict(g_ptr="*bf16", u_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", h_ptr="*bf16", NG=_D16,
             stride_gt=_D16, stride_ut=_D16, stride_ht=_D16, limit="fp32", **_STRIDES),
        dict(BLOCK_G=_bg, STORE_H=False, SOFT=False), _bg)])
for _k in (1024, 4096):
    _ng = next_pow2(_k // ACT_QUANT_GROUP)
    add_compile_configs("rmsnorm_quant", [compile_config(
        _rmsnorm_quant_kernel,
        dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", K=_D16,
             stride_xt=_D16, stride_yt=_D16, stride_qt=_D16,
             stride_st=_D16 if (_k // ACT_QUANT_GROUP) % 16 == 0 else "i32", eps="fp32"),
        dict(NG_P2=_ng, SOFT=False), _rmsnorm_warps(_ng))])
# rmsnorm at the Flash rows it normalises alone: the kv (head_dim 512) and the final norm (4096)
for _k in (512, 4096):
    add_compile_configs("rmsnorm", [compile_config(
        _rmsnorm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", K=_D16, stride_xt=_D16,
                              stride_yt=_D16, eps="fp32"),
        dict(BLOCK_K=_k, SOFT=False), _rmsnorm_warps(_k // ACT_QUANT_GROUP))])
