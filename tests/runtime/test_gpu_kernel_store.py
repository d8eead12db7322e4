"""On a GPU: an engine built here carries its compiled Triton kernels (cubins and metadata JSON,
never a launcher module), and a load in a fresh process with an empty Triton cache compiles none
of them (dspark_compile/engine_dir/kernel_store.py), then runs a step through its CUDA graphs. Triton's
launcher module (host code) is built by that first load into the Triton cache, outside the
engine; a second fresh process with that cache builds nothing."""
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
from dspark_compile.engine_dir import kernel_store
from dspark_compile.runtime.engine import Engine
kernel_store.activate()                           # count compiles from the first launch on
eng = Engine.load(sys.argv[1], kernels="require")
before = kernel_store.compiles()
tokens, num = eng.run_step([0])
torch.cuda.synchronize()
print(json.dumps({"compiles_at_load": before, "compiles_in_step": kernel_store.compiles() - before,
                  "store_hits": kernel_store.store_hits(), "graphs": sorted({k.size for k in eng.captured()}),
                  "launcher_builds": kernel_store.launcher_builds(),
                  "store_files": kernel_store.store_files(), "num": num.tolist()}))
"""


@pytest.fixture(scope="module")
def cuda_engine(request, tmp_path_factory):
    given = request.config.getoption("--gpu-kernel-store-engine")
    if given:
        return given
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.factory.synth import synth_checkpoint
    from dspark_compile.build.pipeline import build_engine
    root = tmp_path_factory.mktemp("kstore")
    synth_checkpoint("tiny", root / "ckpt", seed=0)
    build_engine(root / "ckpt", root / "engine",
                 BuildConfig(buckets=(1,), max_seq_len=128, dtype="bfloat16", device="cuda",
                             backend="aten", prefill_chunks=()), log=lambda m: None)
    return str(root / "engine")


def _fresh_load(engine: str, cache) -> dict:
    res = subprocess.run([sys.executable, "-c", _FRESH_LOAD, engine, str(cache)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_fresh_process_with_an_empty_triton_cache_compiles_nothing(cuda_engine, tmp_path):
    from pathlib import Path
    manifest = json.loads((Path(cuda_engine) / "manifest.json").read_text())
    store = manifest["kernel_store"]
    assert store["kernels"] > 10 and store["path"].startswith("kernels/triton/sm")
    # the store holds GPU code and its metadata only: no launcher module (host code)
    stored = [f for f in manifest["files"] if f.startswith(store["path"] + "/")]
    assert stored and all(f.endswith((".cubin", ".json")) for f in stored), stored
    assert not [p for p in (Path(cuda_engine) / store["path"]).rglob("*")
                if p.is_file() and not p.name.endswith((".cubin", ".json"))]
    cache = tmp_path / "cache"
    out = _fresh_load(cuda_engine, cache)
    assert out["compiles_at_load"] == 0, out
    assert out["compiles_in_step"] == 0, out
    assert out["store_hits"] >= store["kernels"] // 2
    assert out["graphs"] and 0 <= out["num"][0] <= 6
    assert all(n.endswith((".cubin", ".json")) for n in out["store_files"]), out["store_files"]
    # the launcher was built here, into the Triton cache, not taken from the engine
    assert out["launcher_builds"] >= 1, out
    assert [p for p in cache.rglob("*.so")], sorted(str(p) for p in cache.rglob("*"))
    # and a second fresh process with that cache builds nothing
    again = _fresh_load(cuda_engine, cache)
    assert again["launcher_builds"] == 0 and again["compiles_at_load"] == 0, again
