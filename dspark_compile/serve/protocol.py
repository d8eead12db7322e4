"""The HTTP API as data: request and response schemas of the OpenAI completions API (the subset
an engine serves, plus the extensions vLLM's clients already send), apart from the serving
logic, so a malformed request is refused by construction with the field it got wrong.

Extensions over OpenAI's completions schema (sent through the `openai` client's `extra_body`):

- `top_k` (0 or -1: off), `stop_token_ids` (token ids that end a request), `ignore_eos`
  (by default the model's eos id ends a request), `verify` ("block" or "token": how a sampled
  request's drafts are verified, SamplingParams.verify);
- every choice carries `token_ids`, the ids behind its `text` (the only output of an engine
  without a tokenizer); stream chunks carry the ids they add.

vLLM's extensions: `stream_options.continuous_usage_stats` (usage in every chunk),
`skip_special_tokens` (false: special tokens' strings stay in the text), `min_tokens` (only
where it cannot bind: with ignore_eos and no stop / stop_token_ids), `repetition_penalty`
(only 1).

`logprobs` (0..20, vLLM's cap) and `echo` (with max_tokens 0: the prompt's logprobs alone, as
evaluation harnesses ask for loglikelihoods) are served (docs/serve.md, "Logprobs"): the
target's raw log-probabilities (before temperature / top-k / top-p).

Fields of OpenAI's schema that an engine cannot honour (`n` > 1, `best_of` > 1, `suffix`,
`logit_bias`, penalties) are refused by name rather than ignored.
Unknown fields are refused too, so a misspelt `top_k` is a 400, not a silent default.

The sampling fields' ranges (max_tokens, temperature, top_p, top_k, seed, stop_token_ids) are
not restated here: prepare.py checks them with models/request.py's rules, those of every entry
point (the CLI's flags, the engine's stream), against what the decode state holds.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16
# the most top logprobs per token (vLLM's default max_logprobs; the engine computes this many,
# runtime/logprobs.py MAX_LOGPROBS)
MAX_LOGPROBS = 20
# the text held back while it could start a stop string is at most one stop string long, and
# every committed token compares that tail with each stop string: 16 x 1024 characters bound
# that work per token
MAX_STOP_CHARS = 1024


_PENALTIES = ("not supported: penalties need the sampler to see each request's past tokens, "
              "which this engine's does not")
# OpenAI's fields that an engine cannot honour, accepted only at a value that means "off":
# field -> (the values accepted, the refusal)
OFF_ONLY = {
    "n": ((1,), "only 1 is supported (one choice per prompt)"),
    "best_of": ((None, 1), "only 1 is supported (one choice per prompt)"),
    "suffix": ((None,), "not supported (send null or leave it out)"),
    "logit_bias": ((None, {}), "not supported (send null or {})"),
    "presence_penalty": ((0,), f"{_PENALTIES} (only 0, off)"),
    "frequency_penalty": ((0,), f"{_PENALTIES} (only 0, off)"),
    "repetition_penalty": ((None, 1), f"{_PENALTIES} (only 1, off)"),     # vLLM's
}


class _Request(BaseModel):
    # strict: "yes" is not a bool and "5" not an int (JSON's own types; an int is a float)
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's: usage in every chunk


class CompletionRequest(_Request):
    model: str
    # a string, a list of token ids, or a list of either (one choice per prompt); normalised
    # to list[str] or list[list[int]] by the validator
    prompt: Any
    max_tokens: Optional[int] = 16      # None: as many as the positions allow
    temperature: float = 1.0            # below 1e-5 (0 included): greedy
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1)        # 0 or -1: off (-1 is the API's spelling of 0)
    seed: Optional[int] = None          # None: a random seed
    stop: Optional[Union[str, list[str]]] = Field(None, validate_default=True)  # -> tuple
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    verify: Literal["block", "token"] = "block"
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # OpenAI fields accepted only at the value that means "off" (OFF_ONLY)
    n: int = 1
    best_of: Optional[int] = None
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extensions
    min_tokens: int = Field(0, ge=0)     # only where it cannot bind (see _min_tokens)
    skip_special_tokens: bool = True     # False: the text keeps the special tokens' strings
    repetition_penalty: Optional[float] = None     # only 1 (off; OFF_ONLY)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str):
            _unicode(v, "the prompt")
            return [v]
        if not isinstance(v, list) or not v:
            raise ValueError("expected a string, a non-empty list of token ids, or a non-empty "
                             "list of strings or of token-id lists")
        if all(_is_id(t) for t in v):
            return [list(v)]
        if all(isinstance(p, str) for p in v):
            for i, p in enumerate(v):
                _unicode(p, f"prompt {i}" if len(v) > 1 else "the prompt")
            return list(v)
        if all(isinstance(p, list) for p in v):
            for i, p in enumerate(v):
                if not p or not all(_is_id(t) for t in p):
                    raise ValueError(f"prompt {i}: expected a non-empty list of integer token "
                                     "ids")
            return [list(p) for p in v]
        raise ValueError("expected a string, a list of token ids, or a list of strings or of "
                         "token-id lists (not a mixture)")

    @field_validator("stop", mode="after")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return ()
        v = [v] if isinstance(v, str) else v
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}")
        for i, s in enumerate(v):
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop string {i} has {len(s)} characters, at most "
                                 f"{MAX_STOP_CHARS}")
            _unicode(s, f"stop string {i}")
        return tuple(dict.fromkeys(v))

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_LOGPROBS}] (the top logprobs per token; "
                             f"{MAX_LOGPROBS} at most, as vLLM), got {v}")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_only(cls, v, info):
        if v is not None and not info.data.get("stream", False):
            raise ValueError("only with stream: true (it sets what the stream sends)")
        return v

    @field_validator(*OFF_ONLY)
    @classmethod
    def _off_only(cls, v, info):
        accepted, refusal = OFF_ONLY[info.field_name]
        if v not in accepted:     # by ==: 0.0 and -0.0 are 0, {} is an empty logit_bias
            raise ValueError(refusal)
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v, info):
        """vLLM's min_tokens masks the stop tokens until that many tokens came; this engine's
        sampler cannot, so it is accepted only where no stop can come earlier: ignore_eos
        with no stop_token_ids and no stop strings (a load generator's fixed-length
        requests), where the request runs to max_tokens anyway."""
        if v == 0:
            return v
        d = info.data
        if d.get("max_tokens") is not None and v > d["max_tokens"]:
            raise ValueError(f"{v} exceeds max_tokens {d['max_tokens']}")
        if not d.get("ignore_eos") or d.get("stop_token_ids") or d.get("stop"):
            raise ValueError("> 0 needs the sampler to hold back the stop tokens, which this "
                             "engine's does not; send it only with ignore_eos and no stop / "
                             "stop_token_ids (or send 0)")
        return v

    @property
    def prompts(self) -> list:
        """list[str] or list[list[int]] (the validator's normal form)."""
        return self.prompt

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _unicode(s: str, what: str) -> None:
    """JSON's \\uXXXX escapes can spell a lone UTF-16 surrogate, which is no character: the
    tokenizer cannot take it and no output can contain it."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate "
                         f"U+{ord(s[e.start]):04X} at character {e.start}") from None


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


# ---- responses ------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's completion logprobs: per token its string, logprob (None: a prompt's first
    token), the top logprobs by token string, and its character offset in the choice's text."""
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[FinishReason] = None     # None in a stream chunk until the last
    logprobs: Optional[CompletionLogprobs] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: Optional[str] = None          # the engine's fingerprint
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dspark-compile"
    max_model_len: int                                # positions per request (max_seq_len)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error",
               431: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable"}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorBody(message=message, type=ERROR_TYPES.get(status, "error"),
                                         param=param, code=code)).model_dump()


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(one-line message, the first offending field) from pydantic's / FastAPI's error list;
    a location is ('body', field, index...) for a request body."""
    parts, first = [], None
    for e in errors[:3]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # a union's member name (e.g. 'str', 'list[str]') is noise in the location
        loc = [x for x in loc if "[" not in x and x not in _TYPE_TAGS]
        field = ".".join(loc) or "body"
        first = first or field
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif e.get("type") == "missing":
            msg = "field required"
        elif e.get("type") == "json_invalid":
            field, msg = "body", f"invalid JSON ({e.get('ctx', {}).get('error', msg)})"
            first = "body"
        parts.append(f"{field}: {msg}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, first
