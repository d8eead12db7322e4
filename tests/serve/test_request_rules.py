"""One rule, one message: a request broken the same way is refused by every entry point -- the
stream's add(), Engine.generate's checks, the CLI's and the server's prepare -- in the same words
(models/request.py), each entry point adding only its own name for the field and the prompt."""
from types import SimpleNamespace

import pytest

from dspark_compile.cli.engine_commands import SAMPLING_FLAGS, _check_requests
from dspark_compile.models.request import SamplingParams
from dspark_compile.runtime.engine import Engine
from dspark_compile.runtime.scheduler import GenerationStream
from dspark_compile.serve.prepare import BadRequest, EngineLimits, prepare
from dspark_compile.serve.protocol import CompletionRequest

V, L, N = 512, 160, 5


def _engine():
    return SimpleNamespace(cfg=SimpleNamespace(vocab_size=V, dspark_block_size=N),
                           cache=SimpleNamespace(max_rows=2, max_seq_len=L))


def refusals(prompt: list, max_new_tokens: int) -> dict:
    """Each entry point's message for one request (prompt, max_new_tokens)."""
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    out = {}
    with pytest.raises(ValueError) as e:
        GenerationStream(_engine(), False, 8).add(prompt, sp)
    out["stream"] = str(e.value)
    with pytest.raises(ValueError) as e:
        Engine._requests(_engine(), [prompt], sp)
    out["engine"] = str(e.value)
    with pytest.raises(ValueError) as e:
        _check_requests(SimpleNamespace(prompt_ids=[prompt]), [sp.validate(None)], V, L, N)
    out["cli"] = str(e.value)
    req = CompletionRequest(model="m", prompt=[prompt], max_tokens=max_new_tokens,
                            temperature=0.0, seed=0)
    with pytest.raises(BadRequest) as e:
        prepare(req, EngineLimits(vocab_size=V, max_seq_len=L, block=N, eos_token_id=None))
    out["server"] = (e.value.param, e.value.message)
    return out


def test_a_token_id_outside_the_vocabulary_is_one_message_everywhere():
    got = refusals([1, V], 4)
    rule = f"token ids [{V}] outside [0, {V}) (the model's vocab_size)"
    assert got["stream"] == f"prompt: {rule}"
    assert got["engine"] == f"prompt 0: {rule}"
    assert got["cli"] == f"--prompt-ids (prompt 0): {rule}"
    assert got["server"] == ("prompt", f"prompt 0: {rule}")


def test_a_request_past_the_rows_positions_is_one_message_everywhere():
    got = refusals([3] * 150, 8)
    rule = ("150 tokens + {} 8 need 165 positions (with the draft block of 5 and its "
            f"lookahead); the engine holds max_seq_len={L}")
    fit = ", so at most 3 new tokens fit"
    assert got["stream"] == "prompt: " + rule.format("max_new_tokens") + fit
    assert got["engine"] == "prompt 0: " + rule.format("max_new_tokens") + fit
    assert got["cli"] == ("--prompt-ids (prompt 0): " + rule.format("--max-new-tokens")
                          + " (build --max-seq-len)" + fit)
    assert got["server"] == ("max_tokens", "prompt 0: " + rule.format("max_tokens") + fit)


def test_a_prompt_that_alone_fills_the_row_names_the_prompt_everywhere():
    got = refusals([3] * 155, 1)
    rule = ("155 tokens leave no room for a new token: with one they need 163 positions (with "
            f"the draft block of 5 and its lookahead); the engine holds max_seq_len={L}")
    assert got["stream"] == f"prompt: {rule}"
    assert got["engine"] == f"prompt 0: {rule}"
    assert got["cli"] == f"--prompt-ids (prompt 0): {rule} (build --max-seq-len)"
    assert got["server"] == ("prompt", f"prompt 0: {rule}")


def test_the_cli_and_the_server_name_the_seed_rule_alike():
    from dspark_compile.cli.engine_commands import _params
    args = SimpleNamespace(temperature=0.0, top_k=0, top_p=1.0, seed=(1 << 63) - 1,
                           max_new_tokens=4, stop_ids=None, verify="block",
                           prompt_ids=[[1], [2]])
    with pytest.raises(ValueError) as e:
        _params(args)
    rule = f"+ 1 (what prompt 1 samples with) must fit in 64 bits (a signed int64), got {1 << 63}"
    assert str(e.value) == f"{SAMPLING_FLAGS['seed']} {rule}"
    req = CompletionRequest(model="m", prompt=[[1], [2]], seed=(1 << 63) - 1)
    with pytest.raises(BadRequest) as e:
        prepare(req, EngineLimits(vocab_size=V, max_seq_len=L, block=N, eos_token_id=None))
    assert (e.value.param, e.value.message) == ("seed", f"seed {rule}")
