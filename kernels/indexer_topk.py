"""`dspark::indexer_topk`: the C4 lightning indexer's scores and top-k selection in one op.

Per query token t of row b at absolute position P, over the entries j of the row's indexer key
cache k_cache [R, NE, d_i] (compute dtype):

    I(t, j) = sum_h w[t, h] * relu(q[t, h] . k_j)         for visible j < (P + 1) // ratio

and the k = min(topk, NE) entries of highest score, ties broken by the lowest entry index (a
composite key (score desc, index asc): torch.topk promises no order among ties, and exact zero
scores tie often). NaN scores rank above every number (torch's sort order); entries that are
not visible (or of a row outside [0, R): inert) are never selected. The result lists the chosen
entries in ascending index order, -1 in the slots left over when fewer than k are visible:
idx [B, T, k] int64, a fixed shape (capture safe).

Numerics (the reference is the definition): q and k_cache up-cast to the accumulation dtype
(fp32; fp64 for fp64 q), the head sum in it. The kernel's fp32 dot sums in a different order,
so two entries whose scores differ by rounding may swap places at the k-th boundary; exact
arithmetic (integer-valued inputs) gives the reference's selection.

Bytes one call must move (Flash: 64 indexer heads x 128, bf16 keys 256 B per entry): the visible
keys of each row once (its T tokens read the same entries) + q (16 KB per token) + w + the list
(8 B per selected entry). At B = 64 and 8k context: 64 x 2048 x 256 B = 33.6 MB, 7 us at
4.8 TB/s; 32k context: 134 MB, 28 us. The scores are 2 x 64 x 128 = 16 kFLOP per (token,
visible entry): at B = 64, T = 6, 32k that is 51.5 GFLOP, 52 us at ~990 TFLOP/s dense bf16,
above the byte floor however the tokens share the keys (an FP8 indexer, as DeepSeek's, would
halve it); at B = 1 the byte floor (2.1 MB, 0.44 us) and the MMA time (0.8 GFLOP, 0.8 us) are
of the same order.

Kernels (two launches): `_index_scores_kernel`, grid (token, entry chunk), writes the scores of
a chunk of visible entries (dots of all heads against BLOCK_E keys at a time) into an fp32
scratch [B*T, NE] (-inf where not visible; chunks past the visible range exit without reading);
`_topk_select_kernel`, one program per token, finds the k-th largest composite key of the
token's scores by a radix select (4 passes of 8 bits over a monotone 32-bit image of the score)
and writes the selected indices in ascending order (one prefix-sum pass).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import upcast
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.tl_helpers import compile_config, interpreting, launch, next_pow2


def index_scores_reference(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                           rows: torch.Tensor, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """I(t, j) [B, T, NE] in the accumulation dtype; -inf where not visible."""
    B = q.shape[0]
    R, NE = k_cache.shape[:2]
    acc = upcast(q)
    keys = k_cache[rows.clamp(0, R - 1)].to(acc.dtype)                        # [B, NE, d_i]
    logits = torch.relu(torch.einsum("bthd,bnd->bthn", acc, keys))
    score = (logits * weights.to(acc.dtype)[..., None]).sum(2)               # [B, T, NE]
    visible = torch.div(pos + 1, ratio, rounding_mode="floor")[..., None]
    ok = (torch.arange(NE, device=q.device) < visible) & ((rows >= 0) & (rows < R)).view(B, 1, 1)
    return score.masked_fill(~ok, float("-inf"))


def select_topk_reference(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k best entries of score [..., NE] (score desc, index asc; NaN first; -inf never),
    listed in ascending index order, -1 for the slots left over."""
    NE = score.shape[-1]
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = score.gather(-1, order) != float("-inf")
    picked = torch.sort(torch.where(chosen, order, torch.full_like(order, NE)), dim=-1).values
    return torch.where(picked < NE, picked, torch.full_like(picked, -1))


def indexer_topk_reference(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                           rows: torch.Tensor, pos: torch.Tensor, topk: int,
                           ratio: int) -> torch.Tensor:
    """q [B, T, H_i, d_i], weights [B, T, H_i] -> idx [B, T, min(topk, NE)] int64."""
    score = index_scores_reference(q, weights, k_cache, rows, pos, ratio)
    return select_topk_reference(score, min(topk, k_cache.shape[1]))


# ----------------------------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------------------------

SM_COUNT_HINT = 132      # H200: sizes the score grid for the compile configs and CPU plans
TARGET_WAVES = 2
BLOCK_E = 64             # keys per dot: [64 heads x 128] x [128 x 64 keys]
SELECT_BLOCK = 1024      # scores per step of the select passes
NUM_WARPS = 4


@dataclass(frozen=True)
class IndexerTopkPlan:
    """Launch choices of one (tokens, NE) shape: `e_blocks` blocks of `block_e` keys per score
    program (the grid covers ~TARGET_WAVES waves of SMs at the cache's capacity), the select
    kernel's chunk of scores."""
    block_e: int
    e_blocks: int
    select_block: int
    num_warps: int


@functools.lru_cache(maxsize=None)
def indexer_topk_plan(tokens: int, n_entries: int, interpret: bool = False,
                      sm_count: int = SM_COUNT_HINT) -> IndexerTopkPlan:
    if interpret:   # the interpreter pays per operation: small blocks keep the tests' shapes
        return IndexerTopkPlan(16, 2, 64, 4)
    blocks = triton.cdiv(n_entries, BLOCK_E)
    chunks = triton.cdiv(TARGET_WAVES * sm_count, max(tokens, 1))
    return IndexerTopkPlan(BLOCK_E, max(1, triton.cdiv(blocks, chunks)), SELECT_BLOCK, NUM_WARPS)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _visible(rows_ptr, pos_ptr, tok, T, R, NE, ratio):
    """Entries token `tok` may select: min(NE, (P + 1) // ratio); 0 for an inert row."""
    row = tl.load(rows_ptr + tok // T).to(tl.int64)
    P = tl.load(pos_ptr + tok).to(tl.int64)
    ok = (row >= 0) & (row < R) & (P >= 0)
    return row, tl.where(ok, tl.minimum((P + 1) // ratio, NE), 0)


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, rows_ptr, pos_ptr, s_ptr, T, R, NE, HI, ratio,
                         E_BLOCKS, stride_qt, stride_qh, stride_wt, stride_kr, stride_ke,
                         stride_st, DI: tl.constexpr, BLOCK_HI: tl.constexpr,
                         BLOCK_DI: tl.constexpr, BLOCK_E: tl.constexpr, SOFT: tl.constexpr):
    """scores[tok, e] = sum_h w[h] relu(q[h] . k[e]) for the visible e of this program's chunk
    (programs: token fastest, so a row's tokens read a chunk's keys while they are in L2)."""
    tok = tl.program_id(0).to(tl.int64)
    e0 = tl.program_id(1) * (BLOCK_E * E_BLOCKS)
    row, nvis = _visible(rows_ptr, pos_ptr, tok, T, R, NE, ratio)
    if e0 < nvis:
        dt: tl.constexpr = tl.float32 if SOFT else q_ptr.dtype.element_ty
        offs_h = tl.arange(0, BLOCK_HI)
        offs_d = tl.arange(0, BLOCK_DI)
        hm = offs_h < HI
        dm = offs_d < DI
        q = tl.load(q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=hm[:, None] & dm[None, :], other=0.0).to(dt)
        w = tl.load(w_ptr + tok * stride_wt + offs_h, mask=hm, other=0.0).to(tl.float32)
        # only the chunk's blocks that hold visible entries: E_BLOCKS is sized from the cache's
        # capacity, the visible count from this token's position (a short context in a long
        # cache would otherwise run every block's dot for nothing)
        n_blocks = tl.minimum((nvis - e0 + BLOCK_E - 1) // BLOCK_E, E_BLOCKS)
        for b in range(0, n_blocks):
            e = e0 + b * BLOCK_E + tl.arange(0, BLOCK_E)
            em = e < nvis
            k = tl.load(k_ptr + row * stride_kr + e[:, None] * stride_ke + offs_d[None, :],
                        mask=em[:, None] & dm[None, :], other=0.0).to(dt)
            d = tl.dot(q, tl.trans(k), input_precision="ieee")
            logits = tl.where(d < 0.0, 0.0, d)     # relu that keeps NaN, as torch.relu does
            score = tl.sum(logits * w[:, None], 0)
            tl.store(s_ptr + tok * stride_st + e, score, mask=em)


@triton.jit
def _order_key(x):
    """fp32 -> uint32-ordered int64 key: larger float, larger key; -0 == +0; NaN above +inf."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) + 2147483648
    return tl.where(x != x, 4294967295, k)


@triton.jit
def _topk_select_kernel(s_ptr, rows_ptr, pos_ptr, idx_ptr, T, R, NE, ratio, K, stride_st,
                        stride_it, BLOCK: tl.constexpr):
    """The K best visible scores of a token (score desc, index asc), listed ascending, -1 after:
    radix select of the K-th largest key, 8 bits per pass over the token's scores, then one
    pass that writes the chosen indices in order (keys above the threshold, and the first
    `need` entries equal to it)."""
    tok = tl.program_id(0).to(tl.int64)
    _, nvis = _visible(rows_ptr, pos_ptr, tok, T, R, NE, ratio)
    srow = s_ptr + tok * stride_st
    NEG_INF_KEY: tl.constexpr = 8388607   # _order_key(-inf): never selected
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    n_valid = tl.zeros([], tl.int32)
    for c in range(0, nvis, BLOCK):
        u = _order_key(tl.load(srow + c + offs, mask=c + offs < nvis, other=float("-inf")))
        n_valid += tl.sum((u != NEG_INF_KEY).to(tl.int32), 0)
    need = tl.minimum(n_valid, K)
    prefix = tl.zeros([], tl.int64)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], tl.int32)
        for c in range(0, nvis, BLOCK):
            u = _order_key(tl.load(srow + c + offs, mask=c + offs < nvis, other=float("-inf")))
            m = (u != NEG_INF_KEY) & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=m)
        above = tl.cumsum(hist, 0, reverse=True)                  # keys with this digit or more
        d = tl.max(tl.where(above >= need, bins, 0), 0)
        need -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix += d.to(tl.int64) << shift
    # prefix: the K-th largest key; `need` of the entries equal to it are taken, lowest first
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for c in range(0, nvis, BLOCK):
        e = c + offs
        u = _order_key(tl.load(srow + e, mask=e < nvis, other=float("-inf")))
        valid = u != NEG_INF_KEY
        tie = valid & (u == prefix)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - tie.to(tl.int32)
        sel = valid & ((u > prefix) | (tie & (tie_rank < need)))
        at = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(idx_ptr + tok * stride_it + at, e, mask=sel)
        taken += tl.sum(sel.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)
    for c in range(0, K, BLOCK):
        j = c + offs
        tl.store(idx_ptr + tok * stride_it + j, tl.full([BLOCK], -1, tl.int64),
                 mask=(j >= taken) & (j < K))


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

_Q_DTYPES = (torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


def _check(q, weights, k_cache, rows, pos, topk, ratio):
    if q.dim() != 4 or q.dtype not in _Q_DTYPES:
        raise ValueError(f"q must be bf16 / fp32 [B, T, H_i, d_i], got {q.dtype} {tuple(q.shape)}")
    B, T, HI, DI = q.shape
    if weights.shape != (B, T, HI) or not weights.dtype.is_floating_point:
        raise ValueError(f"weights must be float [{B}, {T}, {HI}], got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if k_cache.dim() != 3 or k_cache.shape[2] != DI or k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache must be {q.dtype} [R, NE, {DI}], got {k_cache.dtype} "
                         f"{tuple(k_cache.shape)}")
    if k_cache.stride(2) != 1:
        raise ValueError("k_cache must have a contiguous last dim (it is the cache as stored)")
    if rows.shape != (B,) or rows.dtype not in _INT_DTYPES:
        raise ValueError(f"rows must be int [{B}], got {rows.dtype} {tuple(rows.shape)}")
    if pos.shape != (B, T) or pos.dtype not in _INT_DTYPES:
        raise ValueError(f"pos must be int [{B}, {T}], got {pos.dtype} {tuple(pos.shape)}")
    if topk < 1 or ratio < 1:
        raise ValueError(f"topk ({topk}) and ratio ({ratio}) must be >= 1")


def indexer_topk_launch(q, weights, k_cache, rows, pos, topk, ratio,
                        plan: IndexerTopkPlan | None = None):
    """The Triton path (fp64 runs the reference). `plan` overrides indexer_topk_plan (tests)."""
    if q.dtype == torch.float64:
        return indexer_topk_reference(q, weights, k_cache, rows, pos, topk, ratio)
    _check(q, weights, k_cache, rows, pos, topk, ratio)
    B, T, HI, DI = q.shape
    R, NE = k_cache.shape[:2]
    K = min(topk, NE)
    idx = torch.empty((B * T, K), dtype=torch.int64, device=q.device)
    if B * T == 0:
        return idx.view(B, T, K)
    q3 = q.reshape(B * T, HI, DI)
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    w2 = weights.reshape(B * T, HI).contiguous()
    pos1 = pos.reshape(-1)
    scores = torch.empty((B * T, NE), dtype=torch.float32, device=q.device)
    sk = _index_scores_kernel
    p = plan or indexer_topk_plan(B * T, NE, interpreting(sk))
    chunk = p.block_e * p.e_blocks
    launch(sk)[(B * T, triton.cdiv(NE, chunk))](
        q3, w2, k_cache, rows, pos1, scores, T, R, NE, HI, ratio, p.e_blocks, q3.stride(0),
        q3.stride(1), w2.stride(0), k_cache.stride(0), k_cache.stride(1), scores.stride(0),
        DI=DI, BLOCK_HI=max(16, next_pow2(HI)), BLOCK_DI=max(16, next_pow2(DI)),
        BLOCK_E=p.block_e, SOFT=interpreting(sk), num_warps=p.num_warps)
    tk = _topk_select_kernel
    launch(tk)[(B * T,)](scores, rows, pos1, idx, T, R, NE, ratio, K, scores.stride(0),
                         idx.stride(0), BLOCK=p.select_block, num_warps=p.num_warps)
    return idx.view(B, T, K)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _indexer_topk_fake(q, weights, k_cache, rows, pos, topk, ratio):
    return q.new_empty((*q.shape[:2], min(topk, k_cache.shape[1])), dtype=torch.int64)


@dspark_op("indexer_topk", reference=indexer_topk_reference, fake=_indexer_topk_fake)
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 rows: torch.Tensor, pos: torch.Tensor, topk: int, ratio: int) -> torch.Tensor:
    return indexer_topk_launch(q, weights, k_cache, rows, pos, topk, ratio)


# SM12x readiness: Flash (64 indexer heads x 128, bf16 q and keys, fp32 weights, top-512);
# the cache's entry count (max_seq_len / 4) and what derives from it need not be 16-aligned.
_D16 = "i32:16"
_FLASH_PLAN = indexer_topk_plan(6, 8192)
add_compile_configs("indexer_topk", [
    compile_config(_index_scores_kernel, dict(
        q_ptr="*bf16", w_ptr="*fp32", k_ptr="*bf16", rows_ptr="*i64", pos_ptr="*i64",
        s_ptr="*fp32", T="i32", R="i32", NE="i32", HI=_D16, ratio="i32", E_BLOCKS="i32",
        stride_qt=_D16, stride_qh=_D16, stride_wt=_D16, stride_kr=_D16, stride_ke=_D16,
        stride_st="i32"),
        dict(DI=128, BLOCK_HI=64, BLOCK_DI=128, BLOCK_E=_FLASH_PLAN.block_e, SOFT=False),
        _FLASH_PLAN.num_warps),
    compile_config(_topk_select_kernel, dict(
        s_ptr="*fp32", rows_ptr="*i64", pos_ptr="*i64", idx_ptr="*i64", T="i32", R="i32",
        NE="i32", ratio="i32", K="i32", stride_st="i32", stride_it="i32"),
        dict(BLOCK=_FLASH_PLAN.select_block), _FLASH_PLAN.num_warps),
])
