"""`dspark-compile serve` over the real engine (the session's `small_engine`: float64 CPU,
buckets 1 and 2, 5 state rows): streamed and unstreamed tokens equal Engine.generate's for the
same seeds, greedy and sampled; the CI soak: SOAK = 100 requests from 16 concurrent clients with
random lengths, sampling settings, stop strings and disconnects.

The references are computed with Engine.generate before the server opens its stream (one
GenerationStream per engine at a time), and the server closes its stream at the end, so the
engine goes back to the other tests as it came. The tokenizer is one trained here
(tests/serve/serve_helpers.py), handed to the server directly: the engine directory is shared.
"""
import random
import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve.serve_helpers import start_stream, train_tokenizer

from dspark_compile.models.request import SamplingParams
from dspark_compile.serve.server import Server
from dspark_compile.serve.text import Tokenizer

EOS = 1                    # the tiny preset's eos_token_id: the server stops at it by default
MAX_TOKENS = 4             # the soak's longest request (CPU time: each prefill and each step
                           # of this engine takes ~0.35 s on a free core, ~0.7 s on a busy one)
# sampling settings the soak draws from (API field names); each with its own seed
SETTINGS = [
    {"temperature": 0.0},
    {"temperature": 0.0},
    {"temperature": 0.9, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 8},
    {"temperature": 0.7, "top_p": 0.95, "verify": "token"},
]
TEXTS = ["The quick brown fox", "Compilers rewrite graphs", "servers stream text",
         "na\u00efve caf\u00e9", "A speculative decoder drafts a block", "kernels move bytes"]


SOAK = 100          # requests of the soak (16 clients): every path below is hit many times

def to_params(setting: dict, seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=setting["temperature"], top_p=setting.get("top_p", 1.0),
                          top_k=setting.get("top_k", 0), seed=seed, max_new_tokens=max_tokens,
                          stop_ids=(EOS,), verify=setting.get("verify", "block"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.load(train_tokenizer(tmp_path_factory.mktemp("serve_tok") /
                                          "tokenizer.json"))


@pytest.fixture(scope="module")
def scenarios(small_loaded, tok):
    """(prompt ids, setting, seed) -> the engine's tokens for MAX_TOKENS, from
    Engine.generate in one batch (a request's tokens do not depend on its batch)."""
    cases = []
    for i, text in enumerate(TEXTS):
        for j, setting in enumerate(SETTINGS):
            if (i + j) % 3:                   # 10 of the 30 pairs: enough variety, less CPU
                continue
            cases.append((tok.encode(text), setting, 1000 * i + j))
    res = small_loaded.generate([c[0] for c in cases],
                                [to_params(s, seed, MAX_TOKENS) for _, s, seed in cases])
    return [(p, s, seed, toks) for (p, s, seed), toks in zip(cases, res.tokens)]


@pytest.fixture(scope="module")
def served(small_loaded, scenarios, tok):
    with Server(small_loaded, model_name="tiny", max_queue=64, tokenizer=tok) as srv:
        yield srv, srv.start()


def client_for(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def request_kwargs(prompt, setting, seed, max_tokens, **kw):
    extra = {k: setting[k] for k in ("top_k", "verify") if k in setting}
    return dict(model="tiny", prompt=prompt, max_tokens=max_tokens,
                temperature=setting["temperature"], top_p=setting.get("top_p", 1.0), seed=seed,
                extra_body=extra or None, **kw)


def test_streamed_and_unstreamed_tokens_equal_generate(served, scenarios, tok):
    c = client_for(served[1])
    greedy = next(s for s in scenarios if s[1]["temperature"] == 0)
    sampled = next(s for s in scenarios if s[1]["temperature"] > 0)
    for prompt, setting, seed, want in (greedy, sampled):
        r = c.completions.create(**request_kwargs(prompt, setting, seed, MAX_TOKENS))
        (choice,) = r.choices
        assert choice.token_ids == want
        assert choice.finish_reason == ("stop" if want[-1] == EOS else "length")
        assert choice.text == tok.decode([t for t in want if t != EOS])
        assert r.usage.completion_tokens == len(want) and r.usage.prompt_tokens == len(prompt)
        chunks = list(c.completions.create(**request_kwargs(prompt, setting, seed, MAX_TOKENS),
                                           stream=True))
        assert sum((ch.choices[0].token_ids for ch in chunks), []) == want
        assert "".join(ch.choices[0].text for ch in chunks) == choice.text
    # text in, by the engine's tokenizer: the same request as its ids
    prompt, setting, seed, want = greedy
    r = c.completions.create(**request_kwargs(tok.tok.decode(prompt), setting, seed,
                                              MAX_TOKENS))
    assert r.choices[0].token_ids == want


def expected(tok, want: list[int], max_tokens: int, stops: tuple):
    """(ids, text, finish reason) a request must end with, from the engine's tokens alone: cut
    at max_tokens (eos stays in the ids, not in the text), then at the first stop string (the
    text before it; the ids up to the token that completed it)."""
    ids = want[:max_tokens]
    body = [t for t in ids if t != EOS]
    text = tok.decode(body)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return ids, text, "stop" if ids[-1] == EOS else "length"
    for j in range(1, len(body) + 1):
        if any(s in tok.decode(body[:j]) for s in stops):
            return body[:j], text[:min(hits)], "stop"
    raise AssertionError("unreachable: the stop string is in the whole text")


def scrape(url) -> dict:
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def outcome(m, o):
    return m[("dspark_requests_total", (("outcome", o),))]


def test_soak_100_requests_16_clients(served, scenarios, tok):
    """Every request completes or is cancelled; each gets exactly its own tokens (none
    duplicated, none mixed: every output equals its request's Engine.generate tokens, greedy
    ones lossless); no state row leaks; the metrics add up."""
    srv, url = served
    rng = random.Random(33)
    plan = []
    for i in range(SOAK):
        prompt, setting, seed, want = rng.choice(scenarios)
        # short ones more often: every request's prefill is one engine call (~0.35 s each on a
        # free core here), the soak's main cost, and each later step another
        max_tokens = rng.choices(range(1, MAX_TOKENS + 1), [3, 3, 2, 2])[0]
        full = tok.decode([t for t in want[:max_tokens] if t != EOS])
        stops = ()
        # a stop string the output contains (no U+FFFD: that is where the bytes of a character
        # are missing, which a later token may complete)
        cands = [full[a:a + n] for a in range(len(full)) for n in (1, 2)
                 if len(full[a:a + n]) == n and "\ufffd" not in full[a:a + n]]
        if rng.random() < 0.3 and cands:
            stops = (rng.choice(cands),)
        elif rng.random() < 0.2:
            stops = ("zz",)                           # one that (almost surely) never appears
        # disconnects: once the request is queued (it is cancelled before or after its
        # prefill) or after its first tokens arrived
        mode = rng.choices(["json", "stream", "leave", "disconnect"],
                           [0.375, 0.375, 0.15, 0.1])[0]
        plan.append(dict(i=i, prompt=prompt, setting=setting, seed=seed, want=want,
                         max_tokens=max_tokens, stops=stops, mode=mode))
    before = scrape(url)
    results: dict[int, dict] = {}
    errors: list[str] = []
    lock = threading.Lock()
    # bounded: a client stops at the deadline (about 2 min on CI's 2 cores, which share
    # the engine thread, the server and these 16 clients)
    deadline = time.monotonic() + 480

    def worker(k: int):
        c = client_for(url)
        for p in plan[k::16]:
            if time.monotonic() > deadline:
                errors.append(f"request {p['i']}: soak deadline passed")
                return
            kw = request_kwargs(p["prompt"], p["setting"], p["seed"], p["max_tokens"],
                                stop=list(p["stops"]) or None)
            try:
                if p["mode"] == "json":
                    r = c.completions.create(**kw)
                    got = dict(ids=r.choices[0].token_ids, text=r.choices[0].text,
                               finish=r.choices[0].finish_reason, id=r.id,
                               usage=r.usage.completion_tokens)
                elif p["mode"] == "stream":
                    chunks = list(c.completions.create(**kw, stream=True))
                    got = dict(ids=sum((ch.choices[0].token_ids for ch in chunks), []),
                               text="".join(ch.choices[0].text for ch in chunks),
                               finish=chunks[-1].choices[0].finish_reason,
                               id={ch.id for ch in chunks})
                else:
                    body = {k2: v for k2, v in kw.items() if k2 != "extra_body"}
                    body.update(kw["extra_body"] or {}, stream=True)
                    sock, ids = start_stream(url, body)
                    sock.close()
                    got = dict(ids=ids, disconnected=True)
            except Exception as e:  # noqa: BLE001 -- reported with the request it hit
                got = dict(error=f"{type(e).__name__}: {e}")
            with lock:
                results[p["i"]] = got

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(16)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic() + 5))
    assert not errors and all(not t.is_alive() for t in threads), errors[:3]
    assert sorted(results) == list(range(SOAK))
    ids_seen = set()
    for p in plan:
        got = results[p["i"]]
        assert "error" not in got, (p["i"], got["error"])
        want_ids, want_text, finish = expected(tok, p["want"], p["max_tokens"], p["stops"])
        if got.get("disconnected"):
            assert got["ids"] == want_ids[:len(got["ids"])], p["i"]
            continue
        assert got["ids"] == want_ids, (p["i"], p["setting"], p["stops"])
        assert got["text"] == want_text, (p["i"], p["stops"])
        assert got["finish"] == finish, (p["i"], got, p["stops"])
        rid = got["id"] if isinstance(got["id"], str) else got["id"].pop()
        assert rid not in ids_seen
        ids_seen.add(rid)
    # nothing left behind: no request in flight, every state row free again
    stream = srv.stream
    t_end = time.monotonic() + 30
    while (srv.loop.in_flight or stream.has_work) and time.monotonic() < t_end:
        time.sleep(0.05)
    counters = stream.counters()
    assert srv.loop.in_flight == 0 and counters["running"] == counters["waiting"] == 0
    assert counters["free_rows"] == small_rows(srv)        # every row back
    assert sorted(stream.free) == list(range(small_rows(srv)))
    after = scrape(url)
    done = {o: outcome(after, o) - outcome(before, o)
            for o in ("stop", "length", "cancelled", "queue_full", "invalid", "error")}
    disconnects = sum(p["mode"] in ("leave", "disconnect") for p in plan)
    assert done["queue_full"] == done["invalid"] == done["error"] == 0, done
    assert done["stop"] + done["length"] + done["cancelled"] == SOAK, done
    assert 0 < done["cancelled"] <= disconnects, done
    assert after[("dspark_requests_in_flight", ())] == 0
    assert after[("dspark_spec_decode_num_drafts_total", ())] > \
        before[("dspark_spec_decode_num_drafts_total", ())]
    busy = after[("dspark_engine_busy_seconds_total", ())] - \
        before[("dspark_engine_busy_seconds_total", ())]
    print(f"soak: {SOAK} requests in {time.monotonic() - t0:.1f} s (the engine busy {busy:.1f} s "
          f"of it), outcomes {done}")


def small_rows(srv) -> int:
    return srv.engine.cache.max_rows


def test_cli_serves_until_sigterm(small_engine):
    """`dspark-compile serve ENGINE --port 0` in its own process: the banner names the URL,
    the API answers, SIGTERM ends it with 143 (the CLI's convention) after a clean shutdown."""
    import json
    import re
    import signal
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    exe = Path(sys.executable).with_name("dspark-compile")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "dspark_compile.cli.main"]
    proc = subprocess.Popen(cmd + ["serve", str(small_engine.path), "--port", "0",
                                   "--model-name", "tiny-cli", "--max-queue", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:            # the engine loads first (~20 s here)
            lines.append(line)
            if m := re.search(r"serving tiny-cli on (http://127\.0\.0\.1:\d+) \(5 rows, "
                              r"queue 3, ", line):
                break
        assert m, "".join(lines)
        url = m.group(1)
        models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=60).read())
        assert [d["id"] for d in models["data"]] == ["tiny-cli"]
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"model": "tiny-cli", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        ).encode(), headers={"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert 1 <= len(out["choices"][0]["token_ids"]) <= 2
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 143, "".join(lines) + rest
        assert "dspark-compile serve: terminated" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_chat_request_is_the_completion_of_its_rendered_prompt(served):
    """/v1/chat/completions over the real engine: the conversation rendered (DeepSeek-V4's
    format, the engine's tokenizer_config.json) and tokenized as /tokenize shows, then the
    same tokens as /v1/completions gives for those ids."""
    import json
    import urllib.request
    url = served[1]
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "servers stream text"}]
    req = urllib.request.Request(url + "/tokenize", data=json.dumps({"messages": msgs}).encode(),
                                 headers={"Content-Type": "application/json"})
    ids = json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"]
    c = client_for(url)
    chat = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS,
                                     temperature=0, seed=5)
    want = c.completions.create(model="tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                seed=5)
    assert chat.choices[0].message.content == want.choices[0].text
    assert chat.choices[0].finish_reason == want.choices[0].finish_reason
    assert chat.usage.prompt_tokens == len(ids) == want.usage.prompt_tokens
