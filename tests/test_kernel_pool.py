"""The build's parallel kernel compile (dspark_compile/build/kernel_pool.py): the discovery run
notes each distinct kernel configuration once and launches nothing, the workers compile them
into the build's Triton cache so the recording run compiles none, a worker's error is named and
a worker's death leaves its kernels to the recording run, Triton's hooks are restored after an
exception, and the number of workers is bounded by cores, memory and jobs.

The end-to-end case compiles a real kernel for sm_90 without a GPU (the workers never touch the
device) in a fresh process: this one runs kernels in Triton's interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dspark_compile.build import kernel_pool
from dspark_compile.build.kernel_pool import KernelConfig, compile_configs, worker_count

_KERNEL = '''
import triton, triton.language as tl

@triton.jit
def add_one(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)
'''

_END_TO_END = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from dspark_compile.build import kernel_pool
from dspark_compile.engine_dir import kernel_store
import kmod

def main():
    knobs.cache.dir = sys.argv[1] + "/cache"
    target = {"backend": "cuda", "arch": 90, "warp_size": 32}
    driver.set_active(kernel_pool._TargetDriver(GPUTarget(**target), 0))
    kernel_store.activate()
    x, y = torch.arange(64.0), torch.full((64,), 7.0)
    before = kernel_store.compiles()
    with kernel_pool.discovering({x.untyped_storage().data_ptr()}) as found:
        launched = [kmod.add_one[(1,)](x, y, 64, BLOCK=b) for b in (64, 64, 32)]
    out = {"found": [c.describe() for c in found.values()], "launched": [k is not None for k in launched],
           "discovery_compiles": kernel_store.compiles() - before, "x": x[:3].tolist(), "y": y[:3].tolist(),
           "hook_after": knobs.runtime.jit_cache_hook is None, "pre_run_after": len(kmod.add_one.pre_run_hooks)}
    rep = kernel_pool.compile_configs(list(found.values()), 2, knobs.cache.dir, target, 0)
    out.update(compiled=rep.compiled, failed=rep.failed, crashed=len(rep.crashed))
    before = kernel_store.compiles()
    for b in (64, 32):               # the recording run: both found in the workers' cache
        kmod.add_one.run(x, y, 64, BLOCK=b, grid=(1,), warmup=True)
    out["record_compiles"] = kernel_store.compiles() - before
    kmod.add_one.run(x, y, 64, BLOCK=16, grid=(1,), warmup=True)   # one the workers never saw
    out["unseen_compiles"] = kernel_store.compiles() - before - out["record_compiles"]
    print(json.dumps(out))

if __name__ == "__main__":
    main()
'''


def test_discovered_configurations_compile_in_workers_and_the_recording_run_compiles_none(
        tmp_path):
    (tmp_path / "kmod.py").write_text(_KERNEL)
    (tmp_path / "e2e.py").write_text(_END_TO_END)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(tmp_path / "e2e.py"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # three launches, two distinct configurations, each noted once; nothing compiled or run
    assert len(out["found"]) == 2, out["found"]
    assert all(f.startswith("kmod:add_one ") for f in out["found"])
    assert '{"BLOCK": 64}' in out["found"][0] and '{"BLOCK": 32}' in out["found"][1]
    assert out["launched"] == [False, False, False] and out["discovery_compiles"] == 0
    # a launch's tensors are zeroed first, the protected one (a weight) is not
    assert out["y"] == [0.0, 0.0, 0.0] and out["x"] == [0.0, 1.0, 2.0]
    assert out["hook_after"] and out["pre_run_after"] == 0
    assert out["compiled"] == 2 and out["failed"] == [] and out["crashed"] == 0
    assert out["record_compiles"] == 0, out
    assert out["unseen_compiles"] == 1, out        # the counter does count a real compile


# --------------------------------------------------------------------------- orchestration
# a worker's compile stand-in, in a module the spawned workers can import (this test module is
# imported under a package name they lack): fails, dies or writes a marker into Triton's cache
# dir (the directory the parent passed)
_FAKES = '''
import os

def fake_compile(fn, data):
    from triton import knobs
    if data == "fail":
        raise RuntimeError("PTXAS error: Internal Triton PTX codegen error\\nptxas fatal: boom")
    if data == "die":
        os._exit(3)
    with open(os.path.join(knobs.cache.dir, data + ".done"), "w") as f:
        f.write(fn)
'''


@pytest.fixture
def fake_compile(tmp_path, monkeypatch):
    import importlib
    (tmp_path / "kernel_pool_fakes.py").write_text(_FAKES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("kernel_pool_fakes").fake_compile


_TARGET = {"backend": "cuda", "arch": 90, "warp_size": 32}


def test_a_failing_compile_is_named_and_the_others_still_compile(tmp_path, fake_compile):
    cache = tmp_path / "cache"
    cache.mkdir()
    configs = [KernelConfig("m:k", d) for d in ("a", "fail", "b")]
    rep = compile_configs(configs, 2, str(cache), _TARGET, 0, compile_one=fake_compile)
    assert rep.compiled == 2 and not rep.crashed
    assert [(c.data, e) for c, e in rep.failed] == [("fail", "RuntimeError: ptxas fatal: boom")]
    # the workers wrote into the cache directory the parent named
    assert sorted(p.name for p in cache.iterdir()) == ["a.done", "b.done"]


def test_a_dying_worker_leaves_its_kernels_to_the_build_process(tmp_path, fake_compile):
    configs = [KernelConfig("m:k", d) for d in ("die", "a")]
    rep = compile_configs(configs, 1, str(tmp_path), _TARGET, 0, compile_one=fake_compile)
    assert "die" in [c.data for c in rep.crashed]        # never reported as compiled
    assert rep.compiled + len(rep.crashed) == 2 and not rep.failed


def test_discovery_restores_triton_hooks_after_an_exception():
    from triton import knobs
    from triton.runtime.jit import JITFunction

    def kernel(x):
        pass

    jf = JITFunction(kernel)         # registered, as @triton.jit does on a GPU machine

    def previous(**kw):
        return False

    knobs.runtime.jit_cache_hook = previous
    try:
        with pytest.raises(KeyError):
            with kernel_pool.discovering(set()):
                assert knobs.runtime.jit_cache_hook is not previous
                assert len(jf.pre_run_hooks) == 1
                raise KeyError("a program failed")
        assert knobs.runtime.jit_cache_hook is previous
        assert jf.pre_run_hooks == []
    finally:
        knobs.runtime.jit_cache_hook = None


def test_a_configuration_is_described_by_kernel_constexprs_and_options():
    data = json.dumps({"name": "k", "signature": {"x": "*fp32", "BLOCK": "constexpr"},
                       "constant_keys": [[1]], "constant_vals": [128],
                       "options": {"num_warps": 8, "num_stages": 3, "num_ctas": 1}})
    assert KernelConfig("pkg.mod:k", data).describe() == (
        "pkg.mod:k {\"BLOCK\": 128} {'num_warps': 8, 'num_stages': 3, 'num_ctas': 1}")
    assert KernelConfig("pkg.mod:k", "not json").describe() == "pkg.mod:k not json"


GB = 1 << 30


@pytest.mark.parametrize("requested,jobs,available,cpus,expected", [
    (0, 500, 256 * GB, 16, 16),        # one per core
    (0, 5, 256 * GB, 16, 5),           # never more than jobs
    (0, 500, 6 * GB, 16, 4),           # 1.5 GB each
    (0, 500, 1 * GB, 16, 1),           # at least one
    (8, 500, 256 * GB, 16, 8),         # the caller's number
    (32, 500, 12 * GB, 16, 8),         # the caller's number, still bounded by memory
])
def test_workers_are_one_a_core_bounded_by_memory_and_jobs(requested, jobs, available, cpus,
                                                            expected):
    assert worker_count(requested, jobs, available=available, cpus=cpus) == expected


def test_a_negative_worker_count_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="compile_workers must be >= 0, got -2"):
        worker_count(-2, 10, available=GB, cpus=2)
