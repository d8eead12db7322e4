"""The DeepSeek-V4 target model: embed -> blocks -> hc_head -> norm -> LM head.

Buffers are named after the checkpoint (models/schema.py) so loading is a name check; the one
exception is the routed experts, stacked per layer (see models/weights.py).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels.act_quant import rmsnorm_reference

from dspark_compile.models.attention import Attention
from dspark_compile.models.batch import Batch
from dspark_compile.models.block import Block
from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.linear import RMSNormWeight, acc_dtype, bf16_linear
from dspark_compile.models.mhc import HCHead
from dspark_compile.models.rope import rope_table
from dspark_compile.models.state import state_limits


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(vocab, dim, dtype=torch.bfloat16))


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig, prec: Precision, max_positions: int, with_draft: bool = True):
        super().__init__()
        self.cfg, self.prec = cfg, prec
        main = rope_table(cfg.rope_main, cfg.qk_rope_head_dim, max_positions)
        comp = rope_table(cfg.rope_compress, cfg.qk_rope_head_dim, max_positions)
        self.register_buffer("rope_main", main, persistent=False)
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.head = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = RMSNormWeight(cfg.hidden_size)
        self.hc_head = HCHead(cfg)
        self.layers = nn.ModuleList(
            Block(cfg, Attention(cfg, r, prec, comp if r else main), i < cfg.num_hash_layers, prec)
            for i, r in enumerate(cfg.compress_ratios))
        if with_draft and cfg.has_draft:
            from dspark_compile.models.draft import DraftStage  # the draft builds on these modules
            self.mtp = nn.ModuleList(DraftStage(cfg, i, prec, main) for i in range(cfg.n_mtp_layers))
        else:
            self.mtp = None

    def embed_streams(self, tokens: torch.Tensor) -> torch.Tensor:
        """[M] ids -> [M, m, D]: all hyper-connection streams start as the embedding."""
        e = self.embed.weight[tokens].to(self.prec.dtype)
        return e.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def logits(self, X: torch.Tensor, hc_head: HCHead, norm_weight: torch.Tensor) -> torch.Tensor:
        """[M, m, D] -> fp32 (fp64 in exact mode) logits [M, V]; shared with the draft's head."""
        h = rmsnorm_reference(hc_head(X), norm_weight, self.cfg.rms_norm_eps)
        return bf16_linear(h, self.head.weight, self.prec.dtype, acc_dtype(self.prec.dtype))

    def forward(self, batch: Batch, state: dict, aux_layers: tuple = (),
                logits_at: torch.Tensor | None = None):
        """Returns logits [B, T, V] and, if asked, the hc-mean of the streams after each layer
        in `aux_layers` concatenated: [B, T, len * D] (the DSpark draft's conditioning).

        `logits_at` [K] (flat token indices into B * T): the logits of those tokens only, [K, V].
        A prefill chunk samples from one token; the head over all of its C tokens would cost
        2 C V D FLOPs and C V fp32 logits for nothing (C = 512 at Flash dims: 542 GFLOP, 265 MB)."""
        B, T = batch.B, batch.T
        # shapes only: a static check, also while export traces (no device read)
        step_tokens, _ = state_limits(state, self.cfg)
        if T > step_tokens:
            raise ValueError(f"forward: {T} tokens per row exceed the state's max_step_tokens="
                             f"{step_tokens} (the ring buffers' headroom for one forward)")
        tokens = batch.tokens.reshape(-1)
        X = self.embed_streams(tokens)
        aux = []
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}"
            X = layer(X, tokens, lambda x, xq, a=layer.attn, p=p: a(x, xq, batch, state, p))
            if i in aux_layers:
                aux.append(X.to(acc_dtype(self.prec.dtype)).mean(1).to(self.prec.dtype))
        aux = torch.cat(aux, -1).view(B, T, -1) if aux else None
        if logits_at is not None:
            if logits_at.dim() != 1 or logits_at.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"forward: logits_at must be a 1-D integer tensor of flat token "
                                 f"indices into B * T = {B * T}, got {logits_at.dtype} "
                                 f"{list(logits_at.shape)}")
            # X [B*T, m, D]: the selection comes before hc_head, so fuse_mhc keeps the last
            # layer's hc_post apart from the head (one more launch, C - 1 fewer head rows)
            return self.logits(X.index_select(0, logits_at), self.hc_head, self.norm.weight), aux
        return self.logits(X, self.hc_head, self.norm.weight).view(B, T, -1), aux
