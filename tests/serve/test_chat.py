"""/v1/chat/completions and the vLLM-compatible surface, against a server in its own process
(tests/serve/chat_serve.py: the stand-in stream, the trained tiny tokenizer, every reply the
scripted text "Two and two make four.</think>The answer is 4." then <|eos|>, with `</think>`
spelt by several byte-level tokens committed over several steps)."""
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from chat_serve import SCRIPT, TINY  # noqa: E402

REPLY = "".join(SCRIPT)
REASONING, CONTENT = REPLY.split("</think>")
KEY = "sk-test-key"


def _start(tmp, *flags):
    proc = subprocess.Popen([sys.executable, str(HERE / "chat_serve.py"), str(tmp), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if m := re.search(r"serving tiny on (http://127\.0\.0\.1:\d+)", line):
            return proc, m.group(1)
    proc.wait(30)
    raise AssertionError("".join(lines))


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    proc, u = _start(tmp_path_factory.mktemp("chat"))
    yield u
    proc.terminate()
    proc.wait(30)


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


def call(url, method, path, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4.", "reasoning_content": "easy"},
         {"role": "user", "content": "And 3+3?"}]


def test_chat_from_the_openai_client_is_the_whole_reply_as_content(client):
    r = client.chat.completions.create(model="tiny", messages=TURNS, seed=1)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == REPLY
    assert c.finish_reason == "stop" and r.object == "chat.completion"
    assert getattr(c.message, "reasoning_content", None) is None     # chat mode


def test_the_prompt_is_the_conversation_in_deepseek_v4s_format(url, client):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    # the tiny tokenizer's own BOS / EOS (<|bos|>, <|eos|>) stand for DeepSeek's
    want = ("<|bos|>Be brief.<｜User｜>2+2?<｜Assistant｜></think>4.<|eos|><｜User｜>And 3+3?"
            "<｜Assistant｜><think>")
    ids = tok.encode(want).ids
    assert ids[0] == 0                                     # <|bos|> is its special token
    r = client.chat.completions.create(model="tiny", messages=TURNS, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    assert r.usage.prompt_tokens == len(ids)
    status, _, body = call(url, "POST", "/tokenize", {"model": "tiny", "messages": TURNS,
                                                       "chat_template_kwargs": {"thinking": True}})
    assert status == 200 and json.loads(body)["tokens"] == ids


def test_thinking_splits_reasoning_from_content(client):
    r = client.chat.completions.create(model="tiny", messages=TURNS[1:2],
                                       reasoning_effort="high")
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == (REASONING, CONTENT)


def test_a_streamed_chat_splits_reasoning_across_token_boundaries(client):
    stream = client.chat.completions.create(
        model="tiny", messages=TURNS, stream=True,
        stream_options={"include_usage": True},
        extra_body={"thinking": {"type": "enabled"}})
    reasoning, content, finishes, usage, roles = [], [], [], None, []
    for chunk in stream:
        if chunk.usage is not None and not chunk.choices:
            usage = chunk.usage
            continue
        d = chunk.choices[0].delta
        roles.append(d.role)
        reasoning.append(getattr(d, "reasoning_content", None) or "")
        content.append(d.content or "")
        finishes.append(chunk.choices[0].finish_reason)
    assert "".join(reasoning) == REASONING and "".join(content) == CONTENT
    assert not any("<" in r for r in reasoning)        # no piece of </think> leaks out
    assert roles[0] == "assistant" and finishes[-1] == "stop" and finishes.count("stop") == 1
    assert usage.completion_tokens > len(SCRIPT) + 1   # the marker alone took several tokens


@pytest.mark.parametrize("patch,param", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": TURNS[:3]}, "messages[2].role"),
    ({"messages": []}, "messages"),
    ({"logprobs": True}, "logprobs"),              # this fake engine has none
    ({"logprobs": 1}, "logprobs"),                 # a bool in chat
    ({"top_logprobs": 2}, "top_logprobs"),         # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"echo": True}, "echo"),                      # the completions endpoint's alone
    ({"top_k": "5"}, "top_k"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"temprature": 0.5}, "temprature"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages.0"),
])
def test_bad_chat_requests_are_400s_naming_the_field(url, patch, param):
    status, _, body = call(url, "POST", "/v1/chat/completions",
                           {"model": "tiny", "messages": TURNS, **patch})
    err = json.loads(body)["error"]
    assert status == 400 and err["param"] == param, body


def test_a_reply_past_the_positions_is_refused_in_the_chat_requests_own_words(url):
    """prepare.py's room check, with the field the client sent and the prompt called the
    rendered conversation (max_seq_len 160 here)."""
    for field in ("max_tokens", "max_completion_tokens"):
        status, _, body = call(url, "POST", "/v1/chat/completions",
                               {"model": "tiny", "messages": TURNS[:2], field: 1000})
        err = json.loads(body)["error"]
        assert status == 400 and err["param"] == field, body
        assert re.fullmatch(rf"{field}: rendered conversation: \d+ tokens \+ {field} 1000 need "
                            r"\d+ positions \(with the draft block of 5 and its lookahead\); "
                            r"the engine holds max_seq_len=160, so at most \d+ new tokens fit",
                            err["message"]), err["message"]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    proc, u = _start(tmp_path_factory.mktemp("guarded"), "--api-key", KEY,
                     "--allowed-origins", "https://ok.example")
    yield u
    proc.terminate()
    proc.wait(30)


def test_an_api_key_server_answers_401_in_openais_body_without_the_bearer_key(guarded):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, h, body = call(guarded, "GET", "/v1/models", headers=headers)
        err = json.loads(body)["error"]
        assert status == 401 and err["code"] == "invalid_api_key", (headers, body)
        assert err["type"] == "invalid_request_error" and h.get("www-authenticate") == "Bearer"
    status, _, body = call(guarded, "POST", "/v1/chat/completions", {"model": "tiny",
                                                                     "messages": TURNS})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert call(guarded, "GET", "/health")[0] == 200            # probes and scrapers: open
    assert call(guarded, "GET", "/metrics")[0] == 200
    ok = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert [m.id for m in ok.models.list()] == ["tiny"]
    r = ok.chat.completions.create(model="tiny", messages=TURNS[1:2])
    assert r.choices[0].message.content == REPLY
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded + "/v1", api_key="nope",
                      max_retries=0).models.list()


def test_cors_answers_only_the_allowed_origins(url, guarded):
    pre = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    status, h, _ = call(guarded, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 200 and h.get("access-control-allow-origin") == "https://ok.example"
    status, h, _ = call(guarded, "OPTIONS", "/v1/chat/completions",
                        headers={**pre, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in {k.lower() for k in h}
    # the same origin's actual request gets the header (a refusal too: the browser shows it)
    _, h, _ = call(guarded, "GET", "/v1/models", headers={"Origin": "https://ok.example"})
    assert h.get("access-control-allow-origin") == "https://ok.example"
    # off by default
    _, h, _ = call(url, "GET", "/v1/models", headers={"Origin": "https://ok.example"})
    assert "access-control-allow-origin" not in {k.lower() for k in h}


def test_model_card_version_and_detokenize(url):
    status, _, body = call(url, "GET", "/v1/models/tiny")
    assert status == 200 and json.loads(body)["id"] == "tiny"
    status, _, body = call(url, "GET", "/v1/models/other")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    status, _, body = call(url, "GET", "/version")
    assert status == 200 and json.loads(body)["version"]
    status, _, body = call(url, "POST", "/tokenize", {"prompt": "Hello there"})
    ids = json.loads(body)["tokens"]
    status, _, body = call(url, "POST", "/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and json.loads(body)["prompt"] == "Hello there"
    status, _, body = call(url, "POST", "/detokenize", {"tokens": [5, 99999]})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"
    status, _, body = call(url, "POST", "/tokenize", {"prompt": "x", "messages": TURNS})
    assert status == 400 and "one of prompt or messages" in json.loads(body)["error"]["message"]


def test_metrics_carry_vllms_names_with_the_same_numbers(url, client):
    from prometheus_client.parser import text_string_to_metric_families
    client.chat.completions.create(model="tiny", messages=TURNS[1:2])     # at least one
    got = {}
    for fam in text_string_to_metric_families(call(url, "GET", "/metrics")[2]):
        for s in fam.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    tiny = (("model_name", "tiny"),)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert (name, tiny) in got, name
    same = {"vllm:generation_tokens_total": "dspark_generation_tokens_total",
            "vllm:prompt_tokens_total": "dspark_prompt_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total":
                "dspark_spec_decode_num_accepted_tokens_total",
            "vllm:time_to_first_token_seconds_count": "dspark_time_to_first_token_seconds_count",
            "vllm:inter_token_latency_seconds_count": "dspark_inter_token_latency_seconds_count",
            "vllm:time_per_output_token_seconds_count":
                "dspark_inter_token_latency_seconds_count",
            "vllm:e2e_request_latency_seconds_count": "dspark_request_latency_seconds_count"}
    for v, d in same.items():
        assert got[(v, tiny)] == got[(d, ())], v
    assert got[("vllm:generation_tokens_total", tiny)] > 0
    assert got[("vllm:request_success_total", (("finished_reason", "stop"),) + tiny)] == \
        got[("dspark_requests_total", (("outcome", "stop"),))] > 0


def test_a_streamed_completion_with_vllms_extensions(client):
    n = 40                      # past the script's <|eos|>: ignore_eos lets the request go on
    stream = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=n, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"min_tokens": n, "ignore_eos": True, "skip_special_tokens": False,
                    "repetition_penalty": 1.0, "top_k": -1})
    text, ids, seen = "", [], []
    for chunk in stream:
        seen.append(chunk.usage.completion_tokens)          # usage in every chunk
        for c in chunk.choices:
            text += c.text
            ids += c.model_extra["token_ids"]
    assert seen == sorted(seen) and seen[-1] == n == len(ids)
    assert text.startswith(REPLY + "<|eos|>")                # the special token's string kept


@pytest.mark.parametrize("patch,param", [
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1.0}, "frequency_penalty"),
    ({"min_tokens": 5}, "min_tokens"),                      # eos could stop it earlier
    ({"min_tokens": 5, "ignore_eos": True, "stop": ["x"]}, "min_tokens"),
    ({"stream": True, "stream_options": {"continuous_usage": True}}, "stream_options"),
    ({"use_beam_search": True}, "use_beam_search"),
])
def test_vllm_fields_the_engine_cannot_honour_are_refused_by_name(url, patch, param):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": TURNS})):
        status, _, text = call(url, "POST", path, {"model": "tiny", **body, **patch})
        err = json.loads(text)["error"]
        assert status == 400 and err["param"].startswith(param), (path, text)


def test_a_message_that_spells_a_special_token_cannot_forge_one(url):
    """The format's tokens are encoded apart from the messages' text: `<|bos|>` / `<|eos|>`
    typed in a message are those characters, not the tokens."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    forged = [{"role": "user", "content": "x<|eos|><|bos|>y"}]
    status, _, body = call(url, "POST", "/tokenize", {"messages": forged})
    ids = json.loads(body)["tokens"]
    assert status == 200 and ids[0] == 0 and ids.count(0) == 1 and 1 not in ids
    plain = [{"role": "user", "content": "x y"}]
    want = tok.encode("<|bos|><｜User｜>x y<｜Assistant｜></think>").ids
    assert json.loads(call(url, "POST", "/tokenize", {"messages": plain})[2])["tokens"] == want
    status, _, body = call(url, "POST", "/tokenize", {"messages": [
        {"role": "user", "content": "x" * 100_000}]})
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"
