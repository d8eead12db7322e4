"""Triton's interpreter computes `tl.dot` in one summation order on every CPU
(kernels/interpreter_dot.py): an output element depends on its own row and column only, never on
the tile's shape, the element's place in it, the CPU's BLAS kernels or the thread count.

Before, a `tl.dot` was numpy's OpenBLAS sgemm: on an AMD EPYC with AVX2 (OpenBLAS's Haswell
kernels) the same row summed differently at position 0 and at position 7 of a tile, and
`test_kernel_is_batch_invariant[markov_sample]` failed there while it passed elsewhere.
"""
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from dspark_compile.kernels import interpreter_dot, tl_helpers  # noqa: F401  (installs it)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRETING, reason="runs kernels in Triton's CPU "
                                "interpreter (TRITON_INTERPRET=1, set on CPU machines)")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                ACC: tl.constexpr):
    """c [M, N] = a [M, K] @ b [K, N] (+ c when ACC), one program."""
    m = tl.arange(0, M)
    k = tl.arange(0, K)
    n = tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    c_ptrs = c_ptr + m[:, None] * N + n[None, :]
    if ACC:
        tl.store(c_ptrs, tl.dot(a, b, acc=tl.load(c_ptrs)))
    else:
        tl.store(c_ptrs, tl.dot(a, b))


@triton.jit
def _batched_dot_kernel(a_ptr, b_ptr, c_ptr, B: tl.constexpr, M: tl.constexpr,
                        K: tl.constexpr, N: tl.constexpr):
    """c [B, M, N] = a [B, M, K] @ b [B, K, N] (a 3-D tl.dot), one program."""
    i = tl.arange(0, B)[:, None, None]
    a = tl.load(a_ptr + i * M * K + tl.arange(0, M)[None, :, None] * K
                + tl.arange(0, K)[None, None, :])
    b = tl.load(b_ptr + i * K * N + tl.arange(0, K)[None, :, None] * N
                + tl.arange(0, N)[None, None, :])
    tl.store(c_ptr + i * M * N + tl.arange(0, M)[None, :, None] * N
             + tl.arange(0, N)[None, None, :], tl.dot(a, b))


def _dot(a, b, acc=None):
    M, K = a.shape
    N = b.shape[1]
    c = torch.zeros(M, N) if acc is None else acc.clone()
    _dot_kernel[(1,)](a.contiguous(), b.contiguous(), c, M=M, K=K, N=N, ACC=acc is not None)
    return c


def _tree_sum(terms):
    """The documented order, written independently of the module: pairs (0, 1), (2, 3), ...
    per level, an odd last term carried up as it is."""
    while len(terms) > 1:
        carry = [terms[-1]] if len(terms) % 2 else []
        terms = [terms[i] + terms[i + 1] for i in range(0, len(terms) - 1, 2)] + carry
    return terms[0]


def _expected(a, b):
    """fp32 [M, N]: exact float64 products of the operands' values, summed in the tree order,
    rounded once."""
    a64, b64 = a.double(), b.double()
    return _tree_sum([a64[:, k, None] * b64[None, k, :] for k in range(a.shape[1])]).float()


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_installed_on_the_interpreter_builder():
    from triton.runtime import interpreter
    assert interpreter.InterpreterBuilder.create_dot is interpreter_dot.create_dot
    interpreter_dot.install()                    # idempotent: Triton's own stays the fallback
    assert len(interpreter_dot._INTERPRETER_DOT) == 1
    assert interpreter_dot._INTERPRETER_DOT[0] is not interpreter_dot.create_dot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dot_is_the_fixed_order_sum(dtype):
    """Bit for bit the tree sum of exact products. np.matmul summed in fp32 in its BLAS kernel's
    order, and for bf16 multiplied the stored uint16 bit patterns as integers."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 64, generator=g).to(dtype)
    b = torch.randn(64, 32, generator=g).to(dtype)
    assert torch.equal(_bits(_dot(a, b)), _bits(_expected(a, b)))


def test_fp8_operands():
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(16, 32, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(32, 16, generator=g) * 8).to(torch.float8_e5m2)
    a8, b8 = a.float(), b.float()
    c = torch.zeros(16, 16)
    _fp8_dot_kernel[(1,)](a.view(torch.uint8), b.view(torch.uint8), c, M=16, K=32, N=16)
    assert torch.equal(_bits(c), _bits(_expected(a8, b8)))


@triton.jit
def _fp8_dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    """e4m3 [M, K] @ e5m2 [K, N] from their bytes."""
    m = tl.arange(0, M)
    k = tl.arange(0, K)
    n = tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :]).to(tl.float8e4nv, bitcast=True)
    b = tl.load(b_ptr + k[:, None] * N + n[None, :]).to(tl.float8e5, bitcast=True)
    tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


def test_acc_is_added_after_the_rounding():
    """tl.dot(a, b, acc): the sum rounded to fp32, then acc added in fp32 (the interpreter's own
    `matmul(a, b) + acc`)."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g)
    acc = torch.randn(16, 16, generator=g) * 100
    assert torch.equal(_bits(_dot(a, b, acc)), _bits(_expected(a, b) + acc))


def test_batched_dot():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 16, 16, generator=g), torch.randn(2, 16, 32, generator=g)
    c = torch.zeros(2, 16, 32)
    _batched_dot_kernel[(1,)](a, b, c, B=2, M=16, K=16, N=32)
    for i in range(2):
        assert torch.equal(_bits(c[i]), _bits(_expected(a[i], b[i])))


def test_row_is_independent_of_its_tile():
    """The invariant batch invariance needs: a row of a dot gives the same bits alone (a 1-row
    and a 16-row tile at position 0) and at every position of 16-, 32- and 64-row tiles, and its
    columns the same bits in a 16- or 64-column tile. The operands are the markov_sample case's
    kind: fp32 rows against a weight of rank 32."""
    g = torch.Generator().manual_seed(4)
    K = 32
    w = torch.randn(K, 64, generator=g)
    row = torch.randn(1, K, generator=g)
    ref = _dot(row, w)
    for M in (16, 32, 64):
        for pos in sorted({0, 1, 7, M // 2 + 3, M - 1}):
            a = torch.randn(M, K, generator=g)
            a[pos] = row[0]
            got = _dot(a, w)[pos:pos + 1]
            assert torch.equal(_bits(got), _bits(ref)), f"row at {pos} of a {M}-row tile"
    assert torch.equal(_bits(_dot(row, w[:, :16])), _bits(ref[:, :16])), "16 of 64 columns"


def test_integer_dot_unchanged():
    """int8 dots keep Triton's own np.matmul: exact, so any order gives the same int32."""
    g = torch.Generator().manual_seed(5)
    a = torch.randint(-128, 128, (16, 32), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (32, 16), generator=g, dtype=torch.int8)
    c = torch.zeros(16, 16, dtype=torch.int32)
    _dot_kernel[(1,)](a, b, c, M=16, K=32, N=16, ACC=False)
    assert torch.equal(c, a.int() @ b.int())


def test_fixed_order_matmul_odd_k():
    """Every K, odd ones carried up a level as they are (K = 1, 3, 5, 33)."""
    rng = np.random.default_rng(6)
    for K in (1, 3, 5, 33):
        a, b = rng.standard_normal((4, K)), rng.standard_normal((K, 3))
        want = _tree_sum([a[:, k, None] * b[None, k, :] for k in range(K)])
        assert np.array_equal(interpreter_dot.fixed_order_matmul(a, b), want), K


def test_large_dots_go_by_row_blocks_with_the_same_bits(monkeypatch):
    """A dot over the product budget is summed by row blocks: the same tree per element."""
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((2, 24, 16)), rng.standard_normal((2, 16, 8))
    whole = interpreter_dot.fixed_order_matmul(a, b)
    monkeypatch.setattr(interpreter_dot, "_MAX_PRODUCTS", 2 * 16 * 8 * 5)    # 5-row blocks
    assert np.array_equal(interpreter_dot.fixed_order_matmul(a, b), whole)
