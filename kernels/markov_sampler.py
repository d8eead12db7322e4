"""DSpark Markov draft sampler: reference (the Triton kernels and the op follow below it).

    prev = anchor
    for k in 0..N-1:                       # draft k is the token at position start_pos + k
        l_k = base_logits[:, k] + W1[prev] @ W2^T             (fp32 math)
        greedy rows: x_k = argmax(l_k), draft_probs[:, k] = 0
        other rows:  p_k = softmax(process(l_k)); x_k = Gumbel-max(p_k, STREAM_DRAFT);
                     draft_probs[:, k] = p_k
        prev = x_k

Conventions (temperature/top-k/top-p, degenerate rows, Gumbel keys, id folding) are those of
kernels/sampling.py.
"""
from __future__ import annotations

import torch

from .philox import STREAM_DRAFT
from .sampling import (argmax_tokens, check_sampling_params, fold_ids, gumbel_argmax,
                       greedy_rows, logprobs_from_processed, probs_from_processed, process_logits)


def check_markov_inputs(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos):
    if base_logits.dim() != 3 or not base_logits.dtype.is_floating_point:
        raise ValueError(f"base_logits must be a float [B, N, V] tensor, got {base_logits.dtype} "
                         f"{tuple(base_logits.shape)}")
    B, N, V = base_logits.shape
    if w1.dim() != 2 or w1.shape[0] != V or not w1.dtype.is_floating_point:
        raise ValueError(f"w1 must be a float [{V}, r] tensor, got {w1.dtype} {tuple(w1.shape)}")
    if w2.shape != w1.shape or not w2.dtype.is_floating_point:
        raise ValueError(f"w2 must be a float {tuple(w1.shape)} tensor like w1, got {w2.dtype} "
                         f"{tuple(w2.shape)}")
    if anchor.shape != (B,) or anchor.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"anchor must be an int [{B}] tensor, got {anchor.dtype} {tuple(anchor.shape)}")
    check_sampling_params(B, temperature, top_k, top_p, seed, start_pos, "start_pos")


def markov_bias(prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """W1[prev] @ W2^T in fp32: [B, V] (prev already folded into [0, V))."""
    return w1[prev].float() @ w2.float().T


def markov_sample_reference(base_logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor,
                            w2: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, seed: torch.Tensor, start_pos: torch.Tensor):
    """-> (drafts [B, N] int64, draft_probs [B, N, V] fp32; greedy rows' probs are zeros)."""
    check_markov_inputs(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos)
    B, N, V = base_logits.shape
    greedy = greedy_rows(temperature)
    prev = fold_ids(anchor.to(torch.int64), V)
    drafts, probs = [], []
    for k in range(N):
        logits = base_logits[:, k].float() + markov_bias(prev, w1, w2)
        z = process_logits(logits, temperature, top_k, top_p)
        x = gumbel_argmax(logprobs_from_processed(z), seed, start_pos + k, STREAM_DRAFT)
        x = torch.where(greedy, argmax_tokens(logits), x)
        p = probs_from_processed(z)
        probs.append(torch.where(greedy[:, None], torch.zeros_like(p), p))
        drafts.append(x)
        prev = x
    return torch.stack(drafts, 1), torch.stack(probs, 1)
