"""`dspark::draft_attention`: the DSpark draft's attention over (context ring ∪ block) in one launch.

A draft pass runs N query tokens per row (docs/model.md, "Draft attention"); every query token t
and head h attends, non-causally, to

- the row's context ring `ring[rows[b]]` [W, d] (W = sliding_window): slot s holds position
  L − ((L − s) mod W) for the row's last committed position L, valid when that is ≥ 0;
- all N block KVs `kv[b]` [N, d],

with one softmax per (t, h) over both sets and the learned sink exp(sink_h) in the denominator
only: o = Σ_e exp(s_e − m) K_e / (Σ_e exp(s_e − m) + exp(sink_h − m)), s_e = (q · K_e) · scale.
Keys are values (MQA over one latent). Output in q's dtype (the reference computes in fp32, fp64
for fp64 inputs, and rounds once).

Bytes one call must move at Flash dims (H = 64, d = 512, W = 128, N = 5, bf16), per row:
q 320 KB + o 320 KB + ring 128 KB + block KV 5 KB + sink and ids: 773 KB; 0.77 MB at B = 1
(0.18 µs at 4.3 TB/s copy bandwidth), 49.5 MB at B = 64 (11.5 µs). q and o dominate: the
shared context is 17 % of the bytes, which a per-(token, head) kernel rereads N·H = 320 times.

Kernel: grid (B, ceil(N·H / BLOCK_M)); program (b, i) takes BLOCK_M of the row's N·H query rows
(flattened token-major: m = t·H + h) and streams the row's context ring once, BLOCK_N slots at a
time, then the N block KVs as one more tile: S = Q Kᵀ · scale on the tensor cores (fp32
accumulation), an online softmax per query row in fp32, O += P K with P in the keys' dtype (bf16
on a GPU, as flash attention does; fp32 keys keep an IEEE fp32 product). The sink joins at the
end: o = acc / (l + exp(sink − m)).
"""
from __future__ import annotations

import torch

from dspark_compile.kernels.common import upcast
from dspark_compile.kernels.registry import dspark_op


def context_slot_positions(last_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B, W]: the position ring slot s holds for a row whose last committed position is L."""
    L = last_pos[:, None]
    return L - torch.remainder(L - torch.arange(window, device=last_pos.device), window)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def draft_attention_reference(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor,
                              rows: torch.Tensor, last_pos: torch.Tensor, sink: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """q [B, N, H, d], kv [B, N, d] (the block's RoPE'd KV), ring [rows, W, d], rows [B],
    last_pos [B], sink [H] -> o [B, N, H, d] in q's dtype.

    The same operations, in the same order, as the draft ran through
    models/attention.sink_attention: two score sets, one softmax over them and the sink column,
    the two value sums added."""
    acc = upcast(q).dtype
    B, N, H, _ = q.shape
    W = ring.shape[1]
    ctx = ring[rows].to(acc)                                               # [B, W, d]
    blk = kv.to(acc)
    ctx_ok = (context_slot_positions(last_pos, W) >= 0)[:, None, None, :]  # [B, 1, 1, W]
    qf = q.to(acc)
    s_ctx = (torch.einsum("bthd,bnd->bthn", qf, ctx) * scale).masked_fill(~ctx_ok, float("-inf"))
    s_blk = torch.einsum("bthd,bnd->bthn", qf, blk) * scale
    sink_col = sink.to(acc).view(1, 1, H, 1).expand(B, N, H, 1)
    p = torch.softmax(torch.cat((s_ctx, s_blk, sink_col), dim=-1), dim=-1)
    o = torch.einsum("bthn,bnd->bthd", p[..., :W], ctx)
    o = o + torch.einsum("bthn,bnd->bthd", p[..., W:W + N], blk)
    return o.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

def draft_attention_launch(q, kv, ring, rows, last_pos, sink, scale, plan=None):
    return draft_attention_reference(q, kv, ring, rows, last_pos, sink, scale)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _draft_attention_fake(q, kv, ring, rows, last_pos, sink, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@dspark_op("draft_attention", reference=draft_attention_reference, fake=_draft_attention_fake)
def draft_attention(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, rows: torch.Tensor,
                    last_pos: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    return draft_attention_launch(q, kv, ring, rows, last_pos, sink, scale)
