"""The benchmark harness without a GPU: case discovery, dry run, result files, comparisons.

Timing itself needs CUDA: the GPU test runs one tiny case through the real graph-replay path.
"""
import importlib.util
import json
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(REPO, "benchmarks", "kernel_bench.py")
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CASE_MODULE = '''
import torch
from harness import Case

def cases(batches):
    return [Case("toy", "scale", {"B": B}, lambda device, seed, B=B: {
                 "x": torch.randn(B, 8, generator=torch.Generator().manual_seed(seed)).to(device)},
                 lambda d: d["x"] * 2, lambda d: d["x"] + d["x"], bytes_moved=B * 64,
                 extra={"mul": lambda d: d["x"].mul(2)})
            for B in batches]
'''


def test_case_modules_are_discovered(bench, tmp_path):
    (tmp_path / "toy_cases.py").write_text(CASE_MODULE)
    found = bench.collect_cases([1, 4], case_dir=str(tmp_path))
    names = {(c.group, c.name, c.params["B"]) for c in found}
    assert ("toy", "scale", 4) in names and ("qkv", "qkv_postprocess", 1) in names
    assert {"act_quant", "swiglu_quant", "rmsnorm_quant"} <= {c.name for c in found}
    (tmp_path / "bad_cases.py").write_text("def cases(batches):\n    return [1]\n")
    with pytest.raises(TypeError, match="harness.Case"):
        bench.collect_cases([1], case_dir=str(tmp_path))


def test_dry_run_writes_results(bench, tmp_path):
    (tmp_path / "toy_cases.py").write_text(CASE_MODULE)
    out = tmp_path / "res"
    result = bench.main(["--dry-run", "--batches", "1", "--only", "toy,act_quant",
                         "--out", str(out), "--case-dir", str(tmp_path)])
    rows = result["rows"]
    assert {r["name"] for r in rows} == {"scale", "swiglu_quant", "rmsnorm_quant", "act_quant"}
    assert all(r["check"] == "" for r in rows)
    saved = json.loads((out / "kernels.json").read_text())
    env = saved["environment"]
    for key in ("device", "driver", "torch", "triton", "git_commit", "date_utc"):
        assert key in env
    assert (out / "kernels.csv").read_text().splitlines()[0].startswith("group,name")


def test_compare_and_table(bench):
    h = bench.harness
    a = torch.randn(4, 4)
    assert h.compare("a", a, a.clone()) == ""
    assert "rel err" in h.compare("a", a, a + 1)
    assert "NaN" in h.compare("a", a / 0 * 0, a)
    f8 = a.to(torch.float8_e4m3fn)
    assert h.compare("q", f8, f8.clone()) == ""
    assert "bytes differ" in h.compare("q", f8, (a * 2).to(torch.float8_e4m3fn))
    table = h.format_table([{"x": 1.23456, "y": None}], ["x", "y"])
    assert "1.23" in table and "-" in table


@pytest.mark.gpu
def test_gpu_timing_path(bench, tmp_path):
    (tmp_path / "toy_cases.py").write_text(CASE_MODULE)
    result = bench.main(["--only", "toy,act_quant", "--ops", "scale,act_quant", "--batches", "1",
                         "--replays", "5", "--warmup", "1", "--case-dir", str(tmp_path),
                         "--out", str(tmp_path / "res")])
    rows = result["rows"]
    assert result["copy_bandwidth"]["bytes_per_s"] > 1e11
    for r in rows:
        assert r["method"] == "graph" and r["us_median"] > 0, r
    assert {r["variant"] for r in rows} >= {"eager", "compile", "ours", "mul"}


def test_profile_sampler_arguments():
    """profile_sampler's --launch-kw (JSON lists become the launchers' config tuples) and
    --ops are checked before any GPU work, with a one-line error."""
    import sys
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "profile_sampler", os.path.join(REPO, "benchmarks", "profile_sampler.py"))
        ps = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ps)
    finally:
        sys.path.remove(os.path.join(REPO, "benchmarks"))
    assert ps._launch_kw('{"greedy_config": [64, 4, 3, 2], "pdl": false}') == \
        {"greedy_config": (64, 4, 3, 2), "pdl": False}
    assert ps._launch_kw("") == {}
    for bad in ("[1, 2]", "{pdl: 0}"):
        with pytest.raises(SystemExit, match="--launch-kw"):
            ps._launch_kw(bad)
    with pytest.raises(SystemExit, match="--ops: unknown"):
        ps.main(["--out", "unused.json", "--ops", "markov_nope"])
