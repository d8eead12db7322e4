"""The lossless invariant on the eager reference: greedy speculative decoding emits exactly the
tokens greedy decoding of the target alone emits.

float64 on CPU: batched verify (6 tokens per row) and one-token decode agree to rounding, and
with float64 the FP8 KV / activation rounding decisions are the same in both paths, so the
comparison is exact. Requests of different prompt and output lengths run together, so rows
finish at different steps and later steps carry padded rows. On a mismatch the failure names
the first divergence and the target's logit margin there.
"""
import random

import pytest
import torch

from dspark_compile.runtime.lossless import check_lossless
from dspark_compile.models.config import Precision
from dspark_compile.models.generate import generate
from dspark_compile.models.request import SamplingParams


@pytest.fixture(scope="module")
def model64(make_model):
    return make_model(Precision(dtype=torch.float64), max_positions=256)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_greedy_equals_target_greedy(model64, seed):
    rng = random.Random(seed)
    V = model64.cfg.vocab_size
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 40))] for _ in range(5)]
    params = [SamplingParams(max_new_tokens=rng.randint(6, 20)) for _ in prompts]
    spec = generate(model64, prompts, params, speculative=True)
    plain = generate(model64, prompts, params, speculative=False)
    if spec.tokens != plain.tokens:
        report = check_lossless(model64, prompts, params, spec.tokens)
        pytest.fail(report.line())
    assert [len(t) for t in spec.tokens] == [p.max_new_tokens for p in params]
    # the drafts were actually exercised: some accepted, and fewer steps than tokens
    assert spec.steps < max(p.max_new_tokens for p in params)
    assert sum(spec.accepted_at) > 0, "no draft was ever accepted: the test would not see accept paths"


def test_stop_ids_and_lossless_report(model64):
    """A stop id ends a request early in both modes; the report formats a divergence."""
    prompt = [[3, 1, 4, 1, 5]]
    full = generate(model64, prompt, [SamplingParams(max_new_tokens=10)], speculative=False).tokens[0]
    stop = full[4]
    params = [SamplingParams(max_new_tokens=10, stop_ids=(stop,))]
    for spec in (False, True):
        out = generate(model64, prompt, params, speculative=spec).tokens[0]
        assert out == full[:full.index(stop) + 1]
    bad = [list(full)]
    bad[0][3] = (bad[0][3] + 1) % model64.cfg.vocab_size
    report = check_lossless(model64, prompt, [SamplingParams(max_new_tokens=10)], bad)
    assert not report.ok and report.index == 3 and report.margin > 0
    assert "DIVERGED at request 0, token 3" in report.line()


def test_compare_outputs_names_the_first_divergence():
    """The engine-against-itself check: token for token, a shorter or longer output diverges
    too, and a report without logits is never 'within' a tolerance."""
    from dspark_compile.runtime.lossless import END, compare_outputs
    assert compare_outputs([[1, 2, 3], [4]], [[1, 2, 3], [4]]).line() == "lossless: ok"
    r = compare_outputs([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    assert (r.ok, r.request, r.index, r.expected, r.got) == (False, 1, 1, 5, 6)
    assert r.line() == ("lossless: DIVERGED at request 1, token 1: target-only decoding 5, "
                        "speculative 6")
    assert not r.within(1.0)
    r = compare_outputs([[1, 2, 3]], [[1, 2]])
    assert (r.index, r.expected, r.got) == (2, 3, END) and "speculative output ended" in r.line()
    with pytest.raises(ValueError, match="one of each per request"):
        compare_outputs([[1]], [[1], [2]])
