"""`dspark::fp8_linear`: the W8A8 block-scaled GEMM of every FP8 linear (and the grouped `wo_a`).

y = x W^T with x FP8 e4m3 [M, G*K] + one UE8M0 scale per token per 128-group (fp32 powers of
two, exactly what act_quant / rmsnorm_quant / swiglu_quant produce), W FP8 e4m3 [N, K] + one
UE8M0 byte per 128 x 128 block (E8M0 bytes, models/linear.py E8M0_STORAGE), fp32 accumulation
(fp64 in exact mode), scales applied per K block of 128, output in `out_dtype`. `groups` G > 1
is the grouped `wo_a` einsum: group g multiplies x[:, gK:(g+1)K] by W rows [gN/G, (g+1)N/G) into
y[:, gN/G:(g+1)N/G]. `x_s=None`: x is already a float activation (Precision.act_quant off), the
weight alone is FP8 (W8A16).

Numerics (the reference is the definition): dequantize x (`fp8_group_dequant`) and W
(`fp8_block_dequant`) to the accumulation dtype, matmul (einsum over the groups), round to
`out_dtype`. Every fp8 x fp8 product and every power-of-two scaling is exact in fp32, so the
kernel -- per K block one dot (fp32 accumulator), times the token scale and the weight scale,
added in fp32 -- differs from the reference only in summation order. On Hopper an fp8 dot's
inner accumulation is narrower than fp32 (about 14 significant bits, DeepSeek-V3 §3.3.2; the
per-128 promotion into the fp32 accumulator bounds it to 4 MMA K-steps, as DeepGEMM does). That
is far below a bf16 output's own rounding (2^-8), but it breaks an fp32 step's agreement with
the reference (the H200 GPU test at wq_b's K = 1024 and the fp32 lossless runs saw it), so fp32
outputs take the plan's `fp8_mma=False` path: both e4m3 operands widened to bf16 in registers
(exact), a bf16 MMA with fp32 accumulation; the weight bytes read are the same.

Bytes one call must move at Flash dims (dspark_compile/factory/presets.py FLASH_0731 / FLASH_SLICE: hidden 4096,
q_lora 1024, heads 64 x 512, o_groups 8 x o_lora 1024, indexer 64 x 128, shared expert 2048,
draft main_proj 3 x 4096): N*K weight bytes + N*K/16384 scale bytes + M*K (x) + M*K/32 (x scales)
+ M*N*2 (bf16 y). At M = 6 (B = 1 verify rows):

    (N, K)          use                               weight MB   at 4.8 TB/s (H200 peak)
    (1024, 4096)    wq_a                              4.19        0.87 us
    (32768, 1024)   wq_b                              33.6        7.0 us
    (512, 4096)     wkv                               2.10        0.44 us
    (8192, 1024)    indexer wq_b                      8.39        1.75 us
    (8192, 4096)    wo_a (8 groups of 1024 x 4096)    33.6        7.0 us
    (4096, 8192)    wo_b                              33.6        7.0 us
    (2048, 4096)    shared w1 / w3                    8.39        1.75 us
    (4096, 2048)    shared w2                         8.39        1.75 us
    (4096, 12288)   draft main_proj                   50.3        10.5 us

Activations and output add about 1 % at M = 6 (wq_b: 6 KB in, 393 KB out); at M = 384 up to
75 % (wq_b's 25 MB bf16 output), and there the FP8 MMA time (2MNK: 26 GFLOP for wq_b, ~13 us at
the H200's ~2 PFLOP/s dense FP8) is of the same order as the bytes.

The plan (`fp8_linear_plan`) streams W once: few tokens, so tiles are narrow in M (16) with the
product computed as (W x^T) (SWAP_AB: N fills the MMA's wide side, the tokens its narrow one)
and K split over programs until the grid covers ~2 waves of SMs; partial sums go to an fp32
workspace and the last program of each output tile (an atomic tile counter,
kernels/semaphores.py) sums them in split order, in the same launch: deterministic, since the
atomic only elects who sums, never the order. `fold_splitk=False` keeps the former second
launch (`_splitk_sum_kernel`), bit for bit the same result.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import cached_decode, fp8_group_dequant, row_matmul
from dspark_compile.kernels.invariance import batch_invariant
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.semaphores import tile_counters
from dspark_compile.kernels.tl_helpers import (
    compile_config, exp2_int, interpreting, launch, round_to)

GROUP = 128                 # activation group and weight block edge
SM_COUNT_HINT = 132         # H200: sizes split-K for the compile configs and CPU plans
TARGET_WAVES = 2            # programs per SM the split-K aims for (hides one tile's latency)
MIN_KB_PER_SPLIT = 4        # K blocks of 128 per split: below this the workspace traffic dominates
SMEM_BUDGET = 96 * 1024     # SM12x allows 99 KB a block; the epilogue's layout change needs a few
# The pipeline's budget by compute capability major where a block may take more: sm_90 / sm_100
# allow 227 KB. Under 96 KB the LM head's 128-token tile (48 KB a stage) ran ONE stage on the
# H100 too (gemm_tiles_cases.py). Stages change no bits: the K order is the loop's.
SMEM_BUDGETS = {9: 200 * 1024, 10: 200 * 1024}


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def smem_budget(device) -> int:
    """The shared memory a GEMM's stages may take on `device` (CPU / interpreter: SMEM_BUDGET,
    the plans of the compile configs and the CPU tests)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None:
        return SMEM_BUDGET
    index = device.index if device.index is not None else torch.cuda.current_device()
    return SMEM_BUDGETS.get(_capability_major(index), SMEM_BUDGET)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    return torch.exp2(b.view(torch.uint8).to(torch.float32) - 127.0)


def block_dequant(w: torch.Tensor, w_s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [N, K] * 2^(byte - 127) per 128 x 128 block (models/quant_formats.fp8_block_dequant)."""
    N, K = w.shape
    s = _e8m0_to_float(w_s).repeat_interleave(GROUP, 0)[:N].repeat_interleave(GROUP, 1)[:, :K]
    return (w.float() * s).to(dtype)


def fp8_linear_reference(x: torch.Tensor, x_s: torch.Tensor | None, w: torch.Tensor,
                         w_s: torch.Tensor, groups: int, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., G*K] (fp8 with x_s [..., G*K/128], or float with x_s None) -> [..., N]."""
    acc = _acc_dtype(out_dtype)
    a = fp8_group_dequant(x, x_s, GROUP) if x_s is not None else x
    a = a.to(acc)
    nbytes = w.numel() * torch.empty((), dtype=acc).element_size()
    wd = cached_decode((w, w_s), ("fp8 block", acc), nbytes,
                       lambda: (block_dequant(w, w_s, acc),))
    wd = wd[0] if wd is not None else block_dequant(w, w_s, acc)
    if groups == 1:
        return row_matmul(a, wd.T).to(out_dtype)
    lead, N = a.shape[:-1], w.shape[0]
    a3 = a.reshape(-1, groups, a.shape[-1] // groups)
    w3 = wd.view(groups, N // groups, -1)
    y = torch.stack([row_matmul(a3[:, g], w3[g].T) for g in range(groups)], 1)
    return y.reshape(*lead, N).to(out_dtype)


# ----------------------------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fp8LinearPlan:
    """Launch choices of one (M bucket, N, K, groups) shape.

    block_m x block_n output tiles, K in blocks of 128; `split_k` programs share a tile's K
    range (kb_per_split blocks each) and write fp32 partials, summed in split order by the
    tile's last program (`fold_splitk`: one launch, kernels/semaphores.py's tile counters) or
    by a second launch, `_splitk_sum_kernel` (same bits; the benchmark times both); `swap_ab`
    computes the tile as (W x^T) so the weight rows fill the MMA's M side; `fp8_mma`
    multiplies fp8 x fp8 on the tensor cores (narrow inner accumulation, see the module
    docstring), else bf16 x bf16 from the exactly widened fp8 values (fp32 outputs)."""
    block_m: int
    block_n: int
    swap_ab: bool
    split_k: int
    kb_per_split: int
    num_warps: int
    num_stages: int
    fp8_mma: bool = True
    # the sum launch was 60 of a step's 113 GEMM launches at B = 1 on the H200 (131 us of 490)
    fold_splitk: bool = True


# M bucket -> (block_m, block_n, swap_ab, num_warps, num_stages at 1-byte activations).
# Decode rows (M <= 16) stream the weight; larger M reuses each weight tile over more rows.
TILES = {16: (16, 64, True, 4, 4), 32: (32, 64, False, 4, 4), 64: (64, 128, False, 8, 3)}
M_BUCKETS = tuple(TILES)
# The batch-invariant tiles: always (W x^T) with 64 weight rows on the MMA's M side (Hopper's
# wgmma at every token count; an unswapped tile under 64 rows is Ampere's mma, whose partial
# sums round differently), the tokens on its N side, so a token count only widens the
# instruction's N and an output's products are summed by the same instruction in the same K
# order. Wider token tiles re-read the weight fewer times: at M = 384 (B = 64 verify rows) the
# 16-token tile alone streamed the 1.06 GB LM head 24 times (h200_lossless_2026-12-04).
INVARIANT_TILES = {16: TILES[16], 32: (32, 64, True, 4, 4), 64: (64, 64, True, 4, 4),
                   128: (128, 64, True, 4, 3)}


def m_bucket(M: int) -> int:
    return next((b for b in M_BUCKETS if M <= b), M_BUCKETS[-1])


def _stages(block_m, block_n, a_bytes, stages, smem: int = SMEM_BUDGET):
    """Pipeline depth within `smem` bytes: a stage holds an x tile and a weight tile of 128 K."""
    per_stage = GROUP * (block_m * a_bytes + block_n)
    return max(1, min(stages, smem // per_stage - 1))


def invariant_tile(M: int, interpret: bool = False) -> tuple:
    """The batch-invariant tile for M tokens (INVARIANT_TILES). The interpreter's dots are
    numpy GEMMs whose sums follow the tile's shape: there every M takes the 16-token tile."""
    return INVARIANT_TILES[16 if interpret else
                           next((b for b in INVARIANT_TILES if M <= b), max(INVARIANT_TILES))]


@functools.lru_cache(maxsize=None)
def fp8_linear_plan(M: int, N: int, K: int, groups: int = 1, a_bytes: int = 1,
                    sm_count: int = SM_COUNT_HINT, fp32_out: bool = False,
                    invariant: bool = True, interpret: bool = False,
                    smem: int = SMEM_BUDGET) -> Fp8LinearPlan:
    """The plan for x [M, groups*K] (a_bytes per element) times W [N, K] into a bf16 output
    (fp32 with `fp32_out`). M is the step's static token count (one exported bucket), so each
    linear of a bucket has one plan. `invariant` (kernels/invariance.py): the split of K is
    sized for one 16-token tile whatever M, and the tile is an INVARIANT_TILES one, so an
    output's sum order and instructions depend on (N, K) alone. `smem`: the device's stage
    budget (smem_budget)."""
    n_group = N // groups
    if invariant:
        block_m, block_n, swap, warps, stages = invariant_tile(M, interpret)
        if groups > 1 and n_group % block_n:
            raise ValueError(f"fp8_linear: groups of {n_group} rows fit no tile of "
                             f"{INVARIANT_TILES}")
        split, per = split_k(M, N, K // GROUP, block_m, block_n, sm_count, invariant)
        return Fp8LinearPlan(block_m, block_n, swap, split, per, warps,
                             _stages(block_m, block_n, a_bytes, stages, smem),
                             fp8_mma=a_bytes == 1 and not fp32_out)
    # a tile must not straddle two groups: the largest bucket's tile at most M's whose block_n
    # divides the group (only declared tiles, so every launch has a compile config)
    fits = [b for b in M_BUCKETS
            if b <= m_bucket(M) and (groups == 1 or n_group % TILES[b][1] == 0)]
    if not fits:
        raise ValueError(f"fp8_linear: groups of {n_group} rows fit no tile of {TILES}")
    block_m, block_n, swap, warps, stages = TILES[fits[-1]]
    split, per = split_k(M, N, K // GROUP, block_m, block_n, sm_count, invariant)
    return Fp8LinearPlan(block_m, block_n, swap, split, per, warps,
                         _stages(block_m, block_n, a_bytes, stages, smem),
                         fp8_mma=a_bytes == 1 and not fp32_out)


def split_k(M: int, N: int, kb: int, block_m: int, block_n: int, sm_count: int,
            invariant: bool) -> tuple[int, int]:
    """(splits, K blocks per split) of a GEMM with `kb` K blocks: split until the grid covers
    TARGET_WAVES of the SMs, at least MIN_KB_PER_SPLIT blocks a split. Batch invariant: the
    grid is counted for one 16-token tile whatever M, so the split, and with it every output's
    sum order, follows (N, K) alone."""
    if invariant:
        tiles = triton.cdiv(N, INVARIANT_TILES[16][1])
    else:
        tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split = max(1, min(kb // MIN_KB_PER_SPLIT, triton.cdiv(TARGET_WAVES * sm_count, tiles)))
    per = triton.cdiv(kb, split)
    return triton.cdiv(kb, per), per


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _e8m0_scale(b):
    """E8M0 byte -> fp32 2^(b - 127): the byte is the fp32 exponent field; 0 is the subnormal
    2^-127 (bits 0x400000) and 255 gives inf, as the reference's exp2(b - 127) does."""
    bits = tl.where(b == 0, 0x400000, b.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_load(ptrs, mask, SOFT: tl.constexpr):
    """e4m3 bytes -> float8e4nv on a GPU; decoded to fp32 under the interpreter, whose fp8
    conversion turns the NaN byte (0x7F / 0xFF) into a finite number."""
    b = tl.load(ptrs, mask=mask, other=0)
    if SOFT:
        e = ((b >> 3) & 0xF).to(tl.int32)
        m = (b & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * exp2_int(e - 10))   # 2^-9 subnormal
        mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
        return tl.where((b & 0x80) != 0, -mag, mag)
    else:
        return b.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fp8_tile(x_ptr, xs_ptr, w_ptr, ws_ptr, pid_m, pid_n, pid_s, M, N, K, N_GROUP, KB_PER_SPLIT,
              stride_xm, stride_xsm, stride_wn, stride_wsn, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, A_FP8: tl.constexpr, SWAP_AB: tl.constexpr,
              NUM_STAGES: tl.constexpr, FP8_MMA: tl.constexpr, SOFT: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] sum of output tile (pid_m, pid_n) over split pid_s's K blocks
    (every GEMM kernel of this op and of fp8_linear_multi runs this body)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    mmask, nmask = offs_m < M, offs_n < N
    # the group of this tile (tiles never straddle groups): its x columns start at g * K
    g = (pid_n * BLOCK_N) // N_GROUP
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + g * K + offs_k[None, :]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    xs_rows = xs_ptr + offs_m.to(tl.int64) * stride_xsm + g * (K // 128)
    ws_rows = ws_ptr + (offs_n // 128) * stride_wsn
    kb_lo = pid_s * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, K // 128)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in tl.range(kb_lo, kb_hi, num_stages=NUM_STAGES):
        k0 = kb * 128
        b = _fp8_load(w_rows + k0, nmask[:, None], SOFT)
        sw = _e8m0_scale(tl.load(ws_rows + kb, mask=nmask, other=127))
        if A_FP8:
            a = _fp8_load(x_rows + k0, mmask[:, None], SOFT)
            sa = tl.load(xs_rows + kb, mask=mmask, other=0.0)
            if not FP8_MMA and not SOFT:    # e4m3 -> bf16 is exact; bf16 MMAs sum in fp32
                a = a.to(tl.bfloat16)
                b = b.to(tl.bfloat16)
        else:   # W8A16: fp8 -> the activation's dtype is exact; fp32 dots stay IEEE (no tf32)
            a = tl.load(x_rows + k0, mask=mmask[:, None], other=0.0)
            if SOFT:    # the interpreter's bf16 dot is wrong; bf16 -> fp32 is exact
                a = a.to(tl.float32)
            b = b.to(a.dtype)   # exact: fp8 (or its fp32 decode) fits bf16 and fp32
            sa = tl.full((BLOCK_M,), 1.0, tl.float32)
        if SWAP_AB:
            d = tl.dot(b, tl.trans(a), input_precision="ieee")
            acc += (d * sa[None, :]) * sw[:, None]
        else:
            d = tl.dot(a, tl.trans(b), input_precision="ieee")
            acc += (d * sa[:, None]) * sw[None, :]
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _finish_tile(acc, y_ptr, p_ptr, cnt_ptr, pid_m, pid_n, pid_s, M, N, SPLIT_K, stride_ps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FOLD: tl.constexpr,
                 SOFT: tl.constexpr):
    """One split: y = acc rounded once. Split K: acc is partial pid_s of the tile, stored to
    p[pid_s] (fp32 [S, M, N], row stride N like y's). FOLD: the tile's last program to count
    on its counter (cnt_ptr) sums p[0..S-1] in split order from zeros, exactly as
    _splitk_sum_kernel does (-0.0 partials give +0.0 there too), rounds once into y and sets
    the counter back to 0 for the next launch; without FOLD _splitk_sum_kernel does that."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    # int32 offsets (M * N < 2^31, the launcher checks): a tile of int64 pointers held through
    # the sum loop cost 50 more registers at the 64 x 64 tile
    rows = offs_m[:, None] * N + offs_n[None, :]
    dt = y_ptr.dtype.element_ty
    if SPLIT_K == 1:
        tl.store(y_ptr + rows, round_to(acc, dt, SOFT).to(dt), mask=mask)
    else:
        tl.store(p_ptr + pid_s.to(tl.int64) * stride_ps + rows, acc, mask=mask)
        if FOLD:
            # every thread's partial is stored before the one atomic (issued by one thread)
            # releases them at GPU scope; the last program acquires every other program's
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                tot = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                p_split = p_ptr
                for s in tl.range(0, SPLIT_K, num_stages=1):
                    # .cg: from L2, never a line an earlier launch left in this SM's L1
                    tot += tl.load(p_split + rows, mask=mask, other=0.0, cache_modifier=".cg")
                    p_split += stride_ps
                tl.store(y_ptr + rows, round_to(tot, dt, SOFT).to(dt), mask=mask)
                tl.store(cnt_ptr, 0)


@triton.jit
def _fp8_linear_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, N_GROUP,
                       SPLIT_K, KB_PER_SPLIT, stride_xm, stride_xsm, stride_wn, stride_wsn,
                       stride_ps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       A_FP8: tl.constexpr, SWAP_AB: tl.constexpr, NUM_STAGES: tl.constexpr,
                       FP8_MMA: tl.constexpr, FOLD: tl.constexpr, SOFT: tl.constexpr):
    # M tiles are the grid's fastest axis: the programs sharing a weight tile run together
    # and read it from HBM once (L2 serves the others)
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    acc = _fp8_tile(x_ptr, xs_ptr, w_ptr, ws_ptr, pid_m, pid_n, pid_s, M, N, K, N_GROUP,
                    KB_PER_SPLIT, stride_xm, stride_xsm, stride_wn, stride_wsn, BLOCK_M, BLOCK_N,
                    A_FP8, SWAP_AB, NUM_STAGES, FP8_MMA, SOFT)
    _finish_tile(acc, y_ptr, p_ptr, cnt_ptr + pid_m + pid_n * tl.num_programs(0), pid_m, pid_n,
                 pid_s, M, N, SPLIT_K, stride_ps, BLOCK_M, BLOCK_N, FOLD, SOFT)


@triton.jit
def _splitk_sum_kernel(p_ptr, y_ptr, MN, S, stride_ps, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    """y = sum over s = 0..S-1 of p[s] (fp32, in split order), rounded once to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(S):
        acc += tl.load(p_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    dt = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs, round_to(acc, dt, SOFT).to(dt), mask=mask)


SUM_BLOCK = 1024


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

_A16_DTYPES = (torch.bfloat16, torch.float32)   # W8A16 activations the kernel takes
_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _check(x, x_s, w, w_s, groups):
    """Shape and dtype errors name the argument; returns (x2 [M, G*K], xs2, M, N, K per group)."""
    if w.dim() != 2 or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w must be float8_e4m3fn [N, K], got {w.dtype} {tuple(w.shape)}")
    N, K = w.shape
    if K % GROUP or groups < 1 or N % groups:
        raise ValueError(f"w [N={N}, K={K}]: K must be a multiple of {GROUP} and N of "
                         f"groups={groups}")
    want_s = (triton.cdiv(N, GROUP), K // GROUP)
    if tuple(w_s.shape) != want_s or w_s.element_size() != 1:
        raise ValueError(f"w_s must be E8M0 bytes {want_s}, got {w_s.dtype} {tuple(w_s.shape)}")
    if x.shape[-1] != groups * K:
        raise ValueError(f"x.shape[-1] = {x.shape[-1]} must be groups * K = {groups * K}")
    x2 = x.reshape(-1, groups * K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xs2 = None
    if x_s is not None:
        if x.dtype != torch.float8_e4m3fn or x_s.dtype != torch.float32 or \
                x_s.shape != (*x.shape[:-1], groups * K // GROUP):
            raise ValueError(f"x must be float8_e4m3fn with fp32 x_s [..., {groups * K // GROUP}]"
                             f", got {x.dtype} {tuple(x.shape)} and {x_s.dtype} "
                             f"{tuple(x_s.shape)}")
        xs2 = x_s.reshape(-1, groups * K // GROUP)
    return x2, xs2, x2.shape[0], N, K


def split_k_buffers(y: torch.Tensor, split: int, tiles: int, fold: bool = True):
    """(partials, counters, folded) of one launch of `tiles` output tiles into y [M, N] whose
    programs end in _finish_tile: fp32 partials [split, M, N] (empty without a split); the
    tiles' counters when the launch folds its split-K sum (split > 1 and `fold`), else an empty
    int32 tensor it never reads -- also while a CUDA graph captures on a device whose counter
    ring does not exist yet (kernels/semaphores.py): then split_k_sum sums."""
    M, N = y.shape
    cnt = tile_counters(y.device, tiles) if split > 1 and fold else None
    part = torch.empty((split, M, N), dtype=torch.float32, device=y.device) if split > 1 \
        else y.new_empty(0, dtype=torch.float32)
    if cnt is None:
        return part, y.new_empty(0, dtype=torch.int32), False
    return part, cnt, True


def split_k_sum(part: torch.Tensor, y: torch.Tensor) -> None:
    """The second launch of a split launch that did not fold: the partials in split order into
    y, rounded once (the folded sum's bits)."""
    sk = _splitk_sum_kernel
    MN = y.numel()
    launch(sk)[(triton.cdiv(MN, SUM_BLOCK),)](part, y, MN, part.shape[0], part.stride(0),
                                              BLOCK=SUM_BLOCK, SOFT=interpreting(sk), num_warps=4)


def check_offsets(M: int, N: int) -> None:
    """The kernels address an output tile with int32 offsets (_finish_tile)."""
    if M * N >= 2 ** 31:
        raise ValueError(f"fp8_linear: x rows M = {M} times w rows N = {N} must stay under "
                         f"2^31 (int32 output offsets)")


def fp8_linear_launch(x, x_s, w, w_s, groups, out_dtype, plan: Fp8LinearPlan | None = None):
    """The Triton path; fp64 (exact mode) and W8A16 activations it has no kernel for (other
    than bf16 / fp32 in the output's dtype) run the reference. `plan` overrides
    fp8_linear_plan (tests, the benchmark's two-launch variant)."""
    a16_ok = x.dtype in _A16_DTYPES and x.dtype == out_dtype
    if out_dtype not in _OUT_DTYPES or (x_s is None and not a16_ok):
        return fp8_linear_reference(x, x_s, w, w_s, groups, out_dtype)
    x2, xs2, M, N, K = _check(x, x_s, w, w_s, groups)
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M and N:
        kernel = _fp8_linear_kernel
        a_fp8 = xs2 is not None
        p = plan or fp8_linear_plan(M, N, K, groups, 1 if a_fp8 else x2.element_size(),
                                    fp32_out=out_dtype == torch.float32,
                                    invariant=batch_invariant(), interpret=interpreting(kernel),
                                    smem=smem_budget(x.device))
        if p.split_k * p.kb_per_split < K // GROUP or (groups > 1 and (N // groups) % p.block_n):
            raise ValueError(f"fp8_linear: {p} does not cover K = {K} / groups of {N // groups}")
        check_offsets(M, N)
        grid = (triton.cdiv(M, p.block_m), triton.cdiv(N, p.block_n), p.split_k)
        part, cnt, fold = split_k_buffers(y, p.split_k, grid[0] * grid[1], p.fold_splitk)
        xs_arg = xs2 if a_fp8 else w_s              # unused without A_FP8; any pointer
        launch(kernel)[grid](
            x2.view(torch.uint8) if a_fp8 else x2, xs_arg, w.view(torch.uint8),
            w_s.view(torch.uint8), y, part, cnt, M, N, K, N // groups, p.split_k,
            p.kb_per_split, x2.stride(0), xs_arg.stride(0), w.stride(0), w_s.stride(0), M * N,
            BLOCK_M=p.block_m, BLOCK_N=p.block_n, A_FP8=a_fp8, SWAP_AB=p.swap_ab,
            NUM_STAGES=p.num_stages, FP8_MMA=a_fp8 and p.fp8_mma, FOLD=fold,
            SOFT=interpreting(kernel), num_warps=p.num_warps)
        if p.split_k > 1 and not fold:
            split_k_sum(part, y)
    return y.reshape(*x.shape[:-1], N)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _fp8_linear_fake(x, x_s, w, w_s, groups, out_dtype):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype)


@dspark_op("fp8_linear", reference=fp8_linear_reference, fake=_fp8_linear_fake)
def fp8_linear(x: torch.Tensor, x_s: torch.Tensor | None, w: torch.Tensor, w_s: torch.Tensor,
               groups: int, out_dtype: torch.dtype) -> torch.Tensor:
    return fp8_linear_launch(x, x_s, w, w_s, groups, out_dtype)


# SM12x readiness: every tile of TILES with each activation type and each output the launcher
# writes there: fp8 / bf16 activations in a bf16 step (fp8 MMAs), fp8 / fp32 ones in fp32
# compute (bf16 MMAs); split-K partials are fp32 whatever the output. Each with the folded
# sum (the default) and without it (the two-launch path: benchmarks, capture before the
# counters exist), and the split-K sum launch into each output.
_D16 = "i32:16"   # K, N, strides: multiples of 16 at every model shape (the JIT specialises them)
_RUNS = [("*u8", "*bf16", True, True), ("*u8", "*fp32", True, False),
         ("*bf16", "*bf16", False, False), ("*fp32", "*fp32", False, False)]


def gemm_compile_types(x_type: str, y_type: str, a_fp8: bool) -> dict:
    """The Triton types of _fp8_tile's runtime arguments, shared by this op's kernel and
    fp8_linear_multi's."""
    return dict(x_ptr=x_type, xs_ptr="*fp32" if a_fp8 else "*u8", p_ptr="*fp32", cnt_ptr="*i32",
                M="i32", K=_D16, stride_xm=_D16, stride_xsm="i32")


for _bm, _bn, _swap, _warps, _st in sorted(set(TILES.values()) | set(INVARIANT_TILES.values())):
    for (_xt, _yt, _a8, _f8), _fold in ((r, f) for r in _RUNS for f in (True, False)):
        _ab = 1 if _a8 else int(_xt[-2:]) // 8
        add_compile_configs("fp8_linear", [compile_config(
            _fp8_linear_kernel,
            dict(gemm_compile_types(_xt, _yt, _a8), w_ptr="*u8", ws_ptr="*u8", y_ptr=_yt,
                 N=_D16, N_GROUP=_D16, SPLIT_K="i32", KB_PER_SPLIT="i32", stride_wn=_D16,
                 stride_wsn="i32", stride_ps="i32"),
            dict(BLOCK_M=_bm, BLOCK_N=_bn, A_FP8=_a8, SWAP_AB=_swap,
                 NUM_STAGES=_stages(_bm, _bn, _ab, _st), FP8_MMA=_f8, FOLD=_fold, SOFT=False),
            _warps)])
for _yt in ("*bf16", "*fp32"):
    add_compile_configs("fp8_linear", [compile_config(
        _splitk_sum_kernel, dict(p_ptr="*fp32", y_ptr=_yt, MN="i32", S="i32", stride_ps="i32"),
        dict(BLOCK=SUM_BLOCK, SOFT=False), 4)])
