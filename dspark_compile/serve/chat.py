"""POST /v1/chat/completions: OpenAI's chat API over the completions machinery (app.py).

A chat request is a conversation plus the completions endpoint's sampling fields. The
conversation is rendered into one prompt (chat_format.py: the engine's Jinja template if it
ships one, else DeepSeek-V4's format), and every other field is forwarded to CompletionRequest,
so the sampling fields, their validation and their error messages are the completions
endpoint's own, by construction. Chat's own fields:

    messages                 system / user / assistant; content a string or a list of
                             {"type": "text", "text"} parts (joined with a blank line, as
                             DeepSeek's encoding joins content blocks); an assistant
                             message's reasoning_content is accepted and dropped (the format
                             keeps no earlier turn's reasoning)
    max_completion_tokens    OpenAI's newer name of max_tokens (both: they must agree);
                             neither: as many as the engine's positions allow
    reasoning_effort         none | minimal | low | medium | high | xhigh | max: any but
                             none turns thinking on (DeepSeek's API maps them to high / max)
    thinking                 {"type": "enabled" | "disabled"} (DeepSeek's API)
    chat_template_kwargs     {"thinking" | "enable_thinking": bool, "reasoning_effort"} (vLLM's)
    logprobs, top_logprobs   logprobs: true returns each output token's logprob (the
                             target's raw log-probability, docs/serve.md "Logprobs") and
                             top_logprobs (0..20, default 0) more per token, in
                             choices[].logprobs.content, also in stream chunks; the
                             reasoning's tokens are there too. top_logprobs needs
                             logprobs: true; `echo` is the completions endpoint's alone

Thinking is off unless the request turns it on (vLLM's default for DeepSeek-V4: a client that
knows nothing of reasoning gets the plain answer). With thinking on, the reply's text up to
`</think>` is `reasoning_content` and the rest `content`, in the message and in every stream
chunk's delta.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dspark_compile.serve.http import (ApiError, EventStream, Last, Run, account, admit,
                                       cancel_runs, collect, continuous_usage, json_error,
                                       load_json, not_served, usage, validated)
from dspark_compile.serve.middleware import ACCESS, new_id
from dspark_compile.models.chat_format import EFFORTS, ChatError, ReasoningSplit, split_reasoning
from dspark_compile.serve.loop import EngineDown, RequestFailed
from dspark_compile.serve.prepare import BadRequest, Job, prepare
from dspark_compile.serve.logprobs import chat_content
from dspark_compile.serve.protocol import MAX_LOGPROBS, CompletionRequest
from dspark_compile.serve.protocol import _unicode as unicode_text


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    reasoning_content: Optional[str] = None     # accepted, dropped (an earlier turn's)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n\n".join(p.text for p in self.content)

    @model_validator(mode="after")
    def _unicode(self):
        unicode_text(self.text(), "the message's content")   # no lone UTF-16 surrogate
        return self


class Thinking(_Strict):
    type: Literal["enabled", "disabled"]


class TemplateKwargs(_Strict):
    thinking: Optional[bool] = None
    enable_thinking: Optional[bool] = None
    reasoning_effort: Optional[str] = None


class ChatCompletionRequest(BaseModel):
    # the fields not named here are the completions endpoint's: forwarded, validated there
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    reasoning_effort: Optional[str] = None
    thinking: Optional[Thinking] = None
    chat_template_kwargs: Optional[TemplateKwargs] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


@dataclass(frozen=True)
class Chat:
    """A validated chat request: the conversation, its mode, the forwarded fields."""
    model: str
    messages: list[dict]
    thinking: bool
    effort: str | None              # the format's name: high | max (None: chat mode)
    completion: CompletionRequest   # prompt: a placeholder until the conversation is rendered
    max_tokens_field: str = "max_tokens"    # the name the client used

    @property
    def stream(self) -> bool:
        return self.completion.stream


def parse_chat(raw: bytes, content_type: str | None) -> Chat:
    """A body -> a Chat, or app.ApiError naming the field (run off the event loop)."""
    return chat_of(load_json(raw, content_type))


def chat_of(obj: dict) -> Chat:
    req = validated(ChatCompletionRequest, obj)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true (it sets how many more "
                                "tokens each returned logprob lists)", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs: must be in [0, {MAX_LOGPROBS}] (as vLLM), got "
                                f"{req.top_logprobs}", "top_logprobs")
    extra = dict(req.model_extra or {})
    if "echo" in extra:
        raise ApiError(400, "echo: not a chat completions field (the completions endpoint's: "
                            "a chat reply never repeats its conversation)", "echo")
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    elif req.max_tokens is not None and req.max_tokens != max_tokens:
        raise ApiError(400, f"max_completion_tokens: {max_tokens} contradicts max_tokens "
                            f"{req.max_tokens} (send one)", "max_completion_tokens")
    forward = {**extra, "model": req.model, "prompt": "x", "max_tokens": max_tokens,
               "logprobs": (req.top_logprobs or 0) if req.logprobs else None}
    completion = validated(CompletionRequest, forward)
    thinking, effort = _mode(req)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    named = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return Chat(req.model, messages, thinking, effort, completion, named)


def _mode(req: ChatCompletionRequest) -> tuple[bool, str | None]:
    """(thinking, the format's effort) from the request's three ways of saying it."""
    kw = req.chat_template_kwargs or TemplateKwargs()
    said = {}
    for name, v in (("chat_template_kwargs.thinking", kw.thinking),
                    ("chat_template_kwargs.enable_thinking", kw.enable_thinking),
                    ("thinking.type", None if req.thinking is None
                     else req.thinking.type == "enabled")):
        if v is not None:
            said[name] = v
    if len(set(said.values())) > 1:
        raise ApiError(400, f"{', '.join(said)} disagree on thinking", next(iter(said)))
    effort = req.reasoning_effort
    param = "reasoning_effort"
    if kw.reasoning_effort is not None:
        if effort is not None and effort != kw.reasoning_effort:
            raise ApiError(400, "reasoning_effort: contradicts chat_template_kwargs."
                                "reasoning_effort (send one)", param)
        effort, param = kw.reasoning_effort, "chat_template_kwargs.reasoning_effort"
    if effort is not None and effort not in EFFORTS:
        raise ApiError(400, f"{param}: {effort!r} is not one of {', '.join(EFFORTS)}",
                       param)
    thinking = next(iter(said.values())) if said else False
    if effort is not None:
        if EFFORTS[effort] is None:            # "none"
            if said and thinking:
                raise ApiError(400, f"{param}: 'none' turns thinking off, which "
                                    f"{next(iter(said))} turns on", param)
            thinking = False
        elif not said:
            thinking = True
    return thinking, (EFFORTS.get(effort) or "high") if thinking else None


def prompt_ids(chat: Chat, state) -> list[int]:
    """The conversation's prompt ids (BadRequest naming the message it cannot render). With
    DeepSeek-V4's format the format's tokens are encoded apart from the messages' text, which
    is encoded with special tokens as characters: a message cannot forge a turn. A Jinja
    template's output is one text, encoded as a whole."""
    tok = state.tokenizer
    if tok is None:
        raise BadRequest("messages", "this engine has no tokenizer.json: chat needs one "
                                     "(use /v1/completions with token ids)")
    fmt = state.chat
    try:
        parts = fmt.parts(chat.messages, chat.thinking, chat.effort)
        if parts is None:
            parts = [(fmt.render(chat.messages, chat.thinking, chat.effort), None)]
    except ChatError as e:
        raise BadRequest(e.param, e.message) from None
    if parts[0][0].startswith(fmt.bos) and tok.encode(""):
        # the tokenizer adds BOS itself: not twice
        parts[0] = (parts[0][0][len(fmt.bos):], parts[0][1])
    _fits(sum(len(t) for t, _ in parts), state)
    if parts[0][1] is None:
        return tok.encode(parts[0][0])
    ids, text = [], ""              # text: plain pieces (markers this tokenizer lacks among)
    for piece, marker in parts:
        i = tok.special(piece) if marker else None
        if i is None:
            text += piece
            continue
        if text:
            ids += tok.encode_plain(text)
            text = ""
        ids.append(i)
    return ids + (tok.encode_plain(text) if text else [])


def prepare_chat(chat: Chat, state) -> list[Job]:
    """The conversation rendered and tokenized, then the completions endpoint's checks
    (run off the event loop)."""
    ids = prompt_ids(chat, state)
    if not ids:
        raise BadRequest("messages", "the conversation encodes to no tokens")
    try:
        return prepare(chat.completion.model_copy(update={"prompt": [ids]}), state.limits,
                       state.tokenizer, label=lambda i: "rendered conversation",
                       fields={"prompt": "messages", "max_new_tokens": chat.max_tokens_field})
    except BadRequest as e:         # prepare's own refusals of the prompt: the messages'
        param = "messages" if e.param == "prompt" else e.param
        raise BadRequest(param, e.message, e.status) from None


async def chat_completions(state, request):
    acc = request.scope[ACCESS]
    admitted = await admit(state, request, acc, parse_chat, prepare_chat)
    if not isinstance(admitted, tuple):
        return admitted                      # a refusal
    chat, jobs, tickets = admitted
    rid = f"chatcmpl-{new_id()}"
    run = Run(state, jobs[0], tickets[0], acc.start)
    if chat.stream:
        return EventStream(_sse(state, chat, rid, run, acc),
                           on_disconnect=lambda: cancel_runs([run]),
                           send_timeout=state.http.send_timeout)
    failed = await collect(state, [run], request, acc)
    if failed is not None:
        return failed
    reasoning, content = split_reasoning(run.text.text, chat.thinking)
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name, "system_fingerprint": state.fingerprint,
            "choices": [{"index": 0, "message": message, "finish_reason": run.finish,
                         "logprobs": _logprobs(state, run, run.text.ids, run.logprobs)}],
            "usage": usage([run]).model_dump()}
    return JSONResponse(body)


async def _sse(state, chat: Chat, rid: str, run, acc):
    """OpenAI's chat stream: a first chunk with the role, a chunk per delta (content and
    reasoning_content apart), the last with finish_reason, a usage chunk when
    stream_options.include_usage (usage in every chunk with continuous_usage_stats), then
    `data: [DONE]`; a failure is an error event, then `data: [DONE]`."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": state.model_name, "system_fingerprint": state.fingerprint}
    every = continuous_usage(chat.completion)
    split = ReasoningSplit(chat.thinking)

    def chunk(delta: dict, finish=None, logprobs=None) -> str:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                     "logprobs": logprobs}]}
        if every:
            body["usage"] = usage([run]).model_dump()
        return f"data: {json.dumps(body)}\n\n"

    tail = ""           # the finish chunk: sent with the end (http.Last)
    try:
        yield chunk({"role": "assistant", "content": ""})
        try:
            async for d in run.deltas():
                text, finish = d.text, d.finish
                reasoning, content = split.add(text)
                if finish:
                    r, c = split.finish()
                    reasoning, content = reasoning + r, content + c
                delta = {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if content:
                    delta["content"] = content
                lps = _logprobs(state, run, d.ids, d.logprobs) if d.logprobs else None
                if finish:
                    tail = chunk(delta, finish, lps)
                elif delta or lps:
                    yield chunk(delta, finish, lps)
        except EngineDown as e:
            yield f"data: {json_error(503, str(e))}\n\n"
        except RequestFailed as e:
            yield f"data: {json_error(500, str(e), 'engine_error')}\n\n"
        if chat.completion.include_usage:
            body = {**base, "choices": [], "usage": usage([run]).model_dump()}
            tail += f"data: {json.dumps(body)}\n\n"
        yield Last(tail + "data: [DONE]\n\n")
    finally:
        cancel_runs([run])
        account(acc, [run])


def _logprobs(state, run, ids: list, entries: list | None) -> dict | None:
    """Chat's choices[].logprobs of `ids` (None: the request asked none)."""
    if run.job.logprobs is None:
        return None
    return {"content": chat_content(state.token_pieces(), ids, entries or []),
            "refusal": None}


# ---- /tokenize and /detokenize (vLLM's) --------------------------------------------------------

class TokenizeRequest(BaseModel):
    # {"prompt": text} or {"messages": [...]} with chat's rendering fields
    model_config = ConfigDict(extra="allow", strict=True)
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list] = None


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


def tokenize(raw: bytes, content_type: str | None, state) -> dict:
    """vLLM's /tokenize: {"count", "max_model_len", "tokens"} of a text or of a conversation
    rendered as /v1/chat/completions renders it (run off the event loop)."""
    obj = load_json(raw, content_type)
    req = validated(TokenizeRequest, obj)
    _served(req.model, state)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "body: send one of prompt or messages", "prompt")
    if state.tokenizer is None:
        raise ApiError(400, "this engine has no tokenizer.json", "prompt")
    if req.messages is not None:
        ids = prompt_ids(chat_of({**obj, "model": state.model_name}), state)
    else:
        if req.model_extra:
            name = next(iter(req.model_extra))
            raise ApiError(400, f"{name}: unknown field", name)
        _fits(len(req.prompt), state, "prompt")
        ids = state.tokenizer.encode(req.prompt)
    return {"count": len(ids), "max_model_len": state.limits.max_seq_len, "tokens": ids}


def detokenize(raw: bytes, content_type: str | None, state) -> dict:
    """vLLM's /detokenize: {"prompt": the text of the ids}."""
    req = validated(DetokenizeRequest, load_json(raw, content_type))
    _served(req.model, state)
    if state.tokenizer is None:
        raise ApiError(400, "this engine has no tokenizer.json", "tokens")
    v = state.limits.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < v]
    if bad:
        raise ApiError(400, f"tokens: ids {bad[:5]} outside [0, {v})", "tokens")
    if len(req.tokens) > state.limits.max_seq_len:
        raise ApiError(400, f"tokens: {len(req.tokens)} ids, more than the engine's "
                            f"{state.limits.max_seq_len} positions", "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}


def _served(model: str | None, state) -> None:
    if model is not None and model != state.model_name:
        raise not_served(model, state)


def _fits(chars: int, state, param: str = "messages") -> None:
    """A text that cannot fit the engine is refused before it is tokenized (prepare.py)."""
    per_token = getattr(state.tokenizer, "max_token_chars", None)
    if per_token and -(-chars // per_token) > state.limits.max_seq_len:
        raise BadRequest(param, f"{chars} characters are more tokens than the engine's "
                                f"{state.limits.max_seq_len} positions")
