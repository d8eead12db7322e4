"""Eager reference decoding: plain target decoding and DSpark speculative decoding.

Both run batches of requests over one decode state; requests that finish (max tokens or a stop
id) become padded rows (the trash row) for the remaining steps, exactly as the compiled runtime
does. These loops are the reference the compiled engine is compared against. A request
(SamplingParams and its checks) is models/request.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_compile.kernels.sampling.reference import VERIFY, is_greedy
from dspark_compile.models.config import CacheConfig, request_positions, rope_positions
from dspark_compile.models.request import SamplingParams, validate_batch
from dspark_compile.models.state import allocate_state, trash_row
from dspark_compile.models.step import DraftVerifyStep, prefill, target_decode_step


@dataclass
class Acceptance:
    """Acceptance counts of (row, step) pairs: accepted_at[k] = pairs where at least k+1 drafts
    were accepted."""
    accepted_at: list[int] = field(default_factory=list)
    row_steps: int = 0

    def add(self, num_sampled: int) -> None:
        """One (row, step) pair that committed num_sampled tokens (accepted drafts + 1)."""
        self.row_steps += 1
        for k in range(num_sampled - 1):
            self.accepted_at[k] += 1

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.row_steps if self.row_steps else 0.0 for a in self.accepted_at]

    @property
    def mean_accepted_length(self) -> float:
        """E[accepted drafts] + 1: tokens committed per row-step."""
        return (sum(self.accepted_at) / self.row_steps + 1.0) if self.row_steps else 0.0


@dataclass
class GenerationResult(Acceptance):
    tokens: list[list[int]] = field(default_factory=list)
    steps: int = 0
    # the same counts per verification method (SamplingParams.method), in first-seen order
    by_method: dict = field(default_factory=dict)

    def record(self, num_sampled: int, method: str) -> None:
        """One (row, step) pair of a request verified by `method`: in the totals and its own."""
        self.add(num_sampled)
        if method not in self.by_method:
            self.by_method[method] = Acceptance([0] * len(self.accepted_at))
        self.by_method[method].add(num_sampled)


def set_row_sampling(state: dict, row: int, sp: SamplingParams) -> None:
    """A request's sampling into its state row (values SamplingParams.validate accepted; a
    greedy temperature is stored as 0, as validate returns it)."""
    state["row.temperature"][row] = 0.0 if is_greedy(sp.temperature) else sp.temperature
    state["row.top_k"][row] = sp.top_k
    state["row.top_p"][row] = sp.top_p
    state["row.seed"][row] = sp.seed
    if "row.verify" in state:
        state["row.verify"][row] = VERIFY[sp.verify]
    if "row.draft_logits" in state:
        # NaN until a step or prefill writes this row's draft logits: the engine's greedy
        # variant never stores them, and a NaN row is exact if a row's sampling changes
        # mid-request (a degenerate draft row has q = 0: every draft is rejected and the token
        # is drawn from p)
        state["row.draft_logits"][row].fill_(float("nan"))


def append_committed(out: list[int], new: list[int], sp: SamplingParams) -> bool:
    """Append committed tokens, honouring stop ids and max tokens; True when the request is done."""
    for t in new:
        out.append(t)
        if t in sp.stop_ids or len(out) >= sp.max_new_tokens:
            return True
    return False


def cache_config_for(prompts, params, block: int, chunk: int = 64) -> CacheConfig:
    need = max(request_positions(len(p), sp.max_new_tokens, block) for p, sp in zip(prompts, params))
    return CacheConfig(max_rows=len(prompts), max_seq_len=need, max_step_tokens=max(chunk, block + 1))


@torch.no_grad()
def generate(model, prompts: list[list[int]], params: list[SamplingParams], speculative: bool,
             cache: CacheConfig | None = None, device="cpu") -> GenerationResult:
    cfg = model.cfg
    if speculative and model.mtp is None:
        raise ValueError("speculative decoding needs the DSpark draft (mtp.*) in the checkpoint")
    N = cfg.dspark_block_size if speculative else 0
    # without a cache, one is sized to the requests (cache_config_for): every request fits
    seq = None if cache is None else cache.max_seq_len
    prompts, params = validate_batch(prompts, params, cfg.vocab_size, seq, N,
                                     f"the cache holds max_seq_len={seq}")
    cache = cache or cache_config_for(prompts, params, N)
    # every request has its own row, all admitted up front (host ints: nothing is read back)
    if cache.max_rows < len(prompts):
        raise ValueError(f"cache.max_rows={cache.max_rows} < {len(prompts)} prompts (one state "
                         "row per request)")
    rope = model.rope_main.shape[0]
    if rope_positions(cache.max_seq_len, N) > rope:
        raise ValueError(f"cache.max_seq_len={cache.max_seq_len} needs RoPE tables of "
                         f"{rope_positions(cache.max_seq_len, N)} positions, the model's hold "
                         f"{rope} (max_positions)")
    state = allocate_state(cfg, cache, model.prec, device)
    trash = trash_row(state)
    outs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for r, (p, sp) in enumerate(zip(prompts, params)):
        set_row_sampling(state, r, sp)
        first = prefill(model, state, r, p, cache.max_step_tokens, speculative)
        done[r] = append_committed(outs[r], [first], sp)
    res = GenerationResult(tokens=outs, accepted_at=[0] * N)
    step = DraftVerifyStep(model) if speculative else None
    while not all(done):
        live = torch.tensor([trash if d else r for r, d in enumerate(done)], device=device)
        if speculative:
            tokens, num = step(live, state)
            res.steps += 1
            for r in range(len(prompts)):
                if done[r]:
                    continue
                n = int(num[r])
                res.record(n, params[r].method)
                done[r] = append_committed(outs[r], tokens[r, :n].tolist(), params[r])
        else:
            last_tok = torch.tensor([o[-1] for o in outs], device=device)
            nxt, _ = target_decode_step(model, state, live, last_tok)
            res.steps += 1
            for r in range(len(prompts)):
                if not done[r]:
                    done[r] = append_committed(outs[r], [int(nxt[r])], params[r])
    return res
