"""`dspark-compile serve ENGINE`: the subcommand. Registered at CLI start-up; FastAPI, uvicorn
and prometheus-client (the `serve` extra) are imported only when it runs, so the rest of the
CLI works without them."""
from __future__ import annotations

import argparse
import time

from dspark_compile.cli_common import command, device, engine_errors, int_arg
# server.py imports nothing of the extra at module level
from dspark_compile.serve.server import DEFAULT_HOST, DEFAULT_MAX_QUEUE, DEFAULT_PORT


_port = int_arg(0, 65535, "a port number")
_count = int_arg(0)


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
    p.add_argument("--device", default=None, help="default: the device the engine was built for")
    p.add_argument("--no-graphs", action="store_true", help="run the programs without CUDA graphs")


@command("serve", "serve an engine over an OpenAI-compatible HTTP API", _serve_args,
         flags={"max_queue": "--max-queue"})
def cmd_serve(args) -> int:
    from dspark_compile.serve import require_extra
    require_extra()          # before the engine loads: a missing extra fails in a second
    from dspark_compile.runtime import Engine
    from dspark_compile.serve.server import Server

    dev = device(args.device) if args.device else None
    t = time.perf_counter()
    with engine_errors():
        # a server decodes speculatively only: the target-only programs are not loaded
        eng = Engine.load(args.engine, device=dev, use_graphs=False if args.no_graphs else None,
                          target=False)
    print(f"loaded {args.engine} on {eng.device} in {time.perf_counter() - t:.2f}s", flush=True)
    Server(eng, model_name=args.model_name, max_queue=args.max_queue).run(
        args.host, args.port, log=lambda line: print(line, flush=True))
    return 0
