"""One decoder block with manifold hyper-connections (docs/model.md, "Decoder block").

    (a, post, C) = hc_attn.pre(X);  X = hc_attn.post(attn(norm(a)), X, post, C)
    (f, post, C) = hc_ffn.pre(X);   X = hc_ffn.post(ffn(norm(f)), X, post, C)

Target blocks and DSpark draft blocks share it; only the attention module differs.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.models.attention import norm_and_quant
from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.linear import RMSNormWeight
from dspark_compile.models.mhc import HyperConnection
from dspark_compile.models.moe import MoE


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: nn.Module, hash_layer: bool, prec: Precision):
        super().__init__()
        self.cfg, self.prec = cfg, prec
        self.attn_norm = RMSNormWeight(cfg.hidden_size)
        self.ffn_norm = RMSNormWeight(cfg.hidden_size)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)
        self.attn = attn
        self.ffn = MoE(cfg, hash_layer, prec)

    def forward(self, X: torch.Tensor, tokens: torch.Tensor, attn_fn) -> torch.Tensor:
        """X [M, m, D]; attn_fn(x, xq) runs this block's attention on the normed input."""
        eps = self.cfg.rms_norm_eps
        a, post, comb = self.hc_attn.pre(X)
        x, xq = norm_and_quant(a, self.attn_norm.weight, eps, self.prec)
        X = HyperConnection.post(attn_fn(x, xq), X, post, comb)
        f, post, comb = self.hc_ffn.pre(X)
        x, xq = norm_and_quant(f, self.ffn_norm.weight, eps, self.prec)
        return HyperConnection.post(self.ffn(x, xq, tokens), X, post, comb)
