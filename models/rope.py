"""RoPE tables (docs/model.md, "RoPE").

Two tables per model: SWA-only layers (and the draft) use `rope_theta` without YaRN; compressed
layers use `compress_rope_theta` with YaRN for everything in the layer (q, SWA KV, compressor
output, indexer q/k). Table row t = [cos(t·ω_0..ω_{R/2-1}), sin(...)], fp32. YaRN keeps the
magnitude at 1 (no mscale).
"""
from __future__ import annotations

import math

import torch

from dspark_compile.models.config import RopeSpec


def rope_frequencies(spec: RopeSpec, rope_dim: int) -> torch.Tensor:
    half = rope_dim // 2
    p = torch.arange(half, dtype=torch.float64)
    freqs = spec.theta ** (-2.0 * p / rope_dim)
    if spec.factor != 1.0 and spec.original_max_position_embeddings > 0:
        orig = spec.original_max_position_embeddings

        def correction_dim(n_rot: float) -> float:
            return rope_dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(spec.theta))

        low = max(math.floor(correction_dim(spec.beta_fast)), 0)
        high = min(math.ceil(correction_dim(spec.beta_slow)), rope_dim - 1)
        ramp = ((p - low) / max(high - low, 1e-3)).clamp(0, 1)
        # pairs below `low` keep their frequency, above `high` are divided by `factor`
        freqs = freqs / spec.factor * ramp + freqs * (1 - ramp)
    return freqs


def rope_table(spec: RopeSpec, rope_dim: int, max_pos: int) -> torch.Tensor:
    freqs = rope_frequencies(spec, rope_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).to(torch.float32)
