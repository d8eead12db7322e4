"""A validated CompletionRequest -> the engine's jobs, one per prompt: token ids, SamplingParams
and stop strings, checked against what the engine can hold (vocabulary, positions per request)
by models/request.py's rules -- every entry point's, in the same words -- so every refusal is a
400 naming the API's field, before anything reaches the engine.
"""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

from dspark_compile.models.request import (RequestError, SamplingParams, check_room, prompt_ids,
                                           prompt_seeds, room)
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
    # why the engine cannot return logprobs (Engine.logprobs_refusal); None: it can
    no_logprobs: str | None = None

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length can get (<= 0: the prompt alone is too
        long)."""
        return room(prompt_len, self.block, self.max_seq_len)

    @property
    def holds(self) -> str:
        """Where the positions' limit comes from, for the messages."""
        return f"the engine holds max_seq_len={self.max_seq_len}"


@dataclass(frozen=True)
class Job:
    index: int                    # the choice's index in the response
    prompt: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...]
    skip_special_tokens: bool = True    # False: the text keeps special tokens' strings
    logprobs: int | None = None         # top logprobs per output token (None: none)
    echo: bool = False                  # the prompt's text (and logprobs) ahead of the output
    prompt_logprobs: int | None = None  # top logprobs per prompt token (echo with logprobs)
    decode: bool = True                 # False: echo with max_tokens 0, no output token
    prompt_text: str | None = None      # the prompt as sent (echo of a text prompt)

    @property
    def options(self) -> dict:
        """GenerationStream.add's logprobs options (none for a plain request)."""
        if self.logprobs is None and self.prompt_logprobs is None:
            return {}
        return {"logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs,
                "decode": self.decode}


# SamplingParams' fields (as its messages name them) -> the API's names for them
API_FIELDS = {"max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids"}


def api_field(message: str) -> str | None:
    """The API field a runtime ValueError names (its message starts with the library name)."""
    for lib, api in API_FIELDS.items():
        if lib in message:
            return api
    for name in ("temperature", "top_k", "top_p", "seed", "verify", "prompt_logprobs",
                 "logprobs", "prompt"):
        if name in message:
            return name
    return None


def api_message(message: str) -> str:
    """A runtime message with the library's field names spelt as the API's."""
    for lib, api in API_FIELDS.items():
        message = message.replace(lib, api)
    return message


def prepare(req: CompletionRequest, limits: EngineLimits, tokenizer=None,
            label=lambda i: f"prompt {i}", fields: dict | None = None) -> list[Job]:
    """Run off the event loop (the tokenizer's time grows with the prompt's length).
    `label(i)`: what the messages call prompt i (chat: the rendered conversation); `fields`:
    the request's fields as the client names them where not API_FIELDS' (chat)."""
    fields = {**API_FIELDS, **(fields or {})}
    prompts = req.prompts
    # the sampling fields first: cheap, and refused before any prompt is tokenized
    base = _sampling(req, limits, fields)
    logprobs = _logprobs(req, limits, fields)
    # echo with max_tokens 0: the prompt alone (its logprobs: what an evaluation harness's
    # loglikelihood asks); the request's row still needs room for its prompt
    decode = not (req.echo and req.max_tokens == 0)
    texts = prompts if isinstance(prompts[0], str) else None
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
    jobs = []
    try:
        for i, p in enumerate(prompts):
            prompt_ids(p, limits.vocab_size, label(i))
        seeds = prompt_seeds(base.seed, len(prompts), fields)
        for i, p in enumerate(prompts):
            max_new = limits.max_new_tokens(len(p)) if req.max_tokens is None else req.max_tokens
            max_new = max_new if decode else 1
            check_room(len(p), max_new, limits.block, limits.max_seq_len, limits.holds,
                       label(i), fields)
            sp = dataclasses.replace(base, seed=seeds[i], max_new_tokens=max_new)
            jobs.append(Job(i, list(p), sp.validate(limits.vocab_size, fields), req.stop,
                            req.skip_special_tokens, logprobs, req.echo,
                            # the eager pass over the prompt runs only for what needs it
                            (logprobs if logprobs is not None else 0)
                            if req.echo and (logprobs is not None or not decode) else None,
                            decode, _echo_text(req, texts, i, p, tokenizer)))
    except RequestError as e:
        raise _bad_request(e, fields) from None
    return jobs


def _sampling(req: CompletionRequest, limits: EngineLimits, fields: dict) -> SamplingParams:
    """The request's sampling fields as prompt 0's SamplingParams (its seed; a null max_tokens
    as 1 until a prompt's room is known), checked by SamplingParams.validate."""
    stop_ids = tuple(dict.fromkeys(req.stop_token_ids or ()))
    eos = limits.eos_token_id
    if not req.ignore_eos and eos is not None and eos not in stop_ids:
        stop_ids += (eos,)
    seed = secrets.randbits(62) if req.seed is None else req.seed
    sp = SamplingParams(
        temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p, seed=seed,
        max_new_tokens=1 if not req.max_tokens else req.max_tokens, stop_ids=stop_ids,
        verify=req.verify)
    try:
        return sp.validate(limits.vocab_size, fields)
    except RequestError as e:
        raise _bad_request(e, fields) from None


def _echo_text(req: CompletionRequest, texts, i: int, ids: list[int], tokenizer) -> str | None:
    """The prompt's text for echo: as sent, or its ids decoded ("" without a tokenizer)."""
    if not req.echo:
        return None
    if texts is not None:
        return texts[i]
    if tokenizer is None:
        return ""
    return (tokenizer if req.skip_special_tokens else tokenizer.keeping_special()).decode(ids)


def _logprobs(req: CompletionRequest, limits: EngineLimits, fields: dict) -> int | None:
    """The request's top logprobs per token (None: it asks none), refused by name where the
    engine has none (Engine.logprobs_refusal: an Inductor engine)."""
    name = fields.get("logprobs", "logprobs")
    if req.logprobs is not None and limits.no_logprobs is not None:
        raise BadRequest(name, limits.no_logprobs)
    if req.max_tokens == 0 and not req.echo:
        raise BadRequest(fields.get("max_new_tokens", "max_tokens"),
                         "must be >= 1, got 0 (0 only with echo: the prompt alone, with its "
                         "logprobs)")
    return req.logprobs


def _bad_request(e: RequestError, fields: dict) -> BadRequest:
    """models/request.py's refusal as a 400 naming the API's field: "<field>: <rule>" where
    the message was "<field> <rule>", else "<field>: <the message>"."""
    param = fields.get(e.field, e.field)
    return BadRequest(param, e.rule if str(e) == f"{param} {e.rule}" else str(e))


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
