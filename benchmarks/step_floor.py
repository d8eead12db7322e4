"""The byte floor of one draft-plus-verify step: the bytes the step must move, read plus written.

Divided by the measured device-to-device copy bandwidth (which also counts read plus written
bytes) it gives the floor time `benchmarks/step.py` compares every variant with. Counted, for
the B live rows of the step (N = dspark_block_size, V = vocab_size):

- Weights, each read once per step (tensors shared between modules counted once):
  - routed experts of each MoE layer (target and draft): only the experts the step's tokens
    route to, from the router's top-k ids recorded in one eager run of the reference step on
    the same state (`record_routing`): bytes x distinct experts / n_routed_experts;
  - gathered tables: the embedding (B*(N+1) verify + B*N draft token rows), a hash gate's
    `tid2eid` (one row per routed token), the Markov head's W1 (B*N rows: one per draft
    step's previous token) and the RoPE tables (non-persistent buffers: 2*(N+1) rows per live
    row, the verify and draft positions). Repeated ids are counted again: an upper bound of
    at most B*(N+1) rows per table;
  - every other parameter and buffer: its whole bytes (the LM head included: all its rows
    produce logits).
- Decode state (models/state.py), per live row:
  - read: the entries visible at the row's positions 0 .. last+N+1 of every cache (a ring:
    min(ring, positions); a compressed cache of ratio r: ceil(positions / r) entries) -- an
    upper bound: SWA attention reads its window, C4 attention only the indexer's top-k;
  - written: N+1 entries of every ring (SWA KV, compressor and indexer state, draft context:
    at most the accepted rows), ceil((N+1)/r) + 1 entries of a compressed cache;
  - the per-row tensors (`row.*`) read whole; `row.tokens` and `row.last_pos` written;
    `row.draft_logits` read and written only for sampled rows (a greedy row's rejection never
    reads them, and the greedy program does not write them: dspark_compile/runtime/variants.py);
  - a state tensor these rules do not name: its live rows read whole (listed in
    `state_fallback`).
- Logits written once: the target's B*(N+1)*V and the draft's base B*N*V, in the head's
  accumulation dtype (fp32; fp64 in exact mode). The sampled draft logits land in
  `row.draft_logits` (state, above).

Not counted: activations between ops (a fully fused step keeps them on chip), the step's small
outputs (tokens, counts), scratch of the samplers.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager

import torch

_LAYER = re.compile(r"^layers\.(\d+)\.(swa_\w+|cmp_kv|cmp_score|ckv_\w+|idx_kv|idx_score|idx_k)$")
_CTX = re.compile(r"^mtp\.(\d+)\.ctx$")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextmanager
def record_routing(model):
    """Forward hooks on every MoE router (models/moe.py Gate): yields a dict module name ->
    list of the top-k expert id tensors [M, k] its forward returned (one per call)."""
    from dspark_compile.models.moe import Gate
    seen: dict[str, list] = {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, Gate):
            def hook(m, args, out, name=name):
                seen.setdefault(name, []).append(out[0].detach().reshape(-1, out[0].shape[-1]).cpu())
            handles.append(mod.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _weights(model, routing: dict, B: int, N: int) -> tuple[int, dict]:
    cfg = model.cfg
    E = cfg.n_routed_experts
    persistent = set(model.state_dict())
    experts_used = {}
    for gate, ids in routing.items():
        moe = gate[:-len(".gate")]
        experts_used[moe] = int(torch.unique(torch.cat(ids)).numel()) if ids else 0
    verify_tok, draft_tok = B * (N + 1), B * N
    total, parts, seen = 0, {"experts": 0, "gathered": 0, "whole": 0}, set()
    named = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in named:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        n = _nbytes(t)
        row = n // max(t.shape[0], 1) if t.dim() else n
        moe, _, leaf = name.rpartition(".experts.")
        if leaf and moe in experts_used:
            b, kind = n * experts_used[moe] // E, "experts"
        elif name in ("embed.weight",):
            b, kind = min(t.shape[0], verify_tok + draft_tok) * row, "gathered"
        elif name.endswith(".gate.tid2eid"):
            ids = routing.get(name[:-len(".tid2eid")], [])
            b, kind = min(t.shape[0], sum(i.shape[0] for i in ids)) * row, "gathered"
        elif name.endswith("markov_head.markov_w1.weight"):
            b, kind = min(t.shape[0], draft_tok) * row, "gathered"
        elif name not in persistent:      # RoPE tables: rows at the step's positions
            b, kind = min(t.shape[0], 2 * (N + 1) * B) * row, "gathered"
        else:
            b, kind = n, "whole"
        parts[kind] += b
        total += b
    return total, {"weights_by_kind": parts, "experts_used_per_moe": experts_used,
                   "n_routed_experts": E}


def cache_entry(cfg, name: str, t: torch.Tensor) -> tuple[int, int] | None:
    """(bytes of one entry of one row, positions per entry) of a per-position cache -- a ring
    (SWA KV, compressor / indexer rings, draft context: 1 position an entry) or a compressed
    cache (C4 / C128 KV: the layer's ratio; indexer K: 4) --; None for any other state tensor."""
    m, c = _LAYER.match(name), _CTX.match(name)
    if not (m or c) or t.dim() < 3:
        return None
    stride = 1
    if m and m.group(2).startswith("ckv_"):
        stride = cfg.compress_ratios[int(m.group(1))]
    elif m and m.group(2) == "idx_k":
        stride = 4
    return _nbytes(t) // t.shape[0] // t.shape[1], stride


def _state(model, state: dict, rows: list[int], N: int) -> tuple[int, int, dict]:
    cfg = model.cfg
    last = state["row.last_pos"].cpu()
    temps = state["row.temperature"].cpu()
    read = written = 0
    fallback = []
    per = {}
    for name, t in state.items():
        row_bytes = _nbytes(t) // t.shape[0]
        r = w = 0
        ce = cache_entry(cfg, name, t)
        if ce:
            entry, stride = ce
            for row in rows:
                positions = int(last[row]) + 1 + N + 1
                r += min(t.shape[1], math.ceil(positions / stride)) * entry
                w += min(t.shape[1], (N + 1) if stride == 1 else math.ceil((N + 1) / stride) + 1) * entry
        elif name == "row.draft_logits":
            sampled = sum(1 for row in rows if float(temps[row]) > 0)
            r = w = sampled * row_bytes
        elif name.startswith("row."):
            r = len(rows) * row_bytes
            if name in ("row.tokens", "row.last_pos"):
                w = len(rows) * row_bytes
        else:
            r = len(rows) * row_bytes
            fallback.append(name)
        per[name] = {"read": r, "written": w}
        read += r
        written += w
    return read, written, {"state_fallback": fallback, "state_per_tensor": per}


def byte_floor(model, state: dict, rows: list[int], routing: dict) -> dict:
    """The floor of one step over the live state rows `rows` (see the module docstring);
    `routing`: what `record_routing` recorded over one eager run of the step on this state."""
    cfg = model.cfg
    N, V, B = cfg.dspark_block_size, cfg.vocab_size, len(rows)
    acc = 8 if model.prec.dtype == torch.float64 else 4
    w, wdetail = _weights(model, routing, B, N)
    sr, sw, sdetail = _state(model, state, rows, N)
    logits = (B * (N + 1) * V + B * N * V) * acc
    total = w + sr + sw + logits
    return {"bytes": int(total), "weights_bytes": int(w), "state_read_bytes": int(sr),
            "state_written_bytes": int(sw), "logits_written_bytes": int(logits),
            "live_rows": B, "sampled_rows": int(sum(float(state["row.temperature"][r]) > 0
                                                     for r in rows)),
            **wdetail, **sdetail}
