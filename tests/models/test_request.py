"""models/request.py: each rule of a request refuses with its field named and one message, at
its exact boundary, and never with a traceback of its own (a huge int in a message)."""
import numpy as np
import pytest

from dspark_compile.models.config import request_positions
from dspark_compile.models.request import (INT64_MAX, RequestError, SamplingParams, check_room,
                                           prompt_ids, prompt_seeds, validate_batch,
                                           validate_request)

V, L, N = 512, 160, 5
HOLDS = f"the engine holds max_seq_len={L}"


@pytest.mark.parametrize("prompt, says", [
    ("abc", "p must be a list of token ids, got str"),
    (b"ab", "p must be a list of token ids, got bytes"),
    (7, "p must be a list of token ids, got int"),
    ({1: 2}, "p must be a list of token ids, got dict"),
    ({1, 2}, "p must be a list of token ids, got set"),
    (iter([1, 2]), "p must be a list of token ids, got list_iterator"),
    ([1, 2.0], "p must be a list of integer token ids"),
    ([1, True, None], "p must be a list of integer token ids"),
    ([], "p is empty"),
    ([1, V, -1], f"p: token ids [{V}, -1] outside [0, {V}) (the model's vocab_size)"),
    ([10 ** 5000], f"p: token ids [an int of 16610 bits] outside [0, {V})"),
    ([-10 ** 5000], "p: token ids [a negative int of 16610 bits] outside"),
])
def test_a_bad_prompt_is_refused_naming_it(prompt, says):
    with pytest.raises(RequestError) as e:
        prompt_ids(prompt, V, "p")
    assert e.value.field == "prompt" and str(e.value).startswith(says), str(e.value)


def test_a_prompt_comes_back_as_plain_ints():
    got = prompt_ids(np.array([0, 3, V - 1], dtype=np.int16), V)
    assert got == [0, 3, V - 1] and all(type(t) is int for t in got)
    assert prompt_ids([10 ** 30], None) == [10 ** 30]      # no vocabulary known: >= 0 only


def test_the_room_rule_is_exact_at_its_boundary():
    """A request whose positions equal max_seq_len fits; one more new token does not, and the
    message says how many fit."""
    n = 20
    most = L - request_positions(n, 0, N)
    check_room(n, most, N, L, HOLDS)
    with pytest.raises(RequestError) as e:
        check_room(n, most + 1, N, L, HOLDS, "prompt 3", {"max_new_tokens": "max_tokens"})
    assert e.value.field == "max_new_tokens"
    assert str(e.value) == (f"prompt 3: {n} tokens + max_tokens {most + 1} need {L + 1} "
                            f"positions (with the draft block of {N} and its lookahead); "
                            f"{HOLDS}, so at most {most} new tokens fit")


def test_a_prompt_that_alone_fills_the_row_names_the_prompt():
    n = L - request_positions(0, 0, N)          # room for no new token
    with pytest.raises(RequestError) as e:
        check_room(n, 1, N, L, HOLDS)
    assert e.value.field == "prompt" and "leave no room for a new token" in str(e.value)
    check_room(n - 1, 1, N, L, HOLDS)
    with pytest.raises(RequestError, match="with the step's lookahead"):
        check_room(L, 1, 0, L, HOLDS)           # no speculation: block 0


def test_the_last_prompts_seed_must_fit_in_64_bits():
    assert prompt_seeds(INT64_MAX - 2, 3) == [INT64_MAX - 2, INT64_MAX - 1, INT64_MAX]
    with pytest.raises(RequestError) as e:
        prompt_seeds(INT64_MAX - 1, 3, {"seed": "--seed"})
    assert e.value.field == "seed" and str(e.value).startswith(
        "--seed + 2 (what prompt 2 samples with) must fit in 64 bits")


def test_a_request_is_checked_as_a_copy():
    """The caller's objects may change while the request runs: the request keeps its copies."""
    prompt, sp = [1, 2], SamplingParams(max_new_tokens=4)
    got_prompt, got_sp = validate_request(prompt, sp, V, L, N, HOLDS)
    prompt.append(3)
    sp.max_new_tokens = 10 ** 6
    assert got_prompt == [1, 2] and got_sp.max_new_tokens == 4


@pytest.mark.parametrize("prompts, params, says", [
    ([], [], "no prompts given"),
    ("12", [SamplingParams()], "prompts must be a list of prompts"),
    ([[1]], SamplingParams(), "params must be a list of SamplingParams"),
    ([[1]], [SamplingParams()] * 2, "2 sampling params for 1 prompts"),
    ([[1], [2]], [SamplingParams(), {"max_new_tokens": 3}], "params must be a SamplingParams, "
                                                            "got dict"),
    ([[1], []], [SamplingParams()] * 2, "prompt 1 is empty"),
    ([[1], [1] * 200], [SamplingParams()] * 2, "prompt 1: 200 tokens leave no room"),
    ([[1]], [SamplingParams(top_p=0.0)], "top_p must be in (0, 1]"),
])
def test_a_batch_is_refused_before_anything_runs(prompts, params, says):
    with pytest.raises(ValueError) as e:
        validate_batch(prompts, params, V, L, N, HOLDS)
    assert str(e.value).startswith(says), str(e.value)


def test_without_a_row_size_the_room_is_not_checked():
    """generate() without a cache sizes one to the requests."""
    prompts, params = validate_batch([[1] * 500], [SamplingParams(max_new_tokens=9)], V, None,
                                     N, "")
    assert len(prompts[0]) == 500 and params[0].max_new_tokens == 9
