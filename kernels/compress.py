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

Kernel (one launch): grid (B, n + T). Program (b, j < n) pools candidate j of row b: it loads
the pooled rows in tiles of ROWS (the rows of this chunk from the kv / score inputs, the earlier
ones from the ring: the ring rows this launch writes are exactly this chunk's, so the program
never reads a slot another program writes), an online softmax per channel in fp32, RMSNorm,
RoPE, then the store. Candidates that do not close, and rows that are not valid, are skipped
(`compress` writes zeros there; the reference pools whatever the ring holds, which no caller
stores). Programs (b, n + t) copy token t's kv and score + ape into the rings.
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
# Launchers
# ----------------------------------------------------------------------------------------------

def compress_launch(kv, score, ape, positions, rows, valid, ring_slots, ring_kv, ring_score,
                    norm_weight, cos_sin, eps, out_dtype, cache=None, fp8_cache=None, plan=None):
    """The CUDA path of all three ops (`cache`: float insert, `fp8_cache`: (nope, scale, rope))."""
    if fp8_cache is not None:
        return compress_store_fp8_reference(kv, score, ape, positions, rows, valid, ring_slots,
                                            ring_kv, ring_score, norm_weight, cos_sin,
                                            *fp8_cache, eps, out_dtype)
    if cache is not None:
        return compress_store_reference(kv, score, ape, positions, rows, valid, ring_slots,
                                        ring_kv, ring_score, norm_weight, cos_sin, cache, eps,
                                        out_dtype)
    return compress_reference(kv, score, ape, positions, rows, valid, ring_slots, ring_kv,
                              ring_score, norm_weight, cos_sin, eps, out_dtype)


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
