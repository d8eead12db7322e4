"""A validated CompletionRequest -> the engine's jobs, one per prompt: token ids, SamplingParams
and stop strings, checked against what the engine can hold (vocabulary, positions per request)
so every refusal is a 400 naming the API's field, before anything reaches the engine.
"""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

from dspark_compile.models.config import request_positions
from dspark_compile.models.generate import INT64_MAX, SamplingError, SamplingParams
from dspark_compile.serve.protocol import CompletionRequest


class BadRequest(ValueError):
    """A request the server refuses: `status` (400, 404), the field it names, one line."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.message, self.status = param, message, status


@dataclass(frozen=True)
class EngineLimits:
    """What a request must fit (read once from the loaded engine)."""
    vocab_size: int
    max_seq_len: int        # positions per state row: prompt + new tokens + the lookahead
    block: int              # dspark_block_size
    eos_token_id: int | None
    # the requests the server holds at once (state rows + --max-queue): a request of more
    # prompts could never be admitted (one engine request per prompt)
    max_prompts: int | None = None
    queue: str = ""         # how max_prompts is made up, for the message

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length can get (<= 0: the prompt alone is too
        long)."""
        return self.max_seq_len - request_positions(prompt_len, 0, self.block)


@dataclass(frozen=True)
class Job:
    index: int                    # the choice's index in the response
    prompt: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...]
    skip_special_tokens: bool = True    # False: the text keeps special tokens' strings


# SamplingParams' fields (as its messages name them) -> the API's names for them
API_FIELDS = {"max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids"}


def api_field(message: str) -> str | None:
    """The API field a runtime ValueError names (its message starts with the library name)."""
    for lib, api in API_FIELDS.items():
        if lib in message:
            return api
    for name in ("temperature", "top_k", "top_p", "seed", "verify", "prompt"):
        if name in message:
            return name
    return None


def api_message(message: str) -> str:
    """A runtime message with the library's field names spelt as the API's."""
    for lib, api in API_FIELDS.items():
        message = message.replace(lib, api)
    return message


def prepare(req: CompletionRequest, limits: EngineLimits, tokenizer=None,
            label=lambda i: f"prompt {i}") -> list[Job]:
    """Run off the event loop (the tokenizer's time grows with the prompt's length).
    `label(i)`: what the messages call prompt i (chat: the rendered conversation)."""
    prompts = req.prompts
    # the sampling fields first: cheap, and refused before any prompt is tokenized
    base = _sampling(req, limits)
    if limits.max_prompts is not None and len(prompts) > limits.max_prompts:
        raise BadRequest("prompt", f"{len(prompts)} prompts in one request: this server holds "
                                   f"at most {limits.max_prompts} requests at once "
                                   f"({limits.queue}), so at most {limits.max_prompts} prompts "
                                   "can be admitted together")
    if isinstance(prompts[0], str):
        if tokenizer is None:
            raise BadRequest("prompt", "this engine has no tokenizer.json: send token ids")
        _fits_in_characters(prompts, limits, tokenizer)
        prompts = [tokenizer.encode(p) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise BadRequest("prompt", f"prompt {i} encodes to no tokens")
    if req.stop and tokenizer is None:
        raise BadRequest("stop", "stop strings need the engine's tokenizer.json (none in this "
                                 "engine): use stop_token_ids")
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= t < limits.vocab_size]
        if bad:
            raise BadRequest("prompt", f"{label(i)}: token ids {bad[:5]} outside "
                                       f"[0, {limits.vocab_size})")
    last = base.seed + len(prompts) - 1      # one prompt after another: seed, seed + 1, ...
    if last > INT64_MAX:
        raise BadRequest("seed", f"seed + {len(prompts) - 1} (prompt {len(prompts) - 1}'s seed) "
                                 f"must fit in 64 bits (a signed int64), got {last}")
    jobs = []
    for i, p in enumerate(prompts):
        room = limits.max_new_tokens(len(p))
        if room < 1:
            raise BadRequest("prompt", f"{label(i)}: {len(p)} tokens leave no room for a new "
                                       f"token in the engine's {limits.max_seq_len} positions")
        max_new = room if req.max_tokens is None else req.max_tokens
        if max_new > room:
            raise BadRequest("max_tokens", f"{max_new} new tokens after the {len(p)}-token "
                                           f"{label(i)} exceed the engine's "
                                           f"{limits.max_seq_len} positions: at most {room}")
        sp = _checked(dataclasses.replace(base, seed=base.seed + i, max_new_tokens=max_new),
                      limits)
        jobs.append(Job(i, list(p), sp, req.stop, req.skip_special_tokens))
    return jobs


def _sampling(req: CompletionRequest, limits: EngineLimits) -> SamplingParams:
    """The request's sampling fields as prompt 0's SamplingParams (its seed; a null max_tokens
    as 1 until a prompt's room is known), checked by SamplingParams.validate."""
    stop_ids = tuple(dict.fromkeys(req.stop_token_ids or ()))
    eos = limits.eos_token_id
    if not req.ignore_eos and eos is not None and eos not in stop_ids:
        stop_ids += (eos,)
    seed = secrets.randbits(62) if req.seed is None else req.seed
    return _checked(SamplingParams(
        temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p, seed=seed,
        max_new_tokens=1 if req.max_tokens is None else req.max_tokens, stop_ids=stop_ids,
        verify=req.verify), limits)


def _checked(sp: SamplingParams, limits: EngineLimits) -> SamplingParams:
    """SamplingParams.validate -- the rules of every entry point, against what the decode state
    holds -- with a refusal as a 400 naming the API's field."""
    try:
        return sp.validate(limits.vocab_size, API_FIELDS)
    except SamplingError as e:
        raise BadRequest(API_FIELDS.get(e.field, e.field), e.rule) from None


def _fits_in_characters(texts: list[str], limits: EngineLimits, tokenizer) -> None:
    """A text too long to fit is refused before it is tokenized (the tokenizer's time and
    memory grow with it: 4 x 5 MB of text took a process to 3 GB) when the tokenizer bounds
    the characters a token covers (text.py: Tokenizer.max_token_chars)."""
    per_token = getattr(tokenizer, "max_token_chars", None)
    if not per_token:
        return
    for i, text in enumerate(texts):
        least = -(-len(text) // per_token)
        if least > limits.max_seq_len:
            raise BadRequest("prompt", f"prompt {i}: {len(text)} characters are at least "
                                       f"{least} tokens (this tokenizer's longest token has "
                                       f"{per_token} characters), more than the engine's "
                                       f"{limits.max_seq_len} positions")
