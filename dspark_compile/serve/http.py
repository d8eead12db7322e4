"""What the completions and the chat routes share (app.py, chat.py): the serving state, a
request's way in (its body read within the limits, parsed off the event loop, checked,
submitted: `admit`) and its way through the engine (`Run`: a ticket's events as text deltas;
`collect` for a JSON answer, `EventStream` for server-sent events), and OpenAI's error body
for a refusal (`ApiError`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

# a key given twice is refused: readers that keep the first and readers that keep the last
# (proxies, loggers, this server) would see different requests
from dspark_compile.engine_dir.format import unique_keys as _no_duplicate_keys
from dspark_compile.serve.loop import EngineDown, EngineLoop, QueueFull, RequestFailed, Ticket
from dspark_compile.serve.metrics import Metrics
from dspark_compile.serve.middleware import Access, clip as _clip
from dspark_compile.serve.middleware import error as _error
from dspark_compile.serve.prepare import BadRequest, EngineLimits, Job, api_field, api_message
from dspark_compile.serve.protocol import (CompletionRequest, Usage, error_response,
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
    pieces: object = None       # logprobs.Pieces of the tokenizer (made at first use)

    def token_pieces(self):
        if self.pieces is None:
            from dspark_compile.serve.logprobs import Pieces
            self.pieces = Pieces(self.tokenizer)
        return self.pieces


class ApiError(Exception):
    """A refusal in OpenAI's error body; `close`: the connection closes after it (the body
    was not read to its end)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, outcome: str = "invalid", close: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.outcome, self.close = outcome, close


# A body up to this size is parsed and checked on the event loop (~0.1 ms of JSON and
# pydantic) when it has no text to tokenize (token ids): that costs less than the hop to a
# prepare thread and back (a future, a thread wake-up, two GIL hand-overs, the loop's
# wake-up: ~0.5 ms of time to first token a request on 2 cores). Text is always tokenized on
# the prepare threads (a tokenizer may be slow); a larger body is parsed there too, with its
# tokenization in the same hop.
INLINE_BODY_BYTES = 2048


async def admit(state: ServeState, request: Request, acc: Access, parse, to_jobs,
                tokenizes=lambda req: True):
    """A request read, parsed, checked and submitted: (the parsed request, its jobs, their
    tickets), or the refusal's response (every refusal counted by outcome). `parse(raw,
    content_type)` and `to_jobs(parsed, state)` run off the event loop, except a body of at
    most INLINE_BODY_BYTES that `tokenizes(parsed)` says has no text."""
    m = state.metrics

    def parsed(raw: bytes, content_type: str | None):
        req = parse(raw, content_type)
        if req.model != state.model_name:
            raise not_served(req.model, state)
        return req

    def prepared(raw: bytes, content_type: str | None):
        req = parsed(raw, content_type)
        return req, to_jobs(req, state)

    try:
        raw = await read_body(request, state.http)
        content_type = request.headers.get("content-type")
        if len(raw) <= INLINE_BODY_BYTES:
            req = parsed(raw, content_type)
            jobs = (await off_loop(state, to_jobs, req, state) if tokenizes(req)
                    else to_jobs(req, state))
        else:
            req, jobs = await off_loop(state, prepared, raw, content_type)
        tickets = submit(state.loop, jobs, acc.request_id)
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


# ---- the request, before the engine --------------------------------------------------------

async def read_body(request: Request, http: HttpLimits) -> bytes:
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


def off_loop(state: ServeState, fn, *args):
    return asyncio.get_running_loop().run_in_executor(state.executor, fn, *args)


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


def submit(loop: EngineLoop, jobs: list[Job], request_id: str) -> list[Ticket]:
    """All of a request's prompts or none."""
    tickets = []
    aloop = asyncio.get_running_loop()
    try:
        for job in jobs:
            try:
                tickets.append(loop.submit(job.prompt, job.params, aloop,
                                           f"{request_id} (prompt {job.index})", job.options))
            except ValueError as e:       # the stream's own validation
                raise BadRequest(api_field(str(e)), api_message(str(e))) from None
    except BaseException:
        for t in tickets:
            loop.cancel(t)
        raise
    return tickets


# ---- the request in the engine --------------------------------------------------------------

class Delta(NamedTuple):
    text: str
    ids: list
    finish: str | None
    logprobs: list | None = None   # a logprobs job's entries, one per id (runtime/logprobs.py)
    prompt: bool = False           # the echo: the prompt's text, ids and entries


class _Coalesced(NamedTuple):
    """Several steps' events of one request, as one (Run._coalesce)."""
    tokens: list
    finished: bool
    logprobs: list | None
    prompt_logprobs: list | None


class Run:
    """One job in flight: its ticket's events -> Deltas (text, ids, finish reason, logprobs);
    with echo the first is the prompt's. `logprobs`: the output's entries so far."""

    def __init__(self, state: ServeState, job: Job, ticket: Ticket, arrival: float):
        self.state, self.job, self.ticket, self.arrival = state, job, ticket, arrival
        tok = state.tokenizer
        if tok is not None and not job.skip_special_tokens:
            tok = tok.keeping_special()
        self.text = TextStream(tok, job.prompt, job.stop_strings, job.params.stop_ids)
        self.finish: str | None = None
        self.last: float | None = None
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None
        self.echoed = not job.echo
        self._held = None           # an item taken while coalescing, for the next round

    async def deltas(self):
        m = self.state.metrics
        while self.finish is None:
            item, self._held = self._held or await self.ticket.events.get(), None
            if not isinstance(item, BaseException):
                item = self._coalesce(item)
            if isinstance(item, BaseException):
                self.finish = "error"
                m.outcome("error")
                raise item
            plp = getattr(item, "prompt_logprobs", None)     # (a test double's events: none)
            if plp is not None:
                self.prompt_logprobs = plp
            if not self.echoed:
                self.echoed = True
                yield Delta(self.job.prompt_text or "", list(self.job.prompt), None,
                            self.prompt_logprobs if self.job.logprobs is not None else None,
                            True)
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
            lps = None
            if self.job.logprobs is not None:
                lps = list(getattr(item, "logprobs", None) or ())[:len(ids)]
                self.logprobs += lps
            if text or ids or self.finish:
                yield Delta(text, ids, self.finish, lps)

    def _coalesce(self, item):
        """`item` and the steps' events queued behind it, as one: when the event loop fell
        behind its engine (several steps' events wait), one delta and one chunk carry them
        all, so a loop that is behind spends less per token and catches up instead of
        falling further behind. A failure queued behind is kept for the next round."""
        events = self.ticket.events
        if item.finished or events.empty():
            return item
        tokens, finished = list(item.tokens), False
        lps = list(item.logprobs) if getattr(item, "logprobs", None) is not None else None
        while not finished and not events.empty():
            nxt = events.get_nowait()
            if isinstance(nxt, BaseException):
                self._held = nxt
                break
            tokens += nxt.tokens
            finished = nxt.finished
            if lps is not None:
                lps += list(getattr(nxt, "logprobs", None) or ())
        return _Coalesced(tokens, finished, lps, getattr(item, "prompt_logprobs", None))

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


def cancel_runs(runs: list[Run]) -> None:
    for r in runs:
        r.cancel()


def usage(runs: list[Run]) -> Usage:
    p = sum(len(r.job.prompt) for r in runs)
    c = sum(len(r.text.ids) for r in runs)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def account(acc: Access, runs: list[Run]) -> None:
    acc.completion_tokens = sum(len(r.text.ids) for r in runs)
    acc.finish = [r.finish or "cancelled" for r in runs]


async def collect(state: ServeState, runs: list[Run], request: Request,
                  acc: Access) -> Response | None:
    """Every run to its end (None), or the response that ends the request early: 499 when
    the client left first, 503 when the engine stopped, 500 when it failed the request."""
    async def drain(run: Run):
        async for _ in run.deltas():
            pass

    tasks = [asyncio.ensure_future(drain(r)) for r in runs]
    work = asyncio.ensure_future(asyncio.gather(*tasks))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():                  # the client left first
            work.cancel()
            return Response(status_code=499)
        work.result()                        # EngineDown -> 503, RequestFailed -> 500
    except EngineDown as e:
        return _error(503, str(e))
    except RequestFailed as e:
        return _error(500, prompt_label(runs) + str(e), code="engine_error")
    finally:
        gone.cancel()
        for t in tasks:                      # the others of a request one prompt failed
            t.cancel()
        cancel_runs(runs)                        # a no-op for the finished ones
        account(acc, runs)
    return None


def prompt_label(runs: list[Run]) -> str:
    if len(runs) == 1:
        return ""
    failed = [r.job.index for r in runs if r.finish == "error"]
    return f"prompt {failed[0]}: " if failed else ""


async def disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def json_error(status: int, message: str, code: str | None = None) -> str:
    return json.dumps(error_response(status, message, code=code))


class Last(str):
    """A stream's last text (its finish chunk, usage and `data: [DONE]`): EventStream sends it
    with the response's end, one write instead of three (a system call each, on the event
    loop's thread)."""


class SendTimeout(OSError):
    """The client read nothing for the send timeout: treated as a disconnect."""


class EventStream(StreamingResponse):
    """Server-sent events that stop, and cancel their requests, when the client disconnects
    or reads nothing for `send_timeout` seconds: the disconnect is listened for while
    sending, whatever ASGI spec version the server speaks (Starlette listens only below 2.4
    and otherwise notices at the next send)."""

    def __init__(self, content, on_disconnect, send_timeout: float):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_disconnect, self.send_timeout = on_disconnect, send_timeout

    async def stream_response(self, send) -> None:
        """Starlette's, but a `Last` text ends the response in the same message."""
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            last = isinstance(chunk, Last)
            body = chunk if isinstance(chunk, bytes) else chunk.encode("utf-8")
            await send({"type": "http.response.body", "body": body, "more_body": not last})
            if last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send):
        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass

        clock = asyncio.get_running_loop().time
        began: list = [None]          # when the send in progress began (None: none is)

        async def timed_send(message):
            # two stores a chunk, not a timer armed and cancelled per chunk (asyncio.timeout:
            # ~10 us of the event loop's thread per chunk); `watch` enforces the timeout
            began[0] = clock()
            await send(message)
            began[0] = None

        async def watch():
            """Raises SendTimeout once one send has waited the send timeout: it wakes at
            least every half timeout, and a send found in progress is checked again at its
            begin + timeout, so the cut comes at the timeout, not up to 1.5 x later."""
            t = self.send_timeout
            while True:
                b = began[0]
                if b is None:
                    await asyncio.sleep(t / 2)
                elif clock() - b >= t:
                    raise SendTimeout(f"the client read nothing for {t:g} s (--send-timeout)")
                else:
                    await asyncio.sleep(b + t - clock())

        sending = asyncio.ensure_future(self.stream_response(timed_send))
        gone = asyncio.ensure_future(listen())
        watchdog = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({sending, gone, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sending.done():
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
            gone.cancel()
            watchdog.cancel()
            ended = (sending.done() and not sending.cancelled()
                     and sending.exception() is None)
            if not ended:
                self.on_disconnect()
            await self.body_iterator.aclose()
        exc = sending.exception() if not sending.cancelled() else None
        if watchdog.done() and not watchdog.cancelled():
            exc = watchdog.exception()
        if isinstance(exc, SendTimeout):
            log.info("%s: stream ended", exc)
        elif exc is not None and not isinstance(exc, OSError):   # a closed socket: a disconnect
            raise exc


def continuous_usage(req: CompletionRequest) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage in every chunk."""
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)
