"""`dspark::linear`: the float GEMMs of the step (LM head, BF16Linear, the MoE router), ours.

y = x W^T, W [N, K] in its stored dtype (bf16), accumulated in the compute dtype's accumulator
(fp32 for bf16 compute, the dtype itself for fp32 / fp64), rounded once to `out_dtype`. bf16
compute multiplies bf16 x by bf16 W: every product is exact in fp32, so an fp32 result (the
LM head's logits, the router's and the indexer's fp32 scores) is the fp32 sum of exact products,
and the kernel differs from the reference only in the order of that sum.

Why not cuBLAS: cuBLAS picks its algorithm (tile, split-K, reduction) by M, so a row's logits
in a 6-token verify step and in a 1-token target-only step differ in the last bits, and greedy
decoding flips at near-ties. This kernel fixes every output's K order by (N, K)
(kernels/fp8_linear.py `split_k`, the same plans as the FP8 GEMM): a row's bits do not depend
on the batch (tests/kernels/test_batch_invariance.py). The CPU reference is batch invariant as
well (kernels/common.py `row_matmul`).

Bytes one call must move: N K 2 (the weight) + M K 2 + M N 4 (fp32 out). The Flash LM head
(129,280 x 4,096 bf16) is 1.06 GB, 221 us at 4.8 TB/s, at every decode M; a router (256 x
4,096) 2 MB, an indexer weights_proj (64 x 4,096) 0.5 MB.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import row_matmul
from dspark_compile.kernels.fp8_linear import (
    INVARIANT_TILES, SM_COUNT_HINT, SMEM_BUDGET, TILES, _acc_dtype, _finish_tile, invariant_tile,
    m_bucket, smem_budget, split_k, split_k_buffers, split_k_sum)
from dspark_compile.kernels.invariance import batch_invariant
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.tl_helpers import compile_config, interpreting, launch, round_to

BLOCK_K = 128
OFFSET_LIMIT = 2 ** 31 - 1      # outputs a launch may address (int32 offsets, _finish_tile)


def linear_reference(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T for compute dtype `dtype` -> [..., N] in `out_dtype`: 16-bit
    compute rounds x to w's dtype first (the GEMM's operand), then both operands are widened to
    the accumulator exactly and summed in it."""
    acc = _acc_dtype(dtype)
    a = x.to(w.dtype) if acc != dtype else x
    return row_matmul(a.to(acc), w.to(acc).T).to(out_dtype)


def linear_plan(M: int, N: int, K: int, w_bytes: int, sm_count: int = SM_COUNT_HINT,
                invariant: bool = True, interpret: bool = False, smem: int = SMEM_BUDGET):
    """(block_m, block_n, swap_ab, split, kb_per_split, num_warps, num_stages): the FP8 GEMM's
    tiles for M (an INVARIANT_TILES one when invariant, kernels/fp8_linear.py says why), its
    split of K (by (N, K) when invariant), stages within the `smem` bytes (the device's,
    fp8_linear.smem_budget) that w_bytes-wide operands leave."""
    block_m, block_n, swap, warps, stages = (invariant_tile(M, interpret) if invariant else
                                             TILES[m_bucket(M)])
    split, per = split_k(M, N, triton.cdiv(K, BLOCK_K), block_m, block_n, sm_count, invariant)
    return block_m, block_n, swap, split, per, warps, _stages(block_m, block_n, w_bytes, stages,
                                                               smem)


def _stages(block_m, block_n, w_bytes, stages, smem: int = SMEM_BUDGET):
    """Pipeline depth within `smem` bytes: a stage holds an x tile and a weight tile of
    BLOCK_K."""
    return max(1, min(stages, smem // (BLOCK_K * (block_m + block_n) * w_bytes) - 1))


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, SPLIT_K, KB_PER_SPLIT,
                   stride_xm, stride_wn, stride_ps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, NUM_STAGES: tl.constexpr,
                   FOLD: tl.constexpr, SOFT: tl.constexpr):
    """One (N tile, M tile, K split): the split's K blocks in order into an fp32 accumulator;
    SWAP_AB computes (W x^T) so N fills the MMA's wide side. The output and a split's partials
    are fp8_linear's (_finish_tile: y [M, N] rounded once; split K: fp32 partials p [S, M, N]
    summed in split order by the tile's last program with FOLD, else by _splitk_sum_kernel)."""
    # M tiles fastest: the programs sharing a weight tile run together (one HBM read)
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask, nmask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    kb_lo = pid_s * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in tl.range(kb_lo, kb_hi, num_stages=NUM_STAGES):
        k0 = kb * BLOCK_K
        kmask = (k0 + offs_k) < K
        a = tl.load(x_rows + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_rows + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if SOFT:                           # the interpreter's bf16 dot is wrong; exact widening
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        else:
            b = b.to(a.dtype)              # fp32 compute: the bf16 weight widened exactly
        if SWAP_AB:
            acc += tl.dot(b, tl.trans(a), input_precision="ieee", out_dtype=tl.float32)
        else:
            acc += tl.dot(a, tl.trans(b), input_precision="ieee", out_dtype=tl.float32)
    if SWAP_AB:
        acc = tl.trans(acc)
    _finish_tile(acc, y_ptr, p_ptr, cnt_ptr + pid_m + pid_n * tl.num_programs(0), pid_m, pid_n,
                 pid_s, M, N, SPLIT_K, stride_ps, BLOCK_M, BLOCK_N, FOLD, SOFT)


_X_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _check(x, w, out_dtype):
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"w must be a float [N, K] tensor, got {w.dtype} {tuple(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} must equal w's K = {w.shape[1]}")
    if not x.dtype.is_floating_point or not out_dtype.is_floating_point:
        raise ValueError(f"x and out_dtype must be float, got {x.dtype} and {out_dtype}")


def linear_launch(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
                  out_dtype: torch.dtype, plan: tuple | None = None) -> torch.Tensor:
    """The Triton path for bf16 compute (bf16 operands) and fp32 compute (fp32 x, the weight
    widened in registers); fp64 and other dtypes run the reference. `plan`: linear_plan's
    tuple for this M (benchmarks' A/B variants; None: linear_plan's choice)."""
    _check(x, w, out_dtype)
    acc = _acc_dtype(dtype)
    a = x.to(w.dtype) if acc != dtype else x
    if out_dtype not in _OUT_DTYPES or a.dtype not in _X_DTYPES or \
            (a.dtype == torch.float32) != (acc == dtype == torch.float32):
        return linear_reference(x, w, dtype, out_dtype)
    N, K = w.shape
    x2 = a.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    # the tiles address outputs with int32 offsets (fp8_linear._finish_tile): row chunks under
    # 2^31 elements; a row's bits do not depend on its chunk (the plans are batch invariant)
    rows = max(1, OFFSET_LIMIT // max(N, 1))
    for m0 in range(0, M, rows):
        _launch(x2[m0:m0 + rows], w, y[m0:m0 + rows], plan)
    return y.reshape(*x.shape[:-1], N)


def _launch(x2: torch.Tensor, w: torch.Tensor, y: torch.Tensor, plan: tuple | None) -> None:
    """y [M, N] (contiguous) = x2 [M, K] w^T: one launch, two where the split-K sum cannot be
    folded (fp8_linear.split_k_buffers)."""
    (M, K), N = x2.shape, w.shape[0]
    if not (M and N):
        return
    kernel = _linear_kernel
    bm, bn, swap, split, per, warps, stages = plan or linear_plan(
        M, N, K, max(x2.element_size(), w.element_size()), invariant=batch_invariant(),
        interpret=interpreting(kernel), smem=smem_budget(x2.device))
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    part, cnt, fold = split_k_buffers(y, split, grid[0] * grid[1])
    launch(kernel)[grid](
        x2, w, y, part, cnt, M, N, K, split, per, x2.stride(0), w.stride(0), M * N,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, SWAP_AB=swap, NUM_STAGES=stages, FOLD=fold,
        SOFT=interpreting(kernel), num_warps=warps)
    if split > 1 and not fold:
        split_k_sum(part, y)


def _linear_fake(x, w, dtype, out_dtype):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype)


@dspark_op("linear", reference=linear_reference, fake=_linear_fake)
def linear(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
           out_dtype: torch.dtype) -> torch.Tensor:
    return linear_launch(x, w, dtype, out_dtype)


# SM12x readiness: every tile (M buckets' and the invariant ones), bf16 operands into bf16 / fp32
# outputs, fp32 operands into fp32; the split-K sum folded or not.
_D16 = "i32:16"
for _bm, _bn, _swap, _warps, _st in sorted(set(TILES.values()) | set(INVARIANT_TILES.values())):
    for (_xt, _wt, _yt), _fold in ((r, f) for r in (("*bf16", "*bf16", "*bf16"),
                                                    ("*bf16", "*bf16", "*fp32"),
                                                    ("*fp32", "*bf16", "*fp32"))
                                   for f in (True, False)):
        _stg = _stages(_bm, _bn, 2 if _xt == "*bf16" else 4, _st)
        add_compile_configs("linear", [compile_config(
            _linear_kernel,
            dict(x_ptr=_xt, w_ptr=_wt, y_ptr=_yt, p_ptr="*fp32", cnt_ptr="*i32", M="i32",
                 N="i32", K=_D16, SPLIT_K="i32", KB_PER_SPLIT="i32", stride_xm=_D16,
                 stride_wn=_D16, stride_ps="i32"),
            dict(BLOCK_M=_bm, BLOCK_N=_bn, BLOCK_K=BLOCK_K, SWAP_AB=_swap, NUM_STAGES=_stg,
                 FOLD=_fold, SOFT=False), _warps)])
