"""The server's protocol, errors, queue, disconnects and metrics over a fake stream
(tests/serve/serve_helpers.py: GenerationStream's interface with outputs known in advance);
tests/runtime/test_serve.py runs the real engine."""
import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve.serve_helpers import FakeEngine, start_stream, train_tokenizer

from dspark_compile.models.request import SamplingParams
from dspark_compile.serve.protocol import Completion
from dspark_compile.serve.server import Server
from dspark_compile.serve.text import Tokenizer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake_engine")
    train_tokenizer(d / "tokenizer.json")
    eng = FakeEngine(d)
    with Server(eng, model_name="tiny", max_queue=4) as srv:
        url = srv.start()
        yield srv, url, eng.fake


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="none", max_retries=0, timeout=30)


def post(url, path, body, raw=False):
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    data = body if raw else json.dumps(body)
    c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, r.read().decode()
    c.close()
    return out


def metrics(url) -> dict:
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("GET", "/metrics")
    r = c.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.read().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sp(**kw):
    return SamplingParams(**{"stop_ids": (1,), **kw})


def test_models_lists_the_engine(client):
    (m,) = client.models.list().data
    assert m.id == "tiny" and m.owned_by == "dspark-compile" and m.max_model_len == 160


def test_completion_returns_the_streams_tokens_and_usage(served, client):
    fake = served[2]
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=12, seed=4,
                                  temperature=0.7, top_p=0.9, extra_body={"top_k": 5})
    (c,) = r.choices
    prompt, params = fake.added[-1]
    assert prompt == [5, 6, 7]
    assert (params.seed, params.max_new_tokens, params.temperature, params.top_p,
            params.top_k, params.stop_ids) == (4, 12, 0.7, 0.9, 5, (1,))
    assert c.token_ids == fake.expected([5, 6, 7], params)
    assert c.finish_reason == ("stop" if c.token_ids[-1] == 1 else "length")
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == len(c.token_ids)
    assert r.usage.total_tokens == 3 + len(c.token_ids)
    assert r.system_fingerprint == "dspark-0123456789abcdef"
    assert c.text == Tokenizer.of_engine(fake_dir(served)).decode(
        [t for t in c.token_ids if t != 1])


def fake_dir(served):
    return served[0].engine.dir


def test_stream_chunks_add_up_to_the_unstreamed_completion(client, served):
    kw = dict(model="tiny", prompt="The quick brown", max_tokens=24, seed=9, temperature=1.0)
    whole = client.completions.create(**kw).choices[0]
    # steps of 10 ms: the stream keeps up with them (a stream behind its engine sends the
    # steps waiting as one chunk: test_keeps_up.py), so each step is a chunk of its own
    served[2].step_hook = lambda: time.sleep(0.01)
    try:
        chunks = list(client.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}))
    finally:
        served[2].step_hook = None
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == len(whole.token_ids)
    assert all(ch.usage is None for ch in body)
    assert "".join(ch.choices[0].text for ch in body) == whole.text
    assert sum((ch.choices[0].token_ids for ch in body), []) == whole.token_ids
    assert [ch.choices[0].finish_reason for ch in body][-1] == whole.finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])
    assert len(body) > 2                       # it streamed: several steps' chunks


def test_raw_stream_is_sse_ending_in_done(served):
    u = urlparse(served[1])
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("POST", "/v1/completions", body=json.dumps(
        {"model": "tiny", "prompt": [3, 4], "max_tokens": 6, "stream": True, "seed": 1}),
        headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    events = r.read().decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ")
        # every chunk is the protocol's Completion (the server builds them as plain JSON)
        c = Completion.model_validate_json(e[6:])
        assert c.object == "text_completion" and len(c.choices) == 1 and c.usage is None


def test_several_prompts_get_one_choice_each_in_order(served, client):
    fake = served[2]
    prompts = [[10, 11], [12], [13, 14, 15]]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, seed=100,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, (p, c) in enumerate(zip(prompts, r.choices)):
        assert c.token_ids == fake.expected(p, sp(seed=100 + i, max_new_tokens=5))
    streamed = {}
    for ch in client.completions.create(model="tiny", prompt=prompts, max_tokens=5, seed=100,
                                        temperature=0, stream=True):
        for c in ch.choices:
            streamed.setdefault(c.index, []).extend(c.token_ids)
    assert [streamed[i] for i in range(3)] == [c.token_ids for c in r.choices]


def test_stop_string_ends_the_text_before_it_and_cancels_the_request(served, client):
    tok = Tokenizer.of_engine(fake_dir(served))
    # find a seed whose output text holds a two-character string, and stop there
    for seed in range(50):
        r = client.completions.create(model="tiny", prompt=[7], max_tokens=30, seed=seed,
                                      temperature=0, extra_body={"ignore_eos": True})
        text = r.choices[0].text
        cands = [text[i:i + 2] for i in range(3, len(text) - 2)
                 if "\ufffd" not in text[i:i + 2]]
        if cands:
            break
    stop = cands[0]
    before = len(served[2].added)
    for stream in (False, True):
        kw = dict(model="tiny", prompt=[7], max_tokens=30, seed=seed, temperature=0,
                  stop=[stop], extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            got = "".join(c.choices[0].text for c in chunks)
            ids = sum((c.choices[0].token_ids for c in chunks), [])
            finish = chunks[-1].choices[0].finish_reason
        else:
            c = client.completions.create(**kw).choices[0]
            got, ids, finish = c.text, c.token_ids, c.finish_reason
        assert got == text[:text.index(stop)] and finish == "stop"
        assert ids == r.choices[0].token_ids[:len(ids)]
        assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
    assert len(served[2].added) == before + 2


def test_stop_token_ids_and_eos(served, client):
    fake = served[2]
    full = client.completions.create(model="tiny", prompt=[8, 8], max_tokens=20, seed=2,
                                     extra_body={"ignore_eos": True}).choices[0].token_ids
    stop = full[4]
    c = client.completions.create(model="tiny", prompt=[8, 8], max_tokens=20, seed=2,
                                  extra_body={"stop_token_ids": [stop],
                                              "ignore_eos": True}).choices[0]
    assert fake.added[-1][1].stop_ids == (stop,)
    assert c.token_ids == full[:full.index(stop) + 1] and c.finish_reason == "stop"
    client.completions.create(model="tiny", prompt=[8], max_tokens=2)
    assert fake.added[-1][1].stop_ids == (1,)      # the model's eos by default


BAD = [  # (body changes, the field the 400 must name)
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"temperature": -1}, "temperature"),
    ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"), ({"seed": 1 << 64}, "seed"),
    ({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": [600]}, "prompt"), ({"prompt": [-1]}, "prompt"), ({"prompt": None}, "prompt"),
    ({"prompt": list(range(2, 200))}, "prompt"), ({"stop_token_ids": [512]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"), ({"n": 2}, "n"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"), ({"max_tokens": 0, "echo": False}, "max_tokens"),
    # this fake engine has no logprobs: refused by name, never a 500
    ({"logprobs": 3}, "logprobs"), ({"best_of": 3}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"verify": "maybe"}, "verify"),
    ({"topk": 3}, "topk"), ({"stream": "yes"}, "stream"), ({"max_tokens": "many"}, "max_tokens"),
    ({"model": None}, "model"),
]


@pytest.mark.parametrize("change,field", BAD, ids=[f for _, f in BAD])
def test_bad_request_is_400_naming_the_field(served, change, field):
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 4, **change}
    status, text = post(served[1], "/v1/completions", body)
    assert status == 400, text
    err = json.loads(text)["error"]
    assert err["param"] == field and err["message"].startswith(field), err
    assert err["type"] == "invalid_request_error" and "Traceback" not in text


@pytest.mark.parametrize("raw", ["{not json", "", "[1, 2]", '"prompt"'])
def test_malformed_body_is_400(served, raw):
    status, text = post(served[1], "/v1/completions", raw, raw=True)
    assert status == 400, text
    assert json.loads(text)["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404_naming_it(served):
    status, text = post(served[1], "/v1/completions", {"model": "gpt-9", "prompt": [5]})
    err = json.loads(text)["error"]
    assert status == 404 and err["param"] == "model" and "'tiny'" in err["message"]


def test_text_needs_the_tokenizer(tmp_path):
    with Server(FakeEngine(tmp_path), model_name="m") as srv:     # no tokenizer.json
        url = srv.start()
        for body, field in (({"prompt": "hello"}, "prompt"), ({"prompt": [5], "stop": "x"},
                                                              "stop")):
            status, text = post(url, "/v1/completions", {"model": "m", **body})
            assert status == 400 and json.loads(text)["error"]["param"] == field, text
        status, text = post(url, "/v1/completions", {"model": "m", "prompt": [5],
                                                     "max_tokens": 3})
        c = json.loads(text)["choices"][0]
        assert status == 200 and c["text"] == "" and len(c["token_ids"]) >= 1


def test_full_queue_is_429_with_a_message_and_nothing_leaks(tmp_path):
    eng = FakeEngine(tmp_path, max_rows=1)
    gate = threading.Event()
    eng.fake.step_hook = lambda: gate.wait(10)
    with Server(eng, model_name="m", max_queue=1) as srv:
        url = srv.start()
        results = []

        def call():
            results.append(post(url, "/v1/completions", {"model": "m", "prompt": [5],
                                                         "max_tokens": 3}))

        threads = [threading.Thread(target=call) for _ in range(2)]   # one row + one queued
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while srv.loop.in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, text = post(url, "/v1/completions", {"model": "m", "prompt": [5]})
        assert status == 429, text
        assert "capacity" in json.loads(text)["error"]["message"]
        gate.set()
        for t in threads:
            t.join(20)
        assert [s for s, _ in results] == [200, 200]
        assert srv.loop.in_flight == 0
        m = metrics(url)
        assert m[("dspark_requests_total", (("outcome", "queue_full"),))] == 1
        assert m[("dspark_queue_capacity", ())] == 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_client_disconnect_cancels_its_request(tmp_path, stream):
    eng = FakeEngine(tmp_path, max_rows=2)
    eng.fake.step_hook = lambda: time.sleep(0.02)
    cancelled = []
    real_cancel = eng.fake.cancel
    eng.fake.cancel = lambda rid: cancelled.append(rid) or real_cancel(rid)
    with Server(eng, model_name="m") as srv:
        url = srv.start()
        body = {"model": "m", "prompt": [5], "max_tokens": 150, "stream": stream,
                "extra_body": None}
        body.pop("extra_body")
        if stream:
            sock, _ = start_stream(url, body)
        else:
            u = urlparse(url)
            sock = socket.create_connection((u.hostname, u.port), timeout=30)
            data = json.dumps(body).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            deadline = time.monotonic() + 10
            while not eng.fake.counters()["running"] and time.monotonic() < deadline:
                time.sleep(0.01)
        sock.close()
        deadline = time.monotonic() + 10
        while (srv.loop.in_flight or eng.fake.has_work) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cancelled == [0] and srv.loop.in_flight == 0 and not eng.fake.has_work
        m = metrics(url)
        assert m[("dspark_requests_total", (("outcome", "cancelled"),))] == 1
        assert eng.fake.counters()["committed_tokens"] < 150


def test_metrics_expose_every_family(served, client):
    client.completions.create(model="tiny", prompt=[9, 9], max_tokens=8, temperature=0)
    m = metrics(served[1])
    fake = served[2].counters()
    names = {n for n, _ in m}
    for name in ("dspark_requests_running", "dspark_requests_waiting",
                 "dspark_requests_in_flight", "dspark_greedy_variant_share",
                 "dspark_generation_tokens_per_second",
                 "dspark_spec_decode_mean_acceptance_length",
                 "dspark_time_to_first_token_seconds_count",
                 "dspark_inter_token_latency_seconds_count",
                 "dspark_request_latency_seconds_count", "dspark_prompt_tokens_total",
                 "dspark_engine_busy_seconds_total"):
        assert name in names, name
    assert m[("dspark_spec_decode_num_drafts_total", ())] == fake["row_steps"]
    assert m[("dspark_spec_decode_num_draft_tokens_total", ())] == fake["draft_tokens"]
    assert m[("dspark_spec_decode_num_accepted_tokens_total", ())] == fake["accepted_tokens"]
    for k, n in enumerate(fake["accepted_at"]):
        pos = (("position", str(k + 1)),)
        assert m[("dspark_spec_decode_num_accepted_tokens_per_pos_total", pos)] == n
        assert m[("dspark_spec_decode_acceptance_per_position", pos)] == pytest.approx(
            n / fake["row_steps"])
    assert m[("dspark_spec_decode_mean_acceptance_length", ())] == pytest.approx(
        1 + fake["accepted_tokens"] / fake["row_steps"])
    assert sum(v for (n, _), v in m.items() if n == "dspark_steps_total") == fake["steps"]
    assert m[("dspark_greedy_variant_steps_total", ())] == fake["greedy_steps"]
    assert m[("dspark_generation_tokens_total", ())] == fake["committed_tokens"]
    assert m[("dspark_generation_tokens_per_second", ())] > 0
    assert 0 < m[("dspark_engine_busy_seconds_total", ())] <= served[0].loop.busy_s
    # one inter-token observation per token after each request's first delivery
    assert m[("dspark_inter_token_latency_seconds_count", ())] > 0
    assert m[("dspark_time_to_first_token_seconds_count", ())] >= 1


def test_health(served):
    u = urlparse(served[1])
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("GET", "/health")
    r = c.getresponse()
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"


def test_a_failing_engine_is_503_not_a_hang(tmp_path):
    eng = FakeEngine(tmp_path)

    def boom():
        raise RuntimeError("device lost")

    eng.fake.step_hook = boom
    with Server(eng, model_name="m") as srv:
        url = srv.start()
        status, text = post(url, "/v1/completions", {"model": "m", "prompt": [5]})
        assert status == 503 and "device lost" in json.loads(text)["error"]["message"]
        u = urlparse(url)
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 503 and "device lost" in r.read().decode()
        status, text = post(url, "/v1/completions", {"model": "m", "prompt": [5]})
        assert status == 503


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    import importlib.util

    from dspark_compile import serve
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(ValueError) as e:
        serve.require_extra()
    assert str(e.value) == ("serve needs uvicorn (the 'serve' extra): "
                            "pip install 'dspark-compile[serve]'")


def test_max_tokens_null_takes_what_the_positions_allow_and_no_seed_draws_one(served, client):
    fake = served[2]
    post(served[1], "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7],
                                        "max_tokens": None, "temperature": 0})
    limits = served[0].limits
    assert fake.added[-1][1].max_new_tokens == limits.max_new_tokens(3) == 160 - 3 - 7
    seeds = set()
    for _ in range(3):
        client.completions.create(model="tiny", prompt=[5], max_tokens=1)
        seeds.add(fake.added[-1][1].seed)
    assert len(seeds) == 3
    r = client.completions.create(model="tiny", prompt=["The quick", "brown fox"], max_tokens=2,
                                  seed=5)
    assert [c.index for c in r.choices] == [0, 1] and [p.seed for _, p in fake.added[-2:]] == \
        [5, 6]


def test_many_clients_with_a_small_queue_each_get_their_own_tokens_or_a_429(tmp_path):
    """The server's bookkeeping under contention, without an engine's cost: 300 requests
    from 24 threads against 3 rows and a queue of 5; every answer is its own request's
    tokens or a 429, nothing stays in flight, the outcomes add up."""
    eng = FakeEngine(tmp_path, max_rows=3)
    eng.fake.step_hook = lambda: time.sleep(0.001)
    with Server(eng, model_name="m", max_queue=5) as srv:
        url = srv.start()
        got, lock = {}, threading.Lock()

        def worker(k):
            for i in range(k, 300, 24):
                body = {"model": "m", "prompt": [2 + i % 50, 3], "max_tokens": 1 + i % 7,
                        "seed": i, "temperature": 0.5, "ignore_eos": True,
                        "stream": bool(i % 2)}
                status, text = post(url, "/v1/completions", body)
                if status == 200 and body["stream"]:
                    ids = [t for e in text.split("\n\n") if e.startswith("data: {")
                           for c in json.loads(e[6:])["choices"] for t in c["token_ids"]]
                elif status == 200:
                    ids = json.loads(text)["choices"][0]["token_ids"]
                else:
                    ids = json.loads(text)["error"]["code"]
                with lock:
                    got[i] = (status, ids)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(got) == list(range(300))
        ok = 0
        for i, (status, ids) in got.items():
            if status == 429:
                assert ids == "queue_full"
                continue
            assert status == 200
            want = eng.fake.expected([2 + i % 50, 3], sp(seed=i, max_new_tokens=1 + i % 7,
                                                        stop_ids=()))
            assert ids == want, i
            ok += 1
        assert srv.loop.in_flight == 0 and not eng.fake.has_work
        m = metrics(url)
        outcomes = {o: m[("dspark_requests_total", (("outcome", o),))]
                    for o in ("stop", "length", "queue_full", "cancelled")}
        assert outcomes["length"] == ok and outcomes["queue_full"] == 300 - ok
        assert outcomes["stop"] == outcomes["cancelled"] == 0
        assert ok >= 8, ok                    # rows and queue were used
        print(f"{ok} served, {300 - ok} refused with 429")
