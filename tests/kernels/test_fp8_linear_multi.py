"""dspark::fp8_linear_multi: one launch for 2..4 FP8 linears of one activation, each output bit
for bit the separate fp8_linear call's (the Triton kernel under TRITON_INTERPRET=1 on a CPU
machine, on the GPU on a GPU machine); the op's slots, reference, fake and errors."""
import dataclasses

import pytest
import torch

from dspark_compile.kernels import fp8_linear as fl
from dspark_compile.kernels import fp8_linear_multi as fm
from dspark_compile.kernels import semaphores
from dspark_compile.kernels.act_quant import act_quant_reference
from dspark_compile.models.quant_formats import fp8_block_quant

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OP = torch.ops.dspark.fp8_linear_multi
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _bits(t):
    return t.contiguous().view(_INT[t.element_size()])


def _weights(N, K, seed, dev=DEV):
    w = torch.randn(N, K, generator=_gen(seed)) * 0.05
    w[:, :128] *= 64
    q, s = fp8_block_quant(w)
    return q.to(dev), s.view(torch.uint8).to(dev)


def _acts(M, K, seed, dev=DEV):
    x = torch.randn(M, K, generator=_gen(seed)) * 3
    x[: M // 2, 128:256] *= 1e-3
    return act_quant_reference(x.to(dev))


def _plan(K, split, fp8_mma=True, fold=True, block_m=16):
    return fl.Fp8LinearPlan(block_m, 64, True, split, -(-K // 128 // split), 4, 2,
                            fp8_mma=fp8_mma, fold_splitk=fold)


def _one_launch(monkeypatch):
    """The separate-call fallback fails the test."""
    def separate(*a, **k):
        raise AssertionError("fp8_linear_multi fell back to separate fp8_linear launches")
    monkeypatch.setattr(fl, "fp8_linear_launch", separate)


# (M, K, N per weight, splits per weight): M = 1, 5, 17; N 128 / 320 / 512 (320: partial tiles
# and scale blocks); K 256 and 384; 2, 3 and 4 weights; each weight its own split of K
CASES = [(1, 256, (128, 320), (2, 1)), (5, 384, (320, 512, 128), (3, 1, 2)),
         (17, 256, (512, 128, 320, 128), (1, 2, 2, 1)), (17, 384, (320, 320), (1, 1))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("M,K,Ns,splits", CASES)
def test_each_output_is_the_separate_call_bit_for_bit(M, K, Ns, splits, dtype, monkeypatch):
    ws = [_weights(N, K, 10 + j) for j, N in enumerate(Ns)]
    x, x_s = _acts(M, K, 3)
    plans = [_plan(K, s, dtype == torch.bfloat16) for s in splits]
    alone = [fl.fp8_linear_launch(x, x_s, w, s, 1, dtype, plan=p) for (w, s), p in zip(ws, plans)]
    with monkeypatch.context() as m:
        _one_launch(m)
        got = fm.fp8_linear_multi_launch(x, x_s, [w for w, _ in ws], [s for _, s in ws], dtype,
                                         plans=plans)
    assert [y.shape for y in got] == [(M, N) for N in Ns]
    for j, (a, b) in enumerate(zip(got, alone)):
        assert a.is_contiguous() and torch.equal(_bits(a), _bits(b)), j
    ring = semaphores.ring_of(DEV)
    assert ring is None or not bool(ring.any())


def test_default_plans_are_each_weights_own_and_one_launch(monkeypatch):
    """Without forced plans every weight takes fp8_linear_plan's (the same tile, its own split)."""
    M, K, Ns = 5, 384, (320, 128)
    ws = [_weights(N, K, 20 + j) for j, N in enumerate(Ns)]
    x, x_s = _acts(M, K, 4)
    alone = [fl.fp8_linear_launch(x, x_s, w, s, 1, torch.bfloat16) for w, s in ws]
    _one_launch(monkeypatch)
    got = fm.fp8_linear_multi_launch(x, x_s, [w for w, _ in ws], [s for _, s in ws],
                                     torch.bfloat16)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, alone))


def _alone_and_one_launch(monkeypatch, x, x_s, ws, plans, dtype=torch.float32):
    """(each weight's separate fp8_linear call, the one-launch multi call) under `plans`."""
    alone = [fl.fp8_linear_launch(x, x_s, w, s, 1, dtype, plan=p)
             for (w, s), p in zip(ws, plans)]
    _one_launch(monkeypatch)
    return alone, fm.fp8_linear_multi_launch(x, x_s, [w for w, _ in ws], [s for _, s in ws],
                                             dtype, plans=plans)


def test_zero_rows_and_nan_inf_match_the_separate_calls(monkeypatch):
    """Padded zero rows, NaN / inf activations and a NaN fp8 byte, K split in 3 and 2: each
    output is the separate call's bits and NaN exactly where the reference has it."""
    M, K, Ns = 7, 384, (320, 128)
    ws = [_weights(N, K, 30 + j) for j, N in enumerate(Ns)]
    xf = torch.randn(M, K, generator=_gen(5))
    xf[1] = 0.0
    xf[2, 5], xf[3, 200], xf[4, 300] = float("nan"), float("inf"), float("-inf")
    x, x_s = act_quant_reference(xf.to(DEV))
    x = x.clone()
    x.view(torch.uint8)[5, 17] = 0x7F
    alone, got = _alone_and_one_launch(monkeypatch, x, x_s, ws,
                                       [_plan(K, 3, False), _plan(K, 2, False)])
    for (w, s), y, a in zip(ws, got, alone):
        ref = fl.fp8_linear_reference(x, x_s, w, s, 1, torch.float32)
        assert torch.equal(_bits(y), _bits(a))
        assert torch.equal(y.isnan(), ref.isnan()) and bool(y[2:6].isnan().all())
        assert torch.equal(_bits(y[1]), _bits(torch.zeros_like(y[1])))


def test_w8a16_activations_match_the_separate_calls(monkeypatch):
    """x_s None (Precision.act_quant off): float activations, each output the separate call's."""
    M, K, Ns = 3, 256, (128, 320)
    ws = [_weights(N, K, 40 + j) for j, N in enumerate(Ns)]
    x = torch.randn(M, K, generator=_gen(6)).to(DEV)
    alone, got = _alone_and_one_launch(monkeypatch, x, None, ws,
                                       [_plan(K, 2, False), _plan(K, 1, False)])
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, alone))


def test_plans_one_launch_cannot_keep_fall_back_to_separate_calls():
    """Different tiles (a constexpr of the kernel), a non-contiguous weight or the two-launch
    split: separate fp8_linear calls, the same bits."""
    M, K = 5, 256
    (w0, s0), (w1, s1) = _weights(128, K, 50), _weights(256, K, 51)
    x, x_s = _acts(M, K, 7)
    wt = w1.t().contiguous().t()                          # same values, column-major
    for ws, plans in [([w0, w1], [_plan(K, 2), _plan(K, 1, block_m=32)]),
                      ([w0, wt], [_plan(K, 2), _plan(K, 1)]),
                      ([w0, w1], [_plan(K, 2, fold=False), _plan(K, 2, fold=False)])]:
        got = fm.fp8_linear_multi_launch(x, x_s, ws, [s0, s1], torch.bfloat16, plans=plans)
        for w, s, p, y in zip(ws, [s0, s1], plans, got):
            assert torch.equal(y, fl.fp8_linear_launch(x, x_s, w, s, 1, torch.bfloat16, plan=p))


def test_op_slots_reference_and_fake():
    """The op's fixed slots (2 weights + 2 optional) return 4 tensors, the unused ones empty;
    on CPU it is the reference, i.e. the separate fp8_linear references."""
    M, K = 3, 256
    (w0, s0), (w1, s1), (w2, s2) = (_weights(N, K, 60 + N, dev="cpu") for N in (128, 320, 64))
    x, x_s = _acts(M, K, 8, dev="cpu")
    out = OP(x, x_s, w0, s0, w1, s1, w2, s2, None, None, torch.bfloat16)
    assert len(out) == 4 and out[3].shape == (M, 0)
    for w, s, y in zip((w0, w1, w2), (s0, s1, s2), out):
        assert torch.equal(y, fl.fp8_linear_reference(x, x_s, w, s, 1, torch.bfloat16))
    got = fm.fp8_linear_multi_list(x, x_s, [w0, w1], [s0, s1], torch.float32)
    assert len(got) == 2 and got[1].shape == (M, 320) and got[1].dtype == torch.float32
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        f = OP(*(mode.from_tensor(t) for t in (x, x_s, w0, s0, w1, s1)), None, None, None,
               None, torch.float32)
    assert [t.shape for t in f] == [(M, 128), (M, 320), (M, 0), (M, 0)]


def test_bad_arguments_name_the_argument():
    K = 256
    (w0, s0), (w1, s1) = _weights(128, K, 70, dev="cpu"), _weights(128, 384, 71, dev="cpu")
    x, x_s = _acts(2, K, 9, dev="cpu")
    with pytest.raises(ValueError, match=r"ws\[1\].*same K"):
        fm.fp8_linear_multi_launch(x, x_s, [w0, w1], [s0, s1], torch.bfloat16)
    with pytest.raises(ValueError, match="2 to 4 weights"):
        fm.fp8_linear_multi_launch(x, x_s, [w0], [s0], torch.bfloat16)
    with pytest.raises(ValueError, match="2 to 4 weights"):
        fm.fp8_linear_multi_list(x, x_s, [w0] * 5, [s0] * 5, torch.bfloat16)
    with pytest.raises(ValueError, match="w3 given without w2"):
        OP(x, x_s, w0, s0, w0, s0, None, None, w0, s0, torch.bfloat16)
    with pytest.raises(ValueError, match="w_s2"):
        OP(x, x_s, w0, s0, w0, s0, w0, None, None, None, torch.bfloat16)
    with pytest.raises(ValueError, match="plans"):
        fm.fp8_linear_multi_launch(x, x_s, [w0, w0], [s0, s0], torch.bfloat16,
                                   plans=[_plan(K, 1)])


def test_exported_pair_serialises_and_loads():
    """The op in an exported program round-trips through torch.export.save / load."""
    import io

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for j, N in enumerate((128, 256)):
                w, s = _weights(N, 256, 80 + j, dev="cpu")
                self.register_buffer(f"w{j}", w)
                self.register_buffer(f"s{j}", s)

        def forward(self, x, x_s):
            return fm.fp8_linear_multi_list(x, x_s, [self.w0, self.w1], [self.s0, self.s1],
                                            torch.bfloat16)

    x, x_s = _acts(4, 256, 11, dev="cpu")
    ep = torch.export.export(Pair(), (x, x_s))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    got = torch.export.load(buf).module()(x, x_s)
    want = Pair()(x, x_s)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 6, 24, 96, 384])
def test_gpu_flash_sets_are_the_separate_calls_and_replay_in_a_graph(M):
    """The model's sets at Flash shapes (wq_a + wkv, wq_b + the indexer's wq_b, w1 + w3), the
    engine's plans (each weight its own split, folded), bf16 and fp32 out: every output is
    the separate call's bits; captured in a CUDA graph, a replay on new inputs gives them too."""
    for K, Ns in [(4096, (1024, 512)), (1024, (32768, 8192)), (4096, (2048, 2048))]:
        ws = [_weights(N, K, N + j) for j, N in enumerate(Ns)]
        x, x_s = _acts(M, K, M)
        wl, sl = [w for w, _ in ws], [s for _, s in ws]
        for dtype in (torch.bfloat16, torch.float32):
            got = fm.fp8_linear_multi_list(x, x_s, wl, sl, dtype)
            for (w, s), y in zip(ws, got):
                assert torch.equal(_bits(y), _bits(torch.ops.dspark.fp8_linear(
                    x, x_s, w, s, 1, dtype))), (M, K, w.shape, dtype)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = fm.fp8_linear_multi_list(x, x_s, wl, sl, torch.bfloat16)
        x2, x2_s = _acts(M, K, M + 1000)
        x.copy_(x2)
        x_s.copy_(x2_s)
        for _ in range(3):
            graph.replay()
            for (w, s), y in zip(ws, ys):
                assert torch.equal(y, torch.ops.dspark.fp8_linear(x2, x2_s, w, s, 1,
                                                                  torch.bfloat16))
        assert not bool(semaphores.ring_of("cuda").any())


@pytest.mark.gpu
def test_gpu_folded_equals_two_launch_at_flash_shapes():
    """fp8_linear's folded split-K sum against its two-launch sum on the GPU, every decode
    and verify M, the weights the step splits most (wo_b, draft main_proj, wq_a): the same
    bits, repeatedly (a memory-ordering fault would show as a differing or unstable tile)."""
    for N, K in [(4096, 8192), (4096, 12288), (1024, 4096)]:
        w, w_s = _weights(N, K, N + K)
        for M in (1, 6, 24, 96, 384):
            x, x_s = _acts(M, K, M)
            p = fl.fp8_linear_plan(M, N, K)
            assert p.split_k > 1 and p.fold_splitk
            two = fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.bfloat16,
                                       plan=dataclasses.replace(p, fold_splitk=False))
            for _ in range(20):
                y = fl.fp8_linear_launch(x, x_s, w, w_s, 1, torch.bfloat16, plan=p)
                assert torch.equal(y, two), (N, K, M)
    assert not bool(semaphores.ring_of("cuda").any())
