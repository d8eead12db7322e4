"""KV compressor of C4 / C128 layers (docs/model.md, "Compressor").

Every token's (k, score) goes into a per-row fp32 ring; when token t closes block
b = t // ratio ((t+1) % ratio == 0) the block is pooled: a per-channel softmax over its rows
(C4 overlaps: the previous block's first halves + this block's second halves, previous rows
masked for b = 0), RMSNorm, rounded to the compute dtype, RoPE at position b·ratio.

The two GEMMs (wkv, wgate) run here; everything after them -- ape, the ring writes, the pooling,
norm and RoPE, and in `store` the insert into the compressed cache -- is one `dspark::compress*`
op (kernels/compress.py, whose reference is the definition of the numerics).

Fixed shapes: a forward of T tokens per row closes at most ceil(T / ratio) blocks per row, so
the pooling runs on that many *candidates* per row (offsets e0, e0 + ratio, ...) and masks the
ones past the chunk.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels import compress as compress_kernel  # noqa: F401  (registers the ops)
from dspark_compile.kernels.compress import block_ends, entry_slots

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

    def _op_args(self, x, batch: Batch, ring_kv, ring_score, cos_sin):
        acc = acc_dtype(self.prec.dtype)
        k = self.wkv(x, out_dtype=acc)
        s = self.wgate(x, out_dtype=acc)
        return (k, s, self.ape, batch.pos, batch.rows, batch.valid,
                batch.ring_slots(ring_kv.shape[1]), ring_kv, ring_score, self.norm.weight, cos_sin)

    def forward(self, x: torch.Tensor, batch: Batch, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                cos_sin: torch.Tensor):
        """x [B*T, D]. Updates the rings; returns (entries [B, n, d_c], block ids [B, n], closes [B, n]).

        Entries are defined where the block closes in a valid row (the kernel leaves zeros
        elsewhere); the caller stores them at `entry_slots`."""
        entries = torch.ops.dspark.compress(*self._op_args(x, batch, ring_kv, ring_score, cos_sin),
                                            self.eps, self.prec.dtype)
        blk, closes = block_ends(batch.pos, self.ratio)
        return entries, blk, closes

    def store(self, x: torch.Tensor, batch: Batch, ring_kv: torch.Tensor, ring_score: torch.Tensor,
              cos_sin: torch.Tensor, cache) -> None:
        """forward + the insert of the closing entries, in one op: `cache` is a float cache
        [rows, n_entries, d_c] (indexer K, compressed KV without FP8) or the FP8 triple
        (nope, scale, rope) of the compressed KV."""
        args = self._op_args(x, batch, ring_kv, ring_score, cos_sin)
        if isinstance(cache, torch.Tensor):
            torch.ops.dspark.compress_store(*args, cache, self.eps, self.prec.dtype)
        else:
            torch.ops.dspark.compress_store_fp8(*args, *cache, self.eps, self.prec.dtype)

    @staticmethod
    def entry_slots(batch: Batch, blk: torch.Tensor, closes: torch.Tensor, n_entries: int) -> torch.Tensor:
        """Flat slots into a [rows, n_entries, ...] cache; -1 where nothing is stored."""
        return entry_slots(batch.rows, batch.valid, blk, closes, n_entries)
