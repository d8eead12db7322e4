"""benchmarks/fp8_linear_cases.py without a GPU: every case builds at the Flash shapes, and at toy
shapes every variant that runs on a CPU (the kernel under the interpreter) matches the reference
(scaled-mm needs a GPU: its probe leaves it out here)."""
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import fp8_linear_cases as fc  # noqa: E402
from harness import compare  # noqa: E402


def test_flash_cases_cover_every_shape_and_m():
    found = [c for c in fc.cases([1, 4, 16, 64]) if c.group == "fp8_linear"]
    got = {(c.params["T"], c.params["N"], c.params["K"], c.params["groups"]) for c in found}
    assert got == {(M, *s) for M in (1, 6, 24, 96, 384) for s in fc.SHAPES}
    for c in found:
        M, N, K = c.params["T"], c.params["N"], c.params["K"]
        assert c.bytes_moved >= N * K and "scaled-mm" not in c.extra
    # the largest weight read a step makes through this op: draft main_proj, 50.3 MB
    assert max(c.bytes_moved for c in found if c.params["T"] == 1) < 51e6


def test_multi_cases_cover_every_set_and_t():
    found = [c for c in fc.cases([1, 4, 16, 64]) if c.group == "fp8_linear_multi"]
    assert {(c.params["T"], c.params["use"]) for c in found} == \
        {(T, use) for T in (6, 24, 96, 384) for use in fc.MULTI_SETS}
    for c in found:
        K, Ns = fc.MULTI_SETS[c.params["use"]]
        assert c.bytes_moved >= sum(Ns) * K
        assert {"separate", "separate-two-launch"} <= set(c.extra)


def test_toy_variants_match_the_reference(monkeypatch):
    """Every variant of both groups at toy shapes (K split in 2 by a forced MIN_KB_PER_SPLIT,
    so the two-launch variants exist), on the CPU through the interpreter."""
    monkeypatch.setattr(fc, "SHAPES", {(256, 256, 2): "toy-grouped", (128, 512, 1): "toy"})
    monkeypatch.setattr(fc, "MULTI_SETS", {"toy-set": (512, (128, 320))})
    monkeypatch.setattr(fc.fl, "MIN_KB_PER_SPLIT", 2)
    fc.fl.fp8_linear_plan.cache_clear()
    try:
        found = fc.cases([1])
        assert any("ours-two-launch" in c.extra for c in found)
        for case in found:
            want = case.reference(case.make_inputs("cpu", 0))
            for name, fn in [("ours", case.ours), *case.extra.items()]:
                got = fn(case.make_inputs("cpu", 0))
                if isinstance(got, list):
                    assert all(compare(name, a, b) == "" for a, b in zip(got, want)), name
                    continue
                got = got.transpose(0, 1).flatten(1) if got.dim() == 3 else got  # bmm's [G, M, n]
                assert compare(name, got, want) == "", (case.name, name)
            if case.check is not None and case.group == "fp8_linear_multi":
                assert case.check("cpu") == "", case.name
    finally:
        fc.fl.fp8_linear_plan.cache_clear()
