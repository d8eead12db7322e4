"""SamplingParams.validate, the one rule set of every entry point (the eager loops, the engine,
its stream, the CLI, the server): every value it accepts can be written to the decode state
(models/state.py's dtypes), every value it refuses is named by the caller's name for the
field, and a temperature below GREEDY_BELOW enters the state as 0 -- and a state row is
greedy for the engine's choice of program exactly when its request is greedy."""
from types import SimpleNamespace

import pytest
import torch

from dspark_compile.kernels.sampling.reference import GREEDY_BELOW, greedy_rows
from dspark_compile.models.config import CacheConfig, ModelConfig, Precision
from dspark_compile.models.generate import set_row_sampling
from dspark_compile.models.request import (FLOAT32_MAX, INT64_MAX, INT64_MIN, RequestError,
                                           SamplingParams)
from dspark_compile.factory.presets import preset
from dspark_compile.models.state import state_specs

VOCAB = 512
BIG = 1 << 63
# (field, bad value, what the message says after the field's name)
REFUSED = [
    ("temperature", 1e39, "must be <= 3.4028234663852886e+38 (the largest float32"),
    ("temperature", FLOAT32_MAX * (1 + 2 ** -52), "must be <= 3.4028234663852886e+38"),
    ("temperature", float("inf"), "must be a finite number >= 0 (0 = greedy), got inf"),
    ("temperature", float("nan"), "must be a finite number >= 0 (0 = greedy), got nan"),
    ("temperature", -1e-45, "must be a finite number >= 0"),
    ("temperature", "0.5", "must be a number, got '0.5'"),
    ("temperature", True, "must be a number, got True"),
    ("temperature", 10 ** 400, "must be a finite number >= 0 (0 = greedy), got inf"),
    ("top_k", BIG, f"must be <= {INT64_MAX} (the decode state holds it as int64"),
    ("top_k", 10 ** 40, f"must be <= {INT64_MAX}"),
    ("top_k", -1, "must be >= 0 (0 = off), got -1"),
    ("top_k", -10 ** 5000, "must be >= 0 (0 = off), got a negative int of 16610 bits"),
    ("top_k", 2.0, "must be an int, got 2.0"),
    ("top_p", 0.0, "must be in (0, 1], got 0.0"),
    ("top_p", float("nan"), "must be in (0, 1], got nan"),
    ("top_p", 1 + 1e-15, "must be in (0, 1]"),
    ("seed", BIG, "must fit in 64 bits (a signed int64"),
    ("seed", INT64_MIN - 1, "must fit in 64 bits"),
    ("seed", -10 ** 5000, "must fit in 64 bits (a signed int64, as the decode state holds it), "
                          "got a negative int of 16610 bits"),
    ("max_new_tokens", 0, "must be >= 1, got 0"),
    ("max_new_tokens", -10 ** 5000, "must be >= 1, got a negative int of 16610 bits"),
    ("max_new_tokens", BIG, f"must be <= {INT64_MAX} (positions are int64)"),
    ("max_new_tokens", True, "must be an int, got True"),
    ("stop_ids", (VOCAB,), f"must be token ids in [0, {VOCAB}), got {VOCAB}"),
    ("stop_ids", (BIG,), f"must be token ids in [0, {VOCAB})"),
    ("stop_ids", (-1,), f"must be token ids in [0, {VOCAB}), got -1"),
    ("stop_ids", "12", "must be a list of token ids, got '12'"),
    ("stop_ids", (1.5,), "must be a list of integer token ids"),
    ("verify", "fast", "must be one of ['block', 'token'], got 'fast'"),
    ("verify", ["block"], "must be one of ['block', 'token'], got ['block']"),
]


@pytest.mark.parametrize("field, value, rule", REFUSED,
                         ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(REFUSED)])
def test_validate_names_the_field_as_the_caller_calls_it(field, value, rule):
    sp = SamplingParams(**{field: value})
    with pytest.raises(RequestError) as e:
        sp.validate(VOCAB)
    assert e.value.field == field and str(e.value).startswith(f"{field} {rule}"), str(e.value)
    with pytest.raises(RequestError) as e:
        sp.validate(VOCAB, {field: "--the-flag"})
    assert str(e.value).startswith(f"--the-flag {rule}") and e.value.rule.startswith(rule)


def row_state():
    """The decode state's per-row tensors, with its dtypes (models/state.py)."""
    specs = state_specs(ModelConfig.from_dict(preset("tiny")),
                        CacheConfig(max_rows=1, max_seq_len=32, max_step_tokens=8),
                        Precision(dtype=torch.float32))
    return {k: torch.zeros(s.shape, dtype=s.dtype) for k, s in specs.items()
            if k.startswith("row.")}


@pytest.mark.parametrize("kw", [
    dict(temperature=FLOAT32_MAX), dict(temperature=1e30), dict(temperature=GREEDY_BELOW),
    dict(top_k=INT64_MAX), dict(seed=INT64_MIN), dict(seed=INT64_MAX), dict(top_p=1e-50),
    dict(max_new_tokens=INT64_MAX), dict(stop_ids=(VOCAB - 1, 0)),
], ids=lambda kw: ",".join(f"{k}={v:.3g}" if isinstance(v, float) else k for k, v in kw.items()))
def test_every_accepted_value_fits_the_decode_state(kw):
    sp = SamplingParams(**{"temperature": 1.0, **kw}).validate(VOCAB)
    state = row_state()
    set_row_sampling(state, 0, sp)          # torch refuses a value its dtype cannot hold
    assert state["row.top_k"][0] == sp.top_k and state["row.seed"][0] == sp.seed
    assert torch.isfinite(state["row.temperature"][0])
    assert float(state["row.temperature"][0]) == pytest.approx(sp.temperature, rel=2 ** -24)


@pytest.mark.parametrize("T", [1e-45, 1e-40, 1e-38, GREEDY_BELOW / 2,
                               GREEDY_BELOW * (1 - 2 ** -52)])
def test_temperatures_below_the_threshold_enter_the_state_as_greedy(T):
    sp = SamplingParams(temperature=T, seed=3)
    assert sp.method == "greedy"
    got = sp.validate(VOCAB)
    assert got.temperature == 0.0 and got.method == "greedy" and got.seed == 3
    assert sp.temperature == T                      # validate returns a copy
    state = row_state()
    set_row_sampling(state, 0, sp)                  # unvalidated: stored as 0 all the same
    assert float(state["row.temperature"][0]) == 0.0


def test_host_rule_and_fp32_rule_agree_on_every_validated_temperature():
    """A validated temperature is greedy on the host (SamplingParams.method, the stream's
    choice of program) exactly when its fp32 state value is greedy for the kernels and for
    Engine._step_key."""
    eps = GREEDY_BELOW * 2 ** -30
    temps = [0.0, 1e-45, 1e-38, GREEDY_BELOW - eps, float(torch.tensor(GREEDY_BELOW)),
             GREEDY_BELOW, GREEDY_BELOW + eps, 0.5, FLOAT32_MAX]
    for T in temps:
        sp = SamplingParams(temperature=T).validate(VOCAB)
        stored = torch.tensor([sp.temperature], dtype=torch.float32)
        assert bool(greedy_rows(stored)) == (sp.method == "greedy"), T


def test_plain_numbers_of_other_types_are_taken_as_python_numbers():
    import numpy as np
    sp = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9),
                        seed=np.int32(-4), max_new_tokens=np.uint8(7), stop_ids=[np.int16(2)])
    got = sp.validate(VOCAB)
    assert (got.temperature, got.top_k, got.top_p, got.seed, got.max_new_tokens,
            got.stop_ids) == (0.5, 3, pytest.approx(0.9), -4, 7, (2,))
    assert all(type(v) in (int, float) for v in (got.temperature, got.top_k, got.top_p,
                                                  got.seed, got.max_new_tokens, *got.stop_ids))


def test_stop_ids_without_a_vocabulary_must_be_non_negative_only():
    assert SamplingParams(stop_ids=(10 ** 30,)).validate().stop_ids == (10 ** 30,)
    with pytest.raises(RequestError, match=r"stop_ids must be token ids >= 0, got -3"):
        SamplingParams(stop_ids=(-3,)).validate()


def test_engine_runs_the_greedy_program_for_tiny_temperatures_in_the_state():
    """Engine._step_key reads the temperatures the step will read: a tiny one written to the
    state directly (no validation) is greedy there as in the kernels."""
    from dspark_compile.engine_dir.format import STEP, ProgramKey
    from dspark_compile.runtime.engine import Engine
    temps = torch.tensor([1e-45, 1e-40, 0.0, GREEDY_BELOW / 2, GREEDY_BELOW, 1.0])
    greedy = ProgramKey(STEP, 4, "greedy")
    eng = SimpleNamespace(has=lambda key: key.kind == STEP and key.size == 4,
                          state={"row.temperature": temps})
    assert Engine._step_key(eng, [0, 1, 2, 3], 4, None) == greedy
    assert Engine._step_key(eng, [0, 4], 4, None) == ProgramKey(STEP, 4)
    with pytest.raises(ValueError, match=r"variant='greedy' with a sampled \(temperature >= "
                                         r"1e-05\) row"):
        Engine._step_key(eng, [0, 5], 4, "greedy")


def test_stream_launches_the_greedy_program_for_tiny_temperatures():
    from runtime.test_stream_scheduler import FakeEngine, run
    from dspark_compile.runtime.scheduler import GenerationStream
    eng = FakeEngine()
    s = GenerationStream(eng, True, prefill_tokens=8)
    for T in (1e-45, 1e-40, 1e-38, GREEDY_BELOW / 2):
        s.add([1, 2, 3], SamplingParams(temperature=T, max_new_tokens=6))
    run(s)
    assert eng.launches and all(greedy for _, _, greedy in eng.launches)
    assert (eng.state["row.temperature"] == 0).all()
    eng = FakeEngine()
    s = GenerationStream(eng, True, prefill_tokens=8)
    s.add([1, 2, 3], SamplingParams(temperature=GREEDY_BELOW, max_new_tokens=6))
    run(s)
    assert not any(greedy for _, _, greedy in eng.launches)


def test_stream_refuses_what_validate_refuses_naming_the_field():
    from runtime.test_stream_scheduler import FakeEngine
    from dspark_compile.runtime.scheduler import GenerationStream
    s = GenerationStream(FakeEngine(), True, prefill_tokens=8)     # its vocabulary: 1000
    for field, value, rule in REFUSED:
        if value == (VOCAB,):
            value = (1000,)
        with pytest.raises(ValueError, match=f"^{field} "):
            s.add([1], SamplingParams(**{field: value}))
    assert not s.has_work
