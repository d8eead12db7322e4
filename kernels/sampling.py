"""Shared sampling math (reference): logits processing, Gumbel-max, plain target sampling.

Conventions every sampler of the project follows (the Markov draft sampler, rejection sampling,
plain target decoding), all fixed-shape and capture-safe:

- A row is greedy iff temperature[b] <= 0. Greedy rows take argmax of the raw logits (ties ->
  lowest id).
- Otherwise z = logits / T (fp32), then
  * top-k keeps every token whose z is >= the k-th largest z (top_k <= 0 or >= V: off). Ties at
    the k-th value are all kept, which makes the kept set a threshold `z >= tau`: that is what a
    fused kernel can compute without sorting, and it is what vLLM's threshold masking does.
  * top-p keeps the smallest set of the largest tokens whose mass reaches top_p (top_p >= 1 or
    NaN: off; at least the top token is always kept), measured on the distribution left after
    top-k. In threshold form: tau_p = the largest value v with mass(z >= v) >= top_p * Z, where
    masses are exp(z - max) and Z is their total over the top-k set. Ties at tau_p are kept.
  * p = softmax over the kept tokens.
- A degenerate row (any NaN, or a maximum that is not finite: all -inf, or +inf present) yields
  token 0 and probabilities that are all (finite) zeros. Greedy rows follow the same rule.
- Sampling from a distribution p is Gumbel-max: argmax_v(log p(v) + g(v)) with
  g = kernels.philox.gumbel(seed, c0 = v, c1 = position of the token being sampled, c2 = stream);
  excluded tokens (p = 0) never win; nothing left -> token 0.
- Token ids outside [0, V) are folded to 0 before they index anything.

The cumulative masses of top-p are summed in float64 here: the reference should be the exact
definition, and fused kernels sum fixed-point masses (order independent, so deterministic). The
two agree except where a token's mass-above lies within ~1e-7 of top_p * Z.
"""
from __future__ import annotations

import torch

from .philox import STREAM_TARGET, gumbel

NEG_INF = float("-inf")


def fold_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids outside [0, vocab) -> 0 (same dtype and shape)."""
    return torch.where((ids >= 0) & (ids < vocab), ids, torch.zeros_like(ids))


def greedy_rows(temperature: torch.Tensor) -> torch.Tensor:
    """[B] bool: temperature <= 0 (a NaN temperature is not greedy; its row is degenerate)."""
    return temperature <= 0


def degenerate_rows(x: torch.Tensor) -> torch.Tensor:
    """[B] bool: the row holds a NaN or its maximum is not finite (amax propagates NaN)."""
    return ~torch.isfinite(x.amax(-1))


def argmax_tokens(x: torch.Tensor) -> torch.Tensor:
    """Lowest-id argmax over the last dim; degenerate rows -> 0. int64."""
    tok = torch.argmax(torch.where(torch.isnan(x), torch.zeros_like(x), x), dim=-1)
    return torch.where(degenerate_rows(x), torch.zeros_like(tok), tok)


def _check_rows(name: str, t: torch.Tensor, B: int, dtypes) -> None:
    if t.shape != (B,) or t.dtype not in dtypes:
        raise ValueError(f"{name} must be a [{B}] tensor of {[str(d) for d in dtypes]}, got "
                         f"{t.dtype} {tuple(t.shape)}")


FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.int64, torch.int32)


def check_sampling_params(B: int, temperature, top_k, top_p, seed=None, position=None,
                          position_name: str = "position") -> None:
    """Clear errors naming the argument for mis-shaped or mis-typed sampling metadata."""
    _check_rows("temperature", temperature, B, FLOATS)
    _check_rows("top_k", top_k, B, INTS)
    _check_rows("top_p", top_p, B, FLOATS)
    if seed is not None:
        _check_rows("seed", seed, B, INTS)
    if position is not None:
        _check_rows(position_name, position, B, INTS)


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Masked, temperature-scaled logits fp32 [B, V]; excluded tokens are -inf.

    Degenerate rows come back all -inf. Greedy rows are processed as if T = 1 (their consumers
    use argmax of the raw logits instead).
    """
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a float [B, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    B, V = logits.shape
    check_sampling_params(B, temperature, top_k, top_p)
    t = temperature.float()
    t = torch.where(greedy_rows(t), torch.ones_like(t), t)
    z = logits.float() / t[:, None]
    bad = degenerate_rows(z)
    z = torch.where(bad[:, None], torch.zeros_like(z), z)  # keep NaN out of the sorts below
    ninf = torch.full_like(z, NEG_INF)

    # top-k: threshold at the k-th largest value (ties kept)
    k = top_k.to(torch.int64)
    k_on = (k > 0) & (k < V)
    srt = torch.sort(z, dim=-1, descending=True).values
    kth = srt.gather(1, (k.clamp(1, V) - 1)[:, None])
    z = torch.where(k_on[:, None] & (z < kth), ninf, z)

    # top-p on the top-k distribution: tau = sorted value at the first index whose inclusive
    # cumulative mass reaches top_p * Z (float64 masses: the exact definition)
    p = top_p.double()
    p_on = p < 1.0                                  # NaN compares False: off
    srt = torch.sort(z, dim=-1, descending=True).values
    m = srt[:, :1]
    mass = torch.exp(srt.double() - m.double())     # -inf -> 0
    cum = torch.cumsum(mass, dim=-1)
    target = p[:, None] * cum[:, -1:]
    n_finite = torch.isfinite(srt).sum(-1, keepdim=True)
    J = torch.minimum((cum < target).sum(-1, keepdim=True), n_finite - 1).clamp_min(0)
    tau = srt.gather(1, J)
    z = torch.where(p_on[:, None] & (z < tau), ninf, z)
    return torch.where(bad[:, None], ninf, z)


def probs_from_processed(z: torch.Tensor) -> torch.Tensor:
    """softmax over the kept (finite) tokens of processed logits; degenerate rows -> zeros."""
    bad = degenerate_rows(z)
    p = torch.softmax(torch.where(bad[:, None], torch.zeros_like(z), z), dim=-1)
    return torch.where(bad[:, None], torch.zeros_like(p), p)


def logprobs_from_processed(z: torch.Tensor) -> torch.Tensor:
    """log_softmax over the kept tokens (-inf elsewhere); degenerate rows all -inf."""
    bad = degenerate_rows(z)
    lp = torch.log_softmax(torch.where(bad[:, None], torch.zeros_like(z), z), dim=-1)
    return torch.where(bad[:, None] | torch.isinf(z), torch.full_like(lp, NEG_INF), lp)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, V: int, stream: int) -> torch.Tensor:
    """[B, V] fp32 Gumbel noise keyed (seed[b], c0 = v, c1 = position[b], c2 = stream)."""
    vocab = torch.arange(V, dtype=torch.int64, device=seed.device)[None, :]
    c2 = torch.full((1, 1), stream, dtype=torch.int64, device=seed.device)
    return gumbel(seed.to(torch.int64)[:, None], vocab, position.to(torch.int64)[:, None], c2)


def gumbel_argmax(logw: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                  stream: int) -> torch.Tensor:
    """Gumbel-max sample from log-weights logw [B, V] (-inf: excluded). Nothing left -> 0."""
    s = logw.float() + gumbel_noise(seed, position, logw.shape[-1], stream)
    s = torch.where(torch.isnan(s), torch.full_like(s, NEG_INF), s)
    tok = torch.argmax(s, dim=-1)
    return torch.where(torch.isfinite(s.amax(-1)), tok, torch.zeros_like(tok))


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Plain target sampling: tokens [B] int64 (greedy rows argmax, others Gumbel-max with
    STREAM_TARGET keyed by `position`, the position of the token being sampled)."""
    B = logits.shape[0]
    check_sampling_params(B, temperature, top_k, top_p, seed, position)
    greedy = argmax_tokens(logits.float())
    z = process_logits(logits, temperature, top_k, top_p)
    sampled = gumbel_argmax(logprobs_from_processed(z), seed, position, STREAM_TARGET)
    return torch.where(greedy_rows(temperature), greedy, sampled)
