"""On a GPU: an engine built here carries its compiled Triton kernels, and a load in a fresh
process with an empty Triton cache compiles none of them (dspark_compile/kernel_store.py), then
runs a step through its CUDA graphs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_FRESH_LOAD = r"""
import json, sys
from triton import knobs
knobs.cache.dir = sys.argv[2]                      # empty: a fresh machine
import torch
from dspark_compile import kernel_store
from dspark_compile.runtime import Engine
kernel_store.activate()                           # count compiles from the first launch on
eng = Engine.load(sys.argv[1], kernels="require")
before = kernel_store.compiles()
tokens, num = eng.run_step([0])
torch.cuda.synchronize()
print(json.dumps({"compiles_at_load": before, "compiles_in_step": kernel_store.compiles() - before,
                  "store_hits": kernel_store.store_hits(), "graphs": sorted(eng.graphs),
                  "num": num.tolist()}))
"""


@pytest.fixture(scope="module")
def cuda_engine(request, tmp_path_factory):
    given = request.config.getoption("--gpu-kernel-store-engine")
    if given:
        return given
    from dspark_compile.build_config import BuildConfig
    from dspark_compile.models.synth import synth_checkpoint
    from dspark_compile.trace import build_engine
    root = tmp_path_factory.mktemp("kstore")
    synth_checkpoint("tiny", root / "ckpt", seed=0)
    build_engine(root / "ckpt", root / "engine",
                 BuildConfig(buckets=(1,), max_seq_len=128, dtype="bfloat16", device="cuda",
                             backend="aten", prefill_chunks=()), log=lambda m: None)
    return str(root / "engine")


def test_a_fresh_process_with_an_empty_triton_cache_compiles_nothing(cuda_engine, tmp_path):
    manifest = json.loads((__import__("pathlib").Path(cuda_engine) / "manifest.json").read_text())
    store = manifest["kernel_store"]
    assert store["kernels"] > 10 and store["path"].startswith("kernels/triton/sm")
    res = subprocess.run([sys.executable, "-c", _FRESH_LOAD, cuda_engine, str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["compiles_at_load"] == 0, out
    assert out["compiles_in_step"] == 0, out
    assert out["store_hits"] >= store["kernels"] // 2
    assert out["graphs"] and 0 <= out["num"][0] <= 6
