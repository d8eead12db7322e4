"""`dspark-compile serve ENGINE`: the subcommand. Registered at CLI start-up; FastAPI, uvicorn
and prometheus-client (the `serve` extra) are imported only when it runs, so the rest of the
CLI works without them."""
from __future__ import annotations

import argparse
import math
import time

from dspark_compile.cli.common import (command, device, engine_errors, engine_load_args,
                                       int_arg)
from dspark_compile.serve import require_extra
# server.py imports nothing of the extra at module level
from dspark_compile.serve.server import (BODY_BYTES_PER_TOKEN, BODY_OTHER_BYTES,
                                         DEFAULT_BODY_TIMEOUT, DEFAULT_DRAIN_TIMEOUT,
                                         DEFAULT_HEADER_TIMEOUT, DEFAULT_HOST, DEFAULT_MAX_QUEUE,
                                         DEFAULT_PORT, DEFAULT_SEND_TIMEOUT, Server)


_port = int_arg(0, 65535, "a port number")
_count = int_arg(0)
_bytes = int_arg(1, None, "a number of bytes >= 1")
MAX_SECONDS = 24 * 3600.0       # asyncio's timers take any float; a day is past any use


def _seconds(text: str) -> float:
    """An argparse type: seconds, > 0 and finite."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(v) and 0 < v <= MAX_SECONDS):
        raise argparse.ArgumentTypeError(f"must be in (0, {MAX_SECONDS:g}] seconds, got {text}")
    return v


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine", help="engine directory (dspark-compile build)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"interface to listen on (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT,
                   help=f"TCP port (default {DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--max-queue", type=_count, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help="requests that may wait for a state row beyond the engine's max_rows "
                        f"running ones; more get HTTP 429 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the engine directory's name)")
    engine_load_args(p)
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="serve an engine built with build --tp N on N ranks, which this "
                        "command starts (gloo on the CPU, NCCL with rank r on cuda:r): rank 0 "
                        "holds the server, the others follow its engine calls; must be the "
                        "engine's rank count")
    p.add_argument("--max-request-bytes", type=_bytes, default=None, metavar="N",
                   help="a larger request body gets HTTP 413 before it is read (default: "
                        f"{BODY_BYTES_PER_TOKEN} bytes a token for every state row's positions, "
                        f"max_rows x max_seq_len x {BODY_BYTES_PER_TOKEN} + "
                        f"{BODY_OTHER_BYTES // 1024} KiB)")
    p.add_argument("--header-timeout", type=_seconds, default=DEFAULT_HEADER_TIMEOUT,
                   metavar="S", help="a connection whose request line and headers take longer "
                                     f"gets 408 and is closed (default {DEFAULT_HEADER_TIMEOUT:g})")
    p.add_argument("--body-timeout", type=_seconds, default=DEFAULT_BODY_TIMEOUT, metavar="S",
                   help="a request body that takes longer to arrive gets 408 (default "
                        f"{DEFAULT_BODY_TIMEOUT:g})")
    p.add_argument("--send-timeout", type=_seconds, default=DEFAULT_SEND_TIMEOUT, metavar="S",
                   help="a streaming client that reads nothing for this long is disconnected "
                        f"and its request cancelled (default {DEFAULT_SEND_TIMEOUT:g})")
    p.add_argument("--drain-timeout", type=_seconds, default=DEFAULT_DRAIN_TIMEOUT,
                   metavar="S", help="on SIGTERM / SIGINT: new requests get 503 while those in "
                                     "flight get this long to finish; the rest then end with "
                                     f"an error (default {DEFAULT_DRAIN_TIMEOUT:g})")
    p.add_argument("--no-logprobs", action="store_true",
                   help="load no logprobs variants (saves their load and, on CUDA, their "
                        "graph captures); requests asking logprobs or echo's prompt logprobs "
                        "are then refused by name")
    p.add_argument("--no-access-log", action="store_true",
                   help="no line per request on stdout (failures are still logged)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, metavar="KEY",
                     help="requests must send `Authorization: Bearer KEY`, else HTTP 401 "
                          "(/health and /metrics stay open); the command line is visible to "
                          "other users of the machine: --api-key-file keeps it out")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="--api-key read from the first line of this file")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="browser origins allowed to call the API (CORS), comma-separated, "
                        "e.g. https://app.example.com, or '*' for any; default: none (no CORS "
                        "headers: browsers refuse cross-origin calls)")


def _api_key(args) -> str | None:
    """The key of --api-key or --api-key-file; ValueError (one line) when it is unusable."""
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it "
                             f"({type(e).__name__}: {e})") from None
        flag = "--api-key-file"
    elif args.api_key is not None:
        key, flag = args.api_key, "--api-key"
    else:
        return None
    if not key or any(not 0x21 <= ord(c) <= 0x7e for c in key):
        raise ValueError(f"{flag}: the key must be printable ASCII without spaces (it is sent "
                         "in an HTTP header), and not empty")
    return key


def _origins(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for o in origins:
        if o != "*" and not (o.startswith(("http://", "https://")) and "*" not in o):
            raise ValueError(f"--allowed-origins: {o!r} is not an origin (scheme://host[:port],"
                             " or '*' alone)")
    if not origins:
        raise ValueError("--allowed-origins: no origin given")
    return origins


@command("serve", "serve an engine over an OpenAI-compatible HTTP API", _serve_args,
         flags={"max_queue": "--max-queue", "max_request_bytes": "--max-request-bytes"})
def cmd_serve(args) -> int:
    require_extra()          # before the engine loads: a missing extra fails in a second
    # the runtime (torch) only when the command runs: the CLI starts without it
    from dspark_compile.engine_dir.tp_format import check_tp
    from dspark_compile.runtime.engine import Engine

    api_key, origins = _api_key(args), _origins(args.allowed_origins)   # before the load
    tp = 1 if args.tp is None else args.tp
    with engine_errors():
        check_tp(args.engine, tp)       # a rank count the engine was not built for: one line
    if tp > 1:
        return _serve_tp(args, tp, _server_options(args, api_key, origins))
    dev = device(args.device) if args.device else None
    t = time.perf_counter()
    with engine_errors():
        # a server decodes speculatively only: the target-only programs are not loaded
        eng = Engine.load(args.engine, device=dev, use_graphs=False if args.no_graphs else None,
                          target=False, trust_code=args.trust_engine_code,
                          logprobs=not args.no_logprobs)
    print(f"loaded {args.engine} on {eng.device} in {time.perf_counter() - t:.2f}s", flush=True)
    Server(eng, **_server_options(args, api_key, origins)).run(
        args.host, args.port, log=lambda line: print(line, flush=True),
        access_log=not args.no_access_log)
    return 0


def _server_options(args, api_key, origins) -> dict:
    return dict(model_name=args.model_name, max_queue=args.max_queue,
                max_request_bytes=args.max_request_bytes, header_timeout=args.header_timeout,
                body_timeout=args.body_timeout, send_timeout=args.send_timeout,
                drain_timeout=args.drain_timeout, api_key=api_key, allowed_origins=origins)


def _serve_tp(args, tp: int, options: dict) -> int:
    """serve --tp N: N ranks started here (runtime/ranks.py run_ranks); rank 0 serves, its
    engine thread driving its RankEngine, the others follow its calls. A rank that dies ends
    the others and this command (RanksFailed: one line, exit 1); SIGTERM / SIGINT drains rank
    0's server as without --tp."""
    from pathlib import Path

    from dspark_compile.engine_dir.tp_format import read_ranks
    from dspark_compile.runtime.ranks import run_ranks

    with engine_errors():
        built = read_ranks(args.engine)["build_config"].get("device", "cpu")
    dev = str(device(args.device)) if args.device else str(built).split(":")[0]
    # the rank directory's name is not the model's
    options["model_name"] = options["model_name"] or Path(args.engine).resolve().name
    # rank 0's drain, then uvicorn's own graceful shutdown (Server._server), then a margin
    grace = args.drain_timeout + max(args.body_timeout, args.send_timeout) + 15
    with engine_errors():
        run_ranks(args.engine, tp, _rank_serve,
                  (options, args.host, args.port, not args.no_access_log), device=dev,
                  load_options={"use_graphs": False if args.no_graphs else None,
                                "target": False, "trust_code": args.trust_engine_code,
                                "logprobs": not args.no_logprobs},
                  what="serve", grace_s=grace)
    return 0


def _rank_serve(eng, rank: int, options: dict, host: str, port: int, access_log: bool) -> None:
    """One rank of serve --tp (a spawned process's main thread): rank 0 runs the Server on its
    RankEngine and stops the others when the server ends; they follow its calls until then."""
    import signal

    from dspark_compile.cli.common import Terminated, sigterm_raises
    if rank:
        # Ctrl-C reaches every process of the terminal's group: rank 0 drains, then stops
        # this one's loop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        eng.follow()
        return
    print(f"loaded {eng.dir.parent} on {eng.device} ({eng.pc.tp} ranks)", flush=True)
    server = Server(eng, **options)
    try:
        with sigterm_raises():      # uvicorn raises the signal again once it has drained
            server.run(host, port, log=lambda line: print(line, flush=True),
                       access_log=access_log)
    except (Terminated, KeyboardInterrupt):
        pass                        # the parent, signalled too, reports it (exit 143 / 130)
    try:
        eng.stop()
    except RuntimeError:            # gloo's error: a peer is gone, and the parent names it
        pass
