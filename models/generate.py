"""Eager reference decoding: plain target decoding and DSpark speculative decoding.

Both run batches of requests over one decode state; requests that finish (max tokens or a stop
id) become padded rows (the trash row) for the remaining steps, exactly as the compiled runtime
does. These loops are the reference the compiled engine is compared against.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass, field

import torch

from dspark_compile.kernels.sampling.reference import VERIFY, is_greedy
from dspark_compile.models.config import CacheConfig, request_positions, rope_positions
from dspark_compile.models.state import allocate_state, trash_row
from dspark_compile.models.step import DraftVerifyStep, prefill, target_decode_step


# What the decode state holds (models/state.py): row.temperature and row.top_p are float32,
# row.top_k, row.seed and the positions int64. A value beyond these cannot be stored.
FLOAT32_MAX = 3.4028234663852886e38
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def _shown(n: int) -> str:
    """An int for a message: its digits, or its size beyond 40 of them (Python refuses to
    print an int of more than 4300 digits)."""
    if abs(n) < 10 ** 40:
        return str(n)
    return f"{'a negative' if n < 0 else 'an'} int of {n.bit_length()} bits"


class SamplingError(ValueError):
    """A SamplingParams field the samplers or the decode state cannot take: `field` is
    SamplingParams' name for it, `rule` what was wrong ("must be ..., got ..."); the message is
    "<the caller's name for the field> <rule>"."""

    def __init__(self, field: str, name: str, rule: str):
        super().__init__(f"{name} {rule}")
        self.field, self.rule = field, rule


@dataclass
class SamplingParams:
    """One request's sampling. `validate` is the one rule set every entry point applies (the
    eager loops, the engine, the stream, the CLI, the server): each field against what the
    samplers and the decode state take; it returns the copy that enters the state."""
    temperature: float = 0.0     # < GREEDY_BELOW (1e-5; 0 included): greedy
    top_k: int = 0               # 0: off (as is any top_k >= the vocabulary)
    top_p: float = 1.0           # 1: off
    seed: int = 0
    max_new_tokens: int = 32
    stop_ids: tuple = ()
    # how a sampled row's drafts are verified: "block" (Sun et al., arXiv 2403.10444: the
    # accepted prefix decided jointly; never fewer accepted in expectation) or "token"
    # (token-wise rejection); greedy rows ignore it (kernels/sampling/reference.py)
    verify: str = "block"

    def validate(self, vocab: int | None = None, names: dict | None = None) -> "SamplingParams":
        """A checked copy in plain Python numbers, a temperature below GREEDY_BELOW stored as 0
        (greedy: kernels/sampling/reference.py says why), or SamplingError naming the field as
        `names` maps it (SamplingParams' name -> a CLI flag or an API field; default the field's
        own name). `vocab`: stop ids must be below it (None: not known yet)."""
        names = names or {}

        def bad(f: str, rule: str):
            raise SamplingError(f, names.get(f, f), rule)

        def integer(f: str) -> int:
            v = getattr(self, f)
            try:
                if isinstance(v, bool):
                    raise TypeError
                return operator.index(v)
            except TypeError:
                bad(f, f"must be an int, got {v!r}")

        def real(f: str) -> float:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                bad(f, f"must be a number, got {v!r}")
            try:
                return float(v)
            except OverflowError:       # an int beyond float64: as far out of range as inf
                return math.inf if v > 0 else -math.inf

        def int64(f: str, low: int, low_note: str, high_note: str) -> int:
            """An int field in [low, INT64_MAX] (the decode state holds it as int64)."""
            v = integer(f)
            if v < low:
                bad(f, f"must be >= {low}{low_note}, got {_shown(v)}")
            if v > INT64_MAX:
                bad(f, f"must be <= {INT64_MAX} ({high_note}), got {_shown(v)}")
            return v

        if not isinstance(self.verify, str) or self.verify not in VERIFY:
            bad("verify", f"must be one of {sorted(VERIFY)}, got {self.verify!r}")
        max_new = int64("max_new_tokens", 1, "", "positions are int64")
        temperature = real("temperature")
        if not math.isfinite(temperature) or temperature < 0:
            bad("temperature", f"must be a finite number >= 0 (0 = greedy), got {temperature}")
        if temperature > FLOAT32_MAX:
            bad("temperature", f"must be <= {FLOAT32_MAX} (the largest float32, as the decode "
                               f"state holds it), got {temperature}")
        top_k = int64("top_k", 0, " (0 = off)", "the decode state holds it as int64; any "
                      "top_k >= the vocabulary keeps every token")
        top_p = real("top_p")
        if not 0.0 < top_p <= 1.0:   # NaN fails too
            bad("top_p", f"must be in (0, 1], got {top_p}")
        seed = integer("seed")
        if not INT64_MIN <= seed <= INT64_MAX:
            bad("seed", f"must fit in 64 bits (a signed int64, as the decode state holds it), "
                        f"got {_shown(seed)}")
        if isinstance(self.stop_ids, (str, bytes)) or not hasattr(self.stop_ids, "__iter__"):
            bad("stop_ids", f"must be a list of token ids, got {self.stop_ids!r}")
        try:
            stops = tuple(operator.index(s) for s in self.stop_ids)
        except TypeError:
            bad("stop_ids", f"must be a list of integer token ids, got {self.stop_ids!r}")
        for s in stops:
            if s < 0 or (vocab is not None and s >= vocab):
                bad("stop_ids", f"must be token ids in [0, {vocab}), got {_shown(s)}" if vocab
                    is not None else f"must be token ids >= 0, got {_shown(s)}")
        if is_greedy(temperature):
            temperature = 0.0
        return dataclasses.replace(self, temperature=temperature, top_k=top_k, top_p=top_p,
                                   seed=seed, max_new_tokens=max_new, stop_ids=stops)

    @property
    def method(self) -> str:
        """How this request's drafts are verified: "greedy", "token" or "block"."""
        return "greedy" if is_greedy(self.temperature) else self.verify


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


def validate_prompts(prompts: list[list[int]], vocab: int) -> None:
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} outside [0, {vocab})")


def check_request_positions(prompts, params, max_seq_len: int, block: int) -> None:
    """Every request fits a state row of `max_seq_len` positions (request_positions: prompt,
    new tokens and the step's lookahead); host ints only."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        if request_positions(len(p), sp.max_new_tokens, block) > max_seq_len:
            raise ValueError(f"prompt {i}: {len(p)} + {sp.max_new_tokens} new tokens exceed "
                             f"max_seq_len={max_seq_len}")


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
    validate_prompts(prompts, cfg.vocab_size)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    params = [sp.validate(cfg.vocab_size) for sp in params]
    if speculative and model.mtp is None:
        raise ValueError("speculative decoding needs the DSpark draft (mtp.*) in the checkpoint")
    N = cfg.dspark_block_size if speculative else 0
    cache = cache or cache_config_for(prompts, params, N)
    # every request has its own row, all admitted up front (host ints: nothing is read back)
    if cache.max_rows < len(prompts):
        raise ValueError(f"cache.max_rows={cache.max_rows} < {len(prompts)} prompts (one state "
                         "row per request)")
    check_request_positions(prompts, params, cache.max_seq_len, N)
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
