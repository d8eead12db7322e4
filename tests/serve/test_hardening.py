"""Hostile and failing requests against a real server (uvicorn on a socket, in this process)
over the stand-in stream (serve_helpers.FakeStream): one request's failure in the engine stays
its own, the event loop stays free while a prompt is tokenized, bodies are bounded in bytes and
time, parse errors are 400s naming the problem and counted, every response carries a request
id and every request is one access-log line. Issue 50, items 1, 3 and 5-8 (the drain, item 4,
is tests/serve/test_drain.py)."""
import asyncio
import http.client
import json
import logging
import re
import socket
import threading
import time
from urllib.parse import urlparse

import pytest

from serve.serve_helpers import FakeEngine, train_tokenizer

from dspark_compile.serve.server import Server, default_max_request_bytes
from dspark_compile.serve.text import Tokenizer

TIMEOUT = 2.0          # the shared server's header, body and send timeouts (s)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening")
    train_tokenizer(d / "tokenizer.json")
    eng = FakeEngine(d)
    eng.fake.fail_prompts[(66, 66)] = RuntimeError("value cannot be converted to type float "
                                                   "without overflow")
    with Server(eng, model_name="m", max_queue=4, header_timeout=TIMEOUT, body_timeout=TIMEOUT,
                send_timeout=TIMEOUT) as srv:
        yield srv, srv.start(), eng.fake


def conn(url, timeout=30):
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def request(url, method, path, body=None, headers=None):
    c = conn(url)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    c.request(method, path, body=data,
              headers={"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    out = r.status, r.read().decode(errors="replace"), dict(r.getheaders())
    c.close()
    return out


def post(url, body, **kw):
    return request(url, "POST", "/v1/completions", body, **kw)


def metric(url, name, labels=()):
    from prometheus_client.parser import text_string_to_metric_families
    _, text, _ = request(url, "GET", "/metrics")
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and tuple(sorted(s.labels.items())) == tuple(labels):
                return s.value
    raise KeyError(name)


def invalid(url):
    return metric(url, "dspark_requests_total", (("outcome", "invalid"),))


def stream_events(text: str) -> list:
    return [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]


def raw_socket(url):
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def read_response(s) -> str:
    """One response (its Content-Length), without waiting for the connection to close."""
    got = b""
    while b"\r\n\r\n" not in got or len(got.partition(b"\r\n\r\n")[2]) < int(
            re.search(rb"(?i)content-length: (\d+)", got).group(1)):
        more = s.recv(65536)
        if not more:
            break
        got += more
    return got.decode()


def read_all(s) -> bytes:
    got = b""
    while True:
        try:
            more = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not more:
            break
        got += more
    return got


# ---- 1. a failure inside the engine is one request's -----------------------------------------

def test_a_request_the_engine_fails_on_fails_alone_and_the_others_keep_their_tokens(
        served, caplog):
    """The failing prompt (66, 66) raises at its admission, inside the engine: its client gets
    500 with OpenAI's error body (JSON) or an error event and [DONE] (stream); requests beside
    it get exactly their own tokens; the engine stays up; the traceback is logged with the
    request id; the gauges return to 0."""
    srv, url, fake = served
    errors_before = metric(url, "dspark_requests_total", (("outcome", "error"),))
    ok_bodies = [{"model": "m", "prompt": [7, i], "max_tokens": 12, "seed": i,
                  "ignore_eos": True, "stream": bool(i % 2)} for i in range(4)]
    bad = {"model": "m", "prompt": [66, 66], "max_tokens": 5}
    results = {}
    caplog.set_level(logging.ERROR, "dspark_compile.serve")

    def call(key, body, headers=None):
        results[key] = post(url, body, headers=headers)

    threads = [threading.Thread(target=call, args=(i, b)) for i, b in enumerate(ok_bodies)]
    threads += [threading.Thread(target=call, args=("bad", bad, {"X-Request-Id": "bad-1"})),
                threading.Thread(target=call, args=("bad-stream", {**bad, "stream": True},
                                                    {"X-Request-Id": "bad-2"}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    status, text, _ = results["bad"]
    err = json.loads(text)["error"]
    assert status == 500 and err["type"] == "server_error" and err["code"] == "engine_error"
    assert "RuntimeError: value cannot be converted" in err["message"], err
    status, text, _ = results["bad-stream"]
    events = stream_events(text)
    assert status == 200 and events[-1] == "[DONE]", text
    assert json.loads(events[-2])["error"]["code"] == "engine_error"
    for i, body in enumerate(ok_bodies):
        status, text, _ = results[i]
        assert status == 200, text
        if body["stream"]:
            ids = [t for e in stream_events(text)[:-1] for c in json.loads(e)["choices"]
                   for t in c["token_ids"]]
        else:
            ids = json.loads(text)["choices"][0]["token_ids"]
        prompt, params = next((p, sp) for p, sp in fake.added if p == [7, i])
        assert ids == fake.expected(prompt, params)
    assert request(url, "GET", "/health")[0] == 200
    assert metric(url, "dspark_requests_total", (("outcome", "error"),)) == errors_before + 2
    logged = [r for r in caplog.records if "failed in the engine" in r.getMessage()]
    assert {r.getMessage().split()[1] for r in logged} == {"bad-1", "bad-2"}
    assert all(r.exc_info and "value cannot be converted" in str(r.exc_info[1])
               for r in logged)
    assert srv.loop.in_flight == 0 and metric(url, "dspark_requests_in_flight") == 0
    assert metric(url, "dspark_requests_running") == metric(url, "dspark_requests_waiting") == 0


def test_a_failing_detokenization_fails_that_request_alone(tmp_path, caplog):
    """The tokenizer raising on one request's output ends that request (500, its engine request
    cancelled, the traceback logged); another request's text is unaffected."""
    real = Tokenizer.load(train_tokenizer(tmp_path / "tokenizer.json"))

    class Broken(Tokenizer):
        def decode(self, ids):
            if 99 in ids:
                raise ValueError("broken vocabulary entry")
            return real.decode(ids)

    caplog.set_level(logging.ERROR, "dspark_compile.serve")
    eng = FakeEngine(tmp_path)
    with Server(eng, model_name="m", tokenizer=Broken(real.tok)) as srv:
        url = srv.start()
        status, text, _ = post(url, {"model": "m", "prompt": [99, 5], "max_tokens": 8})
        err = json.loads(text)["error"]
        assert status == 500 and "broken vocabulary entry" in err["message"], text
        status, text, _ = post(url, {"model": "m", "prompt": [5, 6], "max_tokens": 8,
                                     "ignore_eos": True})
        c = json.loads(text)["choices"][0]
        assert status == 200 and c["text"] == real.decode(c["token_ids"])
        assert any("detokenizing" in r.getMessage() and r.exc_info for r in caplog.records)
        deadline = time.monotonic() + 10
        while (srv.loop.in_flight or eng.fake.has_work) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.loop.in_flight == 0 and not eng.fake.has_work


def test_a_dead_engine_thread_is_logged_reported_by_health_and_the_gauges(tmp_path, caplog):
    """An exception out of step() itself ends the engine: its traceback is in the log, /health
    is 503 naming it, every waiting request 503, the running / waiting / in-flight gauges 0
    and dspark_engine_up 0."""
    eng = FakeEngine(tmp_path)
    gate = threading.Event()

    def boom():
        gate.wait(10)
        raise RuntimeError("device lost")

    eng.fake.step_hook = boom
    caplog.set_level(logging.ERROR, "dspark_compile.serve")
    with Server(eng, model_name="m") as srv:
        url = srv.start()
        assert metric(url, "dspark_engine_up") == 1
        got = []
        t = threading.Thread(target=lambda: got.append(post(url, {"model": "m",
                                                                  "prompt": [5]})))
        t.start()
        deadline = time.monotonic() + 10
        while srv.loop.in_flight < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        t.join(30)
        status, text, _ = got[0]
        assert status == 503 and "device lost" in json.loads(text)["error"]["message"]
        status, text, _ = request(url, "GET", "/health")
        assert status == 503 and "RuntimeError: device lost" in text
        (rec,) = [r for r in caplog.records if "engine thread failed" in r.getMessage()]
        assert rec.exc_info and str(rec.exc_info[1]) == "device lost"
        for name in ("dspark_engine_up", "dspark_requests_running", "dspark_requests_waiting",
                     "dspark_requests_in_flight"):
            assert metric(url, name) == 0, name


def test_a_bug_is_a_logged_traceback_with_the_request_id_and_a_one_line_500(tmp_path, caplog):
    """An exception nothing expects (a tokenizer raising TypeError here) reaches the
    middleware: the client gets OpenAI's body naming the request id, the traceback is logged
    under that id, the completion is counted as an error."""
    real = Tokenizer.load(train_tokenizer(tmp_path / "tokenizer.json"))

    class Bug(Tokenizer):
        def encode(self, text):
            raise TypeError("TextInputSequence must be str")

    caplog.set_level(logging.ERROR, "dspark_compile.serve")
    with Server(FakeEngine(tmp_path), model_name="m", tokenizer=Bug(real.tok)) as srv:
        url = srv.start()
        status, text, headers = post(url, {"model": "m", "prompt": "hi"},
                                     headers={"X-Request-Id": "bug-1"})
        err = json.loads(text)["error"]
        assert status == 500 and err["message"] == "internal error (request bug-1): TypeError"
        assert headers["x-request-id"] == "bug-1" and "Traceback" not in text
        (rec,) = [r for r in caplog.records if "internal error" in r.getMessage()]
        assert "bug-1" in rec.getMessage() and "TextInputSequence" in str(rec.exc_info[1])
        assert metric(url, "dspark_requests_total", (("outcome", "error"),)) == 1


def test_log_lines_never_stall_the_server_on_an_unread_stdout():
    """The CLI's log writer: with stdout stuck (a pipe nobody reads), logging goes on at once
    (lines past the queue's 10,000 are dropped and counted) and stopping it returns."""
    from dspark_compile.serve.server import LOG_QUEUE, _log_to_stdout, _QueueHandler

    gate = threading.Event()

    class Stuck:
        def write(self, text):
            gate.wait(60)

        def flush(self):
            pass

    stop = _log_to_stdout(True, out=Stuck(), wait=0.2)
    try:
        (handler,) = [h for h in logging.getLogger("dspark_compile.serve").handlers
                      if isinstance(h, _QueueHandler)]
        access = logging.getLogger("dspark_compile.serve.access")
        t = threading.Thread(target=lambda: [access.info("line %d", i)
                                             for i in range(LOG_QUEUE + 100)])
        t.start()
        t.join(30)
        assert not t.is_alive(), "logging blocked on the stuck stdout"
        assert handler.dropped >= 99
    finally:
        stop()
        gate.set()
    assert not [h for h in logging.getLogger("dspark_compile.serve").handlers
                if isinstance(h, _QueueHandler)]


# ---- 3. large bodies: off the event loop, bounded ----------------------------------------

def test_tokenizing_a_prompt_leaves_the_event_loop_free(tmp_path):
    """While a prompt is being tokenized (a tokenizer held at a gate here), /health and
    /v1/models answer at once: tokenization runs on the prepare threads, not the event loop."""
    real = Tokenizer.load(train_tokenizer(tmp_path / "tokenizer.json"))
    entered, gate = threading.Event(), threading.Event()

    class Slow(Tokenizer):
        def encode(self, text):
            entered.set()
            gate.wait(30)
            return real.encode(text)

    with Server(FakeEngine(tmp_path), model_name="m", tokenizer=Slow(real.tok)) as srv:
        url = srv.start()
        got = []
        t = threading.Thread(target=lambda: got.append(post(
            url, {"model": "m", "prompt": "The quick brown fox", "max_tokens": 2})))
        t.start()
        try:
            assert entered.wait(10)
            c = conn(url, timeout=5)          # a blocked loop would time this out
            c.request("GET", "/health")
            r = c.getresponse()
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
            assert request(url, "GET", "/v1/models")[0] == 200
            assert not got                    # the completion is still being tokenized
        finally:
            gate.set()
            t.join(30)
        assert got[0][0] == 200, got


def test_a_body_over_the_limit_is_413_before_it_is_read(served):
    """Content-Length over --max-request-bytes: 413 from the headers alone (the body is never
    sent here); a chunked body is counted as it arrives. The default limit is the engine's
    rows x positions x 32 bytes + 256 KiB."""
    srv, url, _ = served
    limit = srv.http.max_request_bytes
    assert limit == default_max_request_bytes(160, 3) == 3 * 160 * 32 + 256 * 1024
    before = invalid(url)
    s = raw_socket(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (limit + 1))
    got = read_response(s)
    s.close()
    head, _, body = got.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), got
    assert json.loads(body)["error"]["message"].endswith(
        f"exceeds this server's limit of {limit} bytes (--max-request-bytes)")
    s = raw_socket(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    try:
        for _ in range(limit // len(chunk) + 2):
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass                                  # the server answered and closed first
    got = read_all(s).decode(errors="replace")     # then the connection closes (linger)
    s.close()
    assert got.startswith("HTTP/1.1 413"), got[:300]
    assert invalid(url) == before + 2


def test_a_huge_string_prompt_is_refused_without_tokenizing_it(served):
    """Issue 50's 10.5 MB prompt: a 413 naming the limit, at once."""
    _, url, _ = served
    t = time.monotonic()
    status, text, _ = post(url, {"model": "m", "prompt": "a" * 10_500_000})
    assert status == 413 and "--max-request-bytes" in text
    assert time.monotonic() - t < 10


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(served):
    """The trained tokenizer's longest token is 12 characters and has no normalizer: 2000
    characters are at least 167 tokens, past the engine's 160 positions, whatever they say;
    a normalizer voids the bound (it may drop text)."""
    from tokenizers import normalizers
    srv, url, _ = served
    assert srv.tokenizer.max_token_chars == 12
    status, text, _ = post(url, {"model": "m", "prompt": ["hi", "a" * 2000]})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "prompt"
    assert err["message"] == ("prompt: prompt 1: 2000 characters are at least 167 tokens (this "
                              "tokenizer's longest token has 12 characters), more than the "
                              "engine's 160 positions")
    tok = Tokenizer.load(srv.engine.dir / "tokenizer.json")
    tok.tok.normalizer = normalizers.Lowercase()
    assert Tokenizer(tok.tok).max_token_chars is None


# ---- 5. slow clients ------------------------------------------------------------------------

def test_slow_headers_and_bodies_get_408_and_the_connection_closes(served):
    """A connection that sent half its headers, one that sent nothing, and one that sent half
    its body: each is answered 408 and closed within the timeout (plus slack), not held."""
    _, url, _ = served
    half_headers, silent, half_body = raw_socket(url), raw_socket(url), raw_socket(url)
    half_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 100\r\n\r\n" + b'{"model": "m",')
    t = time.monotonic()
    outs = [read_all(s).decode() for s in (half_headers, silent, half_body)]
    waited = time.monotonic() - t
    for s in (half_headers, silent, half_body):
        s.close()
    assert waited < TIMEOUT + 5, waited
    for got in outs:
        head, _, body = got.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 408") and "connection: close" in head.lower(), got
    assert "--header-timeout" in outs[0] and "--header-timeout" in outs[1]
    assert "--body-timeout" in outs[2] and "14 bytes came" in outs[2]


def test_headers_past_the_bound_get_431_and_a_malformed_request_openais_400(served):
    """uvicorn's parser keeps every header it is sent: past 64 KiB of request line and
    headers the server answers 431 and closes; 1000 small headers are fine; a request the
    parser refuses gets OpenAI's error body, not plain text."""
    _, url, _ = served
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(1000))
    s = raw_socket(url)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"Connection: close\r\n\r\n")
    assert read_all(s).startswith(b"HTTP/1.1 200")
    s.close()
    s = raw_socket(url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + many * 100)
    except (BrokenPipeError, ConnectionResetError):
        pass
    got = read_all(s).decode()
    s.close()
    assert got.startswith("HTTP/1.1 431"), got[:200]
    assert "exceed 65536 bytes" in json.loads(got.partition("\r\n\r\n")[2])["error"]["message"]
    s = raw_socket(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    head, _, body = read_all(s).decode().partition("\r\n\r\n")
    s.close()
    assert head.startswith("HTTP/1.1 400")
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_a_stream_whose_client_reads_nothing_is_cut_at_the_send_timeout():
    """The send of a stream blocks (a client that reads nothing): after the send timeout the
    stream ends as a disconnect, cancelling its requests, and the body's generator is closed."""
    from dspark_compile.serve.http import EventStream

    cancelled, closed = [], []

    async def body():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def main():
        blocked = asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body":
                await blocked.wait()          # never set: the client reads nothing

        async def receive():
            await asyncio.Event().wait()

        stream = EventStream(body(), on_disconnect=lambda: cancelled.append(True),
                             send_timeout=0.2)
        t = time.monotonic()
        await asyncio.wait_for(stream({"type": "http"}, receive, send), 10)
        return time.monotonic() - t

    took = asyncio.run(main())
    assert cancelled == [True] and closed == [True] and took < 5


# ---- 6. bodies that fail to parse ------------------------------------------------------------

PARSE = [  # (raw body, the status, the param, a piece of the message)
    ('{"model": "m", "prompt": "ab\\ud800cd"}', 400, "prompt",
     "the prompt is not valid Unicode: a lone surrogate U+D800 at character 2"),
    ('{"model": "m", "prompt": ["ok", "x\\udfffy"]}', 400, "prompt", "prompt 1 is not valid"),
    ('{"model": "m", "prompt": [1], "stop": ["\\ud800"]}', 400, "stop", "stop string 0"),
    ("[" * 100_000 + "]" * 100_000, 400, "body", "nested too deeply"),
    (b'{"model": "m", "prompt": "\xff\xfe"}', 400, "body", "not valid UTF-8 (byte 0xff at "
                                                            "offset 26)"),
    ('{"model": "m", "prompt": [1], "seed": ' + "9" * 5000 + "}", 400, "body", "digits"),
    ('{"model": "m", "prompt": [1], "temperature": 0, "temperature": 2}', 400, "body",
     "the key 'temperature' is given twice"),
    ('{"model": "m", "prompt": [1], "max_tokens": 1e400}', 400, "max_tokens", ""),
    ('{"model": "m", "prompt": [1], "temperature": NaN}', 400, "temperature", ""),
    ('{"model": "m", "prompt": [1], "stream_options": {"include_usage": true}}', 400,
     "stream_options", "only with stream: true"),
    ("{not json", 400, "body", "invalid JSON"),
    ("", 400, "body", "invalid JSON"),
]


@pytest.mark.parametrize("raw,status,param,piece", PARSE,
                         ids=["surrogate", "surrogate-list", "surrogate-stop", "deep", "utf8",
                              "digits", "duplicate", "inf", "nan", "stream-options", "garbage",
                              "empty"])
def test_a_body_that_fails_to_parse_is_400_naming_the_problem_and_counted(
        served, raw, status, param, piece, caplog):
    _, url, _ = served
    before = invalid(url)
    got, text, _ = post(url, raw)
    err = json.loads(text)["error"]
    assert got == status and err["param"] == param and piece in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert invalid(url) == before + 1
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_a_body_that_is_not_json_is_415(served):
    _, url, _ = served
    before = invalid(url)
    status, text, _ = post(url, "model=m&prompt=hi",
                           headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415 and "application/json" in json.loads(text)["error"]["message"]
    assert invalid(url) == before + 1
    # no Content-Type at all is read as JSON (curl --data-binary without -H)
    c = conn(url)
    c.putrequest("POST", "/v1/completions")
    data = json.dumps({"model": "m", "prompt": [5], "max_tokens": 1}).encode()
    c.putheader("Content-Length", str(len(data)))
    c.endheaders(data)
    assert c.getresponse().status == 200


# ---- 7. a request that could never fit --------------------------------------------------------

def test_more_prompts_than_the_server_holds_is_400_with_the_limit(served):
    """3 rows + a queue of 4 hold 7 requests: 300 prompts can never be admitted (400, not
    429); 7 can."""
    _, url, _ = served
    status, text, _ = post(url, {"model": "m", "prompt": [[5]] * 300, "max_tokens": 1})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "prompt", text
    assert err["message"] == ("prompt: 300 prompts in one request: this server holds at most 7 "
                              "requests at once (3 state rows + --max-queue 4), so at most 7 "
                              "prompts can be admitted together")
    status, text, _ = post(url, {"model": "m", "prompt": [[5]] * 7, "max_tokens": 1})
    assert status == 200 and len(json.loads(text)["choices"]) == 7


# ---- 8. request ids and the access log ----------------------------------------------------------

def test_every_request_is_one_access_line_with_its_id_returned(served, caplog):
    _, url, _ = served
    caplog.set_level(logging.INFO, "dspark_compile.serve.access")
    status, text, headers = post(url, {"model": "m", "prompt": [5, 6], "max_tokens": 3,
                                       "ignore_eos": True}, headers={"X-Request-Id": "abc-123"})
    assert status == 200 and headers["x-request-id"] == "abc-123"
    usage = json.loads(text)["usage"]
    status, text, headers = post(url, {"model": "m", "prompt": [5], "max_tokens": 2,
                                       "stream": True}, headers={"X-Request-Id": "bad id\t"})
    generated = headers["x-request-id"]
    assert status == 200 and len(generated) == 32 and generated != "bad id\t"
    long_id = "x" * 129
    status, _, headers = request(url, "GET", "/health", headers={"X-Request-Id": long_id})
    assert headers["x-request-id"] != long_id
    status, _, headers = post(url, {"model": "nope", "prompt": [1]},
                              headers={"X-Request-Id": "e-1"})
    assert status == 404 and headers["x-request-id"] == "e-1"
    lines = [r.getMessage() for r in caplog.records if r.name == "dspark_compile.serve.access"]
    by_id = {dict(kv.split("=", 1) for kv in line.split())["request_id"]: line
             for line in lines}
    first = dict(kv.split("=", 1) for kv in by_id["abc-123"].split())
    assert first["method"] == "POST" and first["path"] == '"/v1/completions"'
    assert first["status"] == "200" and first["finish"] == "length"
    assert int(first["prompt_tokens"]) == usage["prompt_tokens"] == 2
    assert int(first["completion_tokens"]) == usage["completion_tokens"] == 3
    assert float(first["duration_ms"]) > 0
    assert "status=200" in by_id[generated] and "status=404" in by_id["e-1"]
    assert len(lines) == 4
