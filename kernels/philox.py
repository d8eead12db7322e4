"""Counter-based randomness shared by the reference samplers and the Triton kernels.

A draw is a pure function of (seed, c0, c1, c2): Philox4x32-10 exactly as `tl.philox` computes
it, so a Triton kernel calling `tl.philox(seed, c0, c1, c2, 0)` and this reference produce the
same bits. Keys are tensors (per-request seed, token position, vocab index, stream), so a CUDA
graph replay draws fresh, reproducible noise and nothing depends on a host-side counter.

Streams keep the noise of different consumers disjoint (the vLLM fork bug where the recovery
Gumbel reused the draft's proposal noise is exactly a missing stream id).
"""
from __future__ import annotations

import torch

# c2 values: one per consumer of randomness.
STREAM_DRAFT = 1        # Gumbel noise of the Markov draft sampler (vocab_gumbel, c1 = position)
STREAM_ACCEPT = 2       # uniform of the rejection test, c0 = 0, c1 = position
STREAM_RESAMPLE = 3     # Gumbel noise of residual / bonus sampling (vocab_gumbel, c1 = position)
STREAM_TARGET = 4       # Gumbel noise of plain (non-speculative) target sampling (vocab_gumbel)

_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mulhilo(a: int, b: torch.Tensor):
    """(hi, lo) 32-bit halves of a*b for a python uint32 constant and an int64 tensor < 2^32.

    int64 cannot hold a full 64-bit product, so split b into 16-bit halves.
    """
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    p_lo = a * b_lo                      # < 2^48
    p_hi = a * b_hi                      # < 2^48; true product = p_hi * 2^16 + p_lo
    mid = (p_hi & 0xFFFF) * 65536 + p_lo  # < 2^49
    lo = mid & _M32
    hi = ((p_hi >> 16) + (mid >> 32)) & _M32
    return hi, lo


def philox(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor,
           c3: torch.Tensor | None = None, rounds: int = 10):
    """Philox4x32 on broadcastable int64 tensors; returns four int64 tensors in [0, 2^32)."""
    seed = seed.to(torch.int64)
    k0 = seed & _M32
    k1 = (seed >> 32) & _M32
    c0 = c0.to(torch.int64) & _M32
    c1 = c1.to(torch.int64) & _M32
    c2 = c2.to(torch.int64) & _M32
    c3 = torch.zeros_like(c0) if c3 is None else c3.to(torch.int64) & _M32
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(c0, c1, c2, c3, k0, k1)
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _M32
        k1 = (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def bits_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """U[0, 1) in float32 from Philox words (int64 in [0, 2^32)), as Triton's
    `uint_to_uniform_float`."""
    x = torch.where(x >= 2**31, x - 2**32, x)  # bitcast to int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * 4.6566127342e-10


def uniform(seed, c0, c1, c2) -> torch.Tensor:
    """U[0, 1) in float32 from the first Philox word of (seed, c0, c1, c2)."""
    return bits_to_uniform(philox(seed, c0, c1, c2)[0])


def uniform_to_gumbel(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log u) in float32, u clamped away from 0 (never inf)."""
    u = u.clamp_min(1e-20)
    return -torch.log(-torch.log(u))


def vocab_uniform(seed: torch.Tensor, position: torch.Tensor, V: int, stream: int) -> torch.Tensor:
    """[B, V] uniforms over a vocabulary: token v takes word v % 4 of
    Philox(seed[b], c0 = v // 4, c1 = position[b], c2 = stream).

    One Philox block serves four consecutive tokens: a kernel drawing noise for every token of
    a row (Gumbel-max over 129k tokens) spends 4x less on Philox than with one block per token.
    """
    B = seed.shape[0]
    n4 = (V + 3) // 4
    c0 = torch.arange(n4, dtype=torch.int64, device=seed.device)[None, :]
    c2 = torch.full((1, 1), stream, dtype=torch.int64, device=seed.device)
    words = philox(seed.to(torch.int64)[:, None], c0, position.to(torch.int64)[:, None], c2)
    return bits_to_uniform(torch.stack(words, dim=-1).reshape(B, 4 * n4)[:, :V])


def vocab_gumbel(seed: torch.Tensor, position: torch.Tensor, V: int, stream: int) -> torch.Tensor:
    """[B, V] Gumbel noise over a vocabulary, from vocab_uniform."""
    return uniform_to_gumbel(vocab_uniform(seed, position, V, stream))
