"""Manifold-constrained hyper-connections (docs/model.md, "mHC"), all fp32 (fp64 in exact mode).

The residual stream X is [T, m, D] (m = hc_mult copies). `pre` collapses it to one layer
input; `post` writes the layer output back with a Sinkhorn-normalised m x m mixing matrix
C, summing over C's FIRST index (X'_j = post_j y + sum_i C[i, j] X_i). The math is in
kernels/mhc.py: these modules hold the weights and call the `@fusable` references, so each call
site is one region of the exported step (passes/fuse_mhc.py).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels.mhc import hc_head_reference, hc_post_reference, hc_pre_reference

from dspark_compile.models.config import ModelConfig


class HyperConnection(nn.Module):
    """Holds hc_{site}_fn [(2+m)m, mD], hc_{site}_base [(2+m)m], hc_{site}_scale [3]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.hc_mult
        self.m, self.eps, self.norm_eps, self.iters = m, cfg.hc_eps, cfg.rms_norm_eps, cfg.hc_sinkhorn_iters
        self.register_buffer("fn", torch.zeros(cfg.hc_mix, m * cfg.hidden_size))
        self.register_buffer("base", torch.zeros(cfg.hc_mix))
        self.register_buffer("scale", torch.zeros(3))

    def pre(self, X: torch.Tensor):
        """X [T, m, D] -> (a [T, D] in X.dtype, post [T, m], comb [T, m, m]) (fp32 weights)."""
        return hc_pre_reference(X, self.fn, self.scale, self.base, self.eps, self.norm_eps,
                                self.iters)

    @staticmethod
    def post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X'_j = post_j * y + sum_i comb[i, j] X_i (fp32), cast back to X.dtype."""
        return hc_post_reference(y, X, post, comb)


class HCHead(nn.Module):
    """Collapse the m streams for the LM head: sigmoid gates, no Sinkhorn, no post."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.register_buffer("fn", torch.zeros(m, m * cfg.hidden_size))
        self.register_buffer("base", torch.zeros(m))
        self.register_buffer("scale", torch.zeros(1))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return hc_head_reference(X, self.fn, self.scale, self.base, self.eps, self.norm_eps)
