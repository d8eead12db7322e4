"""Activation quantization in front of FP8 block-scaled GEMMs (reference; Triton in issue 4).

Per token, groups of 128 along K, float8_e4m3fn with power-of-two (UE8M0) scales
`2^ceil(log2(max(amax, 1e-4) / 448))`.

- `swiglu_quant_reference`: SwiGLU with clamp (gate clamped above at `limit`, up clamped to
  [-limit, limit]; fp32 math, h rounded to the input dtype) then the quant. Shared experts.
- `rmsnorm_quant_reference`: weighted RMSNorm (fp32 math, rounded to the input dtype) then the
  quant; returns the normed activations too because other consumers (compressor, router, routed
  experts) read them unquantized.
- `act_quant_reference`: the quant alone.

Bytes per token that must move (Flash shared expert, I = 2048): read g, u 8 KB (bf16), write
2 KB fp8 + 64 B scales.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import fp8_group_quant, rmsnorm, upcast

ACT_QUANT_GROUP = 128


def act_quant_reference(x: torch.Tensor):
    """x [T, K] -> (q float8_e4m3fn [T, K], scale fp32 [T, K/128])."""
    return fp8_group_quant(x, ACT_QUANT_GROUP)


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, -limit, limit) in fp32, rounded to g's dtype (limit 0 = off)."""
    gf, uf = upcast(g), upcast(u)
    if limit > 0:
        gf = gf.clamp(max=limit)
        uf = uf.clamp(-limit, limit)
    return (F.silu(gf) * uf).to(g.dtype)


def swiglu_quant_reference(g: torch.Tensor, u: torch.Tensor, limit: float):
    return act_quant_reference(swiglu(g, u, limit))


def rmsnorm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (y = rmsnorm(x) in x.dtype, q, scale)."""
    y = rmsnorm(x, weight, eps)
    q, s = act_quant_reference(y)
    return y, q, s
