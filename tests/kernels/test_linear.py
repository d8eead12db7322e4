"""dspark::linear (kernels/linear.py): the Triton GEMM (TRITON_INTERPRET=1 on CPU machines)
against its reference, at irregular shapes, every M bucket, forced splits and the dtypes the
models call it with; NaN / inf stay in their row.

Tolerances: bf16 operands have exact fp32 products, so kernel and reference differ only in the
order of K fp32 sums, at most 2 K 2^-24 sum_k |x_k w_k| together; a bf16 result is that fp32
value rounded once (one bf16 ulp, rtol 2^-7). fp32 operands round each product too (another
2^-24 relative each).
"""
import pytest
import torch

from dspark_compile.kernels import fp8_linear as fl
from dspark_compile.kernels import linear as lk
from dspark_compile.kernels.fp8_linear import INVARIANT_TILES

OP = torch.ops.dspark.linear
# the kernel runs where its tensors are: the interpreter on a CPU machine, the GPU on one
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _atol(x, w, K, extra=0):
    mag = (x.float().abs() @ w.float().abs().T).max()
    return float((2 * K + extra) * 2.0 ** -24 * mag)


# (M, N, K): one row; K not a multiple of the 128-wide K block; N not a multiple of a tile;
# M past the 16- and 32-row buckets
SHAPES = [(1, 64, 128), (6, 200, 384), (19, 129, 320), (70, 256, 256)]


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16], ids=["fp32-out", "bf16-out"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_bf16_kernel_matches_reference(M, N, K, out):
    x = torch.randn(M, K, generator=_gen(1)).bfloat16().to(DEV)
    w = (torch.randn(N, K, generator=_gen(2)) * 0.1).bfloat16().to(DEV)
    y = lk.linear_launch(x, w, torch.bfloat16, out)
    ref = lk.linear_reference(x, w, torch.bfloat16, out)
    assert y.dtype == out and y.shape == (M, N)
    torch.testing.assert_close(y, ref, atol=_atol(x, w, K),
                               rtol=2.0 ** -7 if out == torch.bfloat16 else 0.0)


def test_fp32_compute_and_an_fp32_input_in_bf16_compute():
    """fp32 compute (x fp32, the bf16 weight widened); bf16 compute rounds an fp32 x to bf16
    first, as the reference does."""
    M, N, K = 5, 96, 256
    x = torch.randn(M, K, generator=_gen(3)).to(DEV)
    w = torch.randn(N, K, generator=_gen(4)).bfloat16().to(DEV)
    y = lk.linear_launch(x, w, torch.float32, torch.float32)
    torch.testing.assert_close(y, lk.linear_reference(x, w, torch.float32, torch.float32),
                               atol=_atol(x, w, K, K), rtol=0.0)
    y16 = lk.linear_launch(x, w, torch.bfloat16, torch.float32)
    torch.testing.assert_close(y16, lk.linear_reference(x, w, torch.bfloat16, torch.float32),
                               atol=_atol(x, w, K), rtol=0.0)


def test_forced_split_k_sums_in_order(monkeypatch):
    """A split of K (3 partials of 128) gives the unsplit values up to summation order, and
    the same bits every time."""
    M, N, K = 4, 64, 384
    x = torch.randn(M, K, generator=_gen(5)).bfloat16().to(DEV)
    w = torch.randn(N, K, generator=_gen(6)).bfloat16().to(DEV)
    plan = lk.linear_plan
    monkeypatch.setattr(lk, "linear_plan", lambda *a, **k: plan(*a, **k)[:3] + (3, 1) +
                        plan(*a, **k)[5:])
    y = lk.linear_launch(x, w, torch.bfloat16, torch.float32)
    torch.testing.assert_close(y, lk.linear_reference(x, w, torch.bfloat16, torch.float32),
                               atol=_atol(x, w, K), rtol=0.0)
    assert torch.equal(y, lk.linear_launch(x, w, torch.bfloat16, torch.float32))


@pytest.mark.parametrize("tokens", sorted(INVARIANT_TILES))
def test_each_invariant_tile_matches_reference(monkeypatch, tokens):
    """Every batch-invariant tile, forced (the interpreter's plans take the 16-token one), its
    second tile partly padded, K split in 2; bf16 and fp32 compute."""
    M, N, K = tokens + 3, 64, 512
    bm, bn, swap, warps, stages = INVARIANT_TILES[tokens]
    monkeypatch.setattr(lk, "linear_plan", lambda *a, **k: (bm, bn, swap, 2, 2, warps,
                                                            min(stages, 2)))
    for dtype, xt in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)):
        x = torch.randn(M, K, generator=_gen(21)).to(xt).to(DEV)
        w = torch.randn(N, K, generator=_gen(22)).bfloat16().to(DEV)
        y = lk.linear_launch(x, w, dtype, torch.float32)
        torch.testing.assert_close(y, lk.linear_reference(x, w, dtype, torch.float32),
                                   atol=_atol(x, w, K), rtol=0.0)


def test_nan_and_inf_stay_in_their_row():
    M, N, K = 4, 64, 256
    x = torch.randn(M, K, generator=_gen(7)).bfloat16().to(DEV)
    x[1, 5], x[2, 9] = float("nan"), float("inf")
    w = torch.randn(N, K, generator=_gen(8)).bfloat16().to(DEV)
    y = lk.linear_launch(x, w, torch.bfloat16, torch.float32)
    ref = lk.linear_reference(x, w, torch.bfloat16, torch.float32)
    assert torch.equal(y.isnan(), ref.isnan()) and y[1].isnan().all()
    assert torch.equal(y[[0, 3]], lk.linear_launch(x[[0, 3]], w, torch.bfloat16, torch.float32))


def test_plan_split_follows_the_weight_not_the_rows():
    for N, K in [(129280, 4096), (256, 4096), (64, 4096), (512, 256)]:
        splits = {lk.linear_plan(M, N, K, 2)[3] for M in (1, 6, 24, 96, 384)}
        assert len(splits) == 1, (N, K, splits)


def test_folded_split_k_is_the_two_launch_sum_and_row_chunks_change_no_bit(monkeypatch):
    """The split-K partials summed by the tile's last program (one launch) equal, bit for bit,
    the second launch's sum (no ring: tile_counters None); outputs past the int32 offset limit
    go in row chunks that change no row."""
    g = _gen(7)
    x = torch.randn(21, 640, generator=g).bfloat16().to(DEV)
    w = torch.randn(200, 640, generator=g).bfloat16().to(DEV)
    plan = lk.linear_plan
    monkeypatch.setattr(lk, "linear_plan", lambda *a, **k: plan(*a, **k)[:3] + (3, 2) +
                        plan(*a, **k)[5:])
    folded = lk.linear_launch(x, w, torch.bfloat16, torch.float32)
    monkeypatch.setattr(fl, "tile_counters", lambda *a, **k: None)
    two = lk.linear_launch(x, w, torch.bfloat16, torch.float32)
    assert torch.equal(folded, two)
    assert torch.allclose(folded, lk.linear_reference(x, w, torch.bfloat16, torch.float32),
                          rtol=0, atol=_atol(x, w, 640))
    monkeypatch.setattr(lk, "OFFSET_LIMIT", 200 * 8)          # chunks of 8 rows
    assert torch.equal(lk.linear_launch(x, w, torch.bfloat16, torch.float32), two)


def test_hopper_budget_deepens_the_pipeline_and_changes_nothing_else(monkeypatch):
    """The LM head's 128-token tile (48 KB a stage) fits one stage in SM12x's 96 KB and three in
    sm_90's budget; the tile, the split and the warps (every output's sum order) stay."""
    assert fl.smem_budget("cpu") == fl.SMEM_BUDGET
    monkeypatch.setattr(fl, "_capability_major", lambda index: 9)
    monkeypatch.setattr(torch.version, "hip", None)
    hopper = fl.smem_budget(torch.device("cuda", 0))
    assert hopper == fl.SMEM_BUDGETS[9] > fl.SMEM_BUDGET
    monkeypatch.setattr(fl, "_capability_major", lambda index: 12)
    assert fl.smem_budget(torch.device("cuda", 0)) == fl.SMEM_BUDGET
    for M in (1, 6, 24, 96, 384):
        small = lk.linear_plan(M, 129280, 4096, 2)
        big = lk.linear_plan(M, 129280, 4096, 2, smem=hopper)
        assert big[:6] == small[:6] and big[6] >= small[6], (M, small, big)
        assert big[6] * 128 * (big[0] + big[1]) * 2 <= hopper
    assert lk.linear_plan(384, 129280, 4096, 2)[6] == 1
    assert lk.linear_plan(384, 129280, 4096, 2, smem=hopper)[6] == 3


def test_op_dispatch_and_errors():
    x = torch.randn(3, 128).bfloat16()
    w = torch.randn(64, 128).bfloat16()
    assert torch.equal(OP(x, w, torch.bfloat16, torch.float32),
                       lk.linear_reference(x, w, torch.bfloat16, torch.float32))
    with pytest.raises(ValueError, match="K = 128"):
        lk.linear_launch(torch.randn(3, 64), w, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="w must be"):
        lk.linear_launch(x, w[0], torch.bfloat16, torch.float32)
    x64 = x.double()   # exact mode: the reference
    assert OP(x64, w, torch.float64, torch.float64).dtype == torch.float64
