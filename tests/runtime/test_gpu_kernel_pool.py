"""On a GPU: the kernel store a build compiles in worker processes (dspark_compile/build/
kernel_pool.py) is the store the serial build compiles, file for file and byte for byte, and the
building process itself compiles none of its kernels (the recording run finds each in Triton's
cache). Each build runs in a fresh process with its own empty Triton cache: JITFunctions keep
what they compiled in memory, so a second build in one process would compile nothing either
way."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

_BUILD = r"""
import hashlib, json, sys
from pathlib import Path
from triton import knobs
knobs.cache.dir = sys.argv[3]                      # empty: nothing compiled before
from dspark_compile.engine_dir import kernel_store
kernel_store.activate()                           # count this process's compiles from here on
from dspark_compile.build.pipeline import build_engine
from dspark_compile.engine_dir.build_config import BuildConfig
lines = []
build_engine(sys.argv[1], sys.argv[2],
             BuildConfig(buckets=(1,), max_seq_len=128, dtype="bfloat16", device="cuda",
                         backend="aten", prefill_chunks=(), compile_workers=int(sys.argv[4])),
             log=lines.append)
m = json.loads((Path(sys.argv[2]) / "manifest.json").read_text())
root = Path(sys.argv[2]) / m["kernel_store"]["path"]
files = {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
         for p in sorted(root.rglob("*")) if p.is_file()}
print(json.dumps({"compiles": kernel_store.compiles(), "files": files,
                  "store": m["kernel_store"], "log": [l for l in lines if "[kernels]" in l]}))
"""


def _build(ckpt, out, cache, workers: int) -> dict:
    res = subprocess.run([sys.executable, "-c", _BUILD, str(ckpt), str(out), str(cache),
                          str(workers)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print("\n".join(out["log"]))
    return out


def test_parallel_kernel_compile_stores_what_the_serial_build_stores(tmp_path):
    from dspark_compile.factory.synth import synth_checkpoint
    synth_checkpoint("tiny", tmp_path / "ckpt", seed=0)
    serial = _build(tmp_path / "ckpt", tmp_path / "serial", tmp_path / "cache_serial", 1)
    parallel = _build(tmp_path / "ckpt", tmp_path / "parallel", tmp_path / "cache_parallel", 4)
    assert serial["store"]["kernels"] > 10, serial["store"]
    assert serial["compiles"] == serial["store"]["kernels"], serial
    # every kernel came from the workers: the building process compiled none
    assert parallel["compiles"] == 0, parallel["log"]
    assert any("worker processes" in line for line in parallel["log"]), parallel["log"]
    assert sorted(parallel["files"]) == sorted(serial["files"])
    differ = [f for f in serial["files"] if parallel["files"][f] != serial["files"][f]]
    assert not differ, differ[:5]
    assert parallel["store"] == serial["store"]
