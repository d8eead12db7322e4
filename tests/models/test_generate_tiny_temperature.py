"""Tiny temperatures on the eager models (issue 50: `temperature` 1e-45, 1e-40, 1e-38 gave
token 0 every time): below GREEDY_BELOW a request decodes exactly as a greedy one, whether its
temperature came through SamplingParams.validate (stored as 0) or was written to the state as
it is (the samplers' own rule, kernels/sampling/reference.py)."""
import pytest
import torch

from dspark_compile.kernels.sampling.reference import GREEDY_BELOW
from dspark_compile.models.config import CacheConfig, Precision
from dspark_compile.models.generate import generate, set_row_sampling
from dspark_compile.models.request import SamplingParams
from dspark_compile.models.state import allocate_state
from dspark_compile.models.step import DraftVerifyStep, prefill

TINY = [1e-45, 1e-40, 1e-38, GREEDY_BELOW / 2]
PROMPTS = [[5, 6, 7], [3, 1], [2, 7, 1], [9]]


@pytest.fixture(scope="module")
def model(make_model):
    return make_model(Precision(dtype=torch.float64), max_positions=128)


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target"])
def test_tiny_temperatures_decode_as_greedy(model, speculative):
    greedy = generate(model, PROMPTS, [SamplingParams(max_new_tokens=5) for _ in PROMPTS],
                      speculative)
    tiny = generate(model, PROMPTS, [SamplingParams(temperature=T, seed=i, max_new_tokens=5)
                                     for i, T in enumerate(TINY)], speculative)
    assert tiny.tokens == greedy.tokens
    assert any(t != 0 for toks in tiny.tokens for t in toks)
    if speculative:
        assert list(tiny.by_method) == ["greedy"]


def test_a_tiny_temperature_in_the_state_steps_as_greedy(model):
    """The step's samplers read row.temperature as it is: 1e-45 written there directly (no
    validation) drafts and verifies as 0 does."""
    cache = CacheConfig(max_rows=len(PROMPTS), max_seq_len=32, max_step_tokens=8)
    outs = []
    for temps in ([0.0] * len(PROMPTS), TINY):
        state = allocate_state(model.cfg, cache, model.prec)
        for r, p in enumerate(PROMPTS):
            set_row_sampling(state, r, SamplingParams(seed=r))
            prefill(model, state, r, p, cache.max_step_tokens, True)
        state["row.temperature"][:len(PROMPTS)] = torch.tensor(temps)
        assert (state["row.temperature"][:len(PROMPTS)] > 0).all() or temps[0] == 0.0
        rows = torch.arange(len(PROMPTS))
        step = DraftVerifyStep(model)
        outs.append([step(rows, state)])
    for (t0, n0), (t1, n1) in zip(*outs):
        assert torch.equal(n0, n1) and torch.equal(t0, t1)
