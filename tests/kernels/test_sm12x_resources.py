"""SM12x readiness: every declared launch configuration of every kernel compiles for sm_120 and
sm_121 with at most 99 KB of shared memory per block and no local memory (no spills).

Kernels are enumerated generically: every module of dspark_compile.kernels is imported (pkgutil)
and every KERNELS entry with compile configurations is compiled, so kernels that other files add
later are checked without touching this test. Runs without a GPU (cross-compilation, ~1 s per
configuration) and under TRITON_INTERPRET=1, which the test session sets on CPU machines.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from dspark_compile import kernels as kernels_pkg
from dspark_compile.kernels import sm12x
from dspark_compile.kernels.registry import KERNELS

# Triton ops that must keep SM12x-ready (others are checked as soon as they declare configs)
OUR_TRITON_OPS = {"qkv_postprocess", "qkv_rope", "context_kv_store", "act_quant", "swiglu_quant",
                  "rmsnorm_quant", "rmsnorm", "hc_pre", "hc_post", "hc_head", "hc_post_pre", "hc_post_head",
                  "moe_experts", "fp8_linear", "sparse_attention", "indexer_topk", "compress",
                  "compress_store", "compress_store_fp8", "draft_attention"}


@pytest.fixture(scope="module")
def all_kernels():
    return sm12x.import_all_kernel_modules()


def test_every_kernel_module_is_imported(all_kernels):
    root = pathlib.Path(kernels_pkg.__path__[0])
    on_disk = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
               for p in root.rglob("*.py") if "__pycache__" not in p.parts} - {"__init__"}
    assert {n.split(".", 2)[2] for n in all_kernels} == on_disk
    assert OUR_TRITON_OPS <= {n for n, spec in KERNELS.items() if spec.compile_configs}


def _report_in_fresh_process(arch: str) -> list:
    """The report as a build machine computes it: a fresh interpreter without TRITON_INTERPRET
    (`dspark-compile build --arch` never runs under the interpreter), so every kernel compiles
    as the real JITFunction its module defines rather than through sm12x's rebuild of an
    interpreted one (test_compiles_under_the_interpreter and test_interpreter_state.py cover
    compiling in a process that has run interpreted kernels)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys; from dspark_compile.kernels import sm12x; "
            f"json.dump(sm12x.resource_report({arch!r}), sys.stdout)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("arch", sorted(sm12x.ARCHS))
def test_resources_fit_sm12x(arch, all_kernels):
    report = _report_in_fresh_process(arch)
    expected = sum(len(spec.compile_configs) for spec in KERNELS.values())
    assert len(report) == expected and expected > 0
    for r in report:
        where = f"{r['op']}/{r['kernel']} {arch} warps={r['num_warps']} {r['constexprs']}"
        assert r["arch"] == arch
        assert r["shared_bytes"] <= sm12x.SMEM_LIMIT_BYTES, f"{where}: {r['shared_bytes']} B smem"
        assert r["local_bytes"] == 0, f"{where}: {r['local_bytes']} B local memory (spills)"
        assert 0 < r["registers"] <= 255, where
        assert r["ok"]
        # a persistent row pass's grid is sized to one wave of what its build keeps resident
        # (the greedy step kernel's PERSIST is its own: a grid of PROGS_PER_SM, measured)
        if r["constexprs"].get("PERSIST") and r["kernel"] in _PERSISTENT_PER_SM:
            fit = sm12x.ctas_by_registers(r["registers"], r["num_warps"])
            assert fit >= _PERSISTENT_PER_SM[r["kernel"]], f"{where}: {fit} CTAs per SM"
    assert any(r["constexprs"].get("PERSIST") and r["kernel"] in _PERSISTENT_PER_SM
               for r in report)
    sm12x.check_report(report)


def _persistent_per_sm():
    from dspark_compile.kernels.sampling.plan import FINAL_PER_SM, GATED_PER_SM
    sm12 = GATED_PER_SM[12]     # SM12x's row of the table (sm_90's: kernel_resources.py)
    return {"row_reduce_kernel": sm12["reduce"], "row_select_kernel": sm12["select"],
            "row_refine_kernel": sm12["refine"], "_markov_gumbel_kernel": FINAL_PER_SM}


_PERSISTENT_PER_SM = _persistent_per_sm()


def test_ctas_by_registers():
    # the Markov logits kernel at B = 64 (4 warps) before and after a reverted epilogue change:
    # 146 -> 198 registers (benchmarks/results/README.md, "Sampler", "History")
    assert sm12x.ctas_by_registers(146, 4) == 3
    assert sm12x.ctas_by_registers(198, 4) == 2
    assert sm12x.ctas_by_registers(215, 8) == 1             # a persistent refine pass
    assert sm12x.ctas_by_registers(16, 1) == 32             # the per-SM CTA limit


def test_check_report_names_offenders():
    good = {"op": "a", "kernel": "k", "arch": "sm_120", "num_warps": 4, "constexprs": {},
            "shared_bytes": 1024, "local_bytes": 0, "ok": True}
    bad = dict(good, op="b", shared_bytes=100 * 1024, ok=False)
    sm12x.check_report([good])
    with pytest.raises(RuntimeError, match="b/k sm_120"):
        sm12x.check_report([good, bad])
    with pytest.raises(ValueError, match="arch"):
        sm12x.resource_report("sm_90")


@triton.jit
def _probe_helper(x):
    return tl.sum(x * x, axis=0)      # tl.sum is Triton's own @jit standard library


@triton.jit
def _probe_kernel(x_ptr, o_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(o_ptr, _probe_helper(tl.load(x_ptr + offs)) + tl.max(tl.load(x_ptr + offs), axis=0))


def test_compiles_under_the_interpreter():
    """With TRITON_INTERPRET=1 triton.jit returns interpreter objects; compiling must rebuild the
    kernel, its helpers and Triton's standard-library jit functions from source."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not isinstance(_probe_kernel, JITFunction)
    jit = sm12x.as_jit(_probe_kernel)
    assert isinstance(jit, JITFunction)
    assert isinstance(jit.__globals__["_probe_helper"], JITFunction)
    compiled = sm12x.compile_entry(
        (_probe_kernel, {"x_ptr": "*fp32", "o_ptr": "*fp32", "N": "constexpr"}, {"N": 128}, 4), 120)
    res = sm12x.cubin_resources(compiled.asm["cubin"])
    assert res["LOCAL"] == 0 and res["REG"] > 0
    assert "sm_120" in compiled.asm["ptx"]
