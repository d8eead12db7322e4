"""KV compressor of C4 / C128 layers (docs/model.md, "Compressor").

Every token's (k, score) goes into a per-row fp32 ring; when token t closes block
b = t // ratio ((t+1) % ratio == 0) the block is pooled: a per-channel softmax over its rows
(C4 overlaps: the previous block's first halves + this block's second halves, previous rows
masked for b = 0), RMSNorm, rounded to the compute dtype, RoPE at position b·ratio.

Fixed shapes: a forward of T tokens per row closes at most ceil(T / ratio) blocks per row, so
the pooling runs on that many *candidates* per row (offsets e0, e0 + ratio, ...) and masks the
ones past the chunk.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dspark_compile.kernels.common import masked_row_write, rmsnorm, rope_last

from dspark_compile.models.batch import Batch
from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.linear import BF16Linear, RMSNormWeight, acc_dtype
from dspark_compile.models.state import coff


class Compressor(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, d_c: int, prec: Precision):
        super().__init__()
        self.ratio, self.d_c, self.coff, self.prec = ratio, d_c, coff(ratio), prec
        self.eps = cfg.rms_norm_eps
        w = self.coff * d_c
        self.register_buffer("ape", torch.zeros(ratio, w))
        self.norm = RMSNormWeight(d_c)
        self.wkv = BF16Linear(w, cfg.hidden_size, prec)
        self.wgate = BF16Linear(w, cfg.hidden_size, prec)

    def forward(self, x: torch.Tensor, batch: Batch, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                cos_sin: torch.Tensor):
        """x [B*T, D]. Updates the rings; returns (entries [B, n, d_c], block ids [B, n], closes [B, n])."""
        acc = acc_dtype(self.prec.dtype)
        B, T, CR = batch.B, batch.T, self.ratio
        ring = ring_kv.shape[1]
        k = self.wkv(x, out_dtype=acc)
        s = self.wgate(x, out_dtype=acc) + self.ape[batch.flat_pos() % CR].to(acc)
        slots = batch.ring_slots(ring)
        masked_row_write(ring_kv.flatten(0, 1), slots, k)
        masked_row_write(ring_score.flatten(0, 1), slots, s)

        # candidate block ends within this chunk
        n = math.ceil(T / CR)
        pos0 = batch.pos[:, :1]                                            # [B, 1]
        e0 = (CR - 1 - pos0 % CR) % CR
        offs = e0 + CR * torch.arange(n, device=x.device)[None, :]       # [B, n]
        closes = offs < T
        blk = (pos0 + offs) // CR                                          # [B, n]

        # positions pooled for each candidate: [B, n, coff*CR]
        first = (blk - (self.coff - 1)) * CR
        src_pos = first[..., None] + torch.arange(self.coff * CR, device=x.device)
        src_ok = src_pos >= 0
        slot = src_pos.clamp_min(0) % ring
        rowsel = batch.rows[:, None, None].expand_as(slot)
        kv = ring_kv[rowsel, slot].to(acc)                                 # [B, n, coff*CR, coff*d]
        sc = ring_score[rowsel, slot].to(acc)
        if self.coff == 2:
            # rows of the previous block take the first half, this block's rows the second half
            kv = torch.cat((kv[..., :CR, :self.d_c], kv[..., CR:, self.d_c:]), dim=-2)
            sc = torch.cat((sc[..., :CR, :self.d_c], sc[..., CR:, self.d_c:]), dim=-2)
        sc = sc.masked_fill(~src_ok[..., None], float("-inf"))
        kv = kv.masked_fill(~src_ok[..., None], 0.0)
        pooled = (torch.softmax(sc, dim=-2) * kv).sum(-2)                  # [B, n, d_c]
        pooled = rmsnorm(pooled, self.norm.weight, self.eps).to(self.prec.dtype)
        rope_dim = cos_sin.shape[-1]
        pooled = rope_last(pooled.reshape(B * n, self.d_c), cos_sin, (blk * CR).reshape(-1), rope_dim)
        return pooled.view(B, n, self.d_c), blk, closes

    @staticmethod
    def entry_slots(batch: Batch, blk: torch.Tensor, closes: torch.Tensor, n_entries: int) -> torch.Tensor:
        """Flat slots into a [rows, n_entries, ...] cache; -1 where nothing is stored."""
        ok = closes & batch.valid[:, None] & (blk < n_entries)
        slots = batch.rows[:, None] * n_entries + blk
        return torch.where(ok, slots, torch.full_like(slots, -1)).reshape(-1)
