"""A loaded engine served: its stream, the engine thread, the app, and uvicorn around them.

    Server(engine, ...)        opens the engine's GenerationStream, builds the app
    server.run(host, port)     blocking (the CLI): engine thread up, uvicorn until SIGINT/SIGTERM
    server.start(host, port)   in a background thread (tests, benchmarks): returns the base URL
    server.close()             uvicorn down, then the engine thread, then the stream

The host defaults to 127.0.0.1: binding another interface is the operator's explicit choice.
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from dspark_compile.serve import require_extra

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# requests that may wait for a state row beyond the engine's max_rows running ones: a burst of
# a few times the rows queues, a flood gets 429 instead of unbounded time to first token
DEFAULT_MAX_QUEUE = 256


class Server:
    def __init__(self, engine, model_name: str | None = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, tokenizer="engine"):
        require_extra()
        from dspark_compile.serve.app import ServeState, create_app
        from dspark_compile.serve.loop import EngineLoop
        from dspark_compile.serve.metrics import Metrics
        from dspark_compile.serve.prepare import EngineLimits
        from dspark_compile.serve.text import Tokenizer

        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        import prometheus_client
        # no `_created` series beside every counter and histogram (process-wide: a serving
        # process exposes only this registry)
        prometheus_client.disable_created_metrics()
        cfg = engine.cfg
        self.engine = engine
        self.tokenizer = Tokenizer.of_engine(engine.dir) if tokenizer == "engine" else tokenizer
        self.limits = EngineLimits(vocab_size=cfg.vocab_size,
                                   max_seq_len=engine.cache.max_seq_len,
                                   block=cfg.dspark_block_size,
                                   eos_token_id=getattr(cfg, "eos_token_id", None))
        self.model_name = model_name or Path(engine.dir).resolve().name
        self.metrics = Metrics(cfg.dspark_block_size, max_queue)
        self.stream = engine.open_stream()
        self.loop = EngineLoop(self.stream, engine.cache.max_rows, max_queue, self.metrics)
        checksum = str(engine.manifest.get("checksum", ""))
        self.state = ServeState(loop=self.loop, metrics=self.metrics, limits=self.limits,
                                tokenizer=self.tokenizer, model_name=self.model_name,
                                fingerprint=f"dspark-{checksum[:16]}" if checksum else None,
                                created=int(time.time()))
        self.app = create_app(self.state)
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def _config(self, **kw):
        import uvicorn
        return uvicorn.Config(self.app, log_level="warning", access_log=False,
                              timeout_graceful_shutdown=5, **kw)

    def run(self, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, log=print) -> None:
        import uvicorn
        sock = _bind(host, port)      # an address in use is a one-line OSError, before uvicorn
        self.loop.start()
        self._uvicorn = uvicorn.Server(self._config())
        log(f"serving {self.model_name} on http://{_url_host(host)}:{sock.getsockname()[1]} "
            f"({self.engine.cache.max_rows} rows, queue {self.loop.max_queue}, "
            f"{'text and token ids' if self.tokenizer else 'token ids only: no tokenizer.json'})")
        try:
            self._uvicorn.run(sockets=[sock])
        finally:
            self.close()

    def start(self, host: str = DEFAULT_HOST, port: int = 0, ready_timeout: float = 30.0) -> str:
        """Serve from a background thread; returns the base URL (port 0: a free port)."""
        import uvicorn
        sock = _bind(host, port)
        self.loop.start()
        server = self._uvicorn = uvicorn.Server(self._config())
        server.install_signal_handlers = lambda: None          # not the main thread
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
