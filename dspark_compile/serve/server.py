"""A loaded engine served: its stream, the engine thread, the app, and uvicorn around them.

    Server(engine, ...)        opens the engine's GenerationStream, builds the app
    server.run(host, port)     blocking (the CLI): engine thread up, uvicorn until SIGINT/SIGTERM
    server.start(host, port)   in a background thread (tests, benchmarks): returns the base URL
    server.drain()             a graceful stop from any thread (what SIGTERM does)
    server.close()             uvicorn down, then the engine thread, then the stream

The host defaults to 127.0.0.1: binding another interface is the operator's explicit choice.

Shutdown (SIGTERM or SIGINT; a second one ends the drain at once): the server stops admitting
(new requests and /health get 503, on new connections too: the listener stays open while it
drains), requests in flight run to their end for up to --drain-timeout, then each one left is
ended with OpenAI's error body (JSON) or an error event and `data: [DONE]` (a stream), uvicorn
closes the connections, and the process exits (143 after SIGTERM, the CLI's convention).

Slow clients: a connection whose request line and headers have not arrived --header-timeout
seconds after it opened (or after the next request's first byte on a kept-alive connection)
is answered 408 and closed (uvicorn has no such timeout: the protocol class below adds it);
the body has --body-timeout (app.py, 408); a stream's client that reads nothing for
--send-timeout is disconnected; an idle kept-alive connection closes after uvicorn's
keep-alive timeout (5 s).
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dspark_compile.serve import require_extra
from dspark_compile.models.chat_format import ChatFormat
from dspark_compile.serve.loop import EngineLoop
from dspark_compile.serve.text import Tokenizer

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# requests that may wait for a state row beyond the engine's max_rows running ones: a burst of
# a few times the rows queues, a flood gets 429 instead of unbounded time to first token
DEFAULT_MAX_QUEUE = 256
# --max-request-bytes' default: a body that fills every state row's positions with prompt at
# this many bytes a token, plus the other fields. A token id in JSON takes at most 8 bytes
# ("151935, "); a token of text a few characters, up to 6 bytes each when JSON escapes them.
BODY_BYTES_PER_TOKEN = 32
# the fields beside the prompts: 16 stop strings of 1024 characters at up to 12 bytes each
# (an escaped surrogate pair) are 192 KiB
BODY_OTHER_BYTES = 256 * 1024
DEFAULT_HEADER_TIMEOUT = 10.0   # s: a request line and headers are one packet from any client
DEFAULT_BODY_TIMEOUT = 30.0     # s: the default body limit of a large engine (tens of MB) at
                                # a few MB/s
DEFAULT_SEND_TIMEOUT = 30.0     # s a streaming client may read nothing
DEFAULT_DRAIN_TIMEOUT = 30.0    # s for requests in flight to finish after SIGTERM
KEEP_ALIVE_S = 5                # uvicorn's default idle keep-alive
# the request line and headers: uvicorn's parser (llhttp) keeps every header, with no bound of
# its own; 64 KiB is 8x what nginx reads by default (4 buffers of 8 KiB), and a body-less GET
# of 1000 headers fits
MAX_HEADER_BYTES = 64 * 1024
PREPARE_THREADS = 4             # parsing and tokenization at once: their memory is at most
                                # 4 bodies' worth, and the engine thread keeps its cores
LOG_QUEUE = 10_000              # log lines waiting for stdout; past that, lines are dropped
                                # rather than stall the event loop on an unread pipe
# The GIL's switch interval while serving (Python's default: 5 ms). A thread that wants the
# GIL waits this long before the holder is asked to drop it: the engine thread, back from its
# step's device wait, could wait up to 5 ms for the event loop's thread -- longer than the tiny
# engine's 1-2 ms step. On the 2-core development machine (serve_synthetic, one run each) 0.5
# ms served 14.7k instead of 9.2k tokens/s at 16 clients; on an H100 host serve_load with the
# real engine still lost 33 / 41 % at 16 / 64 clients (benchmarks/results/
# h100_tp_serve_2026-12-07): the shared GIL's total work, not its hand-over, is that bound.
SWITCH_INTERVAL_S = 0.0005
log = logging.getLogger("dspark_compile.serve")


def default_max_request_bytes(max_seq_len: int, max_rows: int) -> int:
    return BODY_BYTES_PER_TOKEN * max_seq_len * max_rows + BODY_OTHER_BYTES


class Server:
    def __init__(self, engine, model_name: str | None = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, tokenizer="engine", *,
                 max_request_bytes: int | None = None,
                 header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 send_timeout: float = DEFAULT_SEND_TIMEOUT,
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
                 api_key: str | None = None, allowed_origins=()):
        require_extra()
        # these import the extra (FastAPI, pydantic, prometheus-client): only once it is known
        # to be installed, so that a missing extra is one line naming it
        from dspark_compile.serve.app import create_app
        from dspark_compile.serve.http import HttpLimits, ServeState
        from dspark_compile.serve.metrics import Metrics
        from dspark_compile.serve.prepare import EngineLimits

        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        for name, v in (("header_timeout", header_timeout), ("body_timeout", body_timeout),
                        ("send_timeout", send_timeout), ("drain_timeout", drain_timeout)):
            if not v > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {v}")
        cfg = engine.cfg
        rows, seq = engine.cache.max_rows, engine.cache.max_seq_len
        if max_request_bytes is None:
            max_request_bytes = default_max_request_bytes(seq, rows)
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        import prometheus_client        # the extra (above)
        # no `_created` series beside every counter and histogram (process-wide: a serving
        # process exposes only this registry)
        prometheus_client.disable_created_metrics()
        self.engine = engine
        self.tokenizer = Tokenizer.of_engine(engine.dir) if tokenizer == "engine" else tokenizer
        # a checkpoint's chat template that does not compile is refused here, naming the file
        self.chat = ChatFormat.of_engine(engine.dir, self.tokenizer,
                                         getattr(cfg, "bos_token_id", None),
                                         getattr(cfg, "eos_token_id", None))
        self.limits = EngineLimits(vocab_size=cfg.vocab_size, max_seq_len=seq,
                                   block=cfg.dspark_block_size,
                                   eos_token_id=getattr(cfg, "eos_token_id", None),
                                   max_prompts=rows + max_queue,
                                   queue=f"{rows} state rows + --max-queue {max_queue}",
                                   no_logprobs=_logprobs_refusal(engine))
        self.http = HttpLimits(max_request_bytes, body_timeout, send_timeout)
        self.header_timeout, self.drain_timeout = header_timeout, drain_timeout
        self.model_name = model_name or Path(engine.dir).resolve().name
        self.metrics = Metrics(cfg.dspark_block_size, max_queue, self.model_name)
        self.stream = engine.open_stream()
        # a request the engine fails on fails alone (scheduler.py)
        self.stream.isolate_failures = True
        self.loop = EngineLoop(self.stream, rows, max_queue, self.metrics)
        self.executor = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="dspark-prepare")
        checksum = str(engine.manifest.get("checksum", ""))
        self.state = ServeState(loop=self.loop, metrics=self.metrics, limits=self.limits,
                                tokenizer=self.tokenizer, model_name=self.model_name,
                                fingerprint=f"dspark-{checksum[:16]}" if checksum else None,
                                created=int(time.time()), http=self.http,
                                executor=self.executor, chat=self.chat, api_key=api_key,
                                allowed_origins=tuple(allowed_origins))
        self.app = create_app(self.state)
        self._uvicorn = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._signals: list[int] = []
        self._drain_task: asyncio.Task | None = None
        self._drain_now: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._log_listener = None
        self._switch = False
        self._closed = False

    def _server(self):
        import uvicorn
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False,
            http=_protocol(self.header_timeout, self.http.body_timeout),
            timeout_keep_alive=KEEP_ALIVE_S,
            # after the drain every handler answers at once; one still sending or reading a
            # body ends within these timeouts, before uvicorn would cancel it
            timeout_graceful_shutdown=int(max(self.http.body_timeout,
                                              self.http.send_timeout)) + 5)
        return _uvicorn_class()(config, self)

    def run(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, log=print,
            access_log: bool = True) -> None:
        sock = _bind(host, port)      # an address in use is a one-line OSError, before uvicorn
        self._log_listener = _log_to_stdout(access_log)
        self._switch = _SWITCH.hold()
        self.loop.start()
        self._uvicorn = self._server()
        log(f"serving {self.model_name} on http://{_url_host(host)}:{sock.getsockname()[1]} "
            f"({self.engine.cache.max_rows} rows, queue {self.loop.max_queue}, "
            f"{'text and token ids' if self.tokenizer else 'token ids only: no tokenizer.json'}"
            f", request bodies up to {self.http.max_request_bytes} bytes)")
        try:
            self._uvicorn.run(sockets=[sock])
        finally:
            self.close()

    def start(self, host: str = DEFAULT_HOST, port: int = 0, ready_timeout: float = 30.0) -> str:
        """Serve from a background thread; returns the base URL (port 0: a free port)."""
        sock = _bind(host, port)
        self._switch = _SWITCH.hold()
        self.loop.start()
        server = self._uvicorn = self._server()
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                        name="dspark-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + ready_timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return f"http://{_url_host(host)}:{sock.getsockname()[1]}"

    # ---- shutdown
    def drain(self) -> None:
        """Begin the graceful shutdown (the module docstring) from any thread; a second call
        ends the drain at once."""
        if self._aloop is None:
            raise RuntimeError("the server is not running")
        self._aloop.call_soon_threadsafe(self._on_exit)

    def _on_exit(self) -> None:
        if self._drain_task is None:
            self._drain_now = asyncio.Event()
            self._drain_task = asyncio.ensure_future(self._drain())
        else:
            self._drain_now.set()

    async def _drain(self) -> None:
        loop, t = self.loop, self.drain_timeout
        loop.drain()
        log.info("shutting down: %d requests in flight get up to %g s to finish "
                 "(--drain-timeout); new requests get 503", loop.in_flight, t)
        deadline = time.monotonic() + t
        while loop.in_flight and time.monotonic() < deadline and not self._drain_now.is_set():
            try:
                await asyncio.wait_for(self._drain_now.wait(), 0.05)
            except TimeoutError:
                pass
        if loop.in_flight:
            log.warning("shutting down: %d requests still in flight are ended with an error",
                        loop.in_flight)
            loop.fail_all(f"the server shut down before this request finished "
                          f"(--drain-timeout {t:g} s)")
        import uvicorn
        server = self._uvicorn
        for sig in self._signals:          # uvicorn raises them again once it has stopped
            uvicorn.Server.handle_exit(server, sig, None)
        server.should_exit = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        self.loop.stop()
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self._switch:
            _SWITCH.release()
            self._switch = False
        if self._log_listener is not None:
            self._log_listener()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _SwitchInterval:
    """sys.setswitchinterval(SWITCH_INTERVAL_S) while any server of this process serves; the
    interval found before the first one, back once the last one closed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held, self._saved = 0, None

    def hold(self) -> bool:
        with self._lock:
            if self._held == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, SWITCH_INTERVAL_S))
            self._held += 1
        return True

    def release(self) -> None:
        with self._lock:
            self._held -= 1
            if self._held == 0:
                sys.setswitchinterval(self._saved)


_SWITCH = _SwitchInterval()


def _uvicorn_class():
    import uvicorn

    class _Uvicorn(uvicorn.Server):
        """uvicorn whose SIGINT / SIGTERM drain the engine first (Server._drain)."""

        def __init__(self, config, owner: Server):
            super().__init__(config)
            self.owner = owner

        async def startup(self, sockets=None):
            self.owner._aloop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame):           # the signal handler (main thread)
            self.owner._signals.append(sig)
            if self.owner._aloop is None:
                super().handle_exit(sig, frame)
            else:
                self.owner._aloop.call_soon_threadsafe(self.owner._on_exit)

    return _Uvicorn


def _protocol(header_timeout: float, linger: float):
    """uvicorn's httptools protocol with
    - a header timeout: 408, then the connection closes;
    - a bound on the header bytes: 431, then the connection closes;
    - OpenAI's error body on the parser's own 400 (uvicorn sends plain text);
    - a bound on the rest of a body answered before it ended (a 413): uvicorn reads and drops
      those bytes, so that the client, still sending, reads its answer instead of a reset
      (closing a socket with unread bytes sends RST, and the client loses the answer); a body
      still arriving `linger` seconds after the answer closes the connection."""
    # the extra, imported once the server runs (protocol.py imports pydantic)
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    from dspark_compile.serve.protocol import error_response

    def response(status: int, message: str) -> bytes:
        body = json.dumps(error_response(status, message)).encode()
        return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                         b"content-length: %d\r\n" % len(body),
                         b"connection: close\r\n\r\n", body])

    too_slow = response(408, f"the request line and headers did not arrive within "
                             f"{header_timeout:g} s (--header-timeout)")
    too_big = response(431, f"the request line and headers exceed {MAX_HEADER_BYTES} bytes")

    class Protocol(HttpToolsProtocol):
        _header_timer = None
        _header_bytes = 0
        _linger_timer = None

        def data_received(self, data):
            in_headers = self._header_timer is not None
            super().data_received(data)
            if in_headers and self._header_timer is not None:   # the headers go on
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    self._refuse(too_big)

        def send_400_response(self, msg: str) -> None:
            self._refuse(response(400, f"not a valid HTTP/1.1 request ({msg})"))

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self):
            super().on_message_begin()
            if self._header_timer is None:          # the next request on this connection
                self._arm()

        def on_headers_complete(self):
            self._disarm()
            super().on_headers_complete()

        def on_message_complete(self):
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            super().on_message_complete()

        def on_response_complete(self):
            super().on_response_complete()
            if (self.cycle is not None and self.cycle.more_body
                    and not self.transport.is_closing() and self._linger_timer is None):
                self._linger_timer = self.loop.call_later(linger, self.transport.close)

        def connection_lost(self, exc):
            self._disarm()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
            super().connection_lost(exc)

        def _arm(self):
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(header_timeout, self._refuse, too_slow)

        def _disarm(self):
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _refuse(self, answer: bytes):
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    return Protocol


class _QueueHandler(logging.Handler):
    """Formats a record and hands the line to the writer thread; a full queue drops it (an
    unread stdout pipe must not stall the event loop)."""

    def __init__(self, lines):
        super().__init__()
        self.lines, self.dropped = lines, 0

    def emit(self, record):
        try:
            self.lines.put_nowait(self.format(record))
        except queue.Full:
            self.dropped += 1


def _log_to_stdout(access_log: bool, out=None, wait: float = 5.0):
    """The server's log lines (dspark_compile.serve: access lines at INFO, failures with their
    tracebacks at ERROR) to stdout from a writer thread; returns the function that stops it
    (it writes what is queued, waiting `wait` s at most: a pipe nobody reads never empties)."""
    lines: queue.Queue = queue.Queue(LOG_QUEUE)
    out = out or sys.stdout
    logger = logging.getLogger("dspark_compile.serve")
    handler = _QueueHandler(lines)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    access = logging.getLogger("dspark_compile.serve.access")
    if not access_log:
        access.setLevel(logging.WARNING)

    def write():
        while (line := lines.get()) is not None:
            try:
                out.write(line + "\n")
                out.flush()
            except (OSError, ValueError):      # stdout closed: nothing more can be written
                return

    writer = threading.Thread(target=write, name="dspark-log", daemon=True)
    writer.start()

    def stop():
        logger.removeHandler(handler)
        logger.propagate = True
        access.setLevel(logging.NOTSET)
        try:
            lines.put(None, timeout=wait)
        except queue.Full:
            pass
        writer.join(wait)
    return stop


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot bind ({e.strerror or e})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _logprobs_refusal(engine) -> str | None:
    """Why the engine cannot return logprobs (None: it can; an engine double without the
    method: it cannot)."""
    refusal = getattr(engine, "logprobs_refusal", None)
    return refusal() if refusal is not None else "this engine returns no logprobs"
