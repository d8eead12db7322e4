"""`dspark-compile serve`: an OpenAI-compatible HTTP server over an engine.

    protocol.py  the request and response schemas (pydantic): what the API accepts and returns
    prepare.py   a validated request -> engine jobs (token ids, SamplingParams, stop strings),
                 checked against the engine's vocabulary and positions (400 naming the field)
    text.py      incremental detokenization and stop strings matched across step boundaries
    loop.py      the engine thread: the only caller of GenerationStream.step(); HTTP handlers
                 add and cancel requests from the event loop
    metrics.py   the Prometheus registry: request outcomes, queue depth, steps per bucket,
                 greedy-variant share, speculative-decoding acceptance, latency histograms
    (chat_format: models/chat_format.py, DeepSeek-V4's chat format, which the build also
                 reads to write the engine's tokenizer_config.json)
    http.py      what the routes share: the serving state, a request read, parsed, checked
                 and submitted (admit), its engine events as text (Run), OpenAI's error body
    chat.py      /v1/chat/completions over the completions machinery; /tokenize, /detokenize
    app.py       the FastAPI application: /v1/models, /v1/completions (JSON or SSE), /health,
                 /metrics, /version; registers chat.py's routes
    middleware.py  request ids and the access log, the API key (--api-key)
    server.py    uvicorn around the app: slow and oversized clients refused, SIGTERM drains
    cli.py       the `serve` subcommand (imports nothing of the extra until it runs)

FastAPI, uvicorn and prometheus-client are the `serve` extra; :func:`require_extra` turns their
absence into one line naming it.
"""
from __future__ import annotations

import importlib.util

EXTRA = "serve"
# httptools: uvicorn[standard]'s HTTP parser, whose protocol class the server extends with a
# header timeout (server.py)
EXTRA_MODULES = ("fastapi", "uvicorn", "httptools", "prometheus_client", "pydantic")
INSTALL_HINT = "pip install 'dspark-compile[serve]'"


def require_extra() -> None:
    """Raise a one-line ValueError naming the extra when one of its packages is missing (the
    CLI reports ValueErrors as one line, exit status 1)."""
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"serve needs {', '.join(missing)} (the '{EXTRA}' extra): "
                         f"{INSTALL_HINT}")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("dspark-compile")
    except PackageNotFoundError:
        return "unknown"
