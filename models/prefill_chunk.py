"""One fixed-shape chunk of a prompt's prefill for one request row: the exportable twin of
models/step.py `prefill`.

    PrefillChunk(model, C)(inputs [C + 3], state) -> first [1]
    inputs = [row, start, n, ids_0 .. ids_{C-1}]   (int64; chunk_inputs builds it)

Runs the target over ids[:n] at positions start .. start+n-1 of state row `row` (tokens n..C-1
are padding), seeds the draft context from the chunk's aux states, samples the token after
position start+n-1 and drafts the first block there, and writes row.tokens, row.draft_logits
and row.last_pos as `prefill` does. A prompt is the calls `chunk_schedule` lists, in order
(full chunks, then one padded); every call writes those three per-row fields, so the last
call's values, whose n ends at the prompt's end, are what the step starts from: prefill's.

Padding is inert: a padded token writes no cache entry. Ring writes (SWA KV, compressor rings,
draft context) take slot -1 (`_ChunkBatch.ring_slots`); compressed entries whose block closes
in the padded tail (the compressor pools every block that closes inside the C positions) are
read before the forward and written back after it, so their bytes are what they were. Padded
tokens' positions run on past the prompt (the compressor assumes consecutive positions): the
build's RoPE tables hold `max(prefill_chunks)` positions more than the step's
(BuildConfig.rope_positions).

The inputs are one tensor so that a prefill program has the step's signature `(tensor,
state)`: the build's compile workers, the compiled-program loader and the CUDA-graph capture
take both kinds of program alike.

Capture-safe: fixed shapes, no host read; `row` may be the trash row (warm-up, capture).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark_compile.kernels.common import masked_row_write
from dspark_compile.kernels.compress import block_ends, entry_slots
from dspark_compile.kernels.sampling.reference import fold_ids, sample_reference

from dspark_compile.models.batch import Batch
from dspark_compile.models.draft import store_context
from dspark_compile.models.step import draft_block, sampling_of


HEADER = 3     # row, start, n ahead of the chunk's ids


def chunk_inputs(row: int, start: int, tokens, chunk: int) -> torch.Tensor:
    """The host tensor [chunk + 3] for one call: `tokens` (at most `chunk` ids) at positions
    start.., padded with id 0."""
    n = len(tokens)
    if not 1 <= n <= chunk:
        raise ValueError(f"chunk_inputs: {n} tokens for a chunk of {chunk}")
    out = torch.zeros(chunk + HEADER, dtype=torch.int64)
    out[:HEADER] = torch.tensor([row, start, n])
    out[HEADER:HEADER + n] = torch.as_tensor(tokens, dtype=torch.int64)
    return out


@dataclass
class _ChunkBatch(Batch):
    """A one-row Batch whose tokens at index >= n are padding: their ring writes take slot -1."""
    live: torch.Tensor = None     # [B, T] bool: a prompt token (not padding)

    def ring_slots(self, ring: int, write: torch.Tensor | None = None) -> torch.Tensor:
        return super().ring_slots(ring, self.live if write is None else self.live & write)


def compressed_caches(state: dict, compress_ratios) -> list[tuple[int, torch.Tensor]]:
    """(ratio, cache) of every compressed-entry cache: each compressed layer's KV entries (the
    float cache or the FP8 triple's three tensors) and each C4 layer's indexer K."""
    out = []
    for l, ratio in enumerate(compress_ratios):
        if not ratio:
            continue
        for key in (f"layers.{l}.ckv_kv", f"layers.{l}.ckv_nope", f"layers.{l}.ckv_scale",
                    f"layers.{l}.ckv_rope", f"layers.{l}.idx_k"):
            if key in state:
                out.append((ratio, state[key]))
    return out


def tail_entry_slots(batch: Batch, live_end: torch.Tensor, ratio: int, n_entries: int):
    """Flat slots [n] of the entries whose block closes at a padded position (>= live_end [B]),
    -1 elsewhere: what the compressor writes for the padded tail."""
    blk, closes = block_ends(batch.pos, ratio)
    tail = closes & (blk * ratio + ratio - 1 >= live_end[:, None])
    return entry_slots(batch.rows, batch.valid, blk, tail, n_entries)


class PrefillChunk(nn.Module):
    def __init__(self, model: nn.Module, chunk: int):
        super().__init__()
        if model.mtp is None:
            raise ValueError("PrefillChunk needs a model with the DSpark draft (mtp.*)")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"PrefillChunk: chunk must be a positive int, got {chunk!r}")
        self.model, self.chunk = model, chunk

    def forward(self, inputs: torch.Tensor, state: dict):
        model, cfg = self.model, self.model.cfg
        C, V = self.chunk, cfg.vocab_size
        if isinstance(inputs.shape[0], torch.SymInt):
            # one program for every chunk length up to `chunk` (export_prefill(dynamic=True)):
            # C is the traced length; the export's range bounds it
            C = inputs.shape[0] - HEADER
        elif tuple(inputs.shape) != (C + HEADER,):
            raise ValueError(f"PrefillChunk({C}): inputs must be [{C + HEADER}] (row, start, n, "
                             f"{C} ids), got {list(inputs.shape)}")
        row, start, n, ids = inputs[0:1], inputs[1:2], inputs[2:3], inputs[HEADER:]
        trash = state["row.last_pos"].shape[0] - 1
        ar = torch.arange(C, device=ids.device)
        pos = start[:, None] + ar[None, :]                                    # [1, C]
        batch = _ChunkBatch(rows=row, pos=pos, tokens=fold_ids(ids[None, :], V),
                            valid=row < trash, live=ar[None, :] < n[:, None])
        live_end = start + n
        tails = [(cache, tail_entry_slots(batch, live_end, r, cache.shape[1]))
                 for r, cache in compressed_caches(state, cfg.compress_ratios)]
        kept = [cache.flatten(0, 1)[slots.clamp_min(0)] for cache, slots in tails]

        # the token after the last prompt token so far is sampled from the last live token
        at = (n - 1).clamp(0, C - 1)
        final, aux = model(batch, state, aux_layers=cfg.dspark_target_layer_ids,
                           logits_at=at)                                      # [1, V]
        for (cache, slots), old in zip(tails, kept):
            masked_row_write(cache.flatten(0, 1), slots, old)
        ring = state["mtp.0.ctx"].shape[1]
        store_context(model, aux.reshape(C, -1), batch.flat_pos(), batch.ring_slots(ring), state)

        # that token, and the first draft block after it
        last = live_end - 1
        first = fold_ids(sample_reference(final, *sampling_of(state, row), live_end), V)
        drafts, draft_logits = draft_block(model, state, row, first, last)
        state["row.tokens"].index_put_((row,), torch.cat((first[:, None], drafts), 1))
        state["row.draft_logits"].index_put_((row,), draft_logits)
        state["row.last_pos"].index_put_((row,), last)
        return first


def chunk_schedule(length: int, chunks) -> list[tuple[int, int, int]]:
    """The calls that prefill a prompt of `length` tokens with programs of these chunk lengths:
    [(start, live tokens n, chunk length C)], in order.

    Full chunks of the largest length while the rest is at least that long, then the smallest
    length that holds the rest, padded. A chunk's forward reads every weight once whatever its
    length, and at prefill lengths (tens to hundreds of tokens) reading the weights (the routed
    experts above all) bounds it, so the fewest calls win; among one-call ways to finish, the
    smallest chunk pads the fewest tokens."""
    chunks = sorted(chunks)
    if not chunks:
        raise ValueError("chunk_schedule: no chunk lengths")
    out, start = [], 0
    while start < length:
        rest = length - start
        c = next((c for c in chunks if c >= rest), chunks[-1])
        n = min(c, rest)
        out.append((start, n, c))
        start += n
    return out
