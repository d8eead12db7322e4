"""Rejection sampling of the DSpark drafts against the target (reference; the Triton kernel and
the op follow below it).

Target row i (of N + 1) predicts position start_pos + i: the position of draft i for i < N, the
bonus position for i = N.

- Greedy rows (temperature <= 0): accept draft i while it equals argmax(target row i); at the first
  mismatch emit that argmax and stop; if all N pass, emit the bonus argmax of row N.
- Other rows (standard speculative sampling, Leviathan/Chen): p_i = softmax(process(target row i)),
  q_i = draft_probs[:, i], u_i = uniform(seed, 0, start_pos + i, STREAM_ACCEPT). Accept draft x iff
  q_i(x) > 0 and p_i(x) >= u_i * q_i(x). At the first rejection sample from the residual
  max(p_i - q_i, 0) (from p_i if that is all zero) by Gumbel-max keyed
  (seed, vocab, start_pos + i, STREAM_RESAMPLE); if all N pass, sample the bonus from p_N alike.
- Draft ids outside [0, V) are always rejected and never used as an index.

Outputs: tokens [B, N + 1] int64 (committed tokens first: the accepted drafts, then the
resampled/bonus token; -1 after them) and num_sampled [B] int64 in [1, N + 1].
"""
from __future__ import annotations

import torch

from .philox import STREAM_ACCEPT, STREAM_RESAMPLE, uniform
from .sampling import (argmax_tokens, check_sampling_params, fold_ids, gumbel_argmax,
                       greedy_rows, logprobs_from_processed, probs_from_processed, process_logits)


def check_rejection_inputs(target_logits, draft_tokens, draft_probs, temperature, top_k, top_p,
                           seed, start_pos):
    if target_logits.dim() != 3 or not target_logits.dtype.is_floating_point:
        raise ValueError(f"target_logits must be a float [B, N+1, V] tensor, got "
                         f"{target_logits.dtype} {tuple(target_logits.shape)}")
    B, N1, V = target_logits.shape
    N = N1 - 1
    if N < 0:
        raise ValueError("target_logits needs at least one row per request (N + 1 >= 1)")
    if draft_tokens.shape != (B, N) or draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an int [{B}, {N}] tensor, got "
                         f"{draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    if draft_probs.shape != (B, N, V) or draft_probs.dtype != torch.float32:
        raise ValueError(f"draft_probs must be a float32 [{B}, {N}, {V}] tensor, got "
                         f"{draft_probs.dtype} {tuple(draft_probs.shape)}")
    check_sampling_params(B, temperature, top_k, top_p, seed, start_pos, "start_pos")


def rejection_sample_reference(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                               draft_probs: torch.Tensor, temperature: torch.Tensor,
                               top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                               start_pos: torch.Tensor):
    """-> (tokens [B, N+1] int64, -1 past num_sampled; num_sampled [B] int64)."""
    check_rejection_inputs(target_logits, draft_tokens, draft_probs, temperature, top_k, top_p,
                           seed, start_pos)
    B, N1, V = target_logits.shape
    N = N1 - 1
    dev = target_logits.device
    greedy = greedy_rows(temperature)
    rep = lambda t: t.repeat_interleave(N1)  # noqa: E731  per-request -> per-row
    flat = target_logits.reshape(B * N1, V).float()
    z = process_logits(flat, rep(temperature), rep(top_k), rep(top_p))
    p = probs_from_processed(z).reshape(B, N1, V)
    logp = logprobs_from_processed(z).reshape(B, N1, V)
    target_arg = argmax_tokens(flat).reshape(B, N1)
    pos = start_pos.to(torch.int64)[:, None] + torch.arange(N1, device=dev)[None, :]   # [B, N+1]

    # acceptance of each draft, as if every earlier one had been accepted
    d = draft_tokens.to(torch.int64)
    valid = (d >= 0) & (d < V)
    x = fold_ids(d, V)[..., None]
    px = p[:, :N].gather(2, x).squeeze(2)
    qx = draft_probs.gather(2, x).squeeze(2)
    zeros = torch.zeros_like(pos[:, :N])
    u = uniform(seed.to(torch.int64)[:, None], zeros, pos[:, :N], zeros + STREAM_ACCEPT)
    ok = torch.where(greedy[:, None], d == target_arg[:, :N], (qx > 0) & (px >= u * qx)) & valid
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)              # a in [0, N]

    # the token after the accepted prefix: resampled at row a (a < N) or the bonus (a = N)
    a = accepted
    rows = torch.arange(B, device=dev)
    pa, logpa = p[rows, a], logp[rows, a]
    qa = torch.cat((draft_probs, torch.zeros_like(draft_probs[:, :1])), 1)[rows, a]  # q_N = 0
    resid = (pa - qa).clamp_min(0.0)
    use_p = (resid.sum(-1) <= 0)[:, None] | (a == N)[:, None]
    logw = torch.where(use_p, logpa, torch.log(resid))
    last = gumbel_argmax(logw, seed, start_pos.to(torch.int64) + a, STREAM_RESAMPLE)
    last = torch.where(greedy, target_arg[rows, a], last)

    num_sampled = a + 1
    col = torch.arange(N1, device=dev)[None, :]
    drafts_ext = torch.cat((d, torch.zeros_like(d[:, :1])), 1)
    tokens = torch.where(col < a[:, None], drafts_ext, torch.full_like(drafts_ext, -1))
    tokens = torch.where(col == a[:, None], last[:, None], tokens)
    return tokens, num_sampled
