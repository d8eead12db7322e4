"""`dspark-compile serve` in its own process with the engine replaced by the stand-in stream
(serve_helpers.FakeEngine, each step slowed by --step-s): what tests/serve/test_drain.py sends
SIGTERM to. Exits 143 after SIGTERM, as the CLI does."""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve.serve_helpers import FakeEngine  # noqa: E402

from dspark_compile.cli.common import Terminated, sigterm_raises  # noqa: E402
from dspark_compile.serve.server import Server  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    args = p.parse_args()
    eng = FakeEngine(args.dir)
    eng.fake.step_hook = lambda: time.sleep(args.step_s)
    try:
        with sigterm_raises():
            Server(eng, model_name="m", drain_timeout=args.drain_timeout).run(
                "127.0.0.1", 0, log=lambda line: print(line, flush=True))
    except Terminated:
        print("terminated", flush=True)
        return 143
    return 0


if __name__ == "__main__":
    sys.exit(main())
