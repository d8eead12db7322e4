"""Triton's interpreter leaves triton.language as it found it, so a real compile later in the same
process (sm12x's cross-compile) works after interpreted kernels ran.

Triton 3.7.1 patches the language modules for every interpreted call and restores them after a
launch, but not after a jit function called from a kernel or from the host: a kernel that calls
tl.sum / tl.max (Triton's own @jit standard library, whose globals hold triton.language.core)
left ~60 functions of triton.language.core patched, and every later compile in the process
failed with "'ir.block_argument' object has no attribute 'dtype'". kernels/tl_helpers.py makes
those calls restore their patches (_device_calls_restore_language).
"""
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from dspark_compile.kernels import sm12x, tl_helpers

REPO = Path(__file__).resolve().parents[2]
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="runs kernels in Triton's CPU "
                                       "interpreter (TRITON_INTERPRET=1, set on CPU machines)")


@triton.jit
def _square_sum(x):
    return tl.sum(x * x, axis=0)


@triton.jit
def _reductions_kernel(x_ptr, o_ptr, N: tl.constexpr, AXIS: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    # tl.max / tl.sum are jit functions of triton/language/standard.py, which holds
    # triton.language.core in its globals: their interpreted calls patch core itself
    tl.store(o_ptr, _square_sum(x) + tl.max(x, axis=AXIS))


_SIGNATURE = {"x_ptr": "*fp32", "o_ptr": "*fp32", "N": "constexpr", "AXIS": "constexpr"}
_CONSTEXPRS = {"N": 64, "AXIS": 0}


@needs_interpreter
def test_interpreted_launch_then_real_compile():
    assert sm12x.interpreter_patches() == [], "patched before this test: an earlier test leaked"
    x, out = torch.randn(64), torch.zeros(1)
    _reductions_kernel[(1,)](x, out, **_CONSTEXPRS)
    torch.testing.assert_close(out[0], (x * x).sum() + x.max())
    assert sm12x.interpreter_patches() == []
    compiled = sm12x.compile_entry((_reductions_kernel, _SIGNATURE, _CONSTEXPRS, 4), 120)
    assert sm12x.cubin_resources(compiled.asm["cubin"])["REG"] > 0


@needs_interpreter
def test_host_call_of_a_jit_function_restores():
    """A jit function called from Python (not launched) patches triton.language as well."""
    tl_helpers.pdl_enter(0)
    assert sm12x.interpreter_patches() == []


@needs_interpreter
def test_restored_when_a_called_function_fails():
    x, out = torch.randn(64), torch.zeros(1)
    with pytest.raises(Exception, match="axis"):
        _reductions_kernel[(1,)](x, out, N=64, AXIS=1)    # raised inside tl.max's reduce
    assert sm12x.interpreter_patches() == []


def test_compile_refuses_a_patched_language(monkeypatch):
    """A leak from some other path is named rather than surfacing deep in the compiler."""
    from triton.runtime import interpreter
    monkeypatch.setattr(tl.core, "add", functools.partial(interpreter._patch_attr))
    assert sm12x.interpreter_patches() == ["triton.language.core.add"]
    with pytest.raises(RuntimeError, match="left 1 triton.language attributes patched"):
        sm12x.compile_entry((_reductions_kernel, _SIGNATURE, _CONSTEXPRS, 4), 120)


@needs_interpreter
def test_kernel_tests_then_sm12x_compile_in_one_process():
    """The reported failure as it happened: an interpreted kernel test, then the SM12x
    in-process compile test, in one pytest process (no xdist, fixed order)."""
    tests = ["tests/kernels/test_act_quant.py::test_act_quant_exact[1-128-dtype0]",
             "tests/kernels/test_sm12x_resources.py::test_compiles_under_the_interpreter"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *tests], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "2 passed" in out.stdout, out.stdout[-2000:]
