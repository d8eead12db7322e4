"""The MoE router after its logits: reference, Triton kernel, `dspark::moe_gate`.

    score = sqrt(softplus(logits))                       # [T, E] fp32
    idx   = tid2eid[fold(tokens)]                        # hash layers
          | topk(score + bias, k).indices                # the others (bias only selects)
    w     = score[idx] / sum of the k in slot order      # norm_topk (else score[idx])
    w     = w * scale                                    # routed scaling factor

Unfused this is ~15 aten launches a MoE layer (softplus, sqrt, the bias add, topk's two kernels,
gather, k - 1 adds, clamp, div, mul, and the casts); the kernel is one launch, a program per
token row over all E experts (256 at Flash dims: one 1 KB row of logits, in registers).

Selection: the largest score + bias first; equal keys in ascending expert order; a NaN key
counts as larger than every number (as torch.topk orders NaN). Softplus is computed as
max(x, 0) + log1p(exp(-|x|)) with log1p by Goldberg's formula (the interpreter has no libdevice):
within a few ulps of torch's log1p(exp(x)) and exactly x above 20, as torch returns. The k
weights are summed in slot order by adds, never by a reduction whose order could follow the
batch; a row's result depends on that row only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark_compile.kernels.common import simd_pointwise
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.sampling.reference import fold_ids
from dspark_compile.kernels.tl_helpers import compile_config, launch, next_pow2

NORM_FLOOR = 1e-20   # the weights' sum is clamped here before dividing
NUM_WARPS = 4


def moe_gate_reference(logits: torch.Tensor, bias: torch.Tensor | None,
                       tid2eid: torch.Tensor | None, tokens: torch.Tensor, k: int,
                       norm_topk: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32, fp64 in exact mode); `tid2eid` [V, k] int64 on hash layers (then
    `bias` is None), else `bias` [E]; tokens [T] int64. Returns (idx [T, k] int64, w [T, k])."""
    score = torch.sqrt(simd_pointwise(F.softplus, logits))
    if tid2eid is not None:
        # tokens are folded into [0, vocab) by Batch.make already; folding here as well keeps
        # the gather addressable for any caller
        idx = tid2eid[fold_ids(tokens, tid2eid.shape[0])]
    else:
        idx = (score + bias.to(score.dtype)).topk(k, dim=-1).indices
    w = score.gather(-1, idx)
    if norm_topk:
        # the k weights summed in slot order by adds, not by a reduction: a GPU reduction
        # picks its block shape by the row count, which would make a token's sum batch
        # dependent
        total = w[..., :1]
        for j in range(1, w.shape[-1]):
            total = total + w[..., j:j + 1]
        w = w / total.clamp_min(NORM_FLOOR)
    return idx, w * scale


@triton.jit
def _log1p(u):
    """log(1 + u) for u >= 0 to a few ulps (Goldberg): log(w) * u / (w - 1), w = 1 + u."""
    w = 1.0 + u
    d = tl.where(w == 1.0, 1.0, w - 1.0)
    return tl.where(w == 1.0, u, tl.log(w) * tl.math.div_rn(u, d))


@triton.jit
def _moe_gate_kernel(logits_ptr, bias_ptr, tid2eid_ptr, tokens_ptr, idx_ptr, w_ptr, E, V,
                     stride_l, scale, K: tl.constexpr, HASH: tl.constexpr, NORM: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < E
    x = tl.load(logits_ptr + t * stride_l + offs_e, mask=emask, other=0.0).to(tl.float32)
    sp = tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x)))
    sp = tl.where(x > 20.0, x, sp)
    sp = tl.where(x != x, x, sp)                    # NaN stays NaN
    score = tl.sqrt_rn(sp)

    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    if HASH:
        tok = tl.load(tokens_ptr + t)
        tok = tl.where((tok >= 0) & (tok < V), tok, 0)
        idx = tl.load(tid2eid_ptr + tok * K + offs_k, mask=kmask, other=0)
        w = tl.zeros([BLOCK_K], tl.float32)
        for j in tl.static_range(K):
            e_j = tl.sum(tl.where(offs_k == j, idx, 0), axis=0)
            s_j = tl.sum(tl.where(offs_e == e_j, score, 0.0), axis=0)
            w = tl.where(offs_k == j, s_j, w)
    else:
        key = score + tl.load(bias_ptr + offs_e, mask=emask, other=0.0).to(tl.float32)
        # rank 1: a NaN key (first, ascending expert order), 0: the numbers, -1: no expert
        nan_key = key != key
        rank = tl.where(emask, tl.where(nan_key, 1, 0), -1)
        key = tl.where(nan_key | ~emask, float("-inf"), key)
        idx = tl.zeros([BLOCK_K], tl.int64)
        w = tl.zeros([BLOCK_K], tl.float32)
        for j in tl.static_range(K):
            top_rank = tl.max(rank, axis=0)
            kmax = tl.max(tl.where(rank == top_rank, key, float("-inf")), axis=0)
            hit = (rank == top_rank) & (key == kmax)
            e_j = tl.min(tl.where(hit, offs_e, BLOCK_E), axis=0)
            s_j = tl.sum(tl.where(offs_e == e_j, score, 0.0), axis=0)
            idx = tl.where(offs_k == j, e_j.to(tl.int64), idx)
            w = tl.where(offs_k == j, s_j, w)
            rank = tl.where(offs_e == e_j, -2, rank)
    if NORM:
        total = tl.sum(tl.where(offs_k == 0, w, 0.0), axis=0)
        for j in tl.static_range(1, K):
            total = total + tl.sum(tl.where(offs_k == j, w, 0.0), axis=0)
        w = tl.math.div_rn(w, tl.maximum(total, 1e-20))
    tl.store(idx_ptr + t * K + offs_k, idx, mask=kmask)
    tl.store(w_ptr + t * K + offs_k, w * scale, mask=kmask)


def _check(logits, bias, tid2eid, tokens, k):
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"moe_gate: logits must be fp32/fp64 [T, E], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    T, E = logits.shape
    if not 0 < k <= E:
        raise ValueError(f"moe_gate: k={k} must be in [1, E={E}]")
    if (bias is None) == (tid2eid is None):
        raise ValueError("moe_gate: pass exactly one of bias (top-k layers) and tid2eid (hash "
                         "layers)")
    if bias is not None and (bias.shape != (E,) or not bias.dtype.is_floating_point):
        raise ValueError(f"moe_gate: bias must be a float [{E}] (E from logits), got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if tid2eid is not None and (tid2eid.dim() != 2 or tid2eid.shape[1] != k
                                or tid2eid.dtype != torch.int64):
        raise ValueError(f"moe_gate: tid2eid must be int64 [vocab, k={k}], got {tid2eid.dtype} "
                         f"{tuple(tid2eid.shape)}")
    if tokens.shape != (T,) or tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_gate: tokens must be int32/int64 [{T}] (logits' rows), got "
                         f"{tokens.dtype} {tuple(tokens.shape)}")


def moe_gate_launch(logits, bias, tid2eid, tokens, k, norm_topk, scale):
    _check(logits, bias, tid2eid, tokens, k)
    if logits.dtype == torch.float64:
        return moe_gate_reference(logits, bias, tid2eid, tokens, k, norm_topk, scale)
    T, E = logits.shape
    idx = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, k, dtype=logits.dtype, device=logits.device)
    if T == 0:
        return idx, w
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    hash_layer = tid2eid is not None
    dummy = logits          # the unused table pointer of the other mode: never read
    launch(_moe_gate_kernel)[(T,)](
        logits, dummy if hash_layer else bias.contiguous(),
        tid2eid.contiguous() if hash_layer else dummy, tokens, idx, w, E,
        tid2eid.shape[0] if hash_layer else 0, logits.stride(0), float(scale), K=k,
        HASH=hash_layer, NORM=bool(norm_topk), BLOCK_E=next_pow2(E), BLOCK_K=next_pow2(k),
        num_warps=NUM_WARPS)
    return idx, w


def _moe_gate_fake(logits, bias, tid2eid, tokens, k, norm_topk, scale):
    T = logits.shape[0]
    return (logits.new_empty(T, k, dtype=torch.int64), logits.new_empty(T, k))


@dspark_op("moe_gate", reference=moe_gate_reference, fake=_moe_gate_fake)
def moe_gate(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
             tokens: torch.Tensor, k: int, norm_topk: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_gate_launch(logits, bias, tid2eid, tokens, k, norm_topk, scale)


# SM12x readiness: Flash dims (256 experts, top-6), both modes
_TYPES = dict(logits_ptr="*fp32", bias_ptr="*fp32", tid2eid_ptr="*i64", tokens_ptr="*i64",
              idx_ptr="*i64", w_ptr="*fp32", E="i32:16", V="i32", stride_l="i32:16", scale="fp32")
add_compile_configs("moe_gate", [
    compile_config(_moe_gate_kernel, _TYPES, dict(K=6, HASH=h, NORM=True, BLOCK_E=256, BLOCK_K=8),
                   NUM_WARPS) for h in (False, True)])
