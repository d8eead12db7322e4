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
    ({"logprobs": True}, "logprobs"),
    ({"top_k": "5"}, "top_k"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ({"temprature": 0.5}, "temprature"),
])
def test_bad_chat_requests_are_400s_naming_the_field(url, patch, param):
    status, _, body = call(url, "POST", "/v1/chat/completions",
                           {"model": "tiny", "messages": TURNS, **patch})
    err = json.loads(body)["error"]
    assert status == 400 and err["param"] == param, body
