"""Batch invariance of every `dspark::` op: a row's results do not depend on the batch.

For each op of kernels/registry.py KERNELS (a new op without a case in tests/batch_cases.py
fails here), a few rows of a 64-row pool are computed alone and then inside batches of 2, 7 and
64 rows at the first, a middle and the last position, with random other rows: every result of
the row (returned tensors and the state it writes) is bit-equal. Both implementations are
checked: the reference (what a CPU engine runs; `torch.ops.dspark.*` dispatches to it off CUDA)
and the Triton launcher (the kernel under TRITON_INTERPRET=1 on a CPU machine; on a GPU at the
`big` shapes, where the plans would pick other splits and tiles for 1 row and for 64).

This is what makes greedy speculative decoding emit exactly the tokens of target-only decoding:
a verify step computes a row's logits with other rows and 6 tokens a row, the target-only step
with 1 token a row, and any batch-dependent reduction order moves a logit by an ulp.
"""
import pytest
import torch

from batch_cases import CASES, take
from dspark_compile.kernels.registry import KERNELS
import dspark_compile.kernels.sampling  # noqa: F401  (registers the samplers)
import dspark_compile.kernels.fp8_linear_multi  # noqa: F401  (the op group_fp8_linears inserts)
import dspark_compile.models.step  # noqa: F401  (registers every op the step uses)

POOL = 64   # the references' pool; the kernels' is the case's (tests/batch_cases.py gpu_pool,
#            interpreted_pool: 24 rows by default, two 16-row GEMM tiles, row 23 in the second)


def _batches(r, g, gpu, pool):
    """Sub-batches holding row r: (rows, r's position) at sizes 2 and 7 (r last, r in the
    middle) and, on a GPU, 24 (the 17..32-row GEMM tiles) and, in a larger pool, 100 (the
    65..128-token ones); the whole pool (r at its own index: first, middle, last) is checked
    once."""
    others = [i for i in torch.randperm(pool, generator=g).tolist() if i != r]
    yield [others[0], r], 1
    yield others[:3] + [r] + others[3:6], 3
    if gpu:
        yield others[:11] + [r] + others[11:23], 11
    if gpu and pool > 100:
        yield others[:70] + [r] + others[70:99], 70


def _results(case, fn, kw, idx, j):
    sub = take(case, kw, idx)
    out = fn(**sub)
    return [t.cpu() for t in case.results(sub, out, j)]


def _assert_invariant(name, fn, kw, g, pool=POOL, last_only=False, gpu=False):
    """Rows 0 and pool - 1 (first and last; the 7-row batch puts them in the middle)."""
    case = CASES[name]
    whole = list(range(pool))
    sub = take(case, kw, whole)
    out = fn(**sub)
    for r in ((pool - 1,) if last_only else (0, pool - 1)):
        alone = _results(case, fn, kw, [r], 0)
        assert alone, f"{name}: the case yields no results"
        batches = [(whole, r, [t.cpu() for t in case.results(sub, out, r)])]
        batches += [(idx, j, _results(case, fn, kw, idx, j))
                    for idx, j in _batches(r, g, gpu, pool)]
        for idx, j, got in batches:
            for k, (a, b) in enumerate(zip(alone, got)):
                assert _bits(a).shape == _bits(b).shape and torch.equal(_bits(a), _bits(b)), \
                    f"{name}: result {k} of row {r} alone differs in a {len(idx)}-row batch " \
                    f"(position {j}): max |diff| {(a.double() - b.double()).abs().max():.3g}"


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    """The tensor's bit patterns (NaN payloads and signed zeros included)."""
    return t.contiguous().view(_INT[t.element_size()]) if t.is_floating_point() else t


def test_every_op_has_a_case():
    assert set(KERNELS) == set(CASES), f"ops without a case: {set(KERNELS) - set(CASES)}"


def _to(kw, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_is_batch_invariant(name):
    g = torch.Generator().manual_seed(1)
    kw = CASES[name].build(g, POOL, False)
    _assert_invariant(name, KERNELS[name].reference, kw, g)


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_is_batch_invariant(name):
    g = torch.Generator().manual_seed(2)
    big = torch.cuda.is_available()
    pool = CASES[name].gpu_pool if big else CASES[name].interpreted_pool
    kw = CASES[name].build(g, pool, big)
    if big:
        kw = _to(kw, "cuda")
    _assert_invariant(name, KERNELS[name].launcher, kw, g, pool,
                      last_only=not big and CASES[name].interpreted_last_only, gpu=big)


def test_batch_dependent_plans_only_inside_the_benchmark_switch():
    """Launchers read kernels.invariance.batch_invariant(): True unless a benchmark opts out;
    the opt-out gives the token-count plans (fp8_linear's split at M = 384 shrinks) and ends
    with its block, even on an error."""
    from dspark_compile.kernels import fp8_linear as fl
    from dspark_compile.kernels.invariance import batch_dependent_plans, batch_invariant
    assert batch_invariant()
    splits = {fl.fp8_linear_plan(M, 8192, 4096).split_k for M in (6, 384)}
    assert len(splits) == 1
    with pytest.raises(RuntimeError):
        with batch_dependent_plans():
            assert not batch_invariant()
            assert fl.fp8_linear_plan(384, 8192, 4096, invariant=batch_invariant()).split_k < \
                fl.fp8_linear_plan(6, 8192, 4096, invariant=batch_invariant()).split_k
            raise RuntimeError
    assert batch_invariant()
