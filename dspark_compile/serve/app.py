"""The FastAPI application: the routes, each short, over the engine loop.

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
import logging
import time
import uuid
from concurrent.futures import Executor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

# a key given twice is refused: readers that keep the first and readers that keep the last
# (proxies, loggers, this server) would see different requests
from dspark_compile.engine_dir.format import unique_keys as _no_duplicate_keys
from dspark_compile.serve.loop import EngineDown, EngineLoop, QueueFull, RequestFailed, Ticket
from dspark_compile.serve.metrics import CONTENT_TYPE, Metrics
from dspark_compile.serve.middleware import ACCESS, Access, ApiKey, RequestLog, clip as _clip
from dspark_compile.serve.middleware import error as _error
from dspark_compile.serve.prepare import (BadRequest, EngineLimits, Job, api_field, api_message,
                                          prepare)
from dspark_compile.serve.protocol import (Completion, CompletionChoice, CompletionRequest,
                                           ModelCard, ModelList, Usage, error_response,
                                           validation_message)
from dspark_compile.serve.text import TextStream, Tokenizer

log = logging.getLogger("dspark_compile.serve")


@dataclass(frozen=True)
class HttpLimits:
    max_request_bytes: int     # a larger body: 413
    body_timeout: float        # seconds for the whole body to arrive, else 408
    send_timeout: float        # seconds a stream's client may read nothing, then disconnected


@dataclass
class ServeState:
    loop: EngineLoop
    metrics: Metrics
    limits: EngineLimits
    tokenizer: Tokenizer | None
    model_name: str
    fingerprint: str | None
    created: int
    http: HttpLimits
    executor: Executor          # parsing and tokenization, off the event loop
    chat: object = None         # chat_format.ChatFormat: how conversations become prompts
    api_key: str | None = None  # requests must send `Authorization: Bearer <key>`
    allowed_origins: tuple = () # CORS: browser origins allowed ('*': any); () none


class ApiError(Exception):
    """A refusal in OpenAI's error body; `close`: the connection closes after it (the body
    was not read to its end)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, outcome: str = "invalid", close: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.outcome, self.close = outcome, close


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="dspark-compile", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    m = state.metrics
    # outermost last: the access log sees every answer, CORS headers go on refusals too, and a
    # CORS preflight (OPTIONS, which carries no key) is answered before the key check
    if state.api_key is not None:
        app.add_middleware(ApiKey, key=state.api_key)
    if state.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware
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
        admitted = await admit(state, request, acc, parse_request, _prepare_completion)
        if not isinstance(admitted, tuple):
            return admitted                  # a refusal
        req, jobs, tickets = admitted
        rid = f"cmpl-{uuid.uuid4().hex}"
        runs = [_Run(state, job, ticket, acc.start) for job, ticket in zip(jobs, tickets)]
        if req.stream:
            return _EventStream(_sse(state, req, rid, runs, acc),
                                on_disconnect=lambda: _cancel(runs),
                                send_timeout=state.http.send_timeout)
        return await _json(state, req, rid, runs, request, acc)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        from dspark_compile.serve.chat import chat_completions as handle
        return await handle(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        from dspark_compile.serve.chat import tokenize as handle
        return await _utility(state, request, handle)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        from dspark_compile.serve.chat import detokenize as handle
        return await _utility(state, request, handle)

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != state.model_name:
            e = not_served(model_id, state)
            return _error(e.status, e.message, e.param, e.code)
        return ModelCard(id=state.model_name, created=state.created,
                         max_model_len=state.limits.max_seq_len)

    @app.get("/version")
    async def version():
        from dspark_compile.serve import package_version
        return {"version": package_version()}

    return app


async def admit(state: ServeState, request: Request, acc: Access, parse, to_jobs):
    """A request read, parsed, checked and submitted: (the parsed request, its jobs, their
    tickets), or the refusal's response (every refusal counted by outcome). `parse(raw,
    content_type)` and `to_jobs(parsed, state)` run off the event loop."""
    m = state.metrics
    try:
        raw = await _read_body(request, state.http)
        req = await _off_loop(state, parse, raw, request.headers.get("content-type"))
        if req.model != state.model_name:
            raise not_served(req.model, state)
        jobs = await _off_loop(state, to_jobs, req, state)
        tickets = _submit(state.loop, jobs, acc.request_id)
    except ClientDisconnect:
        m.outcome("cancelled")
        return Response(status_code=499)
    except ApiError as e:
        m.outcome(e.outcome)
        return _error(e.status, e.message, e.param, e.code, e.close)
    except BadRequest as e:
        m.outcome("invalid")
        return _error(e.status, str(e), e.param)
    except QueueFull as e:
        m.outcome("queue_full")
        return _error(429, f"the server is at capacity ({e}): retry later", code="queue_full")
    except EngineDown as e:
        m.outcome("error")
        return _error(503, str(e))
    acc.prompt_tokens = sum(len(j.prompt) for j in jobs)
    m.prompt_tokens.inc(acc.prompt_tokens)
    return req, jobs, tickets


async def _utility(state: ServeState, request: Request, handle) -> Response:
    """/tokenize and /detokenize: the body read as a completion's, `handle(raw, content_type,
    state)` off the event loop, its dict as JSON or its refusal in OpenAI's error body."""
    try:
        raw = await _read_body(request, state.http)
        out = await _off_loop(state, handle, raw, request.headers.get("content-type"), state)
    except ClientDisconnect:
        return Response(status_code=499)
    except ApiError as e:
        return _error(e.status, e.message, e.param, e.code, e.close)
    except BadRequest as e:
        return _error(e.status, str(e), e.param)
    return JSONResponse(out)


def _prepare_completion(req: CompletionRequest, state: ServeState) -> list[Job]:
    return prepare(req, state.limits, state.tokenizer)


# ---- the request, before the engine --------------------------------------------------------

async def _read_body(request: Request, http: HttpLimits) -> bytes:
    """The body, refused with 413 past the limit (at once when Content-Length says so, else
    as a chunked body's bytes arrive; the rest is read and dropped by the server's protocol,
    server.py) and with 408 when it takes longer than the timeout (the connection closes)."""
    limit = http.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body of {int(declared)} bytes exceeds this server's "
                            f"limit of {limit} bytes (--max-request-bytes)")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(http.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body exceeds this server's limit of "
                                        f"{limit} bytes (--max-request-bytes)")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {http.body_timeout:g} s "
                            f"(--body-timeout; {size} bytes came)", close=True) from None
    return b"".join(chunks)


def _off_loop(state: ServeState, fn, *args):
    return asyncio.get_running_loop().run_in_executor(state.executor, fn, *args)


def parse_request(raw: bytes, content_type: str | None) -> CompletionRequest:
    """A body -> a validated CompletionRequest, or ApiError naming the problem (run off the
    event loop: parsing takes time in proportion to the body)."""
    return validated(CompletionRequest, load_json(raw, content_type))


def validated(schema, obj):
    """`schema`'s model of a JSON value, or ApiError (400) naming the first field it got wrong."""
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        raise ApiError(400, message, param) from None
    except RecursionError:       # a value nested within the JSON parser's depth, not pydantic's
        raise ApiError(400, "body: JSON nested too deeply", "body") from None


def not_served(model: str, state: ServeState) -> ApiError:
    """The 404 of a model id this server does not serve."""
    return ApiError(404, f"model {_clip(model)!r} is not served here (this server serves "
                         f"{state.model_name!r}; see /v1/models)", "model", "model_not_found")


def load_json(raw: bytes, content_type: str | None):
    """A body -> its JSON value, or ApiError naming the problem."""
    if content_type is not None and not _is_json(content_type):
        raise ApiError(415, f"the body must be JSON: Content-Type {_clip(content_type)!r} "
                            "(send application/json)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"body: not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                            f"{e.start})", "body") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"body: invalid JSON ({e.msg}: line {e.lineno} column {e.colno})",
                       "body") from None
    except RecursionError:
        raise ApiError(400, "body: JSON nested too deeply", "body") from None
    except ValueError as e:      # a duplicate key; an integer past Python's 4300 digits
        raise ApiError(400, f"body: invalid JSON ({str(e)[:200]})", "body") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(obj).__name__}", "body")
    return obj


def _is_json(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/")
                                          and mime.endswith("+json"))


def _submit(loop: EngineLoop, jobs: list[Job], request_id: str) -> list[Ticket]:
    """All of a request's prompts or none."""
    tickets = []
    aloop = asyncio.get_running_loop()
    try:
        for job in jobs:
            try:
                tickets.append(loop.submit(job.prompt, job.params, aloop,
                                           f"{request_id} (prompt {job.index})"))
            except ValueError as e:       # the stream's own validation
                raise BadRequest(api_field(str(e)), api_message(str(e))) from None
    except BaseException:
        for t in tickets:
            loop.cancel(t)
        raise
    return tickets


# ---- the request in the engine --------------------------------------------------------------

class _Run:
    """One job in flight: its ticket's events -> (text delta, ids delta, finish reason)."""

    def __init__(self, state: ServeState, job: Job, ticket: Ticket, arrival: float):
        self.state, self.job, self.ticket, self.arrival = state, job, ticket, arrival
        tok = state.tokenizer
        if tok is not None and not job.skip_special_tokens:
            tok = tok.keeping_special()
        self.text = TextStream(tok, job.prompt, job.stop_strings, job.params.stop_ids)
        self.finish: str | None = None
        self.last: float | None = None

    async def deltas(self):
        m = self.state.metrics
        while self.finish is None:
            item = await self.ticket.events.get()
            if isinstance(item, BaseException):
                self.finish = "error"
                m.outcome("error")
                raise item
            now = time.monotonic()
            if item.tokens:
                if self.last is None:
                    m.ttft.observe(now - self.arrival)
                else:
                    m.itl.observe((now - self.last) / len(item.tokens), len(item.tokens))
                self.last = now
            try:
                text, ids = self.text.add(item.tokens)
                if item.finished or self.text.stopped:
                    text += self.text.finish()
            except Exception as e:  # noqa: BLE001 -- the tokenizer's fault: this request's
                self._failed(e)
            if self.text.stopped and not item.finished:   # a stop string: the engine stops too
                self.state.loop.cancel(self.ticket)
            if item.finished or self.text.stopped:
                self.finish = "stop" if self.text.stopped else "length"
                m.outcome(self.finish)
                m.e2e.observe(now - self.arrival)
            if text or ids or self.finish:
                yield text, ids, self.finish

    def _failed(self, e: Exception):
        log.error("request %s: detokenizing its output failed (the request ends, the others "
                  "go on)", self.ticket.tag, exc_info=e)
        self.state.loop.cancel(self.ticket)
        self.finish = "error"
        self.state.metrics.outcome("error")
        raise RequestFailed(f"detokenizing this request's output failed: "
                            f"{type(e).__name__}: {str(e)[:200]}") from None

    def cancel(self) -> None:
        if self.finish is None:
            self.finish = "cancelled"
            self.state.metrics.outcome("cancelled")
            self.state.loop.cancel(self.ticket)


def _cancel(runs: list[_Run]) -> None:
    for r in runs:
        r.cancel()


def _usage(runs: list[_Run]) -> Usage:
    p = sum(len(r.job.prompt) for r in runs)
    c = sum(len(r.text.ids) for r in runs)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _account(acc: Access, runs: list[_Run]) -> None:
    acc.completion_tokens = sum(len(r.text.ids) for r in runs)
    acc.finish = [r.finish or "cancelled" for r in runs]


async def collect(state: ServeState, runs: list[_Run], request: Request,
                  acc: Access) -> Response | None:
    """Every run to its end (None), or the response that ends the request early: 499 when
    the client left first, 503 when the engine stopped, 500 when it failed the request."""
    async def drain(run: _Run):
        async for _ in run.deltas():
            pass

    tasks = [asyncio.ensure_future(drain(r)) for r in runs]
    work = asyncio.ensure_future(asyncio.gather(*tasks))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():                  # the client left first
            work.cancel()
            return Response(status_code=499)
        work.result()                        # EngineDown -> 503, RequestFailed -> 500
    except EngineDown as e:
        return _error(503, str(e))
    except RequestFailed as e:
        return _error(500, _prompt_label(runs) + str(e), code="engine_error")
    finally:
        gone.cancel()
        for t in tasks:                      # the others of a request one prompt failed
            t.cancel()
        _cancel(runs)                        # a no-op for the finished ones
        _account(acc, runs)
    return None


async def _json(state: ServeState, req: CompletionRequest, rid: str, runs: list[_Run],
                request: Request, acc: Access):
    failed = await collect(state, runs, request, acc)
    if failed is not None:
        return failed
    choices = [CompletionChoice(index=r.job.index, text=r.text.text, token_ids=r.text.ids,
                                finish_reason=r.finish) for r in runs]
    return Completion(id=rid, model=state.model_name, system_fingerprint=state.fingerprint,
                      choices=choices, usage=_usage(runs))


def _prompt_label(runs: list[_Run]) -> str:
    if len(runs) == 1:
        return ""
    failed = [r.job.index for r in runs if r.finish == "error"]
    return f"prompt {failed[0]}: " if failed else ""


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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


async def _sse(state: ServeState, req: CompletionRequest, rid: str, runs: list[_Run],
               acc: Access):
    """OpenAI's completion stream: `data: {chunk}` per delta (with the usage so far in each
    when stream_options.continuous_usage_stats, vLLM's), a usage chunk (choices []) when
    stream_options.include_usage, then `data: [DONE]`. A prompt the engine failed on,
    or every prompt when the server stops, ends with an error event (OpenAI's error body);
    the others go on, and the stream still ends with `data: [DONE]`."""
    merged: asyncio.Queue = asyncio.Queue()
    base = _chunk_base(state, rid)
    every = continuous_usage(req)

    async def pump(run: _Run):
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
            elif isinstance(item, BaseException):
                label = f"prompt {run.job.index}: " if len(runs) > 1 else ""
                if isinstance(item, EngineDown):
                    body = _json_error(503, label + str(item))
                else:
                    body = _json_error(500, label + str(item), "engine_error")
                yield f"data: {body}\n\n"
            else:
                text, ids, finish = item
                yield _chunk(base, [{"index": run.job.index, "text": text, "token_ids": ids,
                                     "finish_reason": finish, "logprobs": None}],
                             _usage(runs) if every else None)
        if req.include_usage:
            yield _chunk(base, [], _usage(runs))
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        _cancel(runs)
        _account(acc, runs)


def _json_error(status: int, message: str, code: str | None = None) -> str:
    return json.dumps(error_response(status, message, code=code))


class _SendTimeout(OSError):
    """The client read nothing for the send timeout: treated as a disconnect."""


class _EventStream(StreamingResponse):
    """Server-sent events that stop, and cancel their requests, when the client disconnects
    or reads nothing for `send_timeout` seconds: the disconnect is listened for while
    sending, whatever ASGI spec version the server speaks (Starlette listens only below 2.4
    and otherwise notices at the next send)."""

    def __init__(self, content, on_disconnect, send_timeout: float):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_disconnect, self.send_timeout = on_disconnect, send_timeout

    async def __call__(self, scope, receive, send):
        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass

        async def timed_send(message):
            try:
                async with asyncio.timeout(self.send_timeout):
                    await send(message)
            except TimeoutError:
                raise _SendTimeout(f"the client read nothing for {self.send_timeout:g} s "
                                   "(--send-timeout)") from None

        sending = asyncio.ensure_future(self.stream_response(timed_send))
        gone = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sending.done():
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
            gone.cancel()
            ended = (sending.done() and not sending.cancelled()
                     and sending.exception() is None)
            if not ended:
                self.on_disconnect()
            await self.body_iterator.aclose()
        exc = sending.exception() if not sending.cancelled() else None
        if isinstance(exc, _SendTimeout):
            log.info("%s: stream ended", exc)
        elif exc is not None and not isinstance(exc, OSError):   # a closed socket: a disconnect
            raise exc


# what chat.py shares
Run, EventStream, cancel_runs, usage, account, json_error = (_Run, _EventStream, _cancel, _usage,
                                                            _account, _json_error)


def continuous_usage(req: CompletionRequest) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage in every chunk."""
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)
