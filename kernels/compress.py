"""`dspark::compress`: the KV compressor of C4 / C128 layers and of the C4 indexer in one launch.

Per call (docs/model.md, "Compressor"), for B rows of T tokens, ratio CR, output width d_c,
coff = 2 for CR = 4 (overlapping windows) and 1 otherwise, W = coff·d_c ring columns:

    s = score + ape[t mod CR]                                 # every token, acc dtype
    ring_kv[row, t mod ring], ring_score[...] = kv, s         # fp32 rings (slot -1: nothing)
    for each candidate block end e in the chunk (n = ceil(T / CR) per row):
        rows of block b (C4: the previous block's first halves + this block's second halves,
        positions < 0 masked), per channel c = Σ softmax_rows(S) ⊙ K
        c = rmsnorm(c; norm_weight) in fp32, rounded to out_dtype, RoPE at position b·CR
        (compress_store*) entry b of the row's compressed cache := c (FP8 quant for FP8 caches)

Three ops share the reference and the kernel:
- `compress`: returns the entries [B, n, d_c] (the caller inserts them; Compressor.forward);
- `compress_store`: inserts into a float cache [rows, n_entries, d_c] (the indexer's K cache,
  the compressed KV without FP8), returns nothing;
- `compress_store_fp8`: inserts into the fp8_ds_mla-style triple (nope e4m3, UE8M0 bytes per 64,
  bf16 rope part) exactly as `qkv_postprocess` writes the SWA ring.
An entry is inserted where its block closes in this chunk, the row is valid and b < n_entries.

Bytes one call must move at Flash dims (d = 512, indexer d_i = 128, T = 6 tokens per row):
read kv + score (fp32, W per token), write both rings (the same bytes again), and per closing
entry read the rows pooled from the ring that are not in this chunk (fp32 kv + score of
coff·CR rows of d_c, at most) and write the entry:

    layer                    per token (in + ring)     per closing entry (ring rows + entry)
    C4 main   (W = 1024)     8 KB + 8 KB               ≤ 32 KB + 583 B (FP8) / 1 KB (bf16)
    C4 index  (W = 256)      2 KB + 2 KB               ≤ 8 KB + 256 B
    C128 main (W = 512)      4 KB + 4 KB               ≤ 512 KB + 583 B

(plus ape, norm weight and the cos/sin row: < 10 KB). A step of T = 6 closes 1-2 C4 entries
per row and a C128 entry in 6 of 128 steps; the worst case (every row closing a C128 block at
once) reads 512 KB per row.

Kernel: grid (B, n·split + T). Program (b, j < n·split) pools channel block j mod split of
candidate j // split of row b: it loads the pooled rows in tiles of ROWS (the rows of this chunk
from the kv / score inputs, the earlier ones from the ring: the ring rows this launch writes are
exactly this chunk's, so no program reads a slot another program writes), an online softmax
per channel in fp32; with split 1 (C4, the indexer: one launch) the same program applies
RMSNorm, RoPE and the store; with split > 1 (C128, whose 128 pooled rows of 512 channels are
512 KB: split 8, each program 64 channels) the pooled channels go to an fp32 scratch and a
second launch of one program per entry finishes them -- the same bytes either way, as the
pooling is per channel. Candidates that do not close, and rows that are not valid, are
skipped (`compress` writes zeros there; the reference pools whatever the ring holds, which no
caller stores). Programs (b, n·split + t) copy token t's kv and score + ape into the rings.
The plan (`compress_plan`) holds ROWS and split.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import masked_row_write, rmsnorm, rope_last
from dspark_compile.kernels.qkv_postprocess import KV_QUANT_GROUP, kv_quant_reference
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.tl_helpers import (
    compile_config, exp2_int, fp8e4m3_bits, interpreting, launch, next_pow2, round_to,
    ue8m0_exponent)


def coff_of(ratio: int) -> int:
    """Ring columns per output channel: 2 for the overlapping C4 windows, 1 otherwise."""
    return 2 if ratio == 4 else 1


def block_ends(positions: torch.Tensor, ratio: int):
    """Candidate blocks of a chunk: (blk [B, n], closes [B, n]), n = ceil(T / ratio).

    Candidate j ends at offset e0 + j·ratio from the row's first position (e0 the first offset
    that closes a block); it closes in this chunk when that offset is < T."""
    T = positions.shape[1]
    n = -(-T // ratio)
    pos0 = positions[:, :1]                                            # [B, 1]
    e0 = (ratio - 1 - pos0 % ratio) % ratio
    offs = e0 + ratio * torch.arange(n, device=positions.device)[None, :]
    return (pos0 + offs) // ratio, offs < T


def entry_slots(rows: torch.Tensor, valid: torch.Tensor, blk: torch.Tensor, closes: torch.Tensor,
                n_entries: int) -> torch.Tensor:
    """Flat slots [B*n] into a [rows, n_entries, ...] cache; -1 where nothing is stored."""
    ok = closes & valid[:, None] & (blk < n_entries)
    slots = rows[:, None] * n_entries + blk
    return torch.where(ok, slots, torch.full_like(slots, -1)).reshape(-1)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def compress_reference(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                       positions: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                       ring_slots: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                       norm_weight: torch.Tensor, cos_sin: torch.Tensor, eps: float,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """kv, score [B*T, W] (acc dtype) -> entries [B, n, d_c] in out_dtype; updates the rings.

    positions [B, T]; rows [B] state rows; ring_slots [B*T] flat slots into the rings viewed
    [rows*ring, W] (Batch.ring_slots, -1 = not written); ape [CR, W]; norm_weight [d_c]. `valid`
    is not read here: entries of rows that are not valid are never stored."""
    acc = kv.dtype
    B, T = positions.shape
    CR, d_c = ape.shape[0], norm_weight.shape[0]
    coff = kv.shape[-1] // d_c
    ring = ring_kv.shape[1]
    s = score + ape[positions.reshape(-1) % CR].to(acc)
    masked_row_write(ring_kv.flatten(0, 1), ring_slots, kv)
    masked_row_write(ring_score.flatten(0, 1), ring_slots, s)

    blk, _ = block_ends(positions, CR)                                 # [B, n]
    n = blk.shape[1]
    # positions pooled for each candidate: [B, n, coff*CR], read back after the writes above
    first = (blk - (coff - 1)) * CR
    src_pos = first[..., None] + torch.arange(coff * CR, device=kv.device)
    src_ok = src_pos >= 0
    slot = src_pos.clamp_min(0) % ring
    rowsel = rows[:, None, None].expand_as(slot)
    k = ring_kv[rowsel, slot].to(acc)                                  # [B, n, coff*CR, W]
    sc = ring_score[rowsel, slot].to(acc)
    if coff == 2:
        # rows of the previous block take the first half, this block's rows the second half
        k = torch.cat((k[..., :CR, :d_c], k[..., CR:, d_c:]), dim=-2)
        sc = torch.cat((sc[..., :CR, :d_c], sc[..., CR:, d_c:]), dim=-2)
    sc = sc.masked_fill(~src_ok[..., None], float("-inf"))
    k = k.masked_fill(~src_ok[..., None], 0.0)
    pooled = (torch.softmax(sc, dim=-2) * k).sum(-2)                   # [B, n, d_c]
    pooled = rmsnorm(pooled, norm_weight, eps).to(out_dtype)
    rope_dim = cos_sin.shape[-1]
    pooled = rope_last(pooled.reshape(B * n, d_c), cos_sin, (blk * CR).reshape(-1), rope_dim)
    return pooled.view(B, n, d_c)


def _slots_of(positions, rows, valid, ratio, n_entries):
    blk, closes = block_ends(positions, ratio)
    return entry_slots(rows, valid, blk, closes, n_entries)


def compress_store_reference(kv, score, ape, positions, rows, valid, ring_slots, ring_kv,
                             ring_score, norm_weight, cos_sin, cache, eps, out_dtype) -> None:
    """compress_reference, then the closing entries into the float cache [rows, n_entries, d_c]."""
    entries = compress_reference(kv, score, ape, positions, rows, valid, ring_slots, ring_kv,
                                 ring_score, norm_weight, cos_sin, eps, out_dtype)
    slots = _slots_of(positions, rows, valid, ape.shape[0], cache.shape[1])
    masked_row_write(cache.flatten(0, 1), slots, entries.reshape(-1, entries.shape[-1]))


def compress_store_fp8_reference(kv, score, ape, positions, rows, valid, ring_slots, ring_kv,
                                 ring_score, norm_weight, cos_sin, cache_nope, cache_scale,
                                 cache_rope, eps, out_dtype) -> None:
    """compress_reference, then the closing entries into the FP8 cache triple
    (nope e4m3 [rows, n_entries, nope], UE8M0 bytes [.., nope / 64], bf16 rope [.., R])."""
    entries = compress_reference(kv, score, ape, positions, rows, valid, ring_slots, ring_kv,
                                 ring_score, norm_weight, cos_sin, eps, out_dtype)
    slots = _slots_of(positions, rows, valid, ape.shape[0], cache_nope.shape[1])
    q8, sbytes, rope = kv_quant_reference(entries.reshape(-1, entries.shape[-1]),
                                          cache_nope.shape[-1])
    masked_row_write(cache_nope.flatten(0, 1), slots, q8)
    masked_row_write(cache_scale.flatten(0, 1), slots, sbytes)
    masked_row_write(cache_rope.flatten(0, 1), slots, rope)


# ----------------------------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CompressPlan:
    """Launch choices of one (ratio, d_c) compressor.

    `split` programs share an entry's d_c channels (the softmax runs per channel), each pooling
    d_c / split of them; split > 1 writes the pooled channels to an fp32 scratch [B, n, d_c] and a
    second launch (one program per entry) applies the norm, RoPE and store, so the entry's rows
    stream through `split` SMs. `rows` pooled rows per loop step (a [rows, d_c / split] fp32 tile
    of kv and of scores), `num_warps` of the pooling launch."""
    rows: int
    split: int
    num_warps: int


# fp32 elements of one [rows, channels] tile: 4096 = 32 registers a thread per tile at 4 warps
# (kv and scores: 64), so C4's 8 rows of 512 are one step. C128 pools 128 rows of 512 per entry
# (512 KB of fp32 ring rows): on one SM that is the step's longest program, so its channels are
# split over SPLIT_C128 programs of 64 channels (64 KB each, two 64-row steps).
TILE_ELEMS = 4096
NUM_WARPS = 4
SPLIT_C128 = 8


def compress_plan(ratio: int, d_c: int, interpreted: bool = False) -> CompressPlan:
    """The plan for a compressor; the interpreter pays per operation, so it takes every pooled
    row and every channel in one step (tests pass split plans explicitly)."""
    pooled = coff_of(ratio) * ratio
    if interpreted:
        return CompressPlan(pooled, 1, NUM_WARPS)
    split = SPLIT_C128 if pooled > 16 and d_c % (16 * SPLIT_C128) == 0 else 1
    return CompressPlan(max(1, min(pooled, TILE_ELEMS * split // d_c)), split, NUM_WARPS)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _ring_write(kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, rkv_ptr, rsc_ptr, tok, n_slots,
                stride_x, stride_s, stride_ape, stride_rs, CR: tl.constexpr, WIDTH: tl.constexpr):
    """Ring slot of token `tok` := its kv row and its score row + ape[pos mod CR]; slot < 0 (or
    past the ring) writes nothing."""
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    ok = (slot >= 0) & (slot < n_slots)
    c = tl.arange(0, WIDTH)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    x = tl.load(kv_ptr + tok * stride_x + c)
    s = tl.load(sc_ptr + tok * stride_s + c) + tl.load(ape_ptr + (pos % CR) * stride_ape + c)
    tl.store(rkv_ptr + slot * stride_rs + c, x, mask=ok)
    tl.store(rsc_ptr + slot * stride_rs + c, s, mask=ok)


@triton.jit
def _pool(kv_ptr, sc_ptr, ape_ptr, rkv_ptr, rsc_ptr, b, row, pos0, first, c0, T, RING, stride_x,
          stride_s, stride_ape, stride_rr, stride_rs, CR: tl.constexpr, COFF: tl.constexpr,
          DC: tl.constexpr, CB: tl.constexpr, ROWS: tl.constexpr):
    """Σ_rows softmax_rows(S) ⊙ K for the CB channels from c0 (fp32) over the COFF·CR rows from
    `first`: rows of this chunk from the inputs (score + ape), earlier ones from the ring,
    positions < 0 masked."""
    d = c0 + tl.arange(0, CB)
    m = tl.full([CB], float("-inf"), tl.float32)
    l = tl.zeros([CB], tl.float32)
    acc = tl.zeros([CB], tl.float32)
    for r0 in range(0, COFF * CR, ROWS):
        r = r0 + tl.arange(0, ROWS)
        p = first + r                                   # positions, int64
        cols = ((r // CR) * DC)[:, None] + d[None, :]   # C4: this block's rows take the 2nd half
        ok = p >= 0
        inc = (p >= pos0) & (p < pos0 + T)
        m_in = (ok & inc)[:, None]
        m_rg = (ok & ~inc)[:, None]
        tok = b * T + (p - pos0)
        ring_rows = row * stride_rr + (tl.where(ok, p, 0) % RING)[:, None] * stride_rs + cols
        x = tl.where(m_in, tl.load(kv_ptr + tok[:, None] * stride_x + cols, mask=m_in, other=0.0),
                     tl.load(rkv_ptr + ring_rows, mask=m_rg, other=0.0))
        s_in = tl.load(sc_ptr + tok[:, None] * stride_s + cols, mask=m_in, other=0.0) + \
            tl.load(ape_ptr + (tl.where(ok, p, 0) % CR)[:, None] * stride_ape + cols, mask=m_in,
                    other=0.0)
        s = tl.where(m_in, s_in, tl.load(rsc_ptr + ring_rows, mask=m_rg, other=0.0))
        s = tl.where(ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)   # a tile of masked rows only
        alpha = tl.exp(m - m_sub)
        e = tl.exp(s - m_sub[None, :])
        l = l * alpha + tl.sum(e, axis=0)
        acc = acc * alpha + tl.sum(e * x, axis=0)
        m = m_new
    return tl.math.div_rn(acc, l)


@triton.jit
def _norm_rope(x, w_ptr, cs_row, eps, DC: tl.constexpr, ROPE: tl.constexpr, ODT: tl.constexpr,
               SOFT: tl.constexpr):
    """RMSNorm (weight in fp32), rounded to ODT, then RoPE on the last ROPE dims (rounded again),
    as the reference's rmsnorm + rope_last; fp32 holding ODT values."""
    ms = tl.math.div_rn(tl.sum(x * x, axis=0), DC * 1.0)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(ms + eps))
    w = tl.load(w_ptr + tl.arange(0, DC)).to(tl.float32)
    y = round_to(x * rstd * w, ODT, SOFT)
    NOPE: tl.constexpr = DC - ROPE
    ev, od = tl.split(tl.reshape(y, [DC // 2, 2]))
    i = tl.arange(0, DC // 2)
    rot = i >= NOPE // 2
    k = tl.where(rot, i - NOPE // 2, 0)
    c = tl.load(cs_row + k, mask=rot, other=1.0).to(tl.float32)
    sn = tl.load(cs_row + ROPE // 2 + k, mask=rot, other=0.0).to(tl.float32)
    re = round_to(ev * c - od * sn, ODT, SOFT)
    ro = round_to(od * c + ev * sn, ODT, SOFT)
    return tl.reshape(tl.join(tl.where(rot, re, ev), tl.where(rot, ro, od)), [DC])


@triton.jit
def _store_fp8(y, nope_row, scale_row, rope_row, DC: tl.constexpr, ROPE: tl.constexpr,
               SOFT: tl.constexpr):
    """The fp8_ds_mla row: the first DC - ROPE dims in e4m3 groups of 64 with UE8M0 exponent
    bytes (as kv_quant_reference), the rope part in bf16."""
    NOPE: tl.constexpr = DC - ROPE
    g = tl.reshape(y, [DC // 64, 64])
    gi = tl.arange(0, DC // 64)
    cols = gi[:, None] * 64 + tl.arange(0, 64)[None, :]
    is_nope = cols < NOPE
    e = ue8m0_exponent(tl.max(tl.abs(g), axis=1))
    # NaN stays NaN (the reference's e4m3 NaN byte), where min / max alone would clamp it
    q = tl.minimum(tl.maximum(g * exp2_int(-e)[:, None], -448.0, propagate_nan=tl.PropagateNan.ALL),
                   448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = tl.where(q != q, 0x7F, fp8e4m3_bits(q, SOFT))
    tl.store(nope_row + cols, bits.to(tl.uint8), mask=is_nope)
    tl.store(scale_row + gi, (e + 127).to(tl.uint8), mask=gi < NOPE // 64)
    rdt = rope_row.dtype.element_ty
    tl.store(rope_row + (cols - NOPE), round_to(g, rdt, SOFT).to(rdt), mask=~is_nope)


@triton.jit
def _entry(pos_ptr, rows_ptr, valid_ptr, b, j, T, N_ENT, CR: tl.constexpr, MODE: tl.constexpr):
    """Candidate j of row b: (first position of the chunk, block id, state row, whether it is
    computed: it closes in a valid row, and for a store it fits the cache)."""
    pos0 = tl.load(pos_ptr + b * T).to(tl.int64)
    off = (CR - 1 - pos0 % CR) % CR + CR * j
    blk = (pos0 + off) // CR
    row = tl.load(rows_ptr + b).to(tl.int64)
    go = (tl.load(valid_ptr + b) != 0) & (off < T)
    if MODE != 0:
        go = go & (blk < N_ENT)
    return pos0, blk, row, go


@triton.jit
def _finish(x, b, j, blk, row, w_ptr, cs_ptr, out_ptr, c_ptr, cscale_ptr, crope_ptr, max_pos,
            stride_cs, stride_ob, stride_oj, stride_cr, stride_ce, stride_sr, stride_se,
            stride_pr, stride_pe, eps, CR: tl.constexpr, DC: tl.constexpr, ROPE: tl.constexpr,
            MODE: tl.constexpr, SOFT: tl.constexpr):
    """Norm + RoPE of the pooled entry x [DC], then MODE 0: out[b, j]; 1: the float cache's
    entry; 2: the FP8 triple's."""
    ODT = out_ptr.dtype.element_ty
    cs_row = cs_ptr + tl.minimum(blk * CR, max_pos - 1) * stride_cs
    y = _norm_rope(x, w_ptr, cs_row, eps, DC, ROPE, ODT, SOFT)
    d = tl.arange(0, DC)
    if MODE == 0:
        tl.store(out_ptr + b * stride_ob + j * stride_oj + d, y.to(ODT))
    elif MODE == 1:
        cdt = c_ptr.dtype.element_ty
        tl.store(c_ptr + row * stride_cr + blk * stride_ce + d, round_to(y, cdt, SOFT).to(cdt))
    else:
        _store_fp8(y, c_ptr + row * stride_cr + blk * stride_ce,
                   cscale_ptr + row * stride_sr + blk * stride_se,
                   crope_ptr + row * stride_pr + blk * stride_pe, DC, ROPE, SOFT)


@triton.jit
def _compress_kernel(kv_ptr, sc_ptr, ape_ptr, pos_ptr, rows_ptr, valid_ptr, slot_ptr, rkv_ptr,
                     rsc_ptr, w_ptr, cs_ptr, out_ptr, c_ptr, cscale_ptr, crope_ptr, pool_ptr,
                     T, NCAND, RING, n_slots, N_ENT, max_pos, stride_x, stride_s, stride_ape,
                     stride_rr, stride_rs, stride_cs, stride_ob, stride_oj, stride_cr, stride_ce,
                     stride_sr, stride_se, stride_pr, stride_pe, eps,
                     CR: tl.constexpr, COFF: tl.constexpr, DC: tl.constexpr, ROPE: tl.constexpr,
                     ROWS: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr,
                     SOFT: tl.constexpr):
    """Programs (b, j < NCAND·SPLIT) pool candidate j // SPLIT's channel block j % SPLIT, and
    with SPLIT 1 finish it (norm, RoPE, store); SPLIT > 1 leaves the pooled channels in
    pool_ptr [B, NCAND, DC] for _compress_finish_kernel. Programs (b, NCAND·SPLIT + t) write
    token t into the rings."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    if j >= NCAND * SPLIT:
        _ring_write(kv_ptr, sc_ptr, ape_ptr, pos_ptr, slot_ptr, rkv_ptr, rsc_ptr,
                    b * T + (j - NCAND * SPLIT), n_slots, stride_x, stride_s, stride_ape,
                    stride_rs, CR, COFF * DC)
        return
    CB: tl.constexpr = DC // SPLIT
    jc = j // SPLIT
    c0 = (j % SPLIT) * CB
    pos0, blk, row, go = _entry(pos_ptr, rows_ptr, valid_ptr, b, jc, T, N_ENT, CR, MODE)
    if go:
        x = _pool(kv_ptr, sc_ptr, ape_ptr, rkv_ptr, rsc_ptr, b, row, pos0,
                  (blk - (COFF - 1)) * CR, c0, T, RING, stride_x, stride_s, stride_ape,
                  stride_rr, stride_rs, CR, COFF, DC, CB, ROWS)
        if SPLIT == 1:
            _finish(x, b, jc, blk, row, w_ptr, cs_ptr, out_ptr, c_ptr, cscale_ptr, crope_ptr,
                    max_pos, stride_cs, stride_ob, stride_oj, stride_cr, stride_ce, stride_sr,
                    stride_se, stride_pr, stride_pe, eps, CR, DC, ROPE, MODE, SOFT)
        else:
            tl.store(pool_ptr + (b * NCAND + jc) * DC + c0 + tl.arange(0, CB), x)
    elif MODE == 0 and SPLIT == 1:
        tl.store(out_ptr + b * stride_ob + jc * stride_oj + tl.arange(0, DC),
                 tl.zeros([DC], tl.float32).to(out_ptr.dtype.element_ty))


@triton.jit
def _compress_finish_kernel(pos_ptr, rows_ptr, valid_ptr, w_ptr, cs_ptr, out_ptr, c_ptr,
                            cscale_ptr, crope_ptr, pool_ptr, T, NCAND, N_ENT, max_pos, stride_cs,
                            stride_ob, stride_oj, stride_cr, stride_ce, stride_sr, stride_se,
                            stride_pr, stride_pe, eps, CR: tl.constexpr, DC: tl.constexpr,
                            ROPE: tl.constexpr, MODE: tl.constexpr, SOFT: tl.constexpr):
    """Program (b, j): norm, RoPE and store of candidate j pooled by a SPLIT > 1 launch."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos0, blk, row, go = _entry(pos_ptr, rows_ptr, valid_ptr, b, j, T, N_ENT, CR, MODE)
    if go:
        x = tl.load(pool_ptr + (b * NCAND + j) * DC + tl.arange(0, DC))
        _finish(x, b, j, blk, row, w_ptr, cs_ptr, out_ptr, c_ptr, cscale_ptr, crope_ptr, max_pos,
                stride_cs, stride_ob, stride_oj, stride_cr, stride_ce, stride_sr, stride_se,
                stride_pr, stride_pe, eps, CR, DC, ROPE, MODE, SOFT)
    elif MODE == 0:
        tl.store(out_ptr + b * stride_ob + j * stride_oj + tl.arange(0, DC),
                 tl.zeros([DC], tl.float32).to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(kv, score, ape, positions, rows, valid, ring_slots, ring_kv, ring_score, norm_weight,
           cos_sin, out_dtype):
    """Shape / dtype errors name the argument; returns (B, T, CR, d_c, coff, rope dim)."""
    if positions.dim() != 2 or positions.dtype not in _INT_DTYPES:
        raise ValueError(f"positions must be int32/int64 [B, T], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    B, T = positions.shape
    if norm_weight.dim() != 1:
        raise ValueError(f"norm_weight must be [d_c], got {tuple(norm_weight.shape)}")
    d_c = norm_weight.shape[0]
    if ape.dim() != 2 or ape.shape[1] % d_c or ape.shape[1] // d_c not in (1, 2):
        raise ValueError(f"ape must be [ratio, coff * d_c] with d_c = {d_c}, got "
                         f"{tuple(ape.shape)}")
    CR, W = ape.shape
    if W // d_c != coff_of(CR):
        raise ValueError(f"ape [{CR}, {W}]: ratio {CR} needs coff = {coff_of(CR)} (W = "
                         f"{coff_of(CR) * d_c})")
    for name, t in (("kv", kv), ("score", score)):
        if t.shape != (B * T, W) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [B*T = {B * T}, {W}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    for name, t in (("ring_kv", ring_kv), ("ring_score", ring_score)):
        if t.dim() != 3 or t.shape[2] != W or t.dtype != torch.float32 or \
                t.shape != ring_kv.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [rows, ring, {W}] ring (the "
                             f"shape of ring_kv), got {t.dtype} {tuple(t.shape)}")
    if ring_kv.shape[1] < coff_of(CR) * CR + T:
        raise ValueError(f"ring_kv holds {ring_kv.shape[1]} slots, fewer than coff * ratio + T "
                         f"= {coff_of(CR) * CR + T} (a chunk would overwrite rows it pools)")
    for name, t, shape in (("rows", rows, (B,)), ("ring_slots", ring_slots, (B * T,))):
        if t.shape != shape or t.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be int32/int64 {list(shape)}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if valid.shape != (B,) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool [{B}], got {valid.dtype} {tuple(valid.shape)}")
    R = cos_sin.shape[-1] if cos_sin.dim() == 2 else 0
    if not (0 < R <= d_c and R % 2 == 0) or not _pow2(d_c):
        raise ValueError(f"cos_sin must be [max_pos, R] with even R <= d_c and d_c a power of "
                         f"two, got {tuple(cos_sin.shape)} and d_c = {d_c}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    return B, T, CR, d_c, W // d_c, R


def _cache_args(cache, fp8_cache, d_c, R, dev):
    """(MODE, c, scale, rope, n_entries, strides) of the insert target."""
    if fp8_cache is not None:
        nope, scale, rope = fp8_cache
        NE = nope.shape[1] if nope.dim() == 3 else -1
        for name, t, width, dt in (("cache_nope", nope, d_c - R, torch.float8_e4m3fn),
                                   ("cache_scale", scale, (d_c - R) // KV_QUANT_GROUP,
                                    torch.uint8),
                                   ("cache_rope", rope, R, torch.bfloat16)):
            if t.dim() != 3 or t.shape[1:] != (NE, width) or t.dtype != dt or t.stride(2) != 1:
                raise ValueError(f"{name} must be {dt} [rows, n_entries, {width}] with a "
                                 f"contiguous last dim, got {t.dtype} {tuple(t.shape)}")
        if (d_c - R) % KV_QUANT_GROUP or d_c % KV_QUANT_GROUP:
            raise ValueError(f"FP8 cache: d_c = {d_c} and d_c - R = {d_c - R} must be multiples "
                             f"of {KV_QUANT_GROUP}")
        return (2, nope.view(torch.uint8), scale, rope, NE,
                (nope.stride(0), nope.stride(1), scale.stride(0), scale.stride(1),
                 rope.stride(0), rope.stride(1)))
    if cache is not None:
        if cache.dim() != 3 or cache.shape[2] != d_c or cache.dtype not in _OUT_DTYPES or \
                cache.stride(2) != 1:
            raise ValueError(f"cache must be a float [rows, n_entries, {d_c}] cache with a "
                             f"contiguous last dim, got {cache.dtype} {tuple(cache.shape)}")
        return 1, cache, cache, cache, cache.shape[1], (cache.stride(0), cache.stride(1), 0, 0,
                                                         0, 0)
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    return 0, dummy, dummy, dummy, 0, (0,) * 6


def compress_launch(kv, score, ape, positions, rows, valid, ring_slots, ring_kv, ring_score,
                    norm_weight, cos_sin, eps, out_dtype, cache=None, fp8_cache=None, plan=None):
    """The Triton path of all three ops (`cache`: float insert, `fp8_cache`: (nope, scale, rope));
    fp64 (exact mode) runs the reference. `plan` overrides compress_plan (tests)."""
    if kv.dtype == torch.float64 or out_dtype == torch.float64:
        if fp8_cache is not None:
            return compress_store_fp8_reference(kv, score, ape, positions, rows, valid,
                                                ring_slots, ring_kv, ring_score, norm_weight,
                                                cos_sin, *fp8_cache, eps, out_dtype)
        if cache is not None:
            return compress_store_reference(kv, score, ape, positions, rows, valid, ring_slots,
                                            ring_kv, ring_score, norm_weight, cos_sin, cache,
                                            eps, out_dtype)
        return compress_reference(kv, score, ape, positions, rows, valid, ring_slots, ring_kv,
                                  ring_score, norm_weight, cos_sin, eps, out_dtype)
    B, T, CR, d_c, coff, R = _check(kv, score, ape, positions, rows, valid, ring_slots, ring_kv,
                                    ring_score, norm_weight, cos_sin, out_dtype)
    mode, c, cscale, crope, NE, cstr = _cache_args(cache, fp8_cache, d_c, R, kv.device)
    n = -(-T // CR)
    # the store ops return nothing: a one-element buffer carries out_dtype into the kernel
    out = torch.empty((B, n, d_c) if mode == 0 else (1, 1, 1), dtype=out_dtype, device=kv.device)
    if B == 0:
        return out if mode == 0 else None
    kernel = _compress_kernel
    p = plan or compress_plan(CR, d_c, interpreting(kernel))
    if d_c % p.split or not _pow2(d_c // p.split):
        raise ValueError(f"plan.split = {p.split} must leave a power-of-two share of d_c = {d_c}")
    if (coff * CR) % p.rows:      # the pooling loop has no row mask: whole steps only
        raise ValueError(f"plan.rows = {p.rows} must divide the {coff * CR} pooled rows "
                         f"(coff {coff} x ratio {CR})")
    kv, score, ape, cos_sin = (t if t.stride(-1) == 1 else t.contiguous()
                               for t in (kv, score, ape, cos_sin))
    positions = positions.contiguous()
    pool = torch.empty((B, n, d_c) if p.split > 1 else (1,), dtype=torch.float32, device=kv.device)
    valid8 = valid.view(torch.uint8)
    tail = (out.stride(0), out.stride(1), *cstr, float(eps))
    launch(kernel)[(B, n * p.split + T)](
        kv, score, ape, positions, rows, valid8, ring_slots, ring_kv, ring_score, norm_weight,
        cos_sin, out, c, cscale, crope, pool, T, n, ring_kv.shape[1],
        ring_kv.shape[0] * ring_kv.shape[1], NE, cos_sin.shape[0], kv.stride(0), score.stride(0),
        ape.stride(0), ring_kv.stride(0), ring_kv.stride(1), cos_sin.stride(0), *tail,
        CR=CR, COFF=coff, DC=d_c, ROPE=R, ROWS=p.rows, SPLIT=p.split, MODE=mode,
        SOFT=interpreting(kernel), num_warps=p.num_warps)
    if p.split > 1:
        fin = _compress_finish_kernel
        launch(fin)[(B, n)](
            positions, rows, valid8, norm_weight, cos_sin, out, c, cscale, crope, pool, T, n, NE,
            cos_sin.shape[0], cos_sin.stride(0), *tail, CR=CR, DC=d_c, ROPE=R, MODE=mode,
            SOFT=interpreting(fin), num_warps=NUM_WARPS)
    return out if mode == 0 else None


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _compress_fake(kv, score, ape, positions, rows, valid, ring_slots, ring_kv, ring_score,
                   norm_weight, cos_sin, eps, out_dtype):
    B, T = positions.shape
    n = -(-T // ape.shape[0])
    return kv.new_empty((B, n, norm_weight.shape[0]), dtype=out_dtype)


def _compress_store_fake(kv, score, ape, positions, rows, valid, ring_slots, ring_kv, ring_score,
                         norm_weight, cos_sin, cache, eps, out_dtype):
    return None


def _compress_store_fp8_fake(kv, score, ape, positions, rows, valid, ring_slots, ring_kv,
                             ring_score, norm_weight, cos_sin, cache_nope, cache_scale, cache_rope,
                             eps, out_dtype):
    return None


@dspark_op("compress", reference=compress_reference, fake=_compress_fake,
           mutates_args={"ring_kv", "ring_score"})
def compress(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
             rows: torch.Tensor, valid: torch.Tensor, ring_slots: torch.Tensor,
             ring_kv: torch.Tensor, ring_score: torch.Tensor, norm_weight: torch.Tensor,
             cos_sin: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    return compress_launch(kv, score, ape, positions, rows, valid, ring_slots, ring_kv,
                           ring_score, norm_weight, cos_sin, eps, out_dtype)


@dspark_op("compress_store", reference=compress_store_reference, fake=_compress_store_fake,
           mutates_args={"ring_kv", "ring_score", "cache"})
def compress_store(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                   positions: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                   ring_slots: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                   norm_weight: torch.Tensor, cos_sin: torch.Tensor, cache: torch.Tensor,
                   eps: float, out_dtype: torch.dtype) -> None:
    compress_launch(kv, score, ape, positions, rows, valid, ring_slots, ring_kv, ring_score,
                    norm_weight, cos_sin, eps, out_dtype, cache=cache)


@dspark_op("compress_store_fp8", reference=compress_store_fp8_reference,
           fake=_compress_store_fp8_fake,
           mutates_args={"ring_kv", "ring_score", "cache_nope", "cache_scale", "cache_rope"})
def compress_store_fp8(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                       positions: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                       ring_slots: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                       norm_weight: torch.Tensor, cos_sin: torch.Tensor, cache_nope: torch.Tensor,
                       cache_scale: torch.Tensor, cache_rope: torch.Tensor, eps: float,
                       out_dtype: torch.dtype) -> None:
    compress_launch(kv, score, ape, positions, rows, valid, ring_slots, ring_kv, ring_score,
                    norm_weight, cos_sin, eps, out_dtype,
                    fp8_cache=(cache_nope, cache_scale, cache_rope))


# SM12x readiness: the Flash launches (d = 512 main compressors of C4 and C128 in each mode,
# the C4 indexer's d_i = 128 into its bf16 K cache), bf16 compute, fp32 rings and cos/sin,
# int64 ids (tests/kernels/test_sm12x_resources.py).
_D16 = "i32:16"     # the strides that are multiples of 16 at Flash dims (the JIT specialises them)
_CACHE_TYPES = {0: ("*u8", "*u8", "*u8"), 1: ("*bf16", "*bf16", "*bf16"), 2: ("*u8", "*u8", "*bf16")}


def _flash_config(ratio, d_c, mode):
    """The pooling launch's configuration, and the finishing launch's when the plan splits."""
    c, cs8, cr = _CACHE_TYPES[mode]
    ids = dict(pos_ptr="*i64", rows_ptr="*i64", valid_ptr="*u8", w_ptr="*bf16", cs_ptr="*fp32",
               out_ptr="*bf16", c_ptr=c, cscale_ptr=cs8, crope_ptr=cr, pool_ptr="*fp32",
               stride_cs=_D16, stride_ob=_D16, stride_oj=_D16, stride_cr=_D16, stride_ce=_D16,
               stride_sr="i32", stride_se="i32", stride_pr=_D16, stride_pe=_D16, eps="fp32",
               T="i32", NCAND="i32", N_ENT="i32", max_pos="i32")
    types = dict(ids, kv_ptr="*fp32", sc_ptr="*fp32", ape_ptr="*fp32", slot_ptr="*i64",
                 rkv_ptr="*fp32", rsc_ptr="*fp32", RING="i32", n_slots="i32", stride_x=_D16,
                 stride_s=_D16, stride_ape=_D16, stride_rr=_D16, stride_rs=_D16)
    p = compress_plan(ratio, d_c)
    shape = dict(CR=ratio, DC=d_c, ROPE=64, MODE=mode, SOFT=False)
    out = [compile_config(_compress_kernel, types,
                          dict(shape, COFF=coff_of(ratio), ROWS=p.rows, SPLIT=p.split),
                          p.num_warps)]
    if p.split > 1:
        out.append(compile_config(_compress_finish_kernel, ids, shape, NUM_WARPS))
    return out


for _op, _mode in (("compress", 0), ("compress_store", 1), ("compress_store_fp8", 2)):
    _shapes = [(4, 512), (128, 512)] + ([(4, 128)] if _mode != 2 else [])
    add_compile_configs(_op, [cfg for r, d_c in _shapes for cfg in _flash_config(r, d_c, _mode)])
