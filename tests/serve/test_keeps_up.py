"""The server keeps up with its engine (issue 54 item 6): the engine thread never waits for a
client, the GIL comes back to it quickly while serving, and the synthetic benchmark
(benchmarks/serve_synthetic.py) runs the real server over a stand-in stream."""
import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from serve.serve_helpers import FakeEngine, train_tokenizer

from dspark_compile.models.request import SamplingParams
from dspark_compile.serve.server import SWITCH_INTERVAL_S, Server

REPO = Path(__file__).resolve().parents[2]


def scope(path: str = "/v1/completions") -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"x"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


def receiver(body: dict):
    """The request's body, then nothing: the client neither sends more nor leaves."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(),
                    "more_body": False}
        await asyncio.Event().wait()
    return receive


def sse_ids(messages: list) -> tuple[list[int], str]:
    text = b"".join(m.get("body", b"") for m in messages
                    if m["type"] == "http.response.body").decode()
    ids = [t for line in text.splitlines() if line.startswith("data: {")
           for c in json.loads(line[6:])["choices"] for t in c["token_ids"]]
    return ids, text


async def until(cond, timeout: float = 30.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.005)


def test_a_client_that_reads_nothing_holds_up_neither_the_engine_nor_the_others(tmp_path):
    """Client A's first chunk never leaves (its send blocks for good, as a socket whose reader
    stopped does). Meanwhile client B streams its request to the end, every token the engine's,
    and A's request runs to its end in the engine too: the engine thread hands events over
    and goes on, it never waits for a client's send."""
    train_tokenizer(tmp_path / "tokenizer.json")
    eng = FakeEngine(tmp_path)
    srv = Server(eng, model_name="m")
    srv.loop.start()

    async def main():
        blocked, a_sent = asyncio.Event(), []

        async def stalled_send(message):
            a_sent.append(message["type"])
            if message["type"] == "http.response.body":
                await blocked.wait()                 # never set: A reads nothing

        body = {"model": "m", "max_tokens": 60, "stream": True}
        a = asyncio.ensure_future(srv.app(scope(), receiver({**body, "prompt": [5, 6],
                                                             "seed": 1}), stalled_send))
        await until(lambda: "http.response.body" in a_sent)
        b_sent = []

        async def send(message):
            b_sent.append(message)

        await asyncio.wait_for(srv.app(scope(), receiver({**body, "prompt": [7, 8],
                                                          "seed": 2}), send), 30)
        ids, text = sse_ids(b_sent)
        assert ids == eng.fake.expected([7, 8], SamplingParams(seed=2, max_new_tokens=60))
        assert text.endswith("data: [DONE]\n\n")
        await until(lambda: srv.loop.in_flight == 0)  # A's request ended in the engine
        assert not a.done() and a_sent.count("http.response.body") == 1
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)

    try:
        asyncio.run(main())
    finally:
        srv.close()


def test_a_stream_behind_its_engine_catches_up_in_one_chunk(tmp_path):
    """The stream's first send (its headers) is held until the engine has finished its
    request (a client, or an event loop, that fell behind): every step's events then wait in
    its queue, and the stream sends them as one chunk (one JSON body, one write) with the
    finish reason, not one a step; the tokens are still exactly the engine's."""
    train_tokenizer(tmp_path / "tokenizer.json")
    eng = FakeEngine(tmp_path)
    srv = Server(eng, model_name="m")
    srv.loop.start()

    async def main():
        sent = []

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.start":
                await until(lambda: srv.loop.in_flight == 0)   # the engine is done

        body = {"model": "m", "max_tokens": 60, "stream": True, "prompt": [5, 6], "seed": 1}
        await asyncio.wait_for(srv.app(scope(), receiver(body), send), 30)
        ids, text = sse_ids(sent)
        assert ids == eng.fake.expected([5, 6], SamplingParams(seed=1, max_new_tokens=60))
        chunks = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        assert len(chunks) == 1, [c["choices"][0]["token_ids"] for c in chunks]
        assert chunks[0]["choices"][0]["finish_reason"] == "length"
        assert eng.fake.c["steps"] > 3            # many steps' events in that one chunk
        # the finish chunk, [DONE] and the response's end: one message (one write)
        bodies = [m for m in sent if m["type"] == "http.response.body"]
        assert len(bodies) == 1 and bodies[0]["more_body"] is False
        assert bodies[0]["body"].decode().endswith("data: [DONE]\n\n")

    try:
        asyncio.run(main())
    finally:
        srv.close()


def test_serving_shortens_the_gil_switch_interval_and_closing_restores_it(tmp_path):
    """While a server serves, a thread that wants the GIL (the engine thread back from its
    device wait) waits at most SWITCH_INTERVAL_S for it, not Python's 5 ms; two servers at
    once keep it until the last closes."""
    before = sys.getswitchinterval()
    assert SWITCH_INTERVAL_S < before
    train_tokenizer(tmp_path / "tokenizer.json")
    one = Server(FakeEngine(tmp_path), model_name="m")
    two = Server(FakeEngine(tmp_path), model_name="m")
    try:
        one.start()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        two.start()
        one.close()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    finally:
        one.close()
        two.close()
    assert sys.getswitchinterval() == before


def load_bench():
    spec = importlib.util.spec_from_file_location("serve_synthetic", REPO / "benchmarks" /
                                                  "serve_synthetic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("keep_alive", [False, True])
def test_synthetic_benchmark_dry_run_serves_every_token_of_the_stream(tmp_path, keep_alive):
    """--dry-run: the real server over the synthetic stream, serve_load's client (a
    connection a request, or one a client with --keep-alive: 2 rounds, so a connection
    carries a second request); every level's server tokens equal the stream's own, and the
    record is complete."""
    tool = load_bench()
    args = tool._args(["--dry-run", "--out", str(tmp_path), "--step-ms", "20"]
                      + (["--keep-alive", "--rounds", "2"] if keep_alive else []))
    rec = tool.run(args, log=lambda line: None)
    saved = json.loads((tmp_path / "serve_synthetic.json").read_text())
    assert saved["schema"] == tool.SCHEMA and saved["complete"]
    assert saved["keep_alive"] is keep_alive
    assert [r["concurrency"] for r in saved["levels"]] == [1, 2]
    for r in rec["levels"]:
        n = r["concurrency"] * args.rounds * args.max_tokens
        assert r["engine_tokens"] == r["server_tokens"] == n and r["tokens_match"] is True
        assert r["overhead_pct"] == round(100 * (1 - r["server_tokens_per_s"]
                                                 / r["engine_tokens_per_s"]), 2)
        # a stream 20 ms behind its engine would send both steps as one chunk: no gap
        p50, p99 = r["server_itl_p50_ms"], r["server_itl_p99_ms"]
        assert (p50 is None and p99 is None) or 0 < p50 <= p99
        assert 0 < r["server_ttft_p50_ms"] <= r["server_ttft_p99_ms"]


@pytest.mark.parametrize("argv,piece", [
    (["--step-ms", "nan"], "--step-ms must be in [0, 1000]"),
    (["--step-ms-per-row", "-1"], "--step-ms-per-row must be in [0, 1000]"),
    (["--tokenizer", "/nonexistent/tokenizer.json"], "no such file"),
    (["--tokens-per-step", "0"], "must be >= 1"),
    (["--gil-hops", "0"], "--gil-hops: must be >= 1"),
])
def test_synthetic_benchmark_refuses_bad_flags_naming_them(argv, piece, capsys):
    tool = load_bench()
    with pytest.raises(SystemExit):
        tool._args(["--dry-run"] + argv)
    assert piece in capsys.readouterr().err


def test_coalescing_keeps_a_failure_queued_behind_tokens_for_after_them():
    """Events queued as [tokens, tokens, the request's failure]: one delta carries both
    steps' tokens and logprobs in order, then the failure is raised -- taken from the queue
    while coalescing, it is neither lost nor moved ahead of the tokens."""
    from types import SimpleNamespace

    from dspark_compile.serve.http import Run
    from dspark_compile.serve.loop import RequestFailed, Ticket
    from dspark_compile.serve.metrics import Metrics
    from dspark_compile.serve.prepare import Job

    state = SimpleNamespace(tokenizer=None, metrics=Metrics(5, 4, "m"),
                            loop=SimpleNamespace(cancel=lambda ticket: None))
    job = Job(0, [3, 4], SamplingParams(max_new_tokens=10), (), logprobs=0)

    def event(tokens, lps):
        return SimpleNamespace(tokens=tokens, finished=False, error=None, logprobs=lps)

    async def main():
        ticket = Ticket(7, asyncio.get_running_loop(), asyncio.Queue())
        for item in (event([5, 6], [(-0.5, ()), (-0.25, ())]), event([8], [(-1.0, ())]),
                     RequestFailed("boom")):
            ticket.events.put_nowait(item)
        got = []
        with pytest.raises(RequestFailed, match="boom"):
            async for d in Run(state, job, ticket, 0.0).deltas():
                got.append((d.ids, d.logprobs))
        return got

    assert asyncio.run(main()) == [([5, 6, 8], [(-0.5, ()), (-0.25, ()), (-1.0, ())])]


def test_a_text_chunk_is_the_json_of_the_chunk_dict():
    """app._text_chunks (a prefix made once a stream) gives the same JSON as app._chunk, for
    text that JSON must escape (quotes, backslashes, control and non-ASCII characters, a
    lone surrogate's escape) and each finish reason."""
    from dspark_compile.serve.app import _chunk, _chunk_base, _text_chunks
    base = _chunk_base(type("S", (), {"model_name": 'm "q" \\', "fingerprint": None})(),
                       "cmpl-1")
    chunk = _text_chunks(base)
    for text, ids, finish in [("", [], None), ('a "b" \\ c\n\t\x00', [1, 22], "stop"),
                              ("caf\u00e9 \U0001F680 \u65e5", [3], "length"),
                              ("\ud800", [4, 5, 6], None)]:
        fast = chunk(2, text, ids, finish)
        slow = _chunk(base, [{"index": 2, "text": text, "token_ids": ids,
                              "finish_reason": finish, "logprobs": None}])
        assert fast.startswith("data: ") and fast.endswith("\n\n")
        assert json.loads(fast[6:]) == json.loads(slow[6:])
