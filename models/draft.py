"""The DSpark draft (docs/model.md, "DSpark draft"): three SWA-only DSV4 blocks under `mtp.{i}`.

Conditioning ("KV injection"): the target's hc-mean hidden states after
`dspark_target_layer_ids` are concatenated, `main_x = main_norm(main_proj(aux))`, and every draft
layer turns main_x into its own context KV (`kv_norm(wkv(main_x))`, RoPE at the context token's
position) stored in a per-row ring of `sliding_window` entries — committed rows only.

A draft pass runs N query tokens per row, [anchor, noise x (N-1)] at positions last+1..last+N;
each query attends (non-causally) to the valid ring entries (positions <= last) plus all N
block KVs, with the sink in the denominator. Base logits come from the shared LM head after
`mtp.{last}.hc_head` and `.norm`; the Markov head (rank r) adds W2 · W1[prev] in the sampler.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels import draft_attention as _draft_attention  # noqa: F401 (registers the op)
from dspark_compile.kernels.act_quant import rmsnorm_reference
from dspark_compile.kernels.qkv_postprocess import context_kv_store_reference, qkv_rope_reference

from dspark_compile.models.attention import Attention, norm_and_quant
from dspark_compile.models.block import Block
from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.linear import FP8Linear, RMSNormWeight
from dspark_compile.models.mhc import HCHead


class MarkovHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.markov_w1 = _Weight(cfg.vocab_size, cfg.dspark_markov_rank)
        self.markov_w2 = _Weight(cfg.vocab_size, cfg.dspark_markov_rank)


class _Weight(nn.Module):
    def __init__(self, *shape, dtype=torch.bfloat16):
        super().__init__()
        self.register_buffer("weight", torch.zeros(*shape, dtype=dtype))


class DraftAttention(Attention):
    """SWA-only attention over (context ring ∪ block), non-causal inside the block."""

    def __init__(self, cfg: ModelConfig, prec: Precision, cos_sin: torch.Tensor):
        super().__init__(cfg, 0, prec, cos_sin)

    def forward(self, x, xq, rows, pos, last_pos, ring):
        cfg = self.cfg
        B, N = pos.shape
        H = cfg.num_attention_heads
        q, _, _, kv = self.project_q_kv(x, xq)
        q, kv = qkv_rope_reference(q, kv, pos.reshape(-1), self.cos_sin, cfg.rms_norm_eps)
        # one op: the context ring read once per tile of the block's N x H query rows
        o = torch.ops.dspark.draft_attention(q.view(B, N, H, -1), kv.view(B, N, -1), ring, rows,
                                             last_pos, self.attn_sink, cfg.head_dim ** -0.5)
        return self.output(o.view(B * N, H, -1), pos.reshape(-1))

    def context_kv(self, main_x, main_xq):
        return rmsnorm_reference(self.wkv(main_x, main_xq), self.kv_norm.weight,
                                 self.cfg.rms_norm_eps)


class DraftStage(Block):
    """`mtp.{i}`: a block, plus main_proj/main_norm on stage 0 and the heads on the last stage."""

    def __init__(self, cfg: ModelConfig, i: int, prec: Precision, cos_sin: torch.Tensor):
        super().__init__(cfg, DraftAttention(cfg, prec, cos_sin), False, prec)
        D = cfg.hidden_size
        if i == 0:
            self.main_proj = FP8Linear(D, len(cfg.dspark_target_layer_ids) * D, prec, cfg.fp8_block)
            self.main_norm = RMSNormWeight(D)
        if i == cfg.n_mtp_layers - 1:
            self.norm = RMSNormWeight(D)
            self.hc_head = HCHead(cfg)
            self.markov_head = MarkovHead(cfg)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = _Weight(1, D + cfg.dspark_markov_rank)


def store_context(model, aux: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, state: dict):
    """Draft context from target aux states: aux [M, nL*D], positions [M], slots [M] (-1 = skip)."""
    cfg, prec = model.cfg, model.prec
    first = model.mtp[0]
    main_x, main_xq = norm_and_quant(first.main_proj(aux.to(prec.dtype)), first.main_norm.weight,
                                     cfg.rms_norm_eps, prec)
    for i, stage in enumerate(model.mtp):
        kv = stage.attn.context_kv(main_x, main_xq)
        context_kv_store_reference(kv, positions, stage.attn.cos_sin, slots, state[f"mtp.{i}.ctx"].flatten(0, 1))


def draft_forward(model, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, last_pos: torch.Tensor,
                  state: dict) -> torch.Tensor:
    """Base logits [B, N, V] for the block ids [B, N] at positions pos [B, N]."""
    B, N = ids.shape
    flat = ids.reshape(-1)
    X = model.embed_streams(flat)
    for i, stage in enumerate(model.mtp):
        ring = state[f"mtp.{i}.ctx"]
        X = stage(X, flat, lambda x, xq, a=stage.attn, r=ring: a(x, xq, rows, pos, last_pos, r))
    last = model.mtp[-1]
    return model.logits(X, last.hc_head, last.norm.weight).view(B, N, -1)


def markov_weights(model):
    head = model.mtp[-1].markov_head
    return head.markov_w1.weight, head.markov_w2.weight
