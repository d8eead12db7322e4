"""dspark::fp8_linear: the Triton kernel (TRITON_INTERPRET=1 on CPU machines) against its reference,
its plan, its registration, and the linears of models/linear.py that call it.

Tolerances. Every fp8 x fp8 product and every power-of-two scale is exact in fp32, so kernel and
reference differ only in the order of the fp32 sums: over K terms each order errs by at most
K * 2^-24 * sum_k |a_k w_k|, the two together by twice that (`_fp32_atol`, taken at the largest
such sum of the case). A bf16 result is the fp32 one rounded once: the two roundings can land
one bf16 ulp apart, rtol 2^-7. NaN only passes (equal_nan) in the tests whose reference has NaN.
"""
import pytest
import torch

from dspark_compile.kernels import common
from dspark_compile.kernels import fp8_linear as fl
from dspark_compile.kernels import semaphores
from dspark_compile.kernels.act_quant import act_quant_reference
from dspark_compile.kernels.common import row_matmul
from dspark_compile.kernels.linear import linear_reference
from dspark_compile.kernels.registry import KERNELS
from dspark_compile.models.config import Precision
from dspark_compile.models.linear import BF16Linear, FP8Linear, bf16_linear
from dspark_compile.models.quant_formats import fp8_block_dequant, fp8_block_quant

OP = torch.ops.dspark.fp8_linear
BF16_RTOL = 2.0 ** -7
# the kernel runs where its tensors are: the interpreter on a CPU machine, the GPU on one
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _weights(N, K, seed, dev=DEV):
    w = torch.randn(N, K, generator=_gen(seed)) * 0.05
    w[:, :128] *= 64                         # per-block scales that differ between blocks
    q, s = fp8_block_quant(w)
    return q.to(dev), s.view(torch.uint8).to(dev)


def _acts(M, K, seed, dev=DEV):
    x = torch.randn(M, K, generator=_gen(seed)) * 3
    x[: M // 2, 128:256] *= 1e-3             # a group whose scale is far below the others'
    return act_quant_reference(x.to(dev))


def _fp32_atol(x, x_s, w, w_s, groups):
    """2 K 2^-24 max sum_k |a_k w_k|: two fp32 summation orders of K exact products."""
    a = x.float().unflatten(-1, (-1, 128)).mul(x_s[..., None]).flatten(-2).abs()
    wd = fp8_block_dequant(w, w_s).abs()
    K = w.shape[1]
    if groups == 1:
        mag = a @ wd.T
    else:
        mag = torch.einsum("mgi,goi->mgo", a.view(a.shape[0], groups, K),
                           wd.view(groups, -1, K)).flatten(1)
    return 2 * K * 2.0 ** -24 * float(mag.max())


def _assert_matches(y, ref, atol, dtype, equal_nan=False):
    rtol = BF16_RTOL if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(y, ref, rtol=rtol, atol=atol, equal_nan=equal_nan)


# (M, N, K, groups): M = 1; M not a multiple of any tile (19, 70: two 64-row tiles, the second
# padded); N and K at 128; N = 200 (a partial weight-scale block); two groups of 128 rows.
SHAPES = [(1, 128, 128, 1), (19, 256, 384, 1), (6, 256, 256, 2), (40, 200, 256, 1),
          (70, 128, 256, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("M,N,K,groups", SHAPES)
def test_kernel_matches_reference(M, N, K, groups, dtype):
    w, w_s = _weights(N, K, 1)
    x, x_s = _acts(M, groups * K, 2)
    y = fl.fp8_linear_launch(x, x_s, w, w_s, groups, dtype)
    ref = fl.fp8_linear_reference(x, x_s, w, w_s, groups, dtype)
    assert y.dtype == dtype and y.shape == (M, N)
    _assert_matches(y, ref, _fp32_atol(x, x_s, w, w_s, groups), dtype)


@pytest.mark.parametrize("swap,split,per", [(True, 4, 1), (False, 2, 2), (True, 1, 4)])
def test_split_k_and_swap_ab(swap, split, per):
    """Forced plans at K = 512 (4 blocks): split partials summed in order, either orientation;
    the same plan twice gives the same bits (no atomics)."""
    M, N, K = 5, 256, 512
    w, w_s = _weights(N, K, 3)
    x, x_s = _acts(M, K, 4)
    plan = fl.Fp8LinearPlan(16, 64, swap, split, per, 4, 2)
    y = fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.bfloat16, plan=plan)
    ref = fl.fp8_linear_reference(x, x_s, w, w_s, 1, torch.bfloat16)
    _assert_matches(y, ref, _fp32_atol(x, x_s, w, w_s, 1), torch.bfloat16)
    assert torch.equal(y, fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.bfloat16, plan=plan))


def test_nan_inf_rows_propagate_and_stay_in_their_row():
    """NaN / +inf / -inf activations (quantized as the model does: the group's scale becomes
    NaN / inf) and a NaN fp8 byte make exactly the reference's NaN rows; the clean rows (a step's
    real rows beside padded ones holding anything) equal those computed alone."""
    M, N, K = 6, 128, 256
    w, w_s = _weights(N, K, 5)
    xf = torch.randn(M, K, generator=_gen(6)).to(DEV)
    xf[1, 3], xf[2, 130], xf[3, 7] = float("nan"), float("inf"), float("-inf")
    x, x_s = act_quant_reference(xf)
    x = x.clone()
    x.view(torch.uint8)[4, 200] = 0x7F       # e4m3 NaN byte, finite scale
    ref = fl.fp8_linear_reference(x, x_s, w, w_s, 1, torch.float32)
    assert ref[1:5].isnan().all() and not ref[[0, 5]].isnan().any()
    y = fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.float32)
    _assert_matches(y, ref, _fp32_atol(x[[0, 5]], x_s[[0, 5]], w, w_s, 1), torch.float32,
                    equal_nan=True)
    alone = fl.fp8_linear_launch(x[[0, 5]], x_s[[0, 5]], w, w_s, 1, torch.float32)
    assert torch.equal(y[[0, 5]], alone)


def test_reference_decode_cache_follows_the_weights():
    """The reference keeps the dequantized weight between eager CPU calls (kernels/common.py
    `cached_decode`): a fresh view gives the same bits, an in-place write is seen."""
    x, x_s = _acts(5, 256, seed=31, dev="cpu")
    w, w_s = _weights(96, 256, seed=32, dev="cpu")
    def uncached():
        saved = common.DECODE_CACHE_BYTES
        common.DECODE_CACHE_BYTES = 0
        try:
            return fl.fp8_linear_reference(x, x_s, w, w_s, 1, torch.float32)
        finally:
            common.DECODE_CACHE_BYTES = saved

    want = uncached()
    assert torch.equal(fl.fp8_linear_reference(x, x_s, w, w_s, 1, torch.float32), want)
    assert torch.equal(fl.fp8_linear_reference(x, x_s, w[:], w_s[:], 1, torch.float32), want)
    w_s[0, 0] += 1                                        # block (0, 0)'s scale doubled in place
    changed = uncached()
    assert not torch.equal(changed, want)
    assert torch.equal(fl.fp8_linear_reference(x, x_s, w, w_s, 1, torch.float32), changed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_w8a16_kernel(dtype):
    """Precision.act_quant off: float activations, fp8 weight (fp8 -> dtype is exact). bf16
    products are exact in fp32 as well; fp32 ones round once each (another 2^-24 relative)."""
    M, N, K = 3, 128, 256
    w, w_s = _weights(N, K, 7)
    x = torch.randn(M, K, generator=_gen(8)).to(dtype).to(DEV)
    y = fl.fp8_linear_launch(x, None, w, w_s, 1, dtype)
    ref = fl.fp8_linear_reference(x, None, w, w_s, 1, dtype)
    mag = (x.float().abs() @ fp8_block_dequant(w, w_s).abs().T).max()
    _assert_matches(y, ref, float((2 * K + 1) * 2.0 ** -24 * mag), dtype)


# ------------------------------------------------------------------------------------------------
# split-K folded into the GEMM launch (the tile's last program sums; kernels/semaphores.py)
# ------------------------------------------------------------------------------------------------

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t):
    """Bit patterns: NaN payloads and signed zeros compared too."""
    return t.contiguous().view(_INT[t.element_size()])


def _no_sum_launch(monkeypatch):
    """Make the two-launch path's sum kernel fail if it is launched."""
    def boom(*a, **k):
        raise AssertionError("the folded path launched _splitk_sum_kernel")
    monkeypatch.setattr(fl, "_splitk_sum_kernel", type("NoLaunch", (), {"__getitem__": boom})())


def _poison_workspace(x, x_s, w, w_s, dtype, split):
    """A two-launch call on -x just before: the next launch of this shape gets its freed
    workspace back (the allocator reuses it) holding the wrong partials, so a fold that read
    a split before it was written would not pass by luck."""
    neg = (x.view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)
    fl.fp8_linear_launch(neg, x_s, w, w_s, 1, dtype,
                         plan=_split_plan(w.shape[1], split, False, dtype == torch.bfloat16))


def _split_plan(K, split, fold=True, fp8_mma=True):
    per = -(-K // 128 // split)
    return fl.Fp8LinearPlan(16, 64, True, split, per, 4, 2, fp8_mma=fp8_mma, fold_splitk=fold)


def _ring_is_zero():
    ring = semaphores.ring_of(DEV)
    return ring is None or not bool(ring.any())


# (M, N, K): M = 1, 5, 17 (17: a second, padded 16-row tile); N = 320 (a partial 64-wide tile
# and a partial 128-row scale block); K = 384 (3 blocks: splits of 1 + 1 + 1, or 2 + 1)
FOLD_SHAPES = [(1, 128, 256), (5, 320, 384), (17, 512, 256), (17, 320, 384)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("M,N,K", FOLD_SHAPES)
def test_folded_split_k_is_the_two_launch_sum_bit_for_bit(M, N, K, dtype, monkeypatch):
    """Every split of K (2 and K/128 splits): the folded launch equals the two-launch result
    bit for bit and the reference within the summation bound, without a sum launch, and
    leaves every tile counter at 0."""
    w, w_s = _weights(N, K, 41)
    x, x_s = _acts(M, K, 42)
    ref = fl.fp8_linear_reference(x, x_s, w, w_s, 1, dtype)
    for split in sorted({2, K // 128}):
        two = fl.fp8_linear_launch(x, x_s, w, w_s, 1, dtype,
                                   plan=_split_plan(K, split, False, dtype == torch.bfloat16))
        _poison_workspace(x, x_s, w, w_s, dtype, split)
        with monkeypatch.context() as m:
            _no_sum_launch(m)
            folded = fl.fp8_linear_launch(x, x_s, w, w_s, 1, dtype,
                                          plan=_split_plan(K, split, True, dtype == torch.bfloat16))
        assert torch.equal(_bits(folded), _bits(two)), (split, M, N, K)
        _assert_matches(folded, ref, _fp32_atol(x, x_s, w, w_s, 1), dtype)
        assert _ring_is_zero()


def test_counters_reset_between_calls_of_any_shape(monkeypatch):
    """Calls of different shapes in sequence, each twice: every result is the two-launch one,
    each launch takes slots after the previous launch's, and all are back at 0 after."""
    _no_sum_launch(monkeypatch)
    got = []
    for M, N, K in [(5, 320, 384), (1, 128, 256), (17, 512, 256), (5, 320, 384)]:
        w, w_s = _weights(N, K, N + K)
        x, x_s = _acts(M, K, M)
        want = fl.fp8_linear_reference(x, x_s, w, w_s, 1, torch.float32)
        for _ in range(2):
            # fp32 output: the widened bf16 MMA (fp8_linear_plan's for fp32_out; the FP8 MMA's
            # narrow accumulation is outside the fp32 tolerance, measured on the H100)
            got.append(fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.float32,
                                             plan=_split_plan(K, K // 128, fp8_mma=False)))
            _assert_matches(got[-1], want, _fp32_atol(x, x_s, w, w_s, 1), torch.float32)
            assert _ring_is_zero()
        assert torch.equal(got[-1], got[-2])
    a, b = semaphores.tile_counters(DEV, 3), semaphores.tile_counters(DEV, 5)
    assert b.data_ptr() == a.data_ptr() + 3 * 4                # the next slots of the ring


def test_zero_rows_and_nan_inf_propagate_through_the_fold(monkeypatch):
    """Padded all-zero rows give exact zeros (+0.0, as the two-launch sum from zeros gives), a
    NaN / inf activation makes exactly the reference's NaN rows, with K split in 3."""
    M, N, K = 7, 320, 384
    w, w_s = _weights(N, K, 43)
    xf = torch.randn(M, K, generator=_gen(44))
    xf[1] = 0.0
    xf[2, 5], xf[3, 200], xf[4, 300] = float("nan"), float("inf"), float("-inf")
    x, x_s = act_quant_reference(xf.to(DEV))
    ref = fl.fp8_linear_reference(x, x_s, w, w_s, 1, torch.float32)
    two = fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.float32, plan=_split_plan(K, 3, False,
                                                                                  False))
    _poison_workspace(x, x_s, w, w_s, torch.float32, 3)
    _no_sum_launch(monkeypatch)
    y = fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.float32, plan=_split_plan(K, 3, True,
                                                                                False))
    assert torch.equal(_bits(y), _bits(two))
    assert torch.equal(y.isnan(), ref.isnan()) and bool(y[2:5].isnan().all())
    assert torch.equal(_bits(y[1]), _bits(torch.zeros_like(y[1])))
    clean = [0, 1, 5, 6]
    _assert_matches(y[clean], ref[clean], _fp32_atol(x[clean], x_s[clean], w, w_s, 1),
                    torch.float32)


def test_tile_counters_come_from_one_ring_and_refuse_bad_counts(monkeypatch):
    with pytest.raises(ValueError, match="count"):
        semaphores.tile_counters(DEV, 0)
    with pytest.raises(ValueError, match="count"):
        semaphores.tile_counters(DEV, semaphores.RING_SLOTS + 1)
    ring = semaphores.tile_counters(DEV, 1)
    base = semaphores.ring_of(DEV).data_ptr()
    last = semaphores.tile_counters(DEV, semaphores.RING_SLOTS - 1)   # wraps to the start
    assert last.data_ptr() == base and ring.dtype == torch.int32


def test_capture_before_the_ring_exists_takes_the_two_launch_path(monkeypatch):
    """While a CUDA graph captures and the device has no counter ring yet, no ring is
    allocated (it would belong to the graph): the launch sums with the second launch."""
    monkeypatch.setattr(semaphores, "_RINGS", {})
    monkeypatch.setattr(semaphores, "_capturing", lambda device: True)
    launched = []
    real = fl._splitk_sum_kernel
    monkeypatch.setattr(fl, "_splitk_sum_kernel", type("Count", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    M, N, K = 5, 128, 256
    w, w_s = _weights(N, K, 45)
    x, x_s = _acts(M, K, 46)
    y = fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.bfloat16, plan=_split_plan(K, 2))
    assert launched and semaphores.ring_of(DEV) is None
    assert torch.equal(y, fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.bfloat16,
                                               plan=_split_plan(K, 2, False)))


# ------------------------------------------------------------------------------------------------
# plan and compile configurations
# ------------------------------------------------------------------------------------------------

# distinct (N, K, groups) of the Flash FP8 linears (kernels/fp8_linear.py's table)
FLASH = [(1024, 4096, 1), (32768, 1024, 1), (512, 4096, 1), (8192, 1024, 1), (8192, 4096, 8),
         (4096, 8192, 1), (2048, 4096, 1), (4096, 2048, 1), (4096, 12288, 1)]


def _declared():
    return {(c[2]["BLOCK_M"], c[2]["BLOCK_N"], c[2]["SWAP_AB"], c[2]["NUM_STAGES"], c[3])
            for c in KERNELS["fp8_linear"].compile_configs if "BLOCK_M" in c[2]}


@pytest.mark.parametrize("tokens", sorted(fl.INVARIANT_TILES))
def test_each_invariant_tile_matches_reference(tokens):
    """Every batch-invariant tile, forced (the interpreter's plans take the 16-token one), at
    a token count that leaves its second tile partly padded, K split in 2."""
    M, N, K = tokens + 3, 128, 512
    bm, bn, swap, warps, stages = fl.INVARIANT_TILES[tokens]
    w, w_s = _weights(N, K, 11)
    x, x_s = _acts(M, K, 12)
    for dtype in (torch.bfloat16, torch.float32):
        plan = fl.Fp8LinearPlan(bm, bn, swap, 2, 2, warps, stages,
                                fp8_mma=dtype == torch.bfloat16)
        y = fl.fp8_linear_launch(x, x_s, w, w_s, 1, dtype, plan=plan)
        ref = fl.fp8_linear_reference(x, x_s, w, w_s, 1, dtype)
        _assert_matches(y, ref, _fp32_atol(x, x_s, w, w_s, 1), dtype)


def test_invariant_plans_swap_at_every_m_and_split_by_the_weight():
    """On a GPU the invariant tile widens with M, always (W x^T) with 64 weight rows; the
    interpreter's is the 16-token tile; the K split is the same at every M."""
    for N, K, G in FLASH:
        plans = [fl.fp8_linear_plan(M, N, K, G) for M in (1, 6, 17, 24, 64, 96, 384)]
        assert [p.block_m for p in plans] == [16, 16, 32, 32, 64, 128, 128]
        assert all(p.swap_ab and p.block_n == 64 for p in plans)
        assert len({(p.split_k, p.kb_per_split) for p in plans}) == 1, (N, K)
        assert fl.fp8_linear_plan(384, N, K, G, interpret=True).block_m == 16


@pytest.mark.parametrize("a_bytes", [1, 2, 4])
def test_every_plan_at_flash_shapes_is_a_declared_config(a_bytes):
    declared = _declared()
    for N, K, G in FLASH + [(128, 256, 2)]:          # + the tiny preset's wo_a
        for M in (1, 6, 24, 96, 384):
            p = fl.fp8_linear_plan(M, N, K, G, a_bytes)
            assert (p.block_m, p.block_n, p.swap_ab, p.num_stages, p.num_warps) in declared
            assert (N // G) % p.block_n == 0 or G == 1
            assert (p.split_k - 1) * p.kb_per_split < K // 128 <= p.split_k * p.kb_per_split
            if M <= 16 and N * K >= 2 ** 22:          # streamed weights cover ~2 SM waves
                tiles = -(-N // p.block_n) * p.split_k
                assert tiles >= fl.SM_COUNT_HINT or p.kb_per_split <= fl.MIN_KB_PER_SPLIT


# ------------------------------------------------------------------------------------------------
# the op and the model's linears (CPU: the op runs its reference)
# ------------------------------------------------------------------------------------------------

def test_op_on_cpu_is_the_reference_and_fake_has_the_shape():
    w, w_s = _weights(256, 256, 9, dev="cpu")
    x, x_s = _acts(3, 512, 10, dev="cpu")
    y = OP(x.view(3, 512), x_s, w, w_s, 2, torch.bfloat16)
    assert torch.equal(y, fl.fp8_linear_reference(x, x_s, w, w_s, 2, torch.bfloat16))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        f = OP(*(mode.from_tensor(t) for t in (x, x_s, w, w_s)), 2, torch.float32)
    assert f.shape == (3, 256) and f.dtype == torch.float32


@pytest.mark.parametrize("prec", [Precision(dtype=torch.float32), Precision.exact(torch.float64)],
                         ids=["fp32-act-quant", "fp64-exact"])
def test_fp8_linear_module_keeps_todays_numerics(prec):
    """FP8Linear on CPU = dequantize x and W to the accumulation dtype, one matmul of 16-row
    calls (row_matmul, batch invariant): bit for bit; and within the summation-order bound of
    the plain product."""
    lin = FP8Linear(256, 384, prec)
    lin.weight, s = _weights(256, 384, 11, dev="cpu")
    lin.scale.copy_(s)
    x = torch.randn(5, 384, generator=_gen(12)).to(prec.dtype)
    acc = prec.dtype
    xa = x
    if prec.act_quant:
        q, qs = act_quant_reference(x)
        xa = (q.float().unflatten(-1, (-1, 128)) * qs[..., None]).flatten(-2)
    wd = fp8_block_dequant(lin.weight, lin.scale, dtype=acc)
    got = lin(x)
    assert torch.equal(got, row_matmul(xa.to(acc), wd.T).to(prec.dtype))
    plain = (xa.to(acc) @ wd.T).to(prec.dtype)
    bound = 2 * 384 * torch.finfo(acc).eps * (xa.abs().to(acc) @ wd.abs().T)
    assert ((got - plain).abs() <= bound).all()


def test_exported_linear_is_one_opaque_node():
    lin = FP8Linear(128, 256, Precision())
    ep = torch.export.export(lin, (torch.randn(4, 256).to(torch.bfloat16),), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("dspark.fp8_linear.default") == 1
    assert not any("mm" in t or "einsum" in t for t in targets)


def test_bf16_linear_keeps_the_weight_bf16():
    """bf16 compute: one dspark::linear on the bf16 weight (exact products, fp32 sums), a bf16
    result rounded once from them; fp64 compute multiplies in fp64."""
    lin = BF16Linear(64, 128, Precision())
    lin.weight.copy_(torch.randn(64, 128, generator=_gen(13)).to(torch.bfloat16))
    x = torch.randn(3, 128, generator=_gen(14)).to(torch.bfloat16)
    want = (x.float() @ lin.weight.float().T)
    atol = 2 * 128 * 2.0 ** -24 * float((x.float().abs() @ lin.weight.float().abs().T).max())
    assert lin(x).dtype == torch.bfloat16
    torch.testing.assert_close(lin(x).float(), want, rtol=BF16_RTOL, atol=atol)
    torch.testing.assert_close(lin(x, out_dtype=torch.float32), want, rtol=0.0, atol=atol)
    assert torch.equal(lin(x, out_dtype=torch.float32),
                       linear_reference(x, lin.weight, torch.bfloat16, torch.float32))
    torch.testing.assert_close(bf16_linear(x.double(), lin.weight, torch.float64, torch.float64),
                               x.double() @ lin.weight.double().T, rtol=1e-15, atol=1e-13)


# Flash shapes (N, K, groups): wq_b, wkv, wo_a (8 groups), wo_b, draft.main_proj
FLASH_SHAPES = [(32768, 1024, 1), (512, 4096, 1), (8192, 4096, 8), (4096, 8192, 1),
                (4096, 12288, 1)]


def _on_cuda(*ts):
    return [t.cuda() if t is not None else None for t in ts]


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,groups", FLASH_SHAPES)
def test_gpu_flash_shapes_match_reference_and_replay_in_a_graph(N, K, groups):
    """Every M bucket's plan (swap-AB and split-K at decode, 64-row tiles at prefill) on the
    GPU against the reference on the same device, bf16 and fp32 out; the op captured in a CUDA
    graph replays to the same bits on fresh inputs copied into its buffers."""
    w, w_s = _on_cuda(*_weights(N, K, 3))
    for M in (1, 6, 24, 96, 384):
        x, x_s = _on_cuda(*_acts(M, groups * K, M))
        atol = _fp32_atol(x, x_s, w, w_s, groups)
        for dtype in (torch.bfloat16, torch.float32):
            y = OP(x, x_s, w, w_s, groups, dtype)
            _assert_matches(y, fl.fp8_linear_reference(x, x_s, w, w_s, groups, dtype), atol, dtype)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_g = OP(x, x_s, w, w_s, groups, torch.bfloat16)
        x2, x2_s = _on_cuda(*_acts(M, groups * K, M + 1000))
        x.copy_(x2)
        x_s.copy_(x2_s)
        graph.replay()
        assert torch.equal(y_g, OP(x2, x2_s, w, w_s, groups, torch.bfloat16)), M
