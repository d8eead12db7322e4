"""The server's own cost without a GPU: `dspark-compile serve`'s real code (the app, the engine
thread, detokenization, SSE, metrics) over a synthetic stream whose step takes a fixed wall
time with the GIL released, against that stream alone, on the same requests.

    python benchmarks/serve_synthetic.py --out DIR [--step-ms 2] [--tokens-per-step 4]
    python benchmarks/serve_synthetic.py --dry-run --out DIR      # seconds (the test's run)

The stream (`SyntheticStream`) has GenerationStream's surface as the server uses it (add,
cancel, has_work, step, counters, isolate_failures, close): a step sleeps --step-ms (the
device's wait: the GIL is free, as it is while the engine waits for its GPU), admits waiting
requests into free rows (--rows), and commits --tokens-per-step tokens to every running row
(ids of the tokenizer's vocabulary drawn from the request's seed: the text a real
tokenizer -- default the trained tiny model's, dspark_compile/factory/data/tiny-trained --
detokenizes). The step's wall time is --step-ms + --step-ms-per-row x the rows it runs; the
defaults (1.0 + 0.11 x rows, 4 tokens a row) mirror issue 54's H100 run of the trained tiny
engine, whose engine-alone rates at 1 / 4 / 16 / 64 clients (3,793 / 10,116 / 24,377 / 34,285
tokens/s at ~4.3 tokens a row a step) are steps of 1.1 / 1.7 / 2.8 / 8.0 ms.

Per concurrency c, the requests, clients and numbers are benchmarks/serve_load.py's (its
workload, closed-loop asyncio client and summary, imported): `engine` is the stream alone
(serve_load.run_engine), `server` the same requests streamed over HTTP to the server (its own
process by default, as serve_load runs it; `--server thread`: in this one). The overhead is
1 - server tokens/s / engine tokens/s; the machine is shared and the step is a sleep, so the
numbers are indicative: the GPU run (serve_load.py) is the measurement of record.

Writes serve_synthetic.json and prints the table.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402
import serve_load  # noqa: E402

SCHEMA = "dspark-serve-synthetic-benchmark/1"
TOKENIZER = bench_args.REPO / "dspark_compile" / "factory" / "data" / "tiny-trained" / \
    "tokenizer.json"
FIRST_ID = 3          # the tiny tokenizer's special tokens are ids 0..2: never drawn
# a level's fewest requests when --rounds is not given: 1 client x 8 rounds was 0.2 s, a few
# 10 ms ticks of the server's CPU clock
MIN_REQUESTS = 64
TABLE = ["concurrency", "requests", "engine_tokens_per_s", "server_tokens_per_s",
         "overhead_pct", "engine_itl_p50_ms", "server_itl_p50_ms", "engine_itl_p99_ms",
         "server_itl_p99_ms", "server_ttft_p50_ms", "server_cpu_us_per_token", "server_cpu_cores",
         "client_cpu_cores", "tokens_match"]


class StreamEvent(NamedTuple):
    request: int
    tokens: list
    finished: bool
    error: BaseException | None = None


class SyntheticStream:
    """A GenerationStream stand-in whose step costs `step_s` of GIL-free wall time."""

    isolate_failures = False

    def __init__(self, vocab: int, rows: int, step_s: float, per_step: int,
                 row_s: float = 0.0, hops: int = 1):
        self.vocab, self.rows, self.step_s, self.per_step = vocab, rows, step_s, per_step
        self.row_s, self.hops = row_s, hops
        self.ids = range(FIRST_ID, vocab)
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: list[int] = []
        self._running: dict[int, list] = {}       # id -> [its tokens, committed so far]
        self._req: dict[int, list] = {}
        self._cancels: set[int] = set()
        self._live: set[int] = set()
        self.c = {"steps": 0, "greedy_steps": 0, "steps_per_bucket": {}, "row_steps": 0,
                  "draft_tokens": 0, "accepted_tokens": 0, "accepted_at": [0] * per_step,
                  "committed_tokens": 0}

    def add(self, prompt, params, **options) -> int:
        if not prompt:
            raise ValueError("prompt is empty")
        params = params.validate(self.vocab)
        # random.choices: ~10 us for 64 ids where randrange took ~150 (this runs on the
        # server's event loop, in submit: the stand-in must cost no more than the real add)
        tokens = random.Random(params.seed).choices(self.ids, k=params.max_new_tokens)
        with self._lock:
            rid = self._next
            self._next += 1
            self._req[rid] = [tokens, 0]
            self._waiting.append(rid)
            self._live.add(rid)
        return rid

    def cancel(self, request: int) -> bool:
        with self._lock:
            if request not in self._live:
                return False
            self._live.discard(request)
            self._cancels.add(request)
            return True

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._live or self._cancels)

    def step(self) -> list[StreamEvent]:
        with self._lock:
            rows = min(self.rows, len(self._running) + len(self._waiting))
        wait = (self.step_s + self.row_s * rows) / self.hops
        for _ in range(self.hops):          # the device's waits: the GIL is free in each,
            time.sleep(wait)                # and taken back after it (a torch call's way)
        events = []
        with self._lock:
            for rid in self._cancels:
                if rid in self._waiting:
                    self._waiting.remove(rid)
                self._running.pop(rid, None)
                self._req.pop(rid, None)
                events.append(StreamEvent(rid, [], True))
            self._cancels.clear()
            while self._waiting and len(self._running) < self.rows:
                rid = self._waiting.pop(0)
                self._running[rid] = self._req.pop(rid)
            k, n = self.per_step, 0
            for rid, r in list(self._running.items()):
                tokens, done = r
                new = tokens[done:done + k]
                r[1] = done + len(new)
                n += len(new)
                end = r[1] >= len(tokens)
                if end:
                    del self._running[rid]
                    self._live.discard(rid)
                events.append(StreamEvent(rid, new, end))
            c = self.c
            c["steps"] += 1
            c["row_steps"] += len(events)
            c["committed_tokens"] += n
        return events

    def counters(self) -> dict:
        with self._lock:
            out = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                   for k, v in self.c.items()}
            out["running"], out["waiting"] = len(self._running), len(self._waiting)
        return out

    def close(self) -> None:
        with self._lock:
            self._live.clear()
            self._waiting.clear()
            self._running.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SyntheticEngine:
    """What Server and serve_load.run_engine read from an Engine, around SyntheticStreams; its
    directory holds the tokenizer (a temporary copy)."""

    def __init__(self, tokenizer: Path, rows: int, step_s: float, per_step: int,
                 row_s: float = 0.0, hops: int = 1, max_seq_len: int = 4096):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            vocab = HFTokenizer.from_file(str(tokenizer)).get_vocab_size()
        except Exception as e:  # noqa: BLE001 -- the library raises bare Exceptions
            raise SystemExit(f"--tokenizer {tokenizer}: not a Hugging Face tokenizers file "
                             f"({str(e).splitlines()[0][:200]})") from None
        self.dir = Path(tempfile.mkdtemp(prefix="dspark-serve-synthetic-"))
        shutil.copyfile(tokenizer, self.dir / "tokenizer.json")
        self.cfg = type("Cfg", (), {"vocab_size": vocab, "dspark_block_size": per_step,
                                    "eos_token_id": None, "bos_token_id": None})()
        self.cache = type("Cache", (), {"max_rows": rows, "max_seq_len": max_seq_len})()
        self.manifest = {"checksum": "synthetic"}
        self.device = "cpu (synthetic)"
        self.args = (vocab, rows, step_s, per_step, row_s, hops)

    def open_stream(self) -> SyntheticStream:
        return SyntheticStream(*self.args)

    def logprobs_refusal(self) -> str:
        return "the synthetic stream returns no logprobs"

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_args.add_out(p, "serve_synthetic")
    p.add_argument("--concurrency", type=bench_args.ordered_ints, default=None,
                   help="clients in flight per level (default 1,4,16,64; --dry-run 1,2)")
    p.add_argument("--rounds", type=bench_args.at_least(1), default=None,
                   help=f"requests per client per level (default 8, and at least "
                        f"{MIN_REQUESTS} requests a level; --dry-run 1)")
    p.add_argument("--prompt-len", type=bench_args.at_least(1), default=None,
                   help="default 32; --dry-run 4")
    p.add_argument("--max-tokens", type=bench_args.at_least(1), default=None,
                   help="default 64; --dry-run 8")
    p.add_argument("--step-ms", type=float, default=1.0,
                   help="the synthetic step's fixed wall time, GIL released (default 1.0)")
    p.add_argument("--step-ms-per-row", type=float, default=0.11,
                   help="and this much more per row it runs (default 0.11: with --step-ms 1.0 "
                        "the tiny engine's steps on an H100; 0: a fixed step)")
    p.add_argument("--gil-hops", type=bench_args.at_least(1), default=1,
                   help="the step's wait in this many pieces, the GIL taken back after each "
                        "(an engine step's host calls, each of which releases it; default 1)")
    p.add_argument("--tokens-per-step", type=bench_args.at_least(1), default=4,
                   help="tokens a running row commits per step (default 4)")
    p.add_argument("--rows", type=bench_args.at_least(1), default=64,
                   help="state rows: requests running at once (default 64)")
    p.add_argument("--tokenizer", type=Path, default=TOKENIZER,
                   help="tokenizer.json (default: the trained tiny model's)")
    p.add_argument("--server", choices=("subprocess", "thread"), default=None,
                   help="the server in its own process (default) or in this one (--dry-run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-alive", action="store_true",
                   help="serve_load.py's: each client keeps its connection between requests")
    p.add_argument("--dry-run", action="store_true", help="2 levels, 1 round, 8 tokens")
    p.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    bench_args.add_git_commit(p)
    a = p.parse_args(argv)
    d = a.dry_run
    for name in ("step_ms", "step_ms_per_row"):
        v = getattr(a, name)
        if not 0 <= v <= 1000:          # NaN included
            p.error(f"--{name.replace('_', '-')} must be in [0, 1000], got {v}")
    if not a.tokenizer.is_file():
        p.error(f"--tokenizer {a.tokenizer}: no such file")
    a.concurrency = a.concurrency or ([1, 2] if d else [1, 4, 16, 64])
    a.min_requests = 0 if (d or a.rounds) else MIN_REQUESTS
    a.rounds = a.rounds or (1 if d else 8)
    a.prompt_len = a.prompt_len or (4 if d else 32)
    a.max_tokens = a.max_tokens or (8 if d else 64)
    a.server = a.server or ("thread" if d else "subprocess")
    # serve_load's request body and engine side read these
    a.temperature, a.top_p, a.logprobs = 0.0, 1.0, None
    return a


def _level_args(args, c: int):
    """args with the level's rounds: --rounds, raised to MIN_REQUESTS requests a level."""
    import copy
    out = copy.copy(args)
    out.rounds = max(args.rounds, -(-args.min_requests // c))
    return out


def _engine(args) -> SyntheticEngine:
    return SyntheticEngine(args.tokenizer, args.rows, args.step_ms / 1e3, args.tokens_per_step,
                           args.step_ms_per_row / 1e3, args.gil_hops)


def serve_child(args) -> int:
    """The server over a synthetic engine, in this process until SIGTERM (the subprocess the
    benchmark starts; its banner names the port)."""
    from dspark_compile.cli.common import Terminated, sigterm_raises
    from dspark_compile.serve.server import Server
    eng = _engine(args)
    try:
        with sigterm_raises():
            Server(eng, model_name="bench").run("127.0.0.1", 0, access_log=False,
                                                log=lambda line: print(line, flush=True))
    except Terminated:
        return 143
    finally:
        eng.remove()
    return 0


def _child_cmd(args) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--serve-child",
            "--step-ms", repr(args.step_ms), "--step-ms-per-row", repr(args.step_ms_per_row),
            "--tokens-per-step", str(args.tokens_per_step), "--gil-hops", str(args.gil_hops),
            "--rows", str(args.rows), "--tokenizer", str(args.tokenizer)]


def _cpu_s(server) -> float | None:
    """The server process's CPU seconds so far, user + system (Linux's /proc; None for a
    server in this process or elsewhere): per token, the server's cost that a shared machine's
    noise does not change much, and the number to hold against one core (one GIL)."""
    proc = getattr(server, "proc", None)
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (AttributeError, OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _environment(args) -> dict:
    commit = args.git_commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bench_args.REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            commit = None
    return {"device": "cpu", "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "git_commit": commit or None,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run(args, log=print) -> dict:
    env = _environment(args)
    out = bench_args.out_dir(args, env, "serve_synthetic")
    rec = {"schema": SCHEMA, "complete": False, "dry_run": args.dry_run, "environment": env,
           "server": args.server, "step_ms": args.step_ms,
           "step_ms_per_row": args.step_ms_per_row, "gil_hops": args.gil_hops,
           "tokens_per_step": args.tokens_per_step, "rows": args.rows,
           "tokenizer": str(args.tokenizer), "concurrency": args.concurrency,
           "rounds": args.rounds, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
           "keep_alive": args.keep_alive,
           "levels": []}
    eng = _engine(args)
    levels = {c: serve_load.workload(_level_args(args, c), eng.cfg.vocab_size, c)
              for c in args.concurrency}
    rows, engine_tokens = {}, {}
    serve_load.run_engine(eng, args, levels[args.concurrency[0]][:1], 1)   # warm-up, untimed
    for c, reqs in levels.items():
        res, engine_tokens[c] = serve_load.run_engine(eng, args, reqs, c)
        rows[c] = {"concurrency": c, "requests": len(reqs), **res}
        log(f"[engine] c={c}: {res['engine_tokens_per_s']} tokens/s, ITL p50 "
            f"{res['engine_itl_p50_ms']} ms")
    if args.server == "thread":
        from dspark_compile.serve.server import Server
        server = Server(eng, model_name="bench")
        host, port = re.match(r"http://(\S+):(\d+)", server.start()).groups()
        port = int(port)
    else:
        server = serve_load._ServerProcess(None, 1, cmd=_child_cmd(args))
        host, port = server.host, server.port
    try:
        asyncio.run(serve_load._server_level(host, port, "bench", args, levels[
            args.concurrency[0]][:1], 1))                           # warm-up, untimed
        for c, reqs in levels.items():
            cpu, client = _cpu_s(server), time.process_time()
            res, tokens = asyncio.run(serve_load._server_level(host, port, "bench", args,
                                                               reqs, c))
            row = rows[c]
            row.update(res, tokens_match=tokens == engine_tokens[c])
            if args.server == "subprocess":     # the client's share of the machine
                row["client_cpu_cores"] = round((time.process_time() - client)
                                                / res["server_wall_s"], 3)
            if cpu is not None:
                spent = _cpu_s(server) - cpu
                row["server_cpu_us_per_token"] = round(1e6 * spent / max(1, res["server_tokens"]),
                                                       2)
                # ~1.0: the server's one GIL is saturated (the stand-in engine thread only
                # sleeps): its event loop, not the machine, bounds it
                row["server_cpu_cores"] = round(spent / res["server_wall_s"], 3)
            e, s = row["engine_tokens_per_s"], row["server_tokens_per_s"]
            row["overhead_pct"] = round(100 * (1 - s / e), 2) if e and s else None
            log(f"[server] c={c}: {s} tokens/s ({row['overhead_pct']} % below the stream), "
                f"ITL p50 {row['server_itl_p50_ms']} ms, p99 {row['server_itl_p99_ms']} ms, "
                f"{row.get('server_cpu_us_per_token')} us of server CPU a token, "
                f"{row.get('server_cpu_cores')} cores")
            rec["levels"] = list(rows.values())
            bench_args.write_record(out / "serve_synthetic.json", rec)
    finally:
        server.close()
        eng.remove()
    rec["complete"] = True
    bench_args.write_record(out / "serve_synthetic.json", rec)
    log(harness.format_table(rec["levels"], TABLE))
    return rec


def main(argv=None) -> int:
    args = _args(argv)
    if args.serve_child:
        return serve_child(args)
    run(args, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
