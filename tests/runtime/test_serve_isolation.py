"""A request the engine fails on fails alone (issue 50, item 1): GenerationStream with
`isolate_failures` (what the server opens) over the stand-in engine of test_stream_scheduler.py,
whose outputs are known in closed form, with failures injected at admission, at a step's
launch and at a step's read, serial and overlapped; then end to end, the server over the real
small engine with one request's admission failing among others."""
import json
import threading
import urllib.error
import urllib.request

import pytest
from runtime.test_stream_scheduler import FakeEngine, by_request, expected, run

from dspark_compile.models.request import SamplingParams
from dspark_compile.runtime.scheduler import GenerationStream

OVERFLOW = "value cannot be converted to type float without overflow"


def stream(eng, overlap: bool, isolate: bool = True) -> GenerationStream:
    s = GenerationStream(eng, overlap=overlap, prefill_tokens=8)
    s.isolate_failures = isolate
    return s


def failures(events) -> dict:
    return {e.request: e.error for step in events for e in step if e.error is not None}


# six requests for five rows: the last one waits, and takes a row a failure freed
PROMPTS = [[1, 2, 3], [9, 9, 9], [4, 5], [6] * 10, [7, 8], [3, 1, 4, 1, 5]]
PARAMS = [SamplingParams(max_new_tokens=n) for n in (20, 5, 17, 9, 30, 12)]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_an_admission_failure_ends_that_request_alone(overlap):
    eng = FakeEngine()
    real = eng.launch_prefill

    def launch_prefill(row, prompt, calls):
        if prompt == PROMPTS[1]:
            raise RuntimeError(OVERFLOW)
        return real(row, prompt, calls)

    eng.launch_prefill = launch_prefill
    s = stream(eng, overlap)
    ids = [s.add(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    events = run(s)
    got = by_request(events)
    err = failures(events)
    assert list(err) == [ids[1]] and str(err[ids[1]]) == OVERFLOW
    assert got[ids[1]] == ([], True)
    for i in (0, 2, 3, 4, 5):
        assert got[ids[i]] == (expected(PROMPTS[i], PARAMS[i]), True), i
    assert sorted(s.free) == list(range(5)) and not s.active and not s.has_work


@pytest.mark.parametrize("where", ["launch", "read"])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_step_failure_ends_the_requests_of_that_launch_alone(overlap, where):
    """The third decode launch fails (raising, or its outputs' read raising): the requests
    of that launch still running end with the error (with overlap, one may have ended before
    the read: it keeps its whole output), every other request gets exactly its tokens, every
    row comes back."""
    eng = FakeEngine()
    real, calls, failed_prompts = eng.launch, [0], []

    class Broken:
        bucket, greedy = 1, True

        def wait(self):
            raise RuntimeError("step failed")

    def launch(rows, *program):          # the program as the stream names it, passed on
        calls[0] += 1
        if calls[0] == 3:
            failed_prompts.extend(tuple(eng.rows[r]["prompt"]) for r in rows)
            if where == "launch":
                raise RuntimeError("step failed")
            real(rows, *program)         # the device ran it; reading its outputs fails
            return Broken()
        return real(rows, *program)

    eng.launch = launch
    s = stream(eng, overlap)
    ids = [s.add(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    events = run(s)
    got, err = by_request(events), failures(events)
    hit = {ids[i] for i, p in enumerate(PROMPTS) if tuple(p) in failed_prompts}
    assert err and set(err) <= hit
    assert all(str(e) == "step failed" for e in err.values())
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        toks, done = got[ids[i]]
        if ids[i] in err:                  # its tokens before the failure, then the end
            assert done and toks == expected(p, sp)[:len(toks)] and len(toks) < sp.max_new_tokens
        else:
            assert (toks, done) == (expected(p, sp), True), i
    if not overlap:                        # serial: every request of the launch was running
        assert set(err) == hit
    assert sorted(s.free) == list(range(5)) and not s.active and not s.has_work


def test_without_isolation_and_for_a_device_error_the_exception_leaves_step():
    """generate()'s stream (isolate_failures off) raises as before; a CUDA error, which
    poisons every later call, is never pinned on one request."""
    for isolate, message in ((False, OVERFLOW),
                             (True, "CUDA error: an illegal memory access was encountered")):
        eng = FakeEngine()

        def launch_prefill(row, prompt, calls, message=message):
            raise RuntimeError(message)

        eng.launch_prefill = launch_prefill
        s = stream(eng, overlap=False, isolate=isolate)
        s.add([1, 2], SamplingParams(max_new_tokens=3))
        with pytest.raises(RuntimeError, match=message[:20]):
            s.step()


def _post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_server_over_the_engine_fails_one_request_alone(small_loaded, monkeypatch):
    """The original failure: writing one request's sampling settings into its state row raises
    (issue 50: temperature 1e39 overflowed float32 there). Through the server over the real
    engine, with two requests beside it: it gets 500 with OpenAI's error body, they get
    Engine.generate's tokens, /health stays 200, and a request after it runs on the freed
    row."""
    from dspark_compile.serve.server import Server

    eng = small_loaded
    prompts = [[5, 6, 7], [8, 9]]
    params = [SamplingParams(max_new_tokens=2, stop_ids=(1,)) for _ in prompts]
    want = eng.generate(prompts, params).tokens
    real = type(eng).set_row_sampling      # the stream writes a row's settings through it

    def set_row_sampling(self, row, sp):
        if sp.seed == 666:
            raise RuntimeError(OVERFLOW)
        return real(self, row, sp)

    monkeypatch.setattr(type(eng), "set_row_sampling", set_row_sampling)
    with Server(eng, model_name="tiny", tokenizer=None) as srv:
        url = srv.start()
        bodies = {"bad": {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "seed": 666}}
        bodies.update({i: {"model": "tiny", "prompt": p, "max_tokens": 2, "temperature": 0}
                       for i, p in enumerate(prompts)})
        got = {}
        threads = [threading.Thread(target=lambda k=k, b=b: got.update({k: _post(url, b)}))
                   for k, b in bodies.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        status, body = got["bad"]
        assert status == 500 and body["error"]["code"] == "engine_error", body
        assert OVERFLOW in body["error"]["message"]
        for i in range(len(prompts)):
            assert got[i][0] == 200 and got[i][1]["choices"][0]["token_ids"] == want[i], got[i]
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert r.status == 200
        status, body = _post(url, {"model": "tiny", "prompt": prompts[0], "max_tokens": 2,
                                   "temperature": 0})
        assert status == 200 and body["choices"][0]["token_ids"] == want[0]
        c = srv.stream.counters()
        assert c["running"] == c["waiting"] == 0 and c["free_rows"] == eng.cache.max_rows
