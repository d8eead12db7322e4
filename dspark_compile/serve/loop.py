"""The engine thread: the one caller of GenerationStream.step().

Continuous batching is the stream's: a request added between two steps joins at the next one
(prefill into a free state row), a finished or cancelled one frees its row before the next.
This thread only loops step() while there is work, sleeps on an event while there is none, and
hands each StreamEvent to the asyncio queue of the HTTP handler that owns the request
(`loop.call_soon_threadsafe`: the handler's event loop is another thread).

Admission is bounded: at most `max_rows` running plus `max_queue` waiting requests are in
flight; one more is refused (QueueFull -> HTTP 429) rather than queued without bound.

Registration is atomic with respect to dispatch: submit() holds the lock from add() until the
request's ticket is registered, and the engine thread takes the lock to dispatch a step's
events, so no event can arrive for a request the thread does not know yet.

Failures, in two kinds:

- one request's: the stream (opened with `isolate_failures`, dspark_compile/runtime/scheduler.py)
  ends a request whose admission, prefill or step raised, frees its row and reports the
  exception on its last event; this thread logs the traceback under the request's id and
  hands its handler RequestFailed (HTTP 500, OpenAI's error body). The other requests go on.
- the engine's: an exception out of step() itself (a fault the stream cannot pin on a
  request, a device error) ends this thread: the traceback is logged, every request in flight
  gets EngineDown (503), /health answers 503 with the reason and the gauges read 0.

Draining (SIGTERM): drain() refuses new requests (EngineDown: 503) while those in flight go
on; fail_all() ends the ones left when the drain time is up.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

IDLE_WAIT_S = 0.5     # an idle thread re-checks this often (a submit wakes it at once)
log = logging.getLogger("dspark_compile.serve")


class QueueFull(Exception):
    pass


class EngineDown(Exception):
    pass


class RequestFailed(Exception):
    """The engine failed on this request alone (its row is free; the others go on)."""


@dataclass
class Ticket:
    request: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)   # StreamEvent | BaseException
    tag: str = ""                   # the HTTP request id and prompt index, for the log


class EngineLoop:
    def __init__(self, stream, max_rows: int, max_queue: int, metrics=None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.stream, self.metrics = stream, metrics
        self.max_rows, self.max_queue = max_rows, max_queue
        self.capacity = max_rows + max_queue
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None    # why the engine thread stopped, if it failed
        self.steps = 0
        self.busy_s = 0.0                          # wall time inside step()

    # ---- HTTP side (any thread)
    def submit(self, prompt: list[int], params, loop: asyncio.AbstractEventLoop,
               tag: str = "", options: dict | None = None) -> Ticket:
        """Add a request (`options`: GenerationStream.add's logprobs keywords); raises
        QueueFull, EngineDown, or the stream's ValueError."""
        with self._lock:
            if (self.error is not None or self._stopping.is_set()
                    or self._draining.is_set()):
                raise EngineDown(self.down_reason())
            if len(self._tickets) >= self.capacity:
                raise QueueFull(f"{len(self._tickets)} requests in flight: {self.max_rows} "
                                f"state rows and a queue of {self.max_queue} are full")
            rid = (self.stream.add(prompt, params, **options) if options
                   else self.stream.add(prompt, params))
            ticket = Ticket(rid, loop, asyncio.Queue(), tag)
            self._tickets[rid] = ticket
            self._gauge()
        self._wake.set()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The request's row is freed before the next step; its ticket leaves when the stream
        reports the cancellation."""
        self.stream.cancel(ticket.request)
        self._wake.set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._tickets)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    # ---- lifecycle
    def start(self) -> "EngineLoop":
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()
        return self

    def drain(self) -> None:
        """Take no new requests; those in flight go on."""
        self._draining.set()

    def fail_all(self, reason: str) -> None:
        """End every request in flight: its handler gets EngineDown(reason), the engine frees
        its row (a drain whose time is up)."""
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
            self._gauge()
        for t in tickets:
            self.stream.cancel(t.request)
        self._wake.set()
        _deliver([(t, EngineDown(reason)) for t in tickets])

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the step in progress; requests still in flight get EngineDown."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all(EngineDown("the server is shutting down"))

    # ---- engine thread
    def _run(self) -> None:
        stream = self.stream
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                if not stream.has_work:
                    self._wake.wait(IDLE_WAIT_S)
                    continue
                t = time.perf_counter()
                events = stream.step()
                self.busy_s += time.perf_counter() - t
                self.steps += 1
                if self.metrics is not None:
                    self.metrics.engine_counters({**stream.counters(), "busy_s": self.busy_s},
                                                 time.monotonic())
                if events:
                    self._dispatch(events)
        except BaseException as e:  # noqa: BLE001 -- logged, reported to every waiting handler
            self.error = e
            log.error("the engine thread failed: every request in flight gets 503 and /health "
                      "reports the engine down until a restart", exc_info=e)
            if self.metrics is not None:
                self.metrics.engine_down()
            self._fail_all(EngineDown(self.down_reason()))

    def _dispatch(self, events) -> None:
        items, failed = [], []
        with self._lock:
            for ev in events:
                ticket = (self._tickets.pop(ev.request, None) if ev.finished
                          else self._tickets.get(ev.request))
                err = ev.error
                if err is not None:
                    failed.append((ticket, err))
                    if ticket is not None:
                        items.append((ticket, RequestFailed(
                            f"the engine failed on this request: {type(err).__name__}: "
                            f"{str(err)[:300]}")))
                elif ticket is not None:
                    items.append((ticket, ev))
            self._gauge()
        _deliver(items)
        for ticket, err in failed:        # after the handlers are told: logging may be slow
            log.error("request %s failed in the engine (its row is free, the other requests "
                      "go on)", ticket.tag if ticket is not None else "(gone)", exc_info=err)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
            self._gauge()
        _deliver([(t, err) for t in tickets])

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.in_flight.set(len(self._tickets))

    def down_reason(self) -> str:
        if self.error is not None:
            return f"the engine failed: {type(self.error).__name__}: {str(self.error)[:300]}"
        if self._draining.is_set() and not self._stopping.is_set():
            return "the server is shutting down: it takes no new requests"
        return "the server is shutting down"


def _deliver(items: list) -> None:
    """Hand (ticket, item) pairs to their handlers' event loops: one wake-up per loop per
    step (a 64-row step is one call, not 64 writes to the loop's self-pipe)."""
    by_loop: dict = {}
    for ticket, item in items:
        by_loop.setdefault(ticket.loop, []).append((ticket.events, item))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, pairs)
        except RuntimeError:      # the handler's event loop is closed: nobody is listening
            pass


def _put_all(pairs: list) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)
