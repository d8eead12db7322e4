"""Routed experts of one MoE layer as a single `dspark::moe_experts` op: reference, plan, launcher.

    y[t] = sum_j w[t, j] * o_j[t],   o_j = W2_e (swiglu(W1_e x[t], W3_e x[t])),   e = topk_ids[t, j]

Weights are MXFP4 exactly as stored: packed e2m1 pairs (int8 bytes, low nibble = even element)
with one E8M0 scale per 32 consecutive K elements (docs/model.md, "MXFP4 experts").

W4A16, not W4A8: activations stay in the compute dtype (bf16 in deployment), weights are
dequantized to it inside the GEMMs' K loops. The step's MoE reads 6-384 tokens, so the op is
bound by weight bytes (below), which W4A8 does not reduce; it would add an FP8 rounding of x and
of h between the GEMMs that the model's reference and the HF model (tests/models/
test_hf_reference.py) do not have, and e2m1 x 2^k is exact in bf16 (<= 2 significant bits), so
W4A16 loses nothing on the weight side. vLLM runs MXFP4 MoE the same way on Hopper and SM12x.

Numerics (the reference below is the definition; the kernels match it up to fp32 summation
order): both GEMMs accumulate in fp32 (fp64 for fp64 x) and round to x's dtype; the SwiGLU clamp
(kernels/act_quant.py `swiglu`: gate min(g, limit), up clamp(u, -limit, limit), NaN kept) in
fp32, h rounded to x's dtype; o_j times the fp32 routing weight; the k slots summed in slot
order in fp32. A slot whose id is outside [0, E) (slot -1) adds nothing; a token contributes
only through the experts it is routed to (a NaN row stays in its row).

Bytes moved at Flash dims (E = 256, D = 4096, I = 2048, k = 6): per touched expert w1, w3
2048 x 2048 B + 2048 x 128 B scales each, w2 4096 x 1024 B + 4096 x 64 B: 13.37 MB; 6 tokens
touch ~36 experts (0.48 GB, ~100 us at 4.8 TB/s), 384 tokens all 256 (3.42 GB, ~710 us).
Activations at 384 tokens: h (2304 x 2048 bf16) written and read 19 MB, y_pair (2304 x 4096
fp32) 75 MB, 3 % of the weights. The kernels are in kernels/moe_kernels.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from dspark_compile.kernels import moe_kernels as mk
from dspark_compile.kernels.act_quant import swiglu
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.tl_helpers import compile_config, interpreting, launch, next_pow2

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit) -> fp32 E2M1_VALUES, by arithmetic.

    No lookup table: a table built with torch.tensor(...) would be a host-to-device copy, which is
    illegal inside CUDA-graph capture.
    """
    e = (codes >> 1) & 3
    m = (codes & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2((e - 1).to(torch.float32)))
    return torch.where((codes & 8) != 0, -mag, mag)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """packed [..., K/2] int8/uint8, scale [..., K/32] e8m0 -> [..., K] in `dtype`."""
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)        # even element = low nibble
    vals = e2m1_decode(codes)
    exp = scale.view(torch.uint8).to(torch.float32) - 127.0           # never a numeric cast
    vals = vals.unflatten(-1, (-1, MXFP4_BLOCK)) * torch.exp2(exp).unsqueeze(-1)
    return vals.flatten(-2).to(dtype)


def moe_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                          w2: torch.Tensor, s2: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """y [T, D] fp32 (fp64 for fp64 x); the module docstring gives the math.

    x [T, D]; topk_ids [T, k] int64 (outside [0, E): no expert); topk_weights [T, k];
    w1/w3 [E, I, D/2], s1/s3 [E, I, D/32]; w2 [E, D, I/2], s2 [E, D, I/32].
    Fixed shapes (every expert runs on every token, its result kept only where routed): no
    nonzero, no data-dependent shapes.
    """
    acc = _out_dtype(x)
    T, k = topk_ids.shape
    xa, wt = x.to(acc), topk_weights.to(acc)
    ys = torch.zeros(T, k, w2.shape[1], dtype=acc, device=x.device)   # slot j's w * o_j
    for e in range(w1.shape[0]):
        g = (xa @ mxfp4_dequant(w1[e], s1[e], acc).T).to(x.dtype)
        u = (xa @ mxfp4_dequant(w3[e], s3[e], acc).T).to(x.dtype)
        h = swiglu(g, u, swiglu_limit)
        o = (h.to(acc) @ mxfp4_dequant(w2[e], s2[e], acc).T).to(x.dtype).to(acc)
        ys = torch.where((topk_ids == e)[..., None], wt[..., None] * o[:, None, :], ys)
    y = ys[:, 0] if k else ys.sum(1)
    for j in range(1, k):                                             # slot order, as the kernel
        y = y + ys[:, j]
    return y


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# Plan and launcher
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoePlan:
    """Launch choices of one call, from its static shapes (not tuned on the H200 yet)."""
    block_m: int = 16      # rows of an expert block; tl.dot's smallest M. Decode: ~1-9 pairs
    block_n: int = 64      # output columns per program, both GEMMs
    block_k: int = 128     # K elements per step (two dots of block_k / 2 packed bytes)
    block_p: int = 64      # pairs per routing step: a [64, 256] one-hot (sm_120: 127 registers)
    block_d: int = 1024    # output columns per combine program
    num_warps: int = 4
    swap_ab: bool = False  # weight rows on the MMA's M side (moe_kernels._mac)


BIG_BLOCK_FROM = 48        # pairs per touched expert from which 64-row blocks pay (prefill)


def moe_plan(P: int, E: int, D: int, I: int, dtype=torch.bfloat16) -> MoePlan:
    """P = T * k pairs. block_k: the largest of 128, 64, 32 dividing D and I (multiples of 32);
    at most 64 for fp32 activations (64-row blocks at 128 take 113 KB of shared memory on
    sm_120, over SM12x's 99 KB). swap_ab for bf16 16-row blocks: on the H200 at Flash dims it
    took top-6 routing from 715 to 594 us at 6 tokens, 2,380 to 1,910 at 24 and 4,831 to 3,842
    at 96 (benchmarks/results/README.md, "GEMMs"); fp32 and 64-row blocks are unmeasured."""
    per_expert = P / max(1, min(E, P))
    top = 64 if dtype == torch.float32 else 128
    bk = next(b for b in (128, 64, 32) if b <= top and D % b == 0 and I % b == 0)
    bm = 64 if per_expert >= BIG_BLOCK_FROM else 16
    return MoePlan(block_m=bm, block_k=bk, block_d=min(1024, next_pow2(D)),
                   swap_ab=bm == 16 and dtype != torch.float32)


def max_blocks(P: int, E: int, block_m: int) -> int:
    """Worst-case live blocks: sum_e ceil(c_e / bm) <= (P + n (bm - 1)) / bm, n <= min(E, P)
    experts hit."""
    return (P + min(E, P) * (block_m - 1)) // block_m


def moe_route_launch(topk_ids: torch.Tensor, E: int, block_m: int, block_p: int = 64):
    """(pair_of_row [max_blocks * bm] int32, block expert [max_blocks] int32 (-1 unused),
    block live rows [max_blocks] int32, live block count [1] int32); rows past a block's live
    rows are never written."""
    ids = topk_ids.reshape(-1).contiguous()
    P = ids.numel()
    nb = max_blocks(P, E, block_m)
    dev = ids.device
    pair = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    blk_e = torch.empty(nb, dtype=torch.int32, device=dev)
    blk_rows = torch.empty(nb, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    launch(mk._moe_route_kernel)[(1,)](
        ids, pair, blk_e, blk_rows, count, P, E, nb, BLOCK_M=block_m, BLOCK_P=block_p,
        E_P2=next_pow2(E), num_warps=4)
    return pair, blk_e, blk_rows, count


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2):
    if x.dim() != 2 or x.dtype not in _KERNEL_DTYPES + (torch.float64,):
        raise ValueError(f"x must be a float [T, D] tensor, got {x.dtype} {tuple(x.shape)}")
    T, D = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids and topk_weights must both be [{T}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    E, I = w1.shape[0], w1.shape[1]
    want = {"w1": (w1, (E, I, D // 2)), "w3": (w3, (E, I, D // 2)), "w2": (w2, (E, D, I // 2)),
            "s1": (s1, (E, I, D // 32)), "s3": (s3, (E, I, D // 32)), "s2": (s2, (E, D, I // 32))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or t.element_size() != 1:
            raise ValueError(f"{name} must be 1-byte {list(shape)}, got {t.dtype} {tuple(t.shape)}")
    if D % MXFP4_BLOCK or I % MXFP4_BLOCK:
        raise ValueError(f"hidden {D} and intermediate {I} must be multiples of {MXFP4_BLOCK}")
    return T, D, E, I


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def moe_experts_launch(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, swiglu_limit,
                       plan: MoePlan | None = None):
    T, D, E, I = _check(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2)
    if x.dtype == torch.float64:  # exact-precision model runs: no kernel, the reference
        return moe_experts_reference(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2,
                                     swiglu_limit)
    k = topk_ids.shape[1]
    P = T * k
    y = torch.empty(T, D, dtype=torch.float32, device=x.device)
    if P == 0:
        return y.zero_()
    plan = plan or moe_plan(P, E, D, I, x.dtype)
    bm, bn, bk = plan.block_m, plan.block_n, plan.block_k
    if D % bk or I % bk:
        raise ValueError(f"plan.block_k {bk} must divide hidden {D} and intermediate {I}")
    ids = topk_ids.reshape(-1).contiguous()
    wt = topk_weights.reshape(-1).to(torch.float32).contiguous()
    x2 = x if x.stride(1) == 1 else x.contiguous()
    pair, blk_e, blk_rows, count = moe_route_launch(ids, E, bm, plan.block_p)
    nb = blk_e.shape[0]
    h = torch.empty(nb * bm, I, dtype=x.dtype, device=x.device)       # sorted rows
    y_pair = torch.empty(P, D, dtype=torch.float32, device=x.device)
    soft = interpreting(mk._moe_gate_up_kernel)
    ieee = soft or x.dtype == torch.float32       # moe_kernels._dot says why
    route = (pair, blk_e, blk_rows, count)
    launch(mk._moe_gate_up_kernel)[(nb, triton.cdiv(I, bn))](
        x2, _u8(w1), _u8(s1), _u8(w3), _u8(s3), h, *route, D, I, k, x2.stride(0),
        float(swiglu_limit), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=ieee, SOFT=soft,
        SWAP=plan.swap_ab, num_warps=plan.num_warps)
    launch(mk._moe_down_kernel)[(nb, triton.cdiv(D, bn))](
        h, _u8(w2), _u8(s2), wt, y_pair, *route, D, I, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        IEEE=ieee, SOFT=soft, SWAP=plan.swap_ab, num_warps=plan.num_warps)
    launch(mk._moe_combine_kernel)[(T, triton.cdiv(D, plan.block_d))](
        y_pair, ids, y, D, E, k, BLOCK_D=plan.block_d, num_warps=plan.num_warps)
    return y


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _moe_fake(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, swiglu_limit):
    return x.new_empty(x.shape[0], w2.shape[1], dtype=_out_dtype(x))


@dspark_op("moe_experts", reference=moe_experts_reference, fake=_moe_fake)
def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                w2: torch.Tensor, s2: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    return moe_experts_launch(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, swiglu_limit)


def _compile_configs():
    """Every kernel configuration `moe_plan` picks at Flash dims (E = 256), for bf16 (block_k
    128) and fp32 (block_k 64) activations."""
    D16, ptr8, ptr32 = "i32:16", "*u8", "*i32"
    route = dict(pair_ptr=ptr32, blk_expert_ptr=ptr32, blk_rows_ptr=ptr32, count_ptr=ptr32)
    out = []
    for bm in (16, 64):
        out.append(compile_config(mk._moe_route_kernel, dict(
            ids_ptr="*i64", P="i32", E=D16, MAX_BLOCKS="i32", **route),
            dict(BLOCK_M=bm, BLOCK_P=64, E_P2=256), 4))
        # swap_ab where the plan picks it (bf16 16-row blocks)
        for dt, ieee, bk, swap in (("*bf16", False, 128, bm == 16), ("*fp32", True, 64, False)):
            knobs = dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk, IEEE=ieee, SOFT=False, SWAP=swap)
            out.append(compile_config(mk._moe_gate_up_kernel, dict(
                x_ptr=dt, w1_ptr=ptr8, s1_ptr=ptr8, w3_ptr=ptr8, s3_ptr=ptr8, h_ptr=dt, D=D16,
                I=D16, K_TOP="i32", stride_xt=D16, limit="fp32", **route), knobs, 4))
            out.append(compile_config(mk._moe_down_kernel, dict(
                h_ptr=dt, w2_ptr=ptr8, s2_ptr=ptr8, wt_ptr="*fp32", y_ptr="*fp32", D=D16, I=D16,
                **route), knobs, 4))
    out.append(compile_config(mk._moe_combine_kernel, dict(
        y_pair_ptr="*fp32", ids_ptr="*i64", y_ptr="*fp32", D=D16, E=D16, K_TOP="i32"),
        dict(BLOCK_D=1024), 4))
    return out


add_compile_configs("moe_experts", _compile_configs())
