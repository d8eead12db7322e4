"""The FastAPI application: the routes, each short, over the engine loop.

    GET  /health           200 while the engine thread runs, 503 once it failed
    GET  /v1/models        the one engine served (its id: --model-name, default the directory)
    POST /v1/completions   one choice per prompt; JSON, or server-sent events with `stream`
    GET  /metrics          Prometheus text format (metrics.py)

Errors use OpenAI's body, {"error": {"message", "type", "param", "code"}}: 400 names the field
(schema errors from protocol.py, engine limits from prepare.py), 404 an unknown model, 429 a
full queue, 503 a stopped engine; anything else is a one-line 500 (the traceback goes to the
server's log, never to the client).

A client that disconnects cancels its requests: a streamed response listens for the
disconnect while it sends (whatever the ASGI server's spec version), a JSON response waits
for either the result or the disconnect.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_compile.serve.loop import EngineDown, EngineLoop, QueueFull, Ticket
from dspark_compile.serve.metrics import CONTENT_TYPE, Metrics
from dspark_compile.serve.prepare import (BadRequest, EngineLimits, Job, api_field, api_message,
                                          prepare)
from dspark_compile.serve.protocol import (Completion, CompletionChoice, CompletionRequest,
                                           ModelCard, ModelList, Usage, error_response,
                                           validation_message)
from dspark_compile.serve.text import TextStream, Tokenizer

@dataclass
class ServeState:
    loop: EngineLoop
    metrics: Metrics
    limits: EngineLimits
    tokenizer: Tokenizer | None
    model_name: str
    fingerprint: str | None
    created: int


def _error(status: int, message: str, param: str | None = None, code: str | None = None):
    return JSONResponse(error_response(status, message, param, code), status_code=status)


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="dspark-compile", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    m = state.metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(list(exc.errors()))
        if request.url.path == "/v1/completions":
            m.outcome("invalid")
        return _error(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        # the ASGI server logs the traceback; the client gets one line
        return _error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            reason = state.loop.down_reason() if state.loop.error else "engine thread stopped"
            return _error(503, reason)
        return {"status": "ok", "in_flight": state.loop.in_flight}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                         max_model_len=state.limits.max_seq_len)])

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        arrival = time.monotonic()
        if req.model != state.model_name:
            m.outcome("invalid")
            return _error(404, f"model {req.model!r} is not served here (this server serves "
                               f"{state.model_name!r}; see /v1/models)", "model",
                          "model_not_found")
        try:
            jobs = prepare(req, state.limits, state.tokenizer)
            tickets = _submit(state.loop, jobs)
        except BadRequest as e:
            m.outcome("invalid")
            return _error(e.status, str(e), e.param)
        except QueueFull as e:
            m.outcome("queue_full")
            return _error(429, f"the server is at capacity ({e}): retry later",
                          code="queue_full")
        except EngineDown as e:
            m.outcome("error")
            return _error(503, str(e))
        m.prompt_tokens.inc(sum(len(j.prompt) for j in jobs))
        rid = f"cmpl-{uuid.uuid4().hex}"
        runs = [_Run(state, job, ticket, arrival) for job, ticket in zip(jobs, tickets)]
        if req.stream:
            return _EventStream(_sse(state, req, rid, runs), on_disconnect=lambda: _cancel(runs))
        return await _json(state, req, rid, runs, request)

    return app


def _submit(loop: EngineLoop, jobs: list[Job]) -> list[Ticket]:
    """All of a request's prompts or none."""
    tickets = []
    try:
        for job in jobs:
            try:
                tickets.append(loop.submit(job.prompt, job.params, asyncio.get_running_loop()))
            except ValueError as e:       # the stream's own validation
                raise BadRequest(api_field(str(e)), api_message(str(e))) from None
    except BaseException:
        for t in tickets:
            loop.cancel(t)
        raise
    return tickets


class _Run:
    """One job in flight: its ticket's events -> (text delta, ids delta, finish reason)."""

    def __init__(self, state: ServeState, job: Job, ticket: Ticket, arrival: float):
        self.state, self.job, self.ticket, self.arrival = state, job, ticket, arrival
        self.text = TextStream(state.tokenizer, job.prompt, job.stop_strings,
                               job.params.stop_ids)
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
            text, ids = self.text.add(item.tokens)
            if self.text.stopped and not item.finished:   # a stop string: the engine stops too
                self.state.loop.cancel(self.ticket)
            if item.finished or self.text.stopped:
                text += self.text.finish()
                self.finish = "stop" if self.text.stopped else "length"
                m.outcome(self.finish)
                m.e2e.observe(now - self.arrival)
            if text or ids or self.finish:
                yield text, ids, self.finish

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


async def _json(state: ServeState, req: CompletionRequest, rid: str, runs: list[_Run],
                request: Request):
    async def collect(run: _Run):
        async for _ in run.deltas():
            pass

    work = asyncio.ensure_future(asyncio.gather(*(collect(r) for r in runs)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():                  # the client left first
            work.cancel()
            return Response(status_code=499)
        work.result()                        # EngineDown -> 503 below
    except EngineDown as e:
        return _error(503, str(e))
    finally:
        gone.cancel()
        _cancel(runs)                        # a no-op for the finished ones
    choices = [CompletionChoice(index=r.job.index, text=r.text.text, token_ids=r.text.ids,
                                finish_reason=r.finish) for r in runs]
    return Completion(id=rid, model=state.model_name, system_fingerprint=state.fingerprint,
                      choices=choices, usage=_usage(runs))


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


async def _sse(state: ServeState, req: CompletionRequest, rid: str, runs: list[_Run]):
    """OpenAI's completion stream: `data: {chunk}` per delta, a usage chunk (choices [])
    when stream_options.include_usage, then `data: [DONE]`."""
    merged: asyncio.Queue = asyncio.Queue()
    base = _chunk_base(state, rid)

    async def pump(run: _Run):
        try:
            async for delta in run.deltas():
                await merged.put((run, delta))
        except EngineDown as e:
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
            elif isinstance(item, EngineDown):
                yield f"data: {_json_error(503, str(item))}\n\n"
            else:
                text, ids, finish = item
                yield _chunk(base, [{"index": run.job.index, "text": text, "token_ids": ids,
                                     "finish_reason": finish, "logprobs": None}])
        if req.include_usage:
            yield _chunk(base, [], _usage(runs))
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        _cancel(runs)


def _json_error(status: int, message: str) -> str:
    return json.dumps(error_response(status, message))


class _EventStream(StreamingResponse):
    """Server-sent events that stop, and cancel their requests, when the client disconnects:
    the disconnect is listened for while sending, whatever ASGI spec version the server
    speaks (Starlette listens only below 2.4 and otherwise notices at the next send)."""

    def __init__(self, content, on_disconnect):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send):
        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass

        sending = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(listen())
        try:
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sending.done():
                self.on_disconnect()
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
                await self.body_iterator.aclose()
            gone.cancel()
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            exc = sending.exception()
            if not isinstance(exc, OSError):        # a closed socket is a disconnect
                raise exc
