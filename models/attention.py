"""DeepSeek-V4 attention: MQA over one 512-d latent that is both key and value.

Per layer (docs/model.md, "Attention"): q/kv projections and norms, QKV post-processing
(q weightless per-head norm + RoPE, kv RoPE + FP8 quant + SWA insert), then on compressed
layers the compressor (and on C4 layers the lightning indexer's top-k), then one softmax over
SWA window ∪ compressed candidates with the sink in the denominator only, inverse RoPE at the
query position, grouped low-rank output projection. The indexer's scores + top-k and the
attention are one `dspark::` op each (kernels/indexer_topk.py, kernels/sparse_attention.py),
reading the caches as stored.

Candidates are read back from the caches after this forward's writes, so a token attends to
its own (quantized) KV exactly as vLLM does, and causality inside a multi-token forward comes
from masks on absolute positions.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels import indexer_topk as _indexer_topk  # noqa: F401 (registers the op)
from dspark_compile.kernels import sparse_attention as _sparse_attention  # noqa: F401 (registers)
from dspark_compile.kernels.act_quant import rmsnorm_quant_reference, rmsnorm_reference
from dspark_compile.kernels.common import masked_row_write
from dspark_compile.kernels.rope import rope_reference
from dspark_compile.kernels.qkv_postprocess import (
    qkv_postprocess_reference, qkv_rope_reference)

from dspark_compile.models.batch import Batch
from dspark_compile.models.compressor import Compressor
from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.linear import BF16Linear, FP8Linear, RMSNormWeight, acc_dtype


def kv_cache(state: dict, prefix: str) -> tuple:
    """(kv, scale, rope) of a cache as stored: fp8 nope, E8M0 bytes, bf16 rope (fp8_ds_mla style),
    or (float kv, None, None) when the KV caches are not FP8."""
    if f"{prefix}_kv" in state:
        return state[f"{prefix}_kv"], None, None
    return state[f"{prefix}_nope"], state[f"{prefix}_scale"], state[f"{prefix}_rope"]


def norm_and_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, prec: Precision):
    """RMSNorm whose output feeds an FP8 GEMM: (y, (q, s) or None)."""
    if prec.act_quant:
        y, q, s = rmsnorm_quant_reference(x, weight, eps)
        return y, (q, s)
    return rmsnorm_reference(x, weight, eps), None


class Indexer(nn.Module):
    """Lightning indexer of C4 layers: top-k compressed entries per query."""

    def __init__(self, cfg: ModelConfig, prec: Precision):
        super().__init__()
        self.cfg, self.prec = cfg, prec
        self.wq_b = FP8Linear(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, prec, cfg.fp8_block)
        self.weights_proj = BF16Linear(cfg.index_n_heads, cfg.hidden_size, prec)
        self.compressor = Compressor(cfg, 4, cfg.index_head_dim, prec)

    def forward(self, x, qr, qr_q, batch: Batch, state: dict, p: str, cos_sin: torch.Tensor):
        cfg, acc = self.cfg, acc_dtype(self.prec.dtype)
        B, T = batch.B, batch.T
        k_cache = state[f"{p}.idx_k"]
        # the entries that close in this step pooled and inserted by one op
        self.compressor.store(x, batch, state[f"{p}.idx_kv"], state[f"{p}.idx_score"], cos_sin, k_cache)
        qi = self.wq_b(qr, qr_q).view(B * T, cfg.index_n_heads, cfg.index_head_dim)
        qi = rope_reference(qi, cos_sin, batch.flat_pos(), cos_sin.shape[-1], False)
        qi = qi.view(B, T, cfg.index_n_heads, -1)
        w = self.weights_proj(x, out_dtype=acc) * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
        # scores over the visible entries + top-k (ties: lowest entry index), -1 = no entry
        idx = torch.ops.dspark.indexer_topk(qi, w.view(B, T, -1), k_cache, batch.rows, batch.pos,
                                            cfg.index_topk, 4)
        return idx, idx >= 0


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, prec: Precision, cos_sin: torch.Tensor):
        super().__init__()
        self.cfg, self.ratio, self.prec = cfg, ratio, prec
        # the layer's RoPE table (compressed table with YaRN when ratio > 0); not a checkpoint tensor
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        H, d, D, blk = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size, cfg.fp8_block
        self.register_buffer("attn_sink", torch.zeros(H))
        self.q_norm = RMSNormWeight(cfg.q_lora_rank)
        self.kv_norm = RMSNormWeight(d)
        self.wq_a = FP8Linear(cfg.q_lora_rank, D, prec, blk)
        self.wq_b = FP8Linear(H * d, cfg.q_lora_rank, prec, blk)
        self.wkv = FP8Linear(d, D, prec, blk)
        self.wo_a = FP8Linear(cfg.o_groups * cfg.o_lora_rank, (H // cfg.o_groups) * d, prec, blk)
        self.wo_b = FP8Linear(D, cfg.o_groups * cfg.o_lora_rank, prec, blk)
        if ratio:
            self.compressor = Compressor(cfg, ratio, d, prec)
        if ratio == 4:
            self.indexer = Indexer(cfg, prec)

    def project_q_kv(self, x, xq):
        """Shared by target and draft layers: (q [M, H, d], qr, qr_q, kv [M, d]) before RoPE."""
        cfg = self.cfg
        qr, qr_q = norm_and_quant(self.wq_a(x, xq), self.q_norm.weight, cfg.rms_norm_eps, self.prec)
        kv = rmsnorm_reference(self.wkv(x, xq), self.kv_norm.weight, cfg.rms_norm_eps)
        q = self.wq_b(qr, qr_q).view(-1, cfg.num_attention_heads, cfg.head_dim)
        return q, qr, qr_q, kv

    def output(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """o [M, H, d] -> inverse RoPE at the query position -> grouped wo_a -> wo_b."""
        cfg = self.cfg
        o = rope_reference(o, self.cos_sin, positions, cfg.qk_rope_head_dim, True)
        flat = o.reshape(o.shape[0], -1)                                      # [M, H*d]
        # one fp8_linear over the o_groups: group g's heads times wo_a rows [g*o_lora, ...)
        z = self.wo_a(flat, groups=cfg.o_groups)                             # [M, G*o_lora]
        return self.wo_b(z)

    def forward(self, x, xq, batch: Batch, state: dict, p: str) -> torch.Tensor:
        cfg, prec = self.cfg, self.prec
        B, T = batch.B, batch.T
        cos_sin = self.cos_sin
        q, qr, qr_q, kv = self.project_q_kv(x, xq)
        pos = batch.flat_pos()
        swa_ring = state[f"{p}.swa_nope" if prec.kv_fp8 else f"{p}.swa_kv"].shape[1]
        slots = batch.ring_slots(swa_ring)
        if prec.kv_fp8:
            q = qkv_postprocess_reference(q, kv, pos, cos_sin, slots, state[f"{p}.swa_nope"].flatten(0, 1),
                                          state[f"{p}.swa_scale"].flatten(0, 1),
                                          state[f"{p}.swa_rope"].flatten(0, 1), cfg.rms_norm_eps)
        else:
            q, kv_r = qkv_rope_reference(q, kv, pos, cos_sin, cfg.rms_norm_eps)
            masked_row_write(state[f"{p}.swa_kv"].flatten(0, 1), slots, kv_r)

        # candidates: the SWA window (ring slot p % ring for p in (P - W, P]) and, on compressed
        # layers, C128's visible entries or C4's top-k list, read after this forward's writes
        cmp, top_idx = (None, None, None), None
        if self.ratio:
            if self.ratio == 4:
                top_idx, _ = self.indexer(x, qr, qr_q, batch, state, p, cos_sin)
            cmp = kv_cache(state, f"{p}.ckv")
            self.compressor.store(x, batch, state[f"{p}.cmp_kv"], state[f"{p}.cmp_score"], cos_sin,
                                  cmp[0] if cmp[1] is None else cmp)

        q = q.view(B, T, cfg.num_attention_heads, cfg.head_dim)
        o = torch.ops.dspark.sparse_attention(q, *kv_cache(state, f"{p}.swa"), *cmp, top_idx, batch.rows,
                                              batch.pos, self.attn_sink, cfg.head_dim ** -0.5,
                                              cfg.sliding_window, self.ratio)
        return self.output(o.view(B * T, cfg.num_attention_heads, -1), pos)
