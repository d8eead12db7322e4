"""One request as every entry point takes it: `SamplingParams` and the rules a request meets
before it reaches a state row, each rule with its one message.

    SamplingParams.validate   the sampling fields against what the samplers and the decode
                              state take
    prompt_ids                a prompt: a non-empty list of integer token ids in the vocabulary
    check_room                prompt + max_new_tokens + the step's lookahead within a row
    prompt_seeds              prompt i samples with seed + i: the last one within 64 bits
    validate_request          one request (the stream's add)
    validate_batch            a list of requests, all checked before anything runs (generate)

Every entry point applies these: the eager loops (models/generate.py), the engine and its
stream (dspark_compile/runtime/), the CLI and the server. A refusal is a RequestError naming the
request's field (`field`: SamplingParams' names, or "prompt"); each caller spells a field its own
way (`names`: SamplingParams' name -> a CLI flag or an API field; `label`: what it calls a
prompt) and maps the error to its own form (ValueError, one CLI line, a 400 naming the field),
but the rule and its words live here.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Mapping, Set
from dataclasses import dataclass

from dspark_compile.kernels.sampling.reference import VERIFY, is_greedy
from dspark_compile.models.config import request_positions

# What the decode state holds (models/state.py): row.temperature and row.top_p are float32,
# row.top_k, row.seed and the positions int64. A value beyond these cannot be stored.
FLOAT32_MAX = 3.4028234663852886e38
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def shown(n: int) -> str:
    """An int for a message: its digits, or its size beyond 40 of them (Python refuses to
    print an int of more than 4300 digits)."""
    if abs(n) < 10 ** 40:
        return str(n)
    return f"{'a negative' if n < 0 else 'an'} int of {n.bit_length()} bits"


class RequestError(ValueError):
    """A request an entry point cannot take: `field` is the request's field at fault
    (SamplingParams' name, or "prompt"), the message names it as the caller spells it, and
    `rule` is what was wrong: the message less its leading "<field's name> " where it has one
    (a caller that names the field itself, the server's "<field>: ...", shows the rule)."""

    def __init__(self, field: str, message: str, rule: str):
        super().__init__(message)
        self.field, self.rule = field, rule


def _refuse(field: str, names: dict | None, rule: str):
    """RequestError "<the caller's name for the field> <rule>"."""
    raise RequestError(field, f"{(names or {}).get(field, field)} {rule}", rule)


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
        (greedy: kernels/sampling/reference.py says why), or RequestError naming the field as
        `names` maps it (SamplingParams' name -> a CLI flag or an API field; default the field's
        own name). `vocab`: stop ids must be below it (None: not known yet)."""

        def bad(f: str, rule: str):
            _refuse(f, names, rule)

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
                bad(f, f"must be >= {low}{low_note}, got {shown(v)}")
            if v > INT64_MAX:
                bad(f, f"must be <= {INT64_MAX} ({high_note}), got {shown(v)}")
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
                        f"got {shown(seed)}")
        if isinstance(self.stop_ids, (str, bytes)) or not hasattr(self.stop_ids, "__iter__"):
            bad("stop_ids", f"must be a list of token ids, got {self.stop_ids!r}")
        try:
            stops = tuple(operator.index(s) for s in self.stop_ids)
        except TypeError:
            bad("stop_ids", f"must be a list of integer token ids, got {self.stop_ids!r}")
        for s in stops:
            if s < 0 or (vocab is not None and s >= vocab):
                bad("stop_ids", f"must be token ids in [0, {vocab}), got {shown(s)}" if vocab
                    is not None else f"must be token ids >= 0, got {shown(s)}")
        if is_greedy(temperature):
            temperature = 0.0
        return dataclasses.replace(self, temperature=temperature, top_k=top_k, top_p=top_p,
                                   seed=seed, max_new_tokens=max_new, stop_ids=stops)

    @property
    def method(self) -> str:
        """How this request's drafts are verified: "greedy", "token" or "block"."""
        return "greedy" if is_greedy(self.temperature) else self.verify


def _is_list(v) -> bool:
    """A sequence of items: a mapping or a set has a length and iterates, but in no order."""
    return not isinstance(v, (str, bytes, Mapping, Set)) and hasattr(v, "__len__")


def prompt_ids(prompt, vocab: int | None, label: str = "prompt") -> list[int]:
    """The prompt as a list of plain ints, or RequestError("prompt") with the messages calling
    it `label`: a non-empty list of integer token ids, each in [0, vocab) (None: not known)."""
    def bad(rule: str, sep: str = " "):
        raise RequestError("prompt", f"{label}{sep}{rule}", rule)

    if not _is_list(prompt):
        bad(f"must be a list of token ids, got {type(prompt).__name__}")
    try:
        ids = [operator.index(t) for t in prompt]
    except TypeError:
        bad("must be a list of integer token ids")
    if not ids:
        bad("is empty")
    out = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if out:
        listed = "[" + ", ".join(shown(t) for t in out[:5]) + "]"
        bad(f"token ids {listed} outside [0, {vocab}) (the model's vocab_size)"
            if vocab is not None else f"token ids {listed} must be >= 0", ": ")
    return ids


def room(prompt_len: int, block: int, max_seq_len: int) -> int:
    """The most new tokens a prompt of this length can get in a row of `max_seq_len` positions
    with a draft block of `block` (0: no speculation); <= 0: the prompt alone does not fit."""
    return max_seq_len - request_positions(prompt_len, 0, block)


def check_room(prompt_len: int, max_new_tokens: int, block: int, max_seq_len: int,
               holds: str, label: str = "prompt", names: dict | None = None) -> None:
    """Prompt + max_new_tokens + the step's lookahead (request_positions) within a row of
    `max_seq_len` positions, or RequestError: "prompt" when the prompt alone leaves no room,
    else "max_new_tokens". `holds`: where the limit comes from, e.g. "the engine holds
    max_seq_len=160 (build --max-seq-len)"."""
    with_block = (f" (with the draft block of {block} and its lookahead)" if block
                  else " (with the step's lookahead)")
    most = room(prompt_len, block, max_seq_len)
    if most < 1:
        rule = (f"{prompt_len} tokens leave no room for a new token: with one they need "
                f"{request_positions(prompt_len, 1, block)} positions{with_block}; {holds}")
        raise RequestError("prompt", f"{label}: {rule}", rule)
    if max_new_tokens > most:
        name = (names or {}).get("max_new_tokens", "max_new_tokens")
        rule = (f"{prompt_len} tokens + {name} {max_new_tokens} need "
                f"{request_positions(prompt_len, max_new_tokens, block)} positions{with_block}; "
                f"{holds}, so at most {most} new tokens fit")
        raise RequestError("max_new_tokens", f"{label}: {rule}", rule)


def prompt_seeds(seed: int, prompts: int, names: dict | None = None) -> list[int]:
    """Prompt i of a request samples with seed + i (a valid `seed`): the seeds, or
    RequestError("seed") when the last one is beyond 64 bits."""
    last = seed + prompts - 1
    if last > INT64_MAX:
        name = (names or {}).get("seed", "seed")
        # not "prompt i's seed": the CLI spells every bare "seed" as its flag
        rule = (f"{name} + {prompts - 1} (what prompt {prompts - 1} samples with) must fit in 64 "
                f"bits (a signed int64), got {shown(last)}")
        raise RequestError("seed", rule, rule)
    return [seed + i for i in range(prompts)]


def validate_request(prompt, params, vocab: int, max_seq_len: int | None, block: int,
                     holds: str, label: str = "prompt") -> tuple[list[int], SamplingParams]:
    """(the prompt as plain ints, params' checked copy: the caller's objects may change while
    the request runs), or RequestError naming the field. `max_seq_len` None: the row is sized
    to the request later (check_room is not applied)."""
    prompt = prompt_ids(prompt, vocab, label)
    if not isinstance(params, SamplingParams):
        rule = f"must be a SamplingParams, got {type(params).__name__}"
        raise RequestError("params", f"params {rule}", rule)
    params = params.validate(vocab)
    if max_seq_len is not None:
        check_room(len(prompt), params.max_new_tokens, block, max_seq_len, holds, label)
    return prompt, params


def validate_batch(prompts, params, vocab: int, max_seq_len: int | None, block: int,
                   holds: str) -> tuple[list[list[int]], list[SamplingParams]]:
    """validate_request for every (prompt i, params i), prompt i called "prompt i"; all are
    checked before any runs."""
    if not _is_list(prompts):
        raise ValueError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("no prompts given")
    if not _is_list(params):
        raise ValueError(f"params must be a list of SamplingParams (one per prompt), got "
                         f"{type(params).__name__}")
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    out = [validate_request(p, sp, vocab, max_seq_len, block, holds, f"prompt {i}")
           for i, (p, sp) in enumerate(zip(prompts, params))]
    return [p for p, _ in out], [sp for _, sp in out]
