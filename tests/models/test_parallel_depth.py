"""Tensor parallelism at full depth on CPU processes: the depth preset (`tiny-deep`: Flash-0731's
43 target layers with their types and hash layers, the 3-stage draft), widened so every split
holds whole FP8 blocks at tp = 2 (dspark_compile/factory/tp_checkpoint.py; tiny-deep itself is
refused at tp = 2 as the tiny preset is), run by two gloo ranks (models/parallel_check.py):
the ranks agree to the bit, TP = 2's greedy speculative tokens equal its own target-only
decoding (lossless) and TP = 1's, and its logits TP = 1's within fp64 rounding.

The engine at tp = 2 (its programs with their collectives, `run --tp 2 --check-lossless`) is
tests/runtime/test_tp_engine.py's, on the 3-layer widened checkpoint: an engine build at 43
layers per rank takes minutes on a 2-core machine; here the sharded model itself is checked at
depth, where layer-type and hash-layer sharding bugs would show."""
import pytest
import torch

from dspark_compile.factory.synth import synth_checkpoint
from dspark_compile.factory.tp_checkpoint import tp_checkpoint
from dspark_compile.models.config import Precision
from dspark_compile.models.parallel_check import run_check

TP = 2
FLASH_LAYERS = 43


@pytest.fixture(scope="module")
def deep_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_deep")
    deep = synth_checkpoint("tiny-deep", root / "deep")
    wide = tp_checkpoint(deep, root / "deep-wide")
    (root / "out").mkdir()
    return run_check(wide, TP, root / "out", Precision(dtype=torch.float64))


def test_depth_ranks_agree_and_tp2_is_lossless_and_equals_tp1(deep_run):
    ref, (r0, r1) = deep_run
    spec, target = r0["lossless"]
    assert len(spec) >= 4 and spec == target           # speculative == target-only at TP = 2
    assert r0["lossless"] == r1["lossless"] == ref["lossless"]    # and both equal TP = 1's
    assert r0["first"] == r1["first"] == ref["first"]
    for k in ("spec_tokens", "spec_num", "target_tokens", "target_num"):
        assert torch.equal(r0[k], r1[k]) and torch.equal(r0[k], ref[k]), k
    for x, y, z in zip(r0["prefill_logits"], r1["prefill_logits"], ref["prefill_logits"]):
        assert torch.equal(x, y)                       # the ranks hold the same bits
        assert not torch.isnan(x).any()
        # fp64: the row-parallel sums reassociate (~1e-16 an op) over 43 + 3 layers
        torch.testing.assert_close(x, z, rtol=1e-12, atol=1e-12)
