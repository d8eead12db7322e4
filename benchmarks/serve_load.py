"""`dspark-compile serve` under load: tokens/s and inter-token latency vs concurrency, against the
engine's own stream without a server, on the same requests.

    python benchmarks/serve_load.py --engine ENGINE --out DIR [--concurrency 1,4,16,64]
    python benchmarks/serve_load.py --dry-run --engine ENGINE --out DIR   # CPU smoke run

Per concurrency c (closed loop: c clients, each sending its next request when the previous one
ended, `--rounds` requests each; prompts of `--prompt-len` random ids, `--max-tokens` new tokens
each with eos ignored, so every request has the same length on both sides; seeds by request):

- `engine`: the engine alone, in this process: one GenerationStream (Engine.open_stream, what
  `Engine.generate` runs on), c requests in flight, one added as one ends; a request's tokens
  are timed when step() returns them;
- `generate`: `Engine.generate` on the same requests in rounds of c (a round runs to its last
  token before the next starts: no refill between rounds);
- `server`: the same requests over HTTP to `dspark-compile serve` (`--server subprocess`: its
  own process, started once the engine here is freed; `thread`: in this process, the same
  loaded engine), streamed (SSE), timed when each chunk arrives at the client (an asyncio
  client, raw HTTP/1.1, in this process).

Reported per side: tokens/s (completion tokens / wall time of the level), inter-token latency
p50 / p99 (one sample per token: the gap since the request's previous delivery over the tokens
delivered, so a step committing 3 tokens counts 3 samples of a third of its gap), time to first
token p50 / p99; then the server's overhead, 1 - server tokens/s / engine tokens/s (goal
<= 5 %; `overhead_vs_generate_pct` the same against `generate`), and whether every request's
tokens equal the engine's (`tokens_match`, `generate_tokens_match`: the server adds nothing to
or takes nothing from a request, greedy or sampled).

`--chat`: the server side sends each request to `/v1/chat/completions` (streamed, one user
message, the same sampling fields, ignore_eos, seed and max_tokens) instead of `/v1/completions`.
The message is the level's random prompt ids decoded by the engine's tokenizer.json (the same
seeded workload as without the flag, no word list to ship, the whole vocabulary exercised), and
the engine and generate sides run the ids the server's own chat rendering gives that message
(serve/chat.py: chat_of + prompt_ids), so every side runs the same prompt; a request's prompt
length is then the rendered ids' length (`chat_prompt_tokens`: min / mean / max), not
--prompt-len. Chat chunks carry text, not token ids (serve/chat.py has no opt-in for them), so
the server side is checked and timed through the engine side's ids: `tokens_match` is the
server's text equal to the engine's ids through the server's detokenizer (serve/text.py:
TextStream), and the usage chunk's prompt / completion tokens equal the rendered prompt's and
the engine's counts; a chunk's tokens are those of the engine's ids whose text it completes
(a token of no text of its own counts with the next chunk that has text, when the client
sees it). An engine without tokenizer.json: refused in one line.

`--logprobs K`: every request of the engine and server sides asks K top logprobs (the
`generate` side cannot: Engine.generate returns none); the cost of logprobs is a run with the
flag against one without, on the same machine (issue 54's target: <= 3 % at 16 clients).

Writes serve_load.json (rewritten after every level, "complete": false until the end),
serve_load.csv and, with matplotlib, serve_load.png (tokens/s and ITL vs concurrency).
`--dry-run`: CPU, concurrency 1 and 2, one round, 4 tokens (tests/runtime/test_serve_load.py).
serve_load.json's "endpoint": "completions" or "chat".
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402

SCHEMA = "dspark-serve-load-benchmark/1"
TABLE = ["concurrency", "requests", "engine_tokens_per_s", "generate_tokens_per_s",
         "server_tokens_per_s", "overhead_pct", "overhead_vs_generate_pct", "engine_itl_p50_ms", "server_itl_p50_ms", "engine_itl_p99_ms",
         "server_itl_p99_ms", "server_ttft_p50_ms", "server_ttft_p99_ms", "tokens_match"]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory (dspark-compile build)")
    bench_args.add_out(p, "serve")
    p.add_argument("--concurrency", type=bench_args.ordered_ints, default=None,
                   help="clients in flight per level (default 1,4,16,64; --dry-run 1,2)")
    p.add_argument("--rounds", type=int, default=None,
                   help="requests per client per level (default 4; --dry-run 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 32; --dry-run 4")
    p.add_argument("--max-tokens", type=int, default=None, help="default 64; --dry-run 4")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); > 0 sampled with --top-p")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--logprobs", type=int, default=None,
                   help="every request asks this many top logprobs (0..20) on both sides: "
                        "the cost of logprobs, against a run without the flag")
    p.add_argument("--chat", action="store_true",
                   help="the server side on /v1/chat/completions (one user message: the prompt "
                        "ids as text); the engine sides on its rendered ids")
    p.add_argument("--server", choices=("subprocess", "thread"), default=None,
                   help="the server in its own process (default) or in this one (--dry-run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-alive", action="store_true",
                   help="each client keeps its connection from one request to the next (as "
                        "the openai client's pool does); default: a connection a request")
    bench_args.add_threads(p)
    p.add_argument("--dry-run", action="store_true", help="CPU smoke run: 2 levels, 4 tokens")
    bench_args.add_git_commit(p)
    a = p.parse_args(argv)
    d = a.dry_run
    a.concurrency = a.concurrency or ([1, 2] if d else [1, 4, 16, 64])
    a.rounds = a.rounds or (1 if d else 4)
    a.prompt_len = a.prompt_len or (4 if d else 32)
    a.max_tokens = a.max_tokens or (4 if d else 64)
    a.server = a.server or ("thread" if d else "subprocess")
    for name in ("rounds", "prompt_len", "max_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


# ---- the workload ------------------------------------------------------------------------------

def workload(args, vocab: int, c: int) -> list[dict]:
    """The requests of one level, in the order clients take them (client i: i, i + c, ...)."""
    rng = random.Random(args.seed * 1000 + c)
    n = c * args.rounds
    return [{"prompt": [rng.randrange(2, vocab) for _ in range(args.prompt_len)],
             "seed": args.seed * 100_000 + c * 1000 + i} for i in range(n)]


class Chat:
    """The server's chat rendering, as `dspark-compile serve` builds it (server.py): the
    engine's tokenizer.json and chat format; `prompt_ids` of serve/chat.py maps a request body
    to the ids the server runs."""

    def __init__(self, eng):
        from types import SimpleNamespace

        from dspark_compile.models.chat_format import ChatFormat
        from dspark_compile.serve.text import Tokenizer
        try:
            tok = Tokenizer.of_engine(eng.dir)
        except ValueError as e:          # a tokenizer.json that does not load, named
            raise SystemExit(f"--chat: {e}") from None
        if tok is None:
            raise SystemExit(_no_tokenizer(eng.dir))
        fmt = ChatFormat.of_engine(eng.dir, tok, getattr(eng.cfg, "bos_token_id", None),
                                   getattr(eng.cfg, "eos_token_id", None))
        self.tokenizer = tok
        self.state = SimpleNamespace(tokenizer=tok, chat=fmt, limits=SimpleNamespace(
            max_seq_len=eng.cache.max_seq_len))

    def render(self, args, reqs: list[dict]) -> list[dict]:
        """Each request's random ids -> one user message (their text) and its rendered ids."""
        from dspark_compile.serve.chat import chat_of, prompt_ids
        from dspark_compile.serve.http import ApiError
        from dspark_compile.serve.prepare import BadRequest
        known = self.tokenizer.tok.get_vocab_size()
        out = []
        for r in reqs:
            text = self.tokenizer.decode([t % known for t in r["prompt"]])
            r = {**r, "messages": [{"role": "user", "content": text}]}
            try:
                ids = prompt_ids(chat_of(request_body(args, "bench", r)), self.state)
            except (ApiError, BadRequest) as e:
                raise SystemExit(f"--chat: the server would refuse the message {text!r}: "
                                 f"{e}") from None
            out.append({**r, "prompt": ids})
        return out

    def marks(self, prompt: list[int], ids: list[int]) -> tuple[str, list[int]]:
        """The server's text of output `ids` (serve/text.py's TextStream, as http.Run makes
        it) and, per token k, the text's length once token k is in (the last: with what the
        end flushes)."""
        from dspark_compile.serve.text import TextStream
        ts = TextStream(self.tokenizer, prompt)
        marks = []
        for t in ids:
            ts.add([t])
            marks.append(len(ts.text))
        ts.finish()
        if marks:
            marks[-1] = len(ts.text)
        return ts.text, marks


def _no_tokenizer(engine_dir) -> str:
    return (f"--chat: the engine {engine_dir} has no tokenizer.json (the chat endpoint renders "
            "text): build it from a checkpoint that has one, or drop --chat")


def request_body(args, model: str, r: dict) -> dict:
    """One request's body: completions with the prompt's ids, or chat with its message."""
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "seed": r["seed"], "ignore_eos": True, "stream": True}
    if "messages" not in r:
        return {**body, "prompt": r["prompt"], "logprobs": args.logprobs}
    body.update(messages=r["messages"], stream_options={"include_usage": True})
    if args.logprobs is not None:
        body.update(logprobs=True, top_logprobs=args.logprobs)
    return body


def _params(args, seed: int):
    from dspark_compile.models.request import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=seed,
                          max_new_tokens=args.max_tokens, stop_ids=())


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summary(side: str, tokens: int, wall: float, itl: list[float], ttft: list[float]) -> dict:
    ms = lambda v: None if v is None else round(v * 1e3, 4)  # noqa: E731
    return {f"{side}_tokens": tokens, f"{side}_wall_s": round(wall, 4),
            f"{side}_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
            f"{side}_itl_p50_ms": ms(_quantile(itl, 0.5)),
            f"{side}_itl_p99_ms": ms(_quantile(itl, 0.99)),
            f"{side}_ttft_p50_ms": ms(_quantile(ttft, 0.5)),
            f"{side}_ttft_p99_ms": ms(_quantile(ttft, 0.99))}


# ---- the engine alone --------------------------------------------------------------------------

def run_engine(eng, args, reqs: list[dict], c: int) -> tuple[dict, list[list[int]]]:
    """Closed loop over one GenerationStream: c requests in flight."""
    out = [[] for _ in reqs]
    itl, ttft = [], []
    with eng.open_stream() as s:
        ids, start, last, nxt = {}, {}, {}, 0

        def add():
            nonlocal nxt
            r = s.add(reqs[nxt]["prompt"], _params(args, reqs[nxt]["seed"]),
                      **({} if args.logprobs is None else {"logprobs": args.logprobs}))
            ids[r], start[r] = nxt, time.perf_counter()
            nxt += 1

        t0 = time.perf_counter()
        while nxt < min(c, len(reqs)):
            add()
        while s.has_work:
            events = s.step()
            now = time.perf_counter()
            for e in events:
                i = ids[e.request]
                if e.tokens:
                    if e.request in last:
                        itl += [(now - last[e.request]) / len(e.tokens)] * len(e.tokens)
                    else:
                        ttft.append(now - start[e.request])
                    last[e.request] = now
                    out[i] += e.tokens
                if e.finished and nxt < len(reqs):
                    add()
        wall = time.perf_counter() - t0
    return summary("engine", sum(map(len, out)), wall, itl, ttft), out


def run_generate(eng, args, reqs: list[dict], c: int) -> tuple[dict, list[list[int]]]:
    """Engine.generate in rounds of c requests (each round runs to its last token before the
    next starts: no refill, so below the closed loop's rate when lengths differ)."""
    out = []
    t0 = time.perf_counter()
    for start in range(0, len(reqs), c):
        group = reqs[start:start + c]
        res = eng.generate([r["prompt"] for r in group], [_params(args, r["seed"]) for r in group])
        out += res.tokens
    wall = time.perf_counter() - t0
    tokens = sum(map(len, out))
    return {"generate_tokens": tokens, "generate_wall_s": round(wall, 4),
            "generate_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None}, out


# ---- the server --------------------------------------------------------------------------------

async def _sse_request(host: str, port: int, body: dict, conn: dict | None = None) -> dict:
    """One streamed request over raw HTTP/1.1 (chunked transfer). Completions: its token ids
    and each chunk's arrival with its count of ids. Chat (`messages` in the body): its text,
    each chunk of text's arrival with the text's length so far (chat chunks carry no ids), and
    the usage chunk's counts. `conn` (--keep-alive): the client's connection, opened by its
    first request and kept for the next (as the openai client's pool does); None: a
    connection a request, closed by the server after it."""
    t0 = time.perf_counter()
    chat = "messages" in body
    path = b"/v1/chat/completions" if chat else b"/v1/completions"
    if conn is not None and conn:
        reader, writer = conn["reader"], conn["writer"]
    else:
        reader, writer = await asyncio.open_connection(host, port)
        if conn is not None:
            conn.update(reader=reader, writer=writer)
    data = json.dumps(body).encode()
    writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n%s\r\n"
                 % (path, host.encode(), len(data),
                    b"" if conn is not None else b"Connection: close\r\n")
                 + data)
    await writer.drain()
    status = (await reader.readline()).decode()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if " 200 " not in status:
        writer.close()
        raise RuntimeError(f"server answered {status.strip()}")
    chunked = headers.get("transfer-encoding", "") == "chunked"
    buf, tokens, arrivals, text, used = b"", [], [], "", None
    while True:
        if chunked:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                await reader.readline()          # the blank line that ends the body
                break
            piece = await reader.readexactly(size)
            await reader.readline()
        else:
            piece = await reader.read(65536)
            if not piece:
                break
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            payload = event.decode().removeprefix("data: ")
            if payload == "[DONE]":
                continue
            msg = json.loads(payload)
            if "error" in msg:
                raise RuntimeError(msg["error"]["message"])
            if chat:
                used = msg.get("usage") or used
                # thinking is off (the request turns it on): reasoning_content stays empty,
                # read all the same so the text is the whole output
                piece = "".join(ch["delta"].get("reasoning_content", "")
                                + (ch["delta"].get("content") or "") for ch in msg["choices"])
                if piece:
                    text += piece
                    arrivals.append((time.perf_counter(), len(text)))
                continue
            ids = [t for ch in msg["choices"] for t in ch["token_ids"]]
            if ids:
                tokens += ids
                arrivals.append((time.perf_counter(), len(ids)))
    if conn is None or not chunked:
        writer.close()
        if conn:
            conn.clear()
    return {"t0": t0, "tokens": tokens, "arrivals": arrivals, "text": text, "usage": used}


def _chat_counts(r: dict, marks: list[int]) -> list[tuple[float, int]]:
    """A chat request's arrivals (time, text length so far) -> (time, tokens delivered): the
    engine's tokens whose text the chunk completes (`marks`: Chat.marks of the engine's ids
    for the request); a chunk that completes none is no delivery."""
    import bisect
    out, done = [], 0
    for t, length in r["arrivals"]:
        k = min(bisect.bisect_left(marks, length) + 1, len(marks))
        if k > done:
            out.append((t, k - done))
            done = k
    return out


async def _server_level(host, port, model, args, reqs, c, chat=None,
                        expected=None) -> tuple[dict, list]:
    """One level over HTTP: (its summary, each request's token ids; chat: whether each
    request's text and usage equal the engine's `expected` ids')."""
    out: list = [None] * len(reqs)

    async def client(k: int):
        conn = {} if getattr(args, "keep_alive", False) else None
        try:
            for i in range(k, len(reqs), c):
                out[i] = await _sse_request(host, port, request_body(args, model, reqs[i]),
                                            conn)
        finally:
            if conn:
                conn["writer"].close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(min(c, len(reqs)))))
    wall = time.perf_counter() - t0
    itl, ttft = [], []
    if chat is not None:
        same = []
        for r, req, ids in zip(out, reqs, expected or [[] for _ in reqs]):
            text, marks = chat.marks(req["prompt"], ids)
            u = r["usage"] or {}
            same.append(r["text"] == text and u.get("completion_tokens") == len(ids)
                        and u.get("prompt_tokens") == len(req["prompt"]))
            r["arrivals"] = _chat_counts(r, marks) if expected is not None else []
            r["tokens"] = u.get("completion_tokens") or 0
    for r in out:
        prev = None
        for t, n in r["arrivals"]:
            if prev is None:
                ttft.append(t - r["t0"])
            else:
                itl += [(t - prev) / n] * n
            prev = t
    if chat is not None:
        return summary("server", sum(r["tokens"] for r in out), wall, itl, ttft), same
    tokens = [r["tokens"] for r in out]
    return summary("server", sum(map(len, tokens)), wall, itl, ttft), tokens


class _ServerProcess:
    """`dspark-compile serve ENGINE --port 0` (or `cmd`: another server command that prints
    the same banner, serve_synthetic.py's) in its own process; the URL from its banner."""

    def __init__(self, engine_dir: str | None, threads: int, timeout: float = 1800,
                 cmd: list[str] | None = None):
        if cmd is None:
            exe = Path(sys.executable).with_name("dspark-compile")
            cmd = ([str(exe)] if exe.exists()
                   else [sys.executable, "-m", "dspark_compile.cli.main"])
            cmd = cmd + ["serve", engine_dir, "--port", "0", "--threads", str(threads),
                         "--model-name", "bench",
                         "--no-access-log"]     # one access line a request would go unread
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + timeout
        self.log = []
        for line in self.proc.stdout:
            self.log.append(line)
            m = re.search(r"on http://(\S+):(\d+)", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                return
            if time.monotonic() > deadline:
                break
        self.close()
        raise RuntimeError("the server did not start:\n" + "".join(self.log[-20:]))

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---- the run -----------------------------------------------------------------------------------

def run(args, eng=None, log=print) -> dict:
    """The benchmark; `eng`: an already loaded Engine (tests), else --engine is loaded here."""
    if args.chat and eng is None:
        from dspark_compile.serve.text import TOKENIZER_FILE
        if not (Path(args.engine) / TOKENIZER_FILE).is_file():      # before the engine loads
            raise SystemExit(_no_tokenizer(args.engine))
    import torch

    from dspark_compile.runtime.engine import Engine
    env = harness.environment(args.git_commit)
    out = bench_args.out_dir(args, env, "serve")
    rec = {"schema": SCHEMA, "complete": False, "dry_run": args.dry_run, "environment": env,
           "engine": str(args.engine), "server": args.server, "concurrency": args.concurrency,
           "rounds": args.rounds, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
           "temperature": args.temperature, "top_p": args.top_p, "logprobs": args.logprobs,
           "endpoint": "chat" if args.chat else "completions",
           "keep_alive": args.keep_alive, "rows": []}

    def write():
        bench_args.write_record(out / "serve_load.json", rec)

    own = eng is None
    if own:
        eng = Engine.load(args.engine, device="cpu" if args.dry_run else None, target=False,
                          trust_code=True)  # an engine of this checkout
    from dspark_compile.models.config import request_positions
    rec["max_rows"], rec["device"] = eng.cache.max_rows, str(eng.device)
    vocab = eng.cfg.vocab_size
    chat = Chat(eng) if args.chat else None

    def requests(c: int) -> list[dict]:
        reqs = workload(args, vocab, c)
        return chat.render(args, reqs) if chat else reqs

    levels = {c: requests(c) for c in args.concurrency}
    longest = max(len(r["prompt"]) for reqs in levels.values() for r in reqs)
    need = request_positions(longest, args.max_tokens, eng.cfg.dspark_block_size)
    if need > eng.cache.max_seq_len:
        what = (f"the longest rendered chat prompt ({longest} tokens)" if chat
                else f"--prompt-len {args.prompt_len}")
        raise SystemExit(f"{what} + --max-tokens {args.max_tokens} need {need} positions, the "
                         f"engine has {eng.cache.max_seq_len}")
    if chat:
        lens = [len(r["prompt"]) for reqs in levels.values() for r in reqs]
        rec["chat_prompt_tokens"] = {"min": min(lens), "mean": round(sum(lens) / len(lens), 2),
                                     "max": max(lens)}
    rows = {c: {"concurrency": c, "requests": len(r)} for c, r in levels.items()}
    engine_tokens = {}
    run_engine(eng, args, requests(1)[:1], 1)        # warm-up, untimed
    for c, reqs in levels.items():
        res, engine_tokens[c] = run_engine(eng, args, reqs, c)
        rows[c].update(res)
        gen, gen_tokens = run_generate(eng, args, reqs, c)
        rows[c].update(gen, generate_tokens_match=gen_tokens == engine_tokens[c])
        log(f"[engine] c={c}: {res['engine_tokens_per_s']} tokens/s, ITL p50 "
            f"{res['engine_itl_p50_ms']} ms; Engine.generate in rounds of {c}: "
            f"{gen['generate_tokens_per_s']} tokens/s")
    rec["rows"] = list(rows.values())
    write()

    if args.server == "thread":
        from dspark_compile.serve.server import Server
        server = Server(eng, model_name="bench")
        url = server.start()
        host, port = re.match(r"http://(\S+):(\d+)", url).groups()
        port = int(port)
    else:
        if own:
            del eng
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        server = _ServerProcess(str(args.engine), args.threads)
        host, port = server.host, server.port
    try:
        warm = requests(1)[:1]
        asyncio.run(_server_level(host, port, "bench", args, warm, 1, chat))
        for c, reqs in levels.items():
            res, tokens = asyncio.run(_server_level(host, port, "bench", args, reqs, c, chat,
                                                    engine_tokens[c]))
            row = rows[c]
            row.update(res)
            row["tokens_match"] = all(tokens) if chat else tokens == engine_tokens[c]
            e, s = row["engine_tokens_per_s"], row["server_tokens_per_s"]
            g = row["generate_tokens_per_s"]
            row["overhead_pct"] = round(100 * (1 - s / e), 2) if e and s else None
            row["overhead_vs_generate_pct"] = round(100 * (1 - s / g), 2) if g and s else None
            log(f"[server] c={c}: {s} tokens/s ({row['overhead_pct']} % below the engine), "
                f"ITL p50 {row['server_itl_p50_ms']} ms, p99 {row['server_itl_p99_ms']} ms, "
                f"tokens match: {row['tokens_match']}")
            rec["rows"] = list(rows.values())
            write()
    finally:
        server.close()
    rec["complete"] = True
    write()
    harness.write_csv(str(out / "serve_load.csv"), rec["rows"])
    log(write_plot(out / "serve_load.png", rec["rows"]))
    log(harness.format_table(rec["rows"], TABLE))
    return rec


def write_plot(path: Path, rows: list[dict]) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: plot skipped (JSON and CSV written)"
    cs = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(cs, [r.get("generate_tokens_per_s") for r in rows], marker="o", linestyle=":",
           label="Engine.generate (rounds)")
    for side in ("engine", "server"):
        a.plot(cs, [r.get(f"{side}_tokens_per_s") for r in rows], marker="o", label=side)
        for q, style in (("p50", "-"), ("p99", "--")):
            b.plot(cs, [r.get(f"{side}_itl_{q}_ms") for r in rows], marker="o", linestyle=style,
                   label=f"{side} {q}")
    for ax, title, unit in ((a, "throughput", "tokens/s"), (b, "inter-token latency", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written: {path}"


def main(argv=None) -> int:
    import torch
    args = _args(argv)
    torch.set_num_threads(args.threads)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run for the CPU smoke run", file=sys.stderr)
        return 1
    run(args, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
