"""QKV post-processing of DeepSeek-V4 attention (reference; the Triton kernel lands with issue 4).

Unfused, per attention layer and step (T tokens, H heads, head dim D, rope dim R, nope = D - R):

    q  = rmsnorm(q, weight=None)                 # per head, fp32 math, rounded to q.dtype
    q[..., nope:] = rope_gptj(q[..., nope:], t)  # rounded to q.dtype
    kv[..., nope:] = rope_gptj(kv[..., nope:], t)
    nope8, scale = fp8 e4m3 quant of kv[..., :nope] in groups of 64 (UE8M0 scales)
    cache_nope[slot], cache_scale[slot], cache_rope[slot] = nope8, exponent bytes, bf16 rope part

Three entry points, all sharing the same math:
- `qkv_postprocess_reference`: target layers with the FP8 (fp8_ds_mla-style) SWA cache;
- `qkv_rope_reference`: no store (draft block KV is consumed directly; exact-precision mode);
- `context_kv_store_reference`: draft context ring (no quant), writes only rows whose slot >= 0
  (the step gives rejected rows slot -1).

Cache convention: slot = flat row index into the cache viewed as [S, ...]; -1 writes nothing
(see kernels.common.masked_row_write). Bytes per token that must move (Flash: H=64, D=512):
read q 64 KB + kv 1 KB (bf16), write q 64 KB + 584 B cache row.
"""
from __future__ import annotations

import torch

from .common import fp8_group_quant, masked_row_write, rmsnorm, rope_last, scale_to_e8m0_byte

KV_QUANT_GROUP = 64


def _q_norm_rope(q, positions, cos_sin, eps):
    rope_dim = cos_sin.shape[-1]
    qn = rmsnorm(q, None, eps)
    return rope_last(qn, cos_sin, positions, rope_dim)


def qkv_rope_reference(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                       cos_sin: torch.Tensor, eps: float):
    """q [T,H,D] -> per-head weightless RMSNorm + RoPE; kv [T,D] -> RoPE. Returns (q', kv')."""
    rope_dim = cos_sin.shape[-1]
    return _q_norm_rope(q, positions, cos_sin, eps), rope_last(kv, cos_sin, positions, rope_dim)


def kv_quant_reference(kv_roped: torch.Tensor, nope: int):
    """Split a RoPE'd kv row into (fp8 nope, uint8 exponent bytes, bf16 rope) as the cache holds it."""
    q8, scale = fp8_group_quant(kv_roped[..., :nope], KV_QUANT_GROUP)
    return q8, scale_to_e8m0_byte(scale), kv_roped[..., nope:].to(torch.bfloat16)


def qkv_postprocess_reference(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                              cos_sin: torch.Tensor, slots: torch.Tensor, cache_nope: torch.Tensor,
                              cache_scale: torch.Tensor, cache_rope: torch.Tensor,
                              eps: float) -> torch.Tensor:
    """Target layers: returns q'; writes the FP8 KV row of every token with slot >= 0."""
    q_out, kv_out = qkv_rope_reference(q, kv, positions, cos_sin, eps)
    nope = cache_nope.shape[-1]
    q8, sbytes, rope = kv_quant_reference(kv_out, nope)
    masked_row_write(cache_nope, slots, q8)
    masked_row_write(cache_scale, slots, sbytes)
    masked_row_write(cache_rope, slots, rope)
    return q_out


def context_kv_store_reference(kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                               slots: torch.Tensor, cache: torch.Tensor) -> None:
    """Draft context: RoPE kv [T,D] at its position and store rows with slot >= 0 (no quant)."""
    rope_dim = cos_sin.shape[-1]
    masked_row_write(cache, slots, rope_last(kv, cos_sin, positions, rope_dim))
