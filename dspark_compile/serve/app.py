"""The FastAPI application: the routes, each short, over the engine loop (http.py: what the
completions and the chat routes share; chat.py: the chat routes' handlers).

    GET  /health           200 while the engine thread runs; 503 once it failed or while the
                           server drains
    GET  /v1/models        the one engine served (its id: --model-name, default the directory)
    POST /v1/completions   one choice per prompt; JSON, or server-sent events with `stream`
    POST /v1/chat/completions, /tokenize, /detokenize   chat.py
    GET  /v1/models/{id}, /version
    GET  /metrics          Prometheus text format (metrics.py)

A completion request, in order: the body is read (at most --max-request-bytes, else 413 before
the rest is read; within --body-timeout, else 408), parsed and validated, then tokenized and
checked against the engine (prepare.py) -- both on a small thread pool, never on the event
loop, whose thread answers every other client meanwhile -- then submitted to the engine loop.

Errors use OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 names the field
or the problem (schema errors from protocol.py, engine limits from prepare.py, a body that is
not UTF-8 JSON), 404 an unknown model, 408 a body too slow, 413 a body too large, 415 a body
that is not JSON, 429 a full queue, 500 a request the engine failed on (that request alone:
loop.py), 503 a stopped or draining engine. Every refusal before the engine is counted as
`invalid`. Anything else is a bug: its traceback is logged with the request id and the client
gets a one-line 500.

Every response carries `X-Request-Id` (the client's, when it is 1-128 printable ASCII
characters, else a generated one), and every request is one access-log line: its id, method,
path, status, prompt and completion tokens, finish reasons and duration (middleware.py, with
the API key and CORS).

A client that disconnects cancels its requests: a streamed response listens for the
disconnect while it sends (whatever the ASGI server's spec version), a JSON response waits
for either the result or the disconnect. A streaming client that reads nothing for
--send-timeout is disconnected the same way.
"""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from dspark_compile.serve import chat, package_version
from dspark_compile.serve.http import (ApiError, EventStream, Last, Run, ServeState, account,
                                       admit, cancel_runs, collect, continuous_usage,
                                       json_error, load_json, not_served, off_loop, read_body,
                                       usage, validated)
from dspark_compile.serve.logprobs import CompletionLogprobs, merge
from dspark_compile.serve.loop import EngineDown, RequestFailed
from dspark_compile.serve.metrics import CONTENT_TYPE
from dspark_compile.serve.middleware import ACCESS, Access, ApiKey, RequestLog, new_id
from dspark_compile.serve.middleware import error as _error
from dspark_compile.serve.prepare import BadRequest, Job, prepare
from dspark_compile.serve.protocol import (Completion, CompletionChoice, CompletionRequest,
                                           ModelCard, ModelList, Usage, validation_message)


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="dspark-compile", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    m = state.metrics
    # outermost last: the access log sees every answer, CORS headers go on refusals too, and a
    # CORS preflight (OPTIONS, which carries no key) is answered before the key check
    if state.api_key is not None:
        app.add_middleware(ApiKey, key=state.api_key)
    if state.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"])
    app.add_middleware(RequestLog, metrics=m)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not state.loop.alive or state.loop.draining:
            reason = (state.loop.down_reason() if state.loop.error or state.loop.draining
                      else "engine thread stopped")
            return _error(503, reason)
        return {"status": "ok", "in_flight": state.loop.in_flight}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                         max_model_len=state.limits.max_seq_len)])

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        acc: Access = request.scope[ACCESS]
        admitted = await admit(state, request, acc, parse_request, _prepare_completion,
                               _has_text)
        if not isinstance(admitted, tuple):
            return admitted                  # a refusal
        req, jobs, tickets = admitted
        rid = f"cmpl-{new_id()}"
        runs = [Run(state, job, ticket, acc.start) for job, ticket in zip(jobs, tickets)]
        if req.stream:
            return EventStream(_sse(state, req, rid, runs, acc),
                               on_disconnect=lambda: cancel_runs(runs),
                               send_timeout=state.http.send_timeout)
        return await _json(state, req, rid, runs, request, acc)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat.chat_completions(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _utility(state, request, chat.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _utility(state, request, chat.detokenize)

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != state.model_name:
            e = not_served(model_id, state)
            return _error(e.status, e.message, e.param, e.code)
        return ModelCard(id=state.model_name, created=state.created,
                         max_model_len=state.limits.max_seq_len)

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    return app


async def _utility(state: ServeState, request: Request, handle) -> Response:
    """/tokenize and /detokenize: the body read as a completion's, `handle(raw, content_type,
    state)` off the event loop, its dict as JSON or its refusal in OpenAI's error body."""
    try:
        raw = await read_body(request, state.http)
        out = await off_loop(state, handle, raw, request.headers.get("content-type"), state)
    except ClientDisconnect:
        return Response(status_code=499)
    except ApiError as e:
        return _error(e.status, e.message, e.param, e.code, e.close)
    except BadRequest as e:
        return _error(e.status, str(e), e.param)
    return JSONResponse(out)


def _has_text(req: CompletionRequest) -> bool:
    """Whether the prompt has text to tokenize (else token ids: a list of ints, or of lists
    of ints); an unexpected shape counts as text (prepare.py refuses it off the loop)."""
    p = req.prompt
    if not isinstance(p, list) or not p:
        return True
    return not all(type(x) is int or (isinstance(x, list) and all(type(t) is int for t in x))
                   for x in p)


def _prepare_completion(req: CompletionRequest, state: ServeState) -> list[Job]:
    return prepare(req, state.limits, state.tokenizer)


def parse_request(raw: bytes, content_type: str | None) -> CompletionRequest:
    """A body -> a validated CompletionRequest, or ApiError naming the problem (run off the
    event loop: parsing takes time in proportion to the body)."""
    return validated(CompletionRequest, load_json(raw, content_type))


async def _json(state: ServeState, req: CompletionRequest, rid: str, runs: list[Run],
                request: Request, acc: Access):
    failed = await collect(state, runs, request, acc)
    if failed is not None:
        return failed
    choices = [CompletionChoice(index=r.job.index, text=(r.job.prompt_text or "") * r.job.echo
                                + r.text.text, token_ids=r.text.ids, finish_reason=r.finish,
                                logprobs=_run_logprobs(state, r)) for r in runs]
    return Completion(id=rid, model=state.model_name, system_fingerprint=state.fingerprint,
                      choices=choices, usage=usage(runs))


def _run_logprobs(state: ServeState, run: Run) -> dict | None:
    """A finished run's completion logprobs (the echoed prompt's first), or None."""
    if run.job.logprobs is None:
        return None
    out = CompletionLogprobs(state.token_pieces())
    parts = []
    if run.job.echo and run.prompt_logprobs is not None:
        parts.append(out.delta(run.job.prompt, run.prompt_logprobs))
    parts.append(out.delta(run.text.ids, run.logprobs))
    return merge(parts)


def _chunk_base(state: ServeState, rid: str) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "system_fingerprint": state.fingerprint}


def _chunk(base: dict, choices: list, usage: Usage | None = None) -> str:
    """One SSE event of the Completion schema. Built as plain JSON: one per request per step
    on the event loop's thread, which shares the GIL with the engine thread (pydantic's
    model_construct took ~55 us a chunk here, inspecting the default factories each call;
    tests/serve checks the chunks parse as the openai client's Completion)."""
    body = {**base, "choices": choices, "usage": usage.model_dump() if usage else None}
    return f"data: {json.dumps(body)}\n\n"


def _text_chunks(base: dict):
    """`_chunk` of one choice without logprobs or usage (a stream's every chunk but the
    usage one, unless it asks logprobs or continuous usage), from a prefix made once a
    stream: ~3 us a chunk instead of json.dumps' ~11 us of the whole dict (tests/serve
    checks both parse to the same JSON)."""
    prefix = f'data: {json.dumps(base)[:-1]}, "choices": [{{"index": '

    def chunk(index: int, text: str, ids: list, finish: str | None) -> str:
        return (f'{prefix}{index:d}, "text": {json.dumps(text)}, "token_ids": '
                f'[{", ".join(map(str, map(int, ids)))}], "finish_reason": '
                f'{json.dumps(finish)}, "logprobs": null}}], "usage": null}}\n\n')
    return chunk


async def _sse(state: ServeState, req: CompletionRequest, rid: str, runs: list[Run],
               acc: Access):
    """OpenAI's completion stream: `data: {chunk}` per delta (with the usage so far in each
    when stream_options.continuous_usage_stats, vLLM's), a usage chunk (choices []) when
    stream_options.include_usage, then `data: [DONE]`. A prompt the engine failed on,
    or every prompt when the server stops, ends with an error event (OpenAI's error body);
    the others go on, and the stream still ends with `data: [DONE]`."""
    base = _chunk_base(state, rid)
    text_chunk = _text_chunks(base)
    every = continuous_usage(req)
    # per run: its logprobs' text offsets run on across its chunks
    lps = {id(r): CompletionLogprobs(state.token_pieces()) for r in runs
           if r.job.logprobs is not None}
    items = _merged(runs)
    tail = ""           # one run's finish chunk: sent with the end (http.Last)
    try:
        async for run, item in items:
            if isinstance(item, BaseException):
                label = f"prompt {run.job.index}: " if len(runs) > 1 else ""
                if isinstance(item, EngineDown):
                    body = json_error(503, label + str(item))
                else:
                    body = json_error(500, label + str(item), "engine_error")
                yield f"data: {body}\n\n"
            else:
                lp = lps.get(id(run))
                lp = lp.delta(item.ids, item.logprobs) if lp and item.logprobs else None
                ids = [] if item.prompt else item.ids
                if lp is None and not every:
                    chunk = text_chunk(run.job.index, item.text, ids, item.finish)
                else:
                    chunk = _chunk(base, [{"index": run.job.index, "text": item.text,
                                           "token_ids": ids, "finish_reason": item.finish,
                                           "logprobs": lp}], usage(runs) if every else None)
                if item.finish is not None and len(runs) == 1:
                    tail = chunk
                else:
                    yield chunk
        if req.include_usage:
            tail += _chunk(base, [], usage(runs))
        yield Last(tail + "data: [DONE]\n\n")
    finally:
        await items.aclose()
        cancel_runs(runs)
        account(acc, runs)


async def _merged(runs: list[Run]):
    """(run, Delta | EngineDown | RequestFailed) of every run as they come, until each run
    ended. One run (most requests) is read directly: no task and no queue between its
    ticket and its chunks (two task switches a chunk fewer on the event loop)."""
    if len(runs) == 1:
        run = runs[0]
        try:
            async for delta in run.deltas():
                yield run, delta
        except (EngineDown, RequestFailed) as e:
            yield run, e
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run):
        try:
            async for delta in run.deltas():
                await merged.put((run, delta))
        except (EngineDown, RequestFailed) as e:
            await merged.put((run, e))
        finally:
            await merged.put((run, None))

    tasks = [asyncio.ensure_future(pump(r)) for r in runs]
    try:
        left = len(runs)
        while left:
            run, item = await merged.get()
            if item is None:
                left -= 1
            else:
                yield run, item
    finally:
        for t in tasks:
            t.cancel()
