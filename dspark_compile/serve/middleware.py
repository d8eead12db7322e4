"""The server's pure ASGI middleware, outermost first: the access log and request ids
(RequestLog), CORS (Starlette's, with --allowed-origins), the API key (ApiKey, with --api-key).
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from dspark_compile.serve.metrics import Metrics
from dspark_compile.serve.protocol import error_response

log = logging.getLogger("dspark_compile.serve")
access_log = logging.getLogger("dspark_compile.serve.access")   # one line per request
ACCESS = "dspark.access"                 # the scope key of a request's Access record
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")    # printable ASCII, no spaces
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Access:
    """What the access-log line of one request says."""
    request_id: str
    start: float
    status: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: list = field(default_factory=list)


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          close: bool = False):
    """A refusal in OpenAI's error body; `close`: the connection closes after it."""
    return JSONResponse(error_response(status, message, param, code), status_code=status,
                        headers={"Connection": "close"} if close else None)


def clip(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + "..."


# ---- the API key -------------------------------------------------------------------------------

OPEN_PATHS = ("/health", "/metrics")     # probes and scrapers carry no key


class ApiKey:
    """Pure ASGI middleware: every request but /health, /metrics and CORS preflights sends
    `Authorization: Bearer <key>`, else 401 in OpenAI's error body. The key is compared in
    constant time (hmac.compare_digest), so the answer's timing does not spell it out."""

    def __init__(self, app, key: str):
        self.app, self.key = app, ("Bearer " + key).encode()

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope.get("path") in OPEN_PATHS
                or scope.get("method") == "OPTIONS"):
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        body = {"error": {"message": "Incorrect API key provided: send `Authorization: "
                                     "Bearer <key>` with this server's --api-key"
                          if given else "Missing API key: send `Authorization: Bearer <key>` "
                                        "with this server's --api-key",
                          "type": "invalid_request_error", "param": None,
                          "code": "invalid_api_key"}}
        await JSONResponse(body, status_code=401,
                           headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


# ---- request ids and the access log ---------------------------------------------------------

class RequestLog:
    """Pure ASGI middleware: a request id for every request (the client's X-Request-Id when
    valid), returned in the response's X-Request-Id; one access-log line when the response
    ends; a bug's traceback logged with the id, the client told in one line (a completion
    counted as `error`). A request uvicorn cancels at shutdown (it outlived the drain and the
    shutdown's grace) gets a 503 if nothing was sent yet, and one log line, no traceback."""

    def __init__(self, app, metrics: Metrics | None = None):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        acc = Access(_request_id(scope), time.monotonic())
        scope[ACCESS] = acc
        header = (b"x-request-id", acc.request_id.encode())

        async def send_(message):
            if message["type"] == "http.response.start":
                acc.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_)
        except Exception as e:  # noqa: BLE001 -- a bug: logged with its request id
            log.error("request %s: internal error", acc.request_id, exc_info=e)
            if self.metrics is not None and scope.get("path") in COMPLETION_PATHS:
                self.metrics.outcome("error")
            if acc.status is None:
                await error(500, f"internal error (request {acc.request_id}): "
                                  f"{type(e).__name__}")(scope, receive, send_)
        except asyncio.CancelledError:       # the end of this task: nothing awaits it
            log.warning("request %s: cancelled at shutdown", acc.request_id)
            if acc.status is None:
                await error(503, "the server shut down before this request "
                                  "finished")(scope, receive, send_)
        finally:
            if access_log.isEnabledFor(logging.INFO):     # --no-access-log: no line to build
                access_log.info("request_id=%s method=%s path=%s status=%s prompt_tokens=%d "
                                "completion_tokens=%d finish=%s duration_ms=%.1f", acc.request_id,
                                scope.get("method"), json.dumps(clip(scope.get("path", ""), 200)),
                                acc.status if acc.status is not None else "-", acc.prompt_tokens,
                                acc.completion_tokens, ",".join(acc.finish) or "-",
                                1000 * (time.monotonic() - acc.start))


_ID_PREFIX = uuid.uuid4().hex[:16]      # this process's, random: ids differ across restarts
_ID_COUNTER = itertools.count()


def new_id() -> str:
    """32 hex digits, unique in this process (a random prefix and a counter): uuid4's shape
    without its os.urandom call, two of which a request made (a system call each, ~10 us and
    more on a loaded machine, on the event loop's thread)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFFFFFFFFFFFFFF:016x}"


def _request_id(scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            given = value.decode("latin-1")
            if REQUEST_ID.fullmatch(given):
                return given
            break
    return new_id()
