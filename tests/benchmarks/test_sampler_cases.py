"""benchmarks/sampler_cases.py without a GPU: every A/B variant reaches its launcher with a valid
plan (the variants only run on a GPU, where a broken one would only leave a note in the results)."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import sampler_cases  # noqa: E402

from dspark_compile.kernels.sampling.plan import PLAN, SamplerPlan  # noqa: E402


def test_every_variant_calls_its_launcher_with_a_valid_plan(monkeypatch):
    calls = []

    def recorder(name):
        def launch(**kwargs):
            calls.append((name, kwargs.pop("plan", None), sorted(kwargs)))
            return "launched"
        return launch

    monkeypatch.setattr(sampler_cases.ms, "markov_sample_launch", recorder("markov"))
    monkeypatch.setattr(sampler_cases.rj, "rejection_sample_launch", recorder("rejection"))
    variants = 0
    for case in sampler_cases.cases([1, 64]):
        for name, fn in case.extra.items():
            if name.startswith("ours-mode"):
                continue        # the op itself (dspark::<op> with mode=...), not a plan variant
            calls.clear()
            data = {"x": object()}
            assert fn(data) == "launched", (case.name, name)
            assert len(calls) == 1, (case.name, name, calls)
            launcher, plan, args = calls[0]
            assert isinstance(plan, SamplerPlan) and args == ["x"], (case.name, name)
            assert plan != PLAN, f"{case.name} {name}: the variant runs the production plan"
            variants += 1
    assert variants > 20
