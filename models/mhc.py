"""Manifold-constrained hyper-connections (docs/model.md, "mHC"), all fp32.

The residual stream X is [T, m, D] (m = hc_mult copies). `pre` collapses it to one layer
input; `post` writes the layer output back with a Sinkhorn-normalised m x m mixing matrix
C, summing over C's FIRST index (X'_j = post_j y + sum_i C[i, j] X_i).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels.common import upcast

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
        m = self.m
        xf = upcast(X.flatten(1))
        rho = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        mu = (xf @ self.fn.to(xf.dtype).T) * rho                                      # [T, (2+m)m]
        pre = torch.sigmoid(mu[:, :m] * self.scale[0] + self.base[:m]) + self.eps
        post = 2.0 * torch.sigmoid(mu[:, m:2 * m] * self.scale[1] + self.base[m:2 * m])
        c = (mu[:, 2 * m:] * self.scale[2] + self.base[2 * m:]).view(-1, m, m)
        c = torch.softmax(c, dim=-1) + self.eps
        c = c / (c.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            c = c / (c.sum(dim=-1, keepdim=True) + self.eps)
            c = c / (c.sum(dim=-2, keepdim=True) + self.eps)
        a = (pre.unsqueeze(-1) * upcast(X)).sum(1)
        return a.to(X.dtype), post, c

    @staticmethod
    def post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X'_j = post_j * y + sum_i comb[i, j] X_i (fp32), cast back to X.dtype."""
        mixed = torch.einsum("tij,tid->tjd", comb.to(upcast(X).dtype), upcast(X))
        return (post.unsqueeze(-1) * upcast(y).unsqueeze(1) + mixed).to(X.dtype)


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
        xf = upcast(X.flatten(1))
        rho = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        mu = (xf @ self.fn.to(xf.dtype).T) * rho
        g = torch.sigmoid(mu * self.scale[0] + self.base) + self.eps
        return (g.unsqueeze(-1) * upcast(X)).sum(1).to(X.dtype)
