"""The draft-plus-verify step over a fixed batch bucket, and the eager prefill that precedes it.

One step for B request rows (docs/model.md, "The step"), N = dspark_block_size:

    verify    target forward over [anchor, d1..dN] at last+1 .. last+N+1   -> logits, aux
    reject    greedy / standard rejection                                  -> tokens, num_sampled
    context   store aux rows r < num_sampled into each draft layer's ring
    draft     [anchor', noise x (N-1)] at last'+1 .. last'+N               -> base logits
    sample    Markov sampler (N sequential steps)                          -> drafts, draft logits
    next      row state := [anchor', drafts], last' = last + num_sampled

Capture-safe: fixed shapes, no host syncs, randomness keyed by (seed, position) tensors. The only
inputs that change per call are `rows` (state row per batch row; the trash row for padding);
everything else is per-row state updated in place. Outputs: committed tokens [B, N+1] (-1 past
num_sampled) and num_sampled [B] (0 for padded rows).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels.sampling.reference import (fold_ids, markov_sample_reference,
                                                       rejection_sample_reference,
                                                       sample_reference)

from dspark_compile.models.batch import Batch
from dspark_compile.models.draft import draft_forward, markov_weights, store_context
from dspark_compile.models.state import check_prefill


def sampling_of(state: dict, rows: torch.Tensor):
    return (state["row.temperature"][rows], state["row.top_k"][rows], state["row.top_p"][rows],
            state["row.seed"][rows])


def draft_block(model, state: dict, rows: torch.Tensor, anchor: torch.Tensor, last: torch.Tensor):
    """Draft N tokens after `anchor` (at last+1) for each row; returns (drafts, draft logits)."""
    cfg = model.cfg
    N = cfg.dspark_block_size
    B = rows.shape[0]
    ar = torch.arange(N, device=rows.device)
    ids = torch.cat((anchor[:, None], torch.full((B, N - 1), cfg.dspark_noise_token_id,
                                                 dtype=torch.int64, device=rows.device)), 1)
    base = draft_forward(model, ids, last[:, None] + 1 + ar, rows, last, state)
    w1, w2 = markov_weights(model)
    return markov_sample_reference(base, anchor, w1, w2, *sampling_of(state, rows), last + 2)


class DraftVerifyStep(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        if model.mtp is None:
            raise ValueError("DraftVerifyStep needs a model with the DSpark draft (mtp.*)")
        self.model = model

    def forward(self, rows: torch.Tensor, state: dict):
        model, cfg = self.model, self.model.cfg
        N, V = cfg.dspark_block_size, cfg.vocab_size
        trash = state["row.last_pos"].shape[0] - 1
        last = state["row.last_pos"][rows]
        tok_in = state["row.tokens"][rows]
        ar = torch.arange(N + 1, device=rows.device)
        batch = Batch.make(rows, last[:, None] + 1 + ar, tok_in, trash, V)

        logits, aux = model(batch, state, aux_layers=cfg.dspark_target_layer_ids)
        verify = state["row.verify"][rows] if "row.verify" in state else None
        tokens, num = rejection_sample_reference(logits, tok_in[:, 1:], state["row.draft_logits"][rows],
                                                 *sampling_of(state, rows), last + 2, verify)
        num = torch.where(batch.valid, num, torch.zeros_like(num))
        tokens = torch.where(batch.valid[:, None] & (ar[None, :] < num[:, None]), tokens,
                             torch.full_like(tokens, -1))

        # only the anchor and accepted drafts are real context for the draft
        ring = state["mtp.0.ctx"].shape[1]
        slots = batch.ring_slots(ring, write=ar[None, :] < num[:, None])
        store_context(model, aux.reshape(batch.B * (N + 1), -1), batch.flat_pos(), slots, state)

        anchor = fold_ids(tokens.gather(1, (num - 1).clamp_min(0)[:, None]).squeeze(1), V)
        new_last = last + num
        drafts, draft_logits = draft_block(model, state, rows, anchor, new_last)

        state["row.tokens"].index_put_((rows,), torch.cat((anchor[:, None], drafts), 1))
        state["row.draft_logits"].index_put_((rows,), draft_logits)
        state["row.last_pos"].index_put_((rows,), new_last)
        return tokens, num


class TargetStep(nn.Module):
    """Non-speculative decoding of one token per row over a fixed batch bucket, capture-safe like
    DraftVerifyStep and reading the same state: the engine's target-only program
    (`run --no-speculation`, and what `run --check-lossless` compares the speculative output
    with).

        forward   target forward over row.tokens[:, 0] at last+1              -> logits
        sample    the row's sampling, keyed by (seed, last+2)                 -> next token
        next      row.tokens[:, 0] := next, last' = last + 1

    The same token as target_decode_step(model, state, rows, row.tokens[rows, 0]). Outputs are
    the step's: tokens [B, 1] (-1 for padded rows) and num_sampled [B] (1, or 0 for padded rows).
    A prefill (speculative or not) leaves the first token in row.tokens[:, 0]; the drafts a
    speculative prefill stores after it are never read here."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, rows: torch.Tensor, state: dict):
        model, cfg = self.model, self.model.cfg
        V = cfg.vocab_size
        trash = state["row.last_pos"].shape[0] - 1
        last = state["row.last_pos"][rows]
        tok_in = state["row.tokens"][rows][:, :1]
        batch = Batch.make(rows, (last + 1)[:, None], tok_in, trash, V)
        logits, _ = model(batch, state)
        nxt = fold_ids(sample_reference(logits[:, 0], *sampling_of(state, rows), last + 2), V)
        num = batch.valid.to(torch.int64)
        tokens = torch.where(batch.valid, nxt, torch.full_like(nxt, -1))[:, None]
        state["row.tokens"].index_put_((rows, torch.zeros_like(rows)), nxt)
        state["row.last_pos"].index_put_((rows,), torch.where(batch.valid, last + 1, last))
        return tokens, num


@torch.no_grad()
def prefill(model, state: dict, row: int, prompt: list[int], chunk: int, speculative: bool,
            return_logits: bool = False):
    """Eager prompt forward for one request row; returns the first generated token
    (and the logits it was sampled from, with `return_logits`).

    Writes every cache of `row` for positions 0..L-1 (in chunks of at most `chunk` tokens),
    seeds the draft context from the prompt's aux states, samples the first token from the
    target, and (speculative) drafts the first block so the step can start verifying.
    """
    check_prefill(model, state, row, prompt, chunk, speculative)   # host ints only
    cfg = model.cfg
    dev = state["row.last_pos"].device
    trash = state["row.last_pos"].shape[0] - 1
    rows = torch.tensor([row], device=dev)
    L = len(prompt)
    ids = torch.tensor(prompt, dtype=torch.int64, device=dev)
    aux_layers = cfg.dspark_target_layer_ids if speculative else ()
    for start in range(0, L, chunk):
        end = min(start + chunk, L)
        pos = torch.arange(start, end, device=dev)[None]
        batch = Batch.make(rows, pos, ids[None, start:end], trash, cfg.vocab_size)
        # only the chunk's last token is sampled from (the last chunk's)
        logits, aux = model(batch, state, aux_layers=aux_layers,
                            logits_at=torch.tensor([end - start - 1], device=dev))   # [1, V]
        if speculative:
            ring = state["mtp.0.ctx"].shape[1]
            store_context(model, aux.reshape(end - start, -1), batch.flat_pos(), batch.ring_slots(ring), state)
    first = sample_reference(logits, *sampling_of(state, rows), torch.tensor([L], device=dev))
    first = fold_ids(first, cfg.vocab_size)
    last = torch.tensor([L - 1], device=dev)
    state["row.last_pos"][row] = L - 1
    if speculative:
        drafts, draft_logits = draft_block(model, state, rows, first, last)
        state["row.tokens"][row] = torch.cat((first, drafts[0]))
        state["row.draft_logits"][row] = draft_logits[0]
    return (int(first), logits[0]) if return_logits else int(first)


@torch.no_grad()
def target_decode_step(model, state: dict, rows: torch.Tensor, tokens: torch.Tensor):
    """Plain (non-speculative) decoding: feed `tokens` [B] at last+1, return (next tokens, logits)."""
    cfg = model.cfg
    trash = state["row.last_pos"].shape[0] - 1
    last = state["row.last_pos"][rows]
    batch = Batch.make(rows, (last + 1)[:, None], tokens[:, None], trash, cfg.vocab_size)
    logits, _ = model(batch, state)
    nxt = fold_ids(sample_reference(logits[:, 0], *sampling_of(state, rows), last + 2), cfg.vocab_size)
    state["row.last_pos"].index_put_((rows,), torch.where(batch.valid, last + 1, last))
    return nxt, logits[:, 0]
