"""`dspark::sparse_attention`: one layer's attention of a step's tokens over its KV candidates.

Per query token t of row b at absolute position P, for each of the H heads (MQA: one latent of
D = NOPE + ROPE dims is both key and value), the candidates are

- the SWA window: positions p in (P - window, P], p >= 0, read from ring slot p % ring of the
  row's SWA cache (the ring holds window + max_step_tokens slots, so each slot is named once);
- on compressed layers (ratio > 0) the compressed entries j < (P + 1) // ratio of the row's
  compressed cache: every visible one (C128, `cmp_idx` None) or the entries the indexer listed
  (C4, `cmp_idx` [B, T, K], -1 = no entry; an entry outside [0, visible) never counts);

    s_e = (q_h . K_e) * scale,  o_h = sum_e exp(s_e - m) K_e / (sum_e exp(s_e - m) + exp(sink_h - m))

(m the max over the candidates and the sink: the sink is in the denominator only; a row with no
valid candidate gets o = 0). `rows` maps batch row -> cache row; a row outside [0, R) is inert
(o = 0, nothing read). Caches are read as stored: fp8_ds_mla style (e4m3 nope [R, n, NOPE], one
E8M0 exponent byte per 64 nope dims [R, n, NOPE/64], bf16 rope [R, n, ROPE]) or a float cache
[R, n, D] (`*_scale` and `*_rope` None: Precision.kv_fp8 off).

Numerics (the reference is the definition): candidates dequantized to the accumulation dtype
(fp32; fp64 for fp64 q), scores and the softmax in it, o rounded once to q's dtype. Masked
candidates contribute exactly 0 (their bytes are never part of the result, NaN included); NaN in
q or in a valid candidate makes that head's o NaN, as the softmax does.

Bytes one call must move (Flash: H = 64, D = 512 = 448 + 64, 583 B per cached entry = 448 fp8 +
7 scale + 128 rope; bf16 q and o 64 KB each per token): q + o + the entries visited. The SWA and
C128 candidates of a row's T tokens overlap (the window slides by one per token), so a row's
floor holds the union: (window + T - 1) SWA entries + (P + 1) // 128 C128 entries, read once; C4
adds the union of its tokens' top-k lists (<= T * 512 entries) plus the lists (8 B per entry).
At B = 64, T = 6, C4 at 8k context (lists of random visible entries: ~1685 distinct per row):
64 x (6 x 128 KB + (133 + 1685) x 583 B) + lists = 120 MB, 25 us at 4.8 TB/s.

The MMA work is 2 x 2 x H x D = 131 kFLOP per (token, candidate): at that shape 384 tokens x
640 candidates = 32 GFLOP, 33 us at the H200's ~990 TFLOP/s dense bf16, above the byte floor;
SWA-only layers (128 candidates) 6.4 GFLOP against 50 MB (q + o), C128 at 32k (384) 19 GFLOP
against 65 MB. The byte target holds where B * T is small; at B = 64 the MMA rate bounds it.

Kernel: one program per (head block, token, split) takes BLOCK_H = 32 heads of the token as the
MMA's rows (64 heads with their 512-wide fp32 accumulator need more than SM12x's 99 KB of shared
memory; the two head blocks of a token are neighbours in launch order, so the second reads the
candidates from L2) and runs an online softmax over blocks of BLOCK_N candidates, SWA blocks
first, then compressed ones; each block's fp8 bytes are dequantized in registers (byte *
2^(e - 127) per 64 dims, exact in bf16), never through a cache-sized temporary. When the grid would
leave the GPU idle (few tokens, long candidate lists) the blocks are split over programs
(`SparseAttentionPlan.split`); each split writes its (max, denominator, numerator) partial in
fp32 and one combine launch merges them in split order (deterministic: no atomics). The sink
enters split 0 only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import e8m0_byte_to_scale, upcast
from dspark_compile.kernels.invariance import batch_invariant
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.tl_helpers import (
    compile_config, interpreting, launch, next_pow2, round_to)

KV_GROUP = 64            # nope dims per E8M0 scale byte (kernels/qkv_postprocess.KV_QUANT_GROUP)


def _dequant(kv, scale, rope, r, j, acc):
    """Cache rows kv[r, j] (r, j broadcast) dequantized to [..., D] in `acc`."""
    if scale is None:
        return kv[r, j].to(acc)
    nope = kv[r, j].to(torch.float32)
    s = e8m0_byte_to_scale(scale[r, j])
    nope = (nope.unflatten(-1, (-1, KV_GROUP)) * s.unsqueeze(-1)).flatten(-2)
    return torch.cat((nope, rope[r, j].to(torch.float32)), -1).to(acc)


def swa_candidates(pos: torch.Tensor, window: int, ring: int):
    """(slots [B, T, window], valid [B, T, window]) of the SWA window of each query position."""
    p = pos[..., None] - (window - 1) + torch.arange(window, device=pos.device)
    return torch.remainder(p, ring), p >= 0


def compressed_candidates(pos: torch.Tensor, cmp_idx, n_entries: int, ratio: int):
    """(entries [B, T, K] or [1, 1, NE], valid [B, T, K or NE]): C4 the listed entries, C128
    every entry; valid when visible ((P + 1) // ratio of them) and inside the cache."""
    visible = torch.div(pos + 1, ratio, rounding_mode="floor")[..., None]
    if cmp_idx is None:
        j = torch.arange(n_entries, device=pos.device).view(1, 1, -1)
        return j, j < visible
    j = cmp_idx.to(torch.int64)
    return j.clamp(0, n_entries - 1), (j >= 0) & (j < n_entries) & (j < visible)


def sparse_attention_reference(q: torch.Tensor, swa_kv: torch.Tensor, swa_scale, swa_rope,
                               cmp_kv, cmp_scale, cmp_rope, cmp_idx, rows: torch.Tensor,
                               pos: torch.Tensor, sink: torch.Tensor, scale: float, window: int,
                               ratio: int) -> torch.Tensor:
    """q [B, T, H, D] -> o [B, T, H, D] in q.dtype (module docstring)."""
    B, T, H, _ = q.shape
    acc = upcast(q)
    R, ring = swa_kv.shape[:2]
    row_ok = ((rows >= 0) & (rows < R)).view(B, 1, 1)
    r = rows.clamp(0, R - 1).view(B, 1, 1)
    slot, ok = swa_candidates(pos, window, ring)
    keys, masks = [_dequant(swa_kv, swa_scale, swa_rope, r, slot, acc.dtype)], [ok & row_ok]
    if ratio:
        j, ok = compressed_candidates(pos, cmp_idx, cmp_kv.shape[1], ratio)
        k = _dequant(cmp_kv, cmp_scale, cmp_rope, r, j, acc.dtype)
        keys.append(k.expand(B, T, *k.shape[2:]))
        masks.append(ok & row_ok)
    ok = torch.cat(masks, -1)                                             # [B, T, n]
    k = torch.cat(keys, -2).masked_fill(~ok[..., None], 0.0)             # [B, T, n, D]
    s = torch.einsum("bthd,btnd->bthn", acc, k) * scale
    s = s.masked_fill(~ok[:, :, None, :], float("-inf"))
    sink_col = sink.to(acc.dtype).view(1, 1, H, 1).expand(B, T, H, 1)
    p = torch.softmax(torch.cat((s, sink_col), -1), -1)[..., :-1]
    return torch.einsum("bthn,btnd->bthd", p, k).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------------------------

SM_COUNT_HINT = 132      # H200: sizes the split for the compile configs and CPU plans
TARGET_WAVES = 2         # programs per SM the split aims for
# Candidate blocks per chunk (batch-invariant plans). A program takes ~10 µs a block of 32
# candidates whatever the load (H100, 2026-12-06, kernels.csv in benchmarks/results/
# h100_attention_2026-12-06: 4 blocks 40 µs at B = 1, 260 µs for 6 waves of them at B = 64),
# so a token's blocks run one after another unless the chunks spread them over programs. With
# 2 blocks a chunk, B = 1 (12 programs of heads x tokens) runs SWA's 4 blocks as 24 programs of
# 2 and C4's 20 as 120 of 2 plus the combine, against 12 of 4 (SWA) and 60 of 4 (C4) with the
# 4-block chunks of before: 40.5 -> 29.8 µs (SWA), 52.9 -> 45.5 µs (C4) at 8k context (H200,
# same run; 1-block chunks: 24.0 / 71.2). When the tokens alone fill the GPU the programs merge
# their chunks in registers, one merge a chunk.
CHUNK_BLOCKS = 2
MIN_BLOCKS_PER_SPLIT = 4  # batch-dependent plans: candidate blocks per split
# 32 heads x (448 + 64) dims per program: sm_120 cross-compile with 8 warps, 32 candidates a
# block and 2 stages: 75 KB shared memory, no spills (64 heads: 99-132 KB, over SM12x's 99 KB)
BLOCK_H, BLOCK_N, NUM_WARPS, NUM_STAGES = 32, 32, 8, 2
COMBINE_HEADS = 16       # heads per combine program (16 x 512 fp32 partials per split)
COMBINE_STAGES = 3       # the combine's split loads in flight


@dataclass(frozen=True)
class SparseAttentionPlan:
    """Launch choices of one (tokens, heads, candidate capacity) shape: BLOCK_H heads and
    BLOCK_N candidates per MMA tile; a token's candidate blocks in chunks of `chunk` blocks,
    each chunk an online softmax of its own, the chunks merged in order. `split`: one program
    per chunk writing its partial (a combine launch merges them), else one program merges all
    chunks in registers; both merge the same partials with the same formula (`_merge`), so the
    choice, made by the token count, does not change a bit. The chunks follow the capacity."""
    block_h: int
    block_n: int
    chunk: int
    split: bool
    num_warps: int
    num_stages: int


def n_blocks(plan: SparseAttentionPlan, window: int, n_compressed: int) -> int:
    """Candidate blocks of a token at most: the window's, then the compressed capacity's."""
    return triton.cdiv(window, plan.block_n) + triton.cdiv(n_compressed, plan.block_n)


@functools.lru_cache(maxsize=None)
def sparse_attention_plan(tokens: int, heads: int, n_candidates: int, interpret: bool = False,
                          sm_count: int = SM_COUNT_HINT,
                          invariant: bool = True) -> SparseAttentionPlan:
    """`n_candidates`: the most candidates a token can have (window + the compressed list or
    cache capacity): static, so every launch of a bucket's layer has one plan. Chunks of
    CHUNK_BLOCKS blocks; the split (bit-neutral) follows the token count: taken while the
    tokens leave most SMs idle, or while the split grid fits TARGET_WAVES of them.
    `invariant` False (kernels/invariance.py) sizes the chunks for the token count instead (one
    token's chunks fill ~TARGET_WAVES of the SMs, at least MIN_BLOCKS_PER_SPLIT blocks each), as
    the benchmark's batch-dependent variant."""
    if interpret:   # the interpreter pays per operation: big tiles, one chunk unless asked
        return SparseAttentionPlan(max(16, next_pow2(heads)), 16, 1 << 20, False, 4, 1)
    block_h = min(BLOCK_H, max(16, next_pow2(heads)))
    n_hb = triton.cdiv(heads, block_h)
    blocks = triton.cdiv(n_candidates, BLOCK_N)
    if invariant:
        chunk = CHUNK_BLOCKS
    else:
        n_chunks = max(1, min(blocks // MIN_BLOCKS_PER_SPLIT,
                              triton.cdiv(TARGET_WAVES * sm_count, max(tokens * n_hb, 1))))
        chunk = triton.cdiv(blocks, n_chunks)
    programs, n_chunks = tokens * n_hb, triton.cdiv(blocks, chunk)
    # split while the tokens leave most SMs idle, or while the split grid still fits the waves
    # (each split program stores a 66 KB fp32 partial that the combine reads back: at B = 16,
    # SWA's 384 split programs took 98.7 µs against 84.0 for 192 programs of 4 blocks; H200)
    split = n_chunks > 1 and (2 * programs < sm_count
                              or programs * n_chunks <= TARGET_WAVES * sm_count)
    return SparseAttentionPlan(block_h, BLOCK_N, chunk, split, NUM_WARPS, NUM_STAGES)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634   # scores and the sink in base 2 (exp2 in the kernel)


@triton.jit
def _fp8_to_f32(b, SOFT: tl.constexpr):
    """e4m3 bytes -> fp32 (software decode under the interpreter, whose fp8 cast is inexact)."""
    if SOFT:
        e = ((b >> 3) & 0xF).to(tl.int32)
        m = (b & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * ((e + 117) << 23).to(tl.float32,
                                                                                  bitcast=True))
        mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
        return tl.where((b & 0x80) != 0, -mag, mag)
    else:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _load_block(nope_ptr, scale_ptr, rope_ptr, ent, ok, stride_n, stride_s, stride_r,
                FP8: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr, SOFT: tl.constexpr):
    """Entries `ent` [BLOCK_N] of one cache, dequantized in registers: (nope [BN, BLOCK_NOPE],
    rope [BN, BLOCK_R]) fp32, 0 where not `ok` (masked lanes read nothing)."""
    offs_d = tl.arange(0, BLOCK_NOPE)
    offs_r = tl.arange(0, BLOCK_R)
    mn = ok[:, None] & (offs_d[None, :] < NOPE)
    mr = ok[:, None] & (offs_r[None, :] < ROPE)
    if FP8:
        b = tl.load(nope_ptr + ent[:, None] * stride_n + offs_d[None, :], mask=mn, other=0)
        e = tl.load(scale_ptr + ent[:, None] * stride_s + (offs_d // 64)[None, :], mask=mn,
                    other=127)
        # 2^(e - 127) from the exponent bits; 0 is the subnormal 2^-127, as exp2 gives it
        sc = tl.where(e == 0, 0x400000, e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        kn = _fp8_to_f32(b, SOFT) * sc
    else:
        kn = tl.load(nope_ptr + ent[:, None] * stride_n + offs_d[None, :], mask=mn,
                     other=0.0).to(tl.float32)
    kr = tl.load(rope_ptr + ent[:, None] * stride_r + offs_r[None, :], mask=mr,
                 other=0.0).to(tl.float32)
    return kn, kr


@triton.jit
def _attend(q_n, q_r, m, l, acc_n, acc_r, kn, kr, ok, qk_scale, Q_DT: tl.constexpr,
            DOT_DT: tl.constexpr, SOFT: tl.constexpr):
    """One online-softmax step (base 2) over a block of candidates. Scores are dots of DOT_DT
    operands (q's dtype on a GPU; the dequantized cache values are exact in bf16), p is rounded
    to q's dtype for the PV product (FlashAttention's convention), sums in fp32. DOT_DT is fp32
    under the interpreter (its bf16 dot is wrong): the same products, exact in fp32."""
    kn_d = kn.to(DOT_DT)
    kr_d = kr.to(DOT_DT)
    s = tl.dot(q_n, tl.trans(kn_d), input_precision="ieee")
    s += tl.dot(q_r, tl.trans(kr_d), input_precision="ieee")
    s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    p_d = round_to(p, Q_DT, SOFT).to(DOT_DT)
    acc_n = acc_n * alpha[:, None] + tl.dot(p_d, kn_d, input_precision="ieee")
    acc_r = acc_r * alpha[:, None] + tl.dot(p_d, kr_d, input_precision="ieee")
    return m_new, l, acc_n, acc_r


@triton.jit
def _swa_entries(blk, P, row, row_ok, window, RING, BLOCK_N: tl.constexpr):
    """Block `blk` of the SWA window: (flat cache entries, valid). Candidate c is position
    P - window + 1 + c, at ring slot position % RING."""
    c = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    p_c = P - window + 1 + c
    ok = (c < window) & (p_c >= 0) & row_ok
    return row * RING + tl.where(ok, p_c, 0) % RING, ok


@triton.jit
def _cmp_entries(blk, idx_row, row, n_c, visible, NE, K, CMP: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Block `blk` of the compressed candidates: (flat cache entries, valid). C128 (CMP 1):
    entries 0 .. n_c - 1; C4 (CMP 2): the list's entries, valid when in [0, min(NE, visible))."""
    c = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    if CMP == 1:
        e = c.to(tl.int64)
        ok = c < n_c
    else:
        e = tl.load(idx_row + c, mask=c < K, other=-1).to(tl.int64)
        ok = (e >= 0) & (e < NE) & (e < visible)
    return row * NE + tl.where(ok, e, 0), ok


@triton.jit
def _store_o(o_rows, acc_n, acc_r, l, hm, NOPE: tl.constexpr, ROPE: tl.constexpr,
             BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr, SOFT: tl.constexpr):
    """o = acc / l, rounded once to o's dtype."""
    dt = o_rows.dtype.element_ty
    offs_d = tl.arange(0, BLOCK_NOPE)
    offs_r = tl.arange(0, BLOCK_R)
    tl.store(o_rows + offs_d[None, :], round_to(acc_n / l[:, None], dt, SOFT).to(dt),
             mask=hm[:, None] & (offs_d[None, :] < NOPE))
    tl.store(o_rows + NOPE + offs_r[None, :], round_to(acc_r / l[:, None], dt, SOFT).to(dt),
             mask=hm[:, None] & (offs_r[None, :] < ROPE))


@triton.jit
def _store_partial(w_rows, acc_n, acc_r, m, l, hm, NOPE: tl.constexpr, ROPE: tl.constexpr,
                   BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr):
    """One chunk's (numerator | m | l) per head in fp32. A chunk past the token's last block
    stores its empty state (zeros, m = -1e30, l = 0), which the merge leaves without effect,
    exactly as the in-register merge does."""
    offs_d = tl.arange(0, BLOCK_NOPE)
    offs_r = tl.arange(0, BLOCK_R)
    tl.store(w_rows + offs_d[None, :], acc_n, mask=hm[:, None] & (offs_d[None, :] < NOPE))
    tl.store(w_rows + NOPE + offs_r[None, :], acc_r, mask=hm[:, None] & (offs_r[None, :] < ROPE))
    two = tl.arange(0, 2)[None, :]
    tl.store(w_rows + NOPE + ROPE + two, tl.where(two == 0, m[:, None], l[:, None]),
             mask=hm[:, None])


@triton.jit
def _sparse_attention_kernel(
        q_ptr, o_ptr, ws_ptr, sink_ptr, rows_ptr, pos_ptr, idx_ptr,
        swn_ptr, sws_ptr, swr_ptr, cn_ptr, cs_ptr, cr_ptr,
        T, H, R, RING, NE, K, window, ratio, qk_scale, CHUNK, N_CHUNKS,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_it,
        sw_n, sw_s, sw_r, c_n, c_s, c_r,
        FP8: tl.constexpr, CMP: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_NOPE: tl.constexpr,
        BLOCK_R: tl.constexpr, NUM_STAGES: tl.constexpr, SOFT: tl.constexpr):
    """Program (head block, token, split): head blocks of a token, then the tokens of a row,
    are neighbours in launch order, so their shared candidates come from L2. CMP: 0 SWA only,
    1 every visible compressed entry (C128), 2 the listed entries (C4). With a split (grid axis 2
    = N_CHUNKS) program sp takes chunk sp and writes its fp32 partial (acc | m | l per head) to
    ws [N_CHUNKS, tokens, H, NOPE + ROPE + 2]; otherwise it merges the N_CHUNKS chunks itself and
    writes o (one compiled kernel for both: the branch is per program)."""
    hb = tl.program_id(0)
    tok = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    SPLIT = tl.num_programs(2)
    Q_DT: tl.constexpr = q_ptr.dtype.element_ty
    DOT_DT: tl.constexpr = tl.float32 if SOFT else Q_DT
    row = tl.load(rows_ptr + tok // T).to(tl.int64)
    P = tl.load(pos_ptr + tok).to(tl.int64)
    row_ok = (row >= 0) & (row < R)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs_h < H
    offs_d = tl.arange(0, BLOCK_NOPE)
    offs_r = tl.arange(0, BLOCK_R)
    q_rows = q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh
    q_n = tl.load(q_rows + offs_d[None, :], mask=hm[:, None] & (offs_d[None, :] < NOPE),
                  other=0.0).to(DOT_DT)
    q_r = tl.load(q_rows + NOPE + offs_r[None, :], mask=hm[:, None] & (offs_r[None, :] < ROPE),
                  other=0.0).to(DOT_DT)
    sink = tl.load(sink_ptr + offs_h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
    visible = tl.where(row_ok & (P >= 0), (P + 1) // ratio, 0)   # compressed entries visible
    if CMP == 1:
        n_c = tl.minimum(visible, NE)
    elif CMP == 2:
        n_c = K + 0 * visible
    else:
        n_c = 0 * visible
    nb_swa = tl.cdiv(window, BLOCK_N)
    n_blocks = nb_swa + tl.cdiv(n_c, BLOCK_N)
    # chunk c: blocks [c CHUNK, (c + 1) CHUNK); every program of a split takes one chunk, one
    # without a split all of them, merging each into (big, den, num) as the combine does
    c_lo = tl.where(SPLIT == 1, 0, sp)
    c_hi = tl.where(SPLIT == 1, N_CHUNKS, sp + 1)
    big = tl.full([BLOCK_H], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    num_n = tl.zeros([BLOCK_H, BLOCK_NOPE], tl.float32)
    num_r = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for c in range(c_lo, c_hi):
        # the sink is one more softmax term (value 0) in chunk 0 only; the other chunks start
        # from a finite -1e30 so that exp2(m - m_new) is 1, not NaN, while they see nothing
        m = tl.where(c == 0, sink, -1.0e30)
        l = tl.where(c == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
        acc_n = tl.zeros([BLOCK_H, BLOCK_NOPE], tl.float32)
        acc_r = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, n_blocks)
        for blk in tl.range(lo, tl.minimum(hi, nb_swa), num_stages=NUM_STAGES):
            ent, ok = _swa_entries(blk, P, row, row_ok, window, RING, BLOCK_N)
            kn, kr = _load_block(swn_ptr, sws_ptr, swr_ptr, ent, ok, sw_n, sw_s, sw_r, FP8, NOPE,
                                 ROPE, BLOCK_NOPE, BLOCK_R, SOFT)
            m, l, acc_n, acc_r = _attend(q_n, q_r, m, l, acc_n, acc_r, kn, kr, ok, qk_scale,
                                         Q_DT, DOT_DT, SOFT)
        for blk in tl.range(tl.maximum(lo, nb_swa), hi, num_stages=NUM_STAGES):
            ent, ok = _cmp_entries(blk - nb_swa, idx_ptr + tok * stride_it, row, n_c, visible,
                                   NE, K, CMP, BLOCK_N)
            kn, kr = _load_block(cn_ptr, cs_ptr, cr_ptr, ent, ok, c_n, c_s, c_r, FP8, NOPE, ROPE,
                                 BLOCK_NOPE, BLOCK_R, SOFT)
            m, l, acc_n, acc_r = _attend(q_n, q_r, m, l, acc_n, acc_r, kn, kr, ok, qk_scale,
                                         Q_DT, DOT_DT, SOFT)
        if SPLIT == 1:
            big, den, a, b = _merge_weights(big, den, m, l)
            num_n = num_n * a[:, None] + acc_n * b[:, None]
            num_r = num_r * a[:, None] + acc_r * b[:, None]
        else:
            W: tl.constexpr = NOPE + ROPE + 2
            _store_partial(ws_ptr + ((sp * tl.num_programs(1) + tok) * H + offs_h[:, None]) * W,
                           acc_n, acc_r, m, l, hm, NOPE, ROPE, BLOCK_NOPE, BLOCK_R)
    if SPLIT == 1:
        _store_o(o_ptr + tok * stride_ot + offs_h[:, None] * stride_oh, num_n, num_r, den, hm,
                 NOPE, ROPE, BLOCK_NOPE, BLOCK_R, SOFT)


@triton.jit
def _merge_weights(big, den, m, l):
    """Merge a chunk's (max m, denominator l) into the running (big, den): the new running
    pair and the weights a, b of the running and the chunk's numerators (num a + acc b). One
    function for the kernel's in-register merge and the combine's, so both round alike."""
    new = tl.maximum(big, m)
    a = tl.exp2(big - new)
    b = tl.exp2(m - new)
    return new, den * a + l * b, a, b


@triton.jit
def _combine_kernel(ws_ptr, o_ptr, H, SPLIT, stride_ot, stride_oh, D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, COMBINE_STAGES: tl.constexpr,
                    SOFT: tl.constexpr):
    """o = num / den after merging the chunks' partials in chunk order (`_merge_weights`)."""
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    W: tl.constexpr = D + 2
    stride_s = tl.num_programs(0) * H * W
    rows = ws_ptr + (tok * H + offs_h) * W
    big = tl.full([BLOCK_H], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    num = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # the splits' loads pipelined (10 splits of C4 at B = 1 otherwise wait one load each);
    # merged in split order, as the in-register merge does
    for s in tl.range(0, SPLIT, num_stages=COMBINE_STAGES):
        m = tl.load(rows + s * stride_s + D, mask=hm, other=-1.0e30)
        l = tl.load(rows + s * stride_s + D + 1, mask=hm, other=0.0)
        acc = tl.load(rows[:, None] + s * stride_s + offs_d[None, :],
                      mask=hm[:, None] & (offs_d[None, :] < D), other=0.0)
        big, den, a, b = _merge_weights(big, den, m, l)
        num = num * a[:, None] + acc * b[:, None]
    dt = o_ptr.dtype.element_ty
    o = round_to(num / tl.where(hm, den, 1.0)[:, None], dt, SOFT).to(dt)   # chunk 0 has l >= 1
    tl.store(o_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], o,
             mask=hm[:, None] & (offs_d[None, :] < D))


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

_Q_DTYPES = (torch.bfloat16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


def _cache_views(name, kv, scale, rope, R, D):
    """(nope, scale, rope) 2-D [R*n, width] views of one cache + (fp8, NOPE, ROPE); raises
    naming the argument when the layout is not the one the caches are stored in."""
    if kv.dim() != 3 or kv.shape[0] != R:
        raise ValueError(f"{name}_kv must be [R={R}, n, width], got {tuple(kv.shape)}")
    n = kv.shape[1]
    if scale is None:
        if rope is not None or kv.shape[2] != D or not kv.dtype.is_floating_point:
            raise ValueError(f"{name}: a float cache is {name}_kv [R, n, D={D}] with "
                             f"{name}_scale and {name}_rope None")
        flat = kv.view(R * n, D)
        return (flat, flat, flat), False, D, 0
    nope = kv.shape[2]
    if kv.dtype != torch.float8_e4m3fn or nope % KV_GROUP:
        raise ValueError(f"{name}_kv must be float8_e4m3fn [R, n, 64k], got {kv.dtype} "
                         f"{tuple(kv.shape)}")
    for arg, t, w, dt in (("scale", scale, nope // KV_GROUP, torch.uint8),
                          ("rope", rope, D - nope, torch.bfloat16)):
        if t is None or t.shape != (R, n, w) or t.dtype != dt:
            raise ValueError(f"{name}_{arg} must be {dt} [{R}, {n}, {w}], got "
                             f"{None if t is None else (t.dtype, tuple(t.shape))}")
    views = (kv.view(torch.uint8).view(R * n, nope), scale.view(R * n, nope // KV_GROUP),
             rope.view(R * n, D - nope))
    return views, True, nope, D - nope


def _check(q, swa, cmp, cmp_idx, rows, pos, sink, window, ratio):
    if q.dim() != 4 or q.dtype not in _Q_DTYPES:
        raise ValueError(f"q must be bf16 / fp32 [B, T, H, D], got {q.dtype} {tuple(q.shape)}")
    B, T, H, D = q.shape
    if rows.shape != (B,) or rows.dtype not in _INT_DTYPES:
        raise ValueError(f"rows must be int [{B}], got {rows.dtype} {tuple(rows.shape)}")
    if pos.shape != (B, T) or pos.dtype not in _INT_DTYPES:
        raise ValueError(f"pos must be int [{B}, {T}], got {pos.dtype} {tuple(pos.shape)}")
    if sink.shape != (H,):
        raise ValueError(f"sink must be [{H}], got {tuple(sink.shape)}")
    R = swa[0].shape[0]
    sw, fp8, nope, rope = _cache_views("swa", *swa, R, D)
    if not 0 < window <= swa[0].shape[1]:
        raise ValueError(f"window={window} must be in (0, ring={swa[0].shape[1]}]")
    cv = sw
    if ratio:
        if cmp[0] is None:
            raise ValueError(f"ratio={ratio} needs the compressed cache (cmp_kv)")
        cv, cfp8, _, _ = _cache_views("cmp", *cmp, R, D)
        if cfp8 != fp8:
            raise ValueError("swa and cmp caches must both be FP8 or both float")
    if cmp_idx is not None and (not ratio or cmp_idx.dim() != 3 or cmp_idx.shape[:2] != (B, T)
                                or cmp_idx.dtype not in _INT_DTYPES):
        raise ValueError(f"cmp_idx must be int [{B}, {T}, K] on a compressed layer, got "
                         f"{cmp_idx.dtype} {tuple(cmp_idx.shape)} with ratio={ratio}")
    return sw, cv, fp8, nope, rope


def sparse_attention_launch(q, swa_kv, swa_scale, swa_rope, cmp_kv, cmp_scale, cmp_rope, cmp_idx,
                            rows, pos, sink, scale, window, ratio,
                            plan: SparseAttentionPlan | None = None):
    """The Triton path (fp64 runs the reference: exact-precision mode has no kernel). `plan`
    overrides sparse_attention_plan (tests)."""
    if q.dtype == torch.float64:
        return sparse_attention_reference(q, swa_kv, swa_scale, swa_rope, cmp_kv, cmp_scale,
                                          cmp_rope, cmp_idx, rows, pos, sink, scale, window, ratio)
    sw, cv, fp8, nope, rope = _check(q, (swa_kv, swa_scale, swa_rope),
                                     (cmp_kv, cmp_scale, cmp_rope), cmp_idx, rows, pos, sink,
                                     window, ratio)
    B, T, H, D = q.shape
    q3 = q.reshape(B * T, H, D)
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    o = torch.empty((B * T, H, D), dtype=q.dtype, device=q.device)
    if B * T == 0 or H == 0:
        return o.view(B, T, H, D)
    mode = 0 if not ratio else (1 if cmp_idx is None else 2)
    NE = cmp_kv.shape[1] if ratio else 1
    K = cmp_idx.shape[2] if mode == 2 else 0
    kernel = _sparse_attention_kernel
    soft = interpreting(kernel)
    p = plan or sparse_attention_plan(B * T, H, window + (K if mode == 2 else NE if mode else 0),
                                      soft, invariant=batch_invariant())
    n_hb = triton.cdiv(H, p.block_h)
    n_chunks = triton.cdiv(n_blocks(p, window, K if mode == 2 else NE if mode else 0), p.chunk)
    split = n_chunks if p.split and n_chunks > 1 else 1
    ws = torch.empty((split, B * T, H, D + 2) if split > 1 else (1,), dtype=torch.float32,
                     device=q.device)
    idx = cmp_idx.reshape(B * T, -1) if mode == 2 else rows
    block_d = next_pow2(nope)
    launch(kernel)[(n_hb, B * T, split)](
        q3, o, ws, sink, rows, pos.reshape(-1), idx, *sw, *cv, T, H, swa_kv.shape[0],
        swa_kv.shape[1], NE, K, window, max(ratio, 1),
        float(scale) * LOG2E, p.chunk, n_chunks, q3.stride(0), q3.stride(1), o.stride(0),
        o.stride(1), idx.stride(0), *(t.stride(0) for t in sw), *(t.stride(0) for t in cv),
        FP8=fp8, CMP=mode, NOPE=nope, ROPE=rope, BLOCK_H=p.block_h, BLOCK_N=p.block_n,
        BLOCK_NOPE=block_d, BLOCK_R=max(16, next_pow2(rope)),
        NUM_STAGES=p.num_stages, SOFT=soft, num_warps=p.num_warps)
    if split > 1:
        ck = _combine_kernel
        launch(ck)[(B * T, triton.cdiv(H, COMBINE_HEADS))](
            ws, o, H, split, o.stride(0), o.stride(1), D=D, BLOCK_H=COMBINE_HEADS,
            BLOCK_D=next_pow2(D), COMBINE_STAGES=1 if interpreting(ck) else COMBINE_STAGES,
            SOFT=interpreting(ck), num_warps=4)
    return o.view(B, T, H, D)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _sparse_attention_fake(q, swa_kv, swa_scale, swa_rope, cmp_kv, cmp_scale, cmp_rope, cmp_idx,
                           rows, pos, sink, scale, window, ratio):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@dspark_op("sparse_attention", reference=sparse_attention_reference, fake=_sparse_attention_fake)
def sparse_attention(q: torch.Tensor, swa_kv: torch.Tensor, swa_scale: torch.Tensor | None,
                     swa_rope: torch.Tensor | None, cmp_kv: torch.Tensor | None,
                     cmp_scale: torch.Tensor | None, cmp_rope: torch.Tensor | None,
                     cmp_idx: torch.Tensor | None, rows: torch.Tensor, pos: torch.Tensor,
                     sink: torch.Tensor, scale: float, window: int, ratio: int) -> torch.Tensor:
    return sparse_attention_launch(q, swa_kv, swa_scale, swa_rope, cmp_kv, cmp_scale, cmp_rope,
                                   cmp_idx, rows, pos, sink, scale, window, ratio)


# SM12x readiness: the Flash launches (H = 64, D = 448 fp8 + 64 bf16 rope; bf16 q; the float
# cache of --no-kv-fp8 in bf16) for each compressed mode (split or not: one kernel), + the combine.
_D16 = "i32:16"


def _configs():
    out = []
    p = sparse_attention_plan(6, 64, 640)
    for fp8, cache_t in ((True, "*u8"), (False, "*bf16")):
        nope, rope = (448, 64) if fp8 else (512, 0)
        for mode in (0, 1, 2):
            types = dict(q_ptr="*bf16", o_ptr="*bf16", ws_ptr="*fp32", sink_ptr="*fp32",
                         rows_ptr="*i64", pos_ptr="*i64", idx_ptr="*i64", swn_ptr=cache_t,
                         sws_ptr="*u8" if fp8 else cache_t, swr_ptr="*bf16", cn_ptr=cache_t,
                         cs_ptr="*u8" if fp8 else cache_t, cr_ptr="*bf16", T="i32", H=_D16,
                         R="i32", RING="i32", NE="i32", K=_D16, window=_D16, ratio="i32",
                         qk_scale="fp32", CHUNK="i32", N_CHUNKS="i32", stride_qt=_D16, stride_qh=_D16, stride_ot=_D16,
                         stride_oh=_D16, stride_it=_D16, sw_n=_D16, sw_s="i32", sw_r=_D16,
                         c_n=_D16, c_s="i32", c_r=_D16)
            out.append(compile_config(_sparse_attention_kernel, types, dict(
                FP8=fp8, CMP=mode, NOPE=nope, ROPE=rope, BLOCK_H=p.block_h, BLOCK_N=p.block_n,
                BLOCK_NOPE=512, BLOCK_R=max(16, next_pow2(rope)), NUM_STAGES=p.num_stages,
                SOFT=False), p.num_warps))
    out.append(compile_config(_combine_kernel, dict(ws_ptr="*fp32", o_ptr="*bf16", H=_D16,
                                                    SPLIT="i32", stride_ot=_D16, stride_oh=_D16),
                              dict(D=512, BLOCK_H=COMBINE_HEADS, BLOCK_D=512,
                                   COMBINE_STAGES=COMBINE_STAGES, SOFT=False), 4))
    return out


add_compile_configs("sparse_attention", _configs())
