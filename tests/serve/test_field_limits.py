"""The completions API's sampling fields against what the decode state holds, over HTTP (a
Server on a real socket around the fake stream of tests/serve/serve_helpers.py, which records
what reaches the engine):

- a value the state cannot hold (issue 50: temperature 1e39 or top_k 2^63 stopped the engine
  with "value cannot be converted to type float without overflow") is a 400 naming the field,
  and nothing reaches the engine;
- a temperature below 1e-5 (1e-45 gave eight token-0 ids) reaches the engine as 0, greedy;
- the extremes the state does hold are served.

The rules are SamplingParams.validate's (tests/test_sampling_limits.py)."""
import http.client
import json
from urllib.parse import urlparse

import pytest

from serve.serve_helpers import FakeEngine

from dspark_compile.serve.server import Server

I64 = 1 << 63
FLOAT32_MAX = 3.4028234663852886e38


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    eng = FakeEngine(tmp_path_factory.mktemp("fake_engine"))
    with Server(eng, model_name="tiny", max_queue=4) as srv:
        yield srv.start(), eng.fake


def post(url, body: str):
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, r.read().decode()
    c.close()
    return out


def request(url, **fields):
    return post(url, json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 3, **fields}))


REFUSED = [  # (fields, the field the 400 names, what its message says)
    ({"temperature": 1e39}, "temperature", "must be <= 3.4028234663852886e+38"),
    ({"temperature": FLOAT32_MAX * 1.0000001}, "temperature", "must be <= 3.40282346638528"),
    ({"temperature": -1e-45}, "temperature", "must be a finite number >= 0"),
    ({"top_k": I64}, "top_k", f"must be <= {I64 - 1} (the decode state holds it as int64"),
    ({"top_k": 10 ** 40}, "top_k", f"must be <= {I64 - 1}"),
    ({"top_k": -2}, "top_k", ""),
    ({"top_p": 1e-400}, "top_p", "must be in (0, 1], got 0.0"),      # JSON's 1e-400 is 0.0
    ({"top_p": 1.0000001}, "top_p", "must be in (0, 1]"),
    ({"seed": I64}, "seed", "must fit in 64 bits"),
    ({"seed": -I64 - 1}, "seed", "must fit in 64 bits"),
    ({"seed": I64 - 1, "prompt": [[5], [6]]}, "seed", f"seed + 1 (what prompt 1 samples with) "
                                                      f"must fit in 64 bits (a signed int64), "
                                                      f"got {I64}"),
    ({"max_tokens": I64}, "max_tokens", f"must be <= {I64 - 1} (positions are int64)"),
    ({"max_tokens": 0}, "max_tokens", "must be >= 1, got 0"),
    ({"max_tokens": -5}, "max_tokens", "must be >= 1, got -5"),
    ({"stop_token_ids": [I64]}, "stop_token_ids", f"must be token ids in [0, 512), got {I64}"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "must be token ids in [0, 512), got -1"),
]


@pytest.mark.parametrize("fields, param, says", REFUSED,
                         ids=[json.dumps(f)[:40] for f, _, _ in REFUSED])
def test_a_value_the_state_cannot_hold_is_a_400_naming_the_field(served, fields, param, says):
    url, fake = served
    before = len(fake.added)
    status, text = request(url, **fields)
    assert status == 400, text
    err = json.loads(text)["error"]
    assert err["param"] == param and err["message"].startswith(param), err
    assert says in err["message"], err
    assert len(fake.added) == before            # nothing reached the engine


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_temperatures_never_reach_the_engine(served, raw):
    """JSON has no NaN or infinity; Python's parser reads these spellings (and 1e400 as inf):
    whichever layer refuses them, the answer is a 400 and the engine sees nothing."""
    url, fake = served
    before = len(fake.added)
    status, text = post(url, '{"model": "tiny", "prompt": [5], "temperature": %s}' % raw)
    assert status == 400, text
    err = json.loads(text)["error"]
    assert err["param"] in ("temperature", "body"), err
    assert len(fake.added) == before


@pytest.mark.parametrize("T", [1e-45, 1e-40, 1e-38, 5e-6])
def test_a_tiny_temperature_reaches_the_engine_as_greedy(served, T):
    url, fake = served
    status, text = request(url, temperature=T, seed=7)
    assert status == 200, text
    params = fake.added[-1][1]
    assert params.temperature == 0.0 and params.method == "greedy" and params.seed == 7
    assert json.loads(text)["choices"][0]["token_ids"]


def test_the_extremes_the_state_holds_are_served(served):
    url, fake = served
    cases = [({"temperature": FLOAT32_MAX}, "temperature", FLOAT32_MAX),
             ({"temperature": 1e-5}, "temperature", 1e-5),
             ({"top_k": I64 - 1, "temperature": 1.0}, "top_k", I64 - 1),
             ({"top_k": -1, "temperature": 1.0}, "top_k", 0),
             ({"seed": -I64}, "seed", -I64), ({"seed": I64 - 1}, "seed", I64 - 1),
             ({"top_p": 1e-30, "temperature": 1.0}, "top_p", 1e-30)]
    for fields, name, want in cases:
        status, text = request(url, **fields)
        assert status == 200, (fields, text)
        assert getattr(fake.added[-1][1], name) == want, fields
