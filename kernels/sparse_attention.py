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
At B = 64, T = 6, C4 at 8k context: 64 x (6 x 128 KB + 133 x 583 B + 3072 x 583 B) = 169 MB,
35 us at 4.8 TB/s.

Kernel: one program per (token, split) takes all H heads of the token (BLOCK_H = H rows of the
MMA: the candidates' bytes are read once for the heads) and runs an online softmax over blocks of
BLOCK_N candidates, SWA blocks first, then compressed ones; each block's fp8 bytes are
dequantized in registers (byte * 2^(e - 127) per 64 dims, exact in bf16). When the grid would
leave the GPU idle (few tokens, long candidate lists) the blocks are split over programs
(`SparseAttentionPlan.split`); each split writes its (max, denominator, numerator) partial in
fp32 and one combine launch merges them in split order (deterministic: no atomics). The sink
enters split 0 only.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import e8m0_byte_to_scale, upcast
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
# Launcher
# ----------------------------------------------------------------------------------------------

def sparse_attention_launch(q, swa_kv, swa_scale, swa_rope, cmp_kv, cmp_scale, cmp_rope, cmp_idx,
                            rows, pos, sink, scale, window, ratio, plan=None):
    return sparse_attention_reference(q, swa_kv, swa_scale, swa_rope, cmp_kv, cmp_scale, cmp_rope,
                                      cmp_idx, rows, pos, sink, scale, window, ratio)


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
