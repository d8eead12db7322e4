"""dspark::moe_experts: the Triton kernels (under TRITON_INTERPRET=1 on CPU) against the reference.

Tiny irregular shapes (8 experts, hidden 64 / 128, intermediate 64): 1 token, token counts that
are no multiple of the 16-row block, all pairs on one expert, experts never hit, slots without
an expert (-1, >= E), padded rows holding garbage, NaN / +-inf activations, hash- and
score-routed gates, the 64-row / narrow GPU tilings. Routing buffers are compared exactly.

Tolerances (outputs are fp32): fp32 activations 1e-5 x the row's largest |y| (fp32 sums in
another order); bf16 activations 2^-6 x the row's largest |y| (the kernel rounds g, u, h and o
to bf16 like the reference, and a different fp32 summation order may flip one of those
roundings by a bf16 ulp, 2^-8 relative). NaN and inf positions must match exactly (NaN never
passes a comparison), finite elements must be finite on both sides.
"""
import dataclasses
import math
import os
import sys
import types

import pytest
import torch

from dspark_compile.kernels import moe
from dspark_compile.kernels.registry import KERNELS
from dspark_compile.models.moe import Gate
from dspark_compile.models.quant_formats import mxfp4_quant

E, I = 8, 64
LIMIT = 10.0
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -6}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _experts(D, seed=0, n=E):
    """MXFP4 w1, s1, w3, s3, w2, s2 of `n` experts; rows at spread magnitudes so the E8M0 scales
    differ per block (scales held as uint8 bytes, as the model stores them)."""
    g = _gen(seed)
    out = []
    for rows, cols in ((I, D), (I, D), (D, I)):
        ws, ss = [], []
        for _ in range(n):
            w = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-4, 1, (rows, 1),
                                                                                generator=g))
            q, s = mxfp4_quant(w * 0.2)
            ws.append(q)
            ss.append(s.view(torch.uint8))
        out += [torch.stack(ws), torch.stack(ss)]
    return out


def _x(T, D, dtype, seed=1, scale=1.0):
    return (torch.randn(T, D, generator=_gen(seed)) * scale).to(dtype)


def _routing(T, k, kind, seed=2):
    g = _gen(seed)
    if kind == "random":           # distinct experts per token, as the gate's top-k
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    elif kind == "one":            # every pair on expert 3 (duplicates within a token too)
        ids = torch.full((T, k), 3)
    elif kind == "few":            # experts 1, 2, 4, 6, 7 never hit
        ids = torch.tensor([0, 5, 3])[torch.randint(0, 3, (T, k), generator=g)]
    elif kind == "holes":          # slots without an expert: -1 (padding) and out of range
        ids = torch.randint(0, E, (T, k), generator=g)
        ids[::2, 0] = -1
        ids[1::3, -1] = E + 5
    w = torch.rand(T, k, generator=g) + 0.25
    return ids.to(torch.int64), w


def _run(x, ids, w, experts, limit=LIMIT, plan=None):
    y = moe.moe_experts_launch(x, ids, w, *experts, limit, plan=plan)
    ref = moe.moe_experts_reference(x, ids, w, *experts, limit)
    return y, ref


def _assert_close(y, ref, dtype):
    assert y.dtype == ref.dtype == torch.float32 and y.shape == ref.shape
    assert torch.equal(y.isnan(), ref.isnan()), "NaN positions differ"
    inf = ref.isinf()
    assert torch.equal(y.isinf(), inf) and torch.equal(y[inf], ref[inf]), "inf positions differ"
    fin = ref.isfinite()
    scale = torch.where(fin, ref.abs(), 0).amax(1, keepdim=True).clamp_min(1e-30)
    err = torch.where(fin, (y - ref).abs() / scale, 0)
    assert err.max().item() <= TOL[dtype], f"max error {err.max().item():.3g} x row scale"


# ------------------------------------------------------------------------------------------------
# routing: exact layout
# ------------------------------------------------------------------------------------------------

def _expected_layout(ids, bm):
    flat = ids.reshape(-1).tolist()
    rows, blocks = {}, []
    for e in range(E):
        pairs = [p for p, x in enumerate(flat) if x == e]
        for b in range(math.ceil(len(pairs) / bm)):
            blocks.append((e, pairs[b * bm:(b + 1) * bm]))
    for b, (_, pairs) in enumerate(blocks):
        for r, p in enumerate(pairs):
            rows[b * bm + r] = p
    return blocks, rows


@pytest.mark.parametrize("T,k,kind,bm", [(1, 2, "random", 16), (7, 3, "random", 16),
                                         (19, 3, "one", 16), (13, 2, "few", 16),
                                         (11, 3, "holes", 16), (40, 4, "random", 64)])
def test_route_layout(T, k, kind, bm):
    ids, _ = _routing(T, k, kind)
    pair, blk_e, blk_rows, count = moe.moe_route_launch(ids, E, bm, block_p=16)
    blocks, rows = _expected_layout(ids, bm)
    nb = moe.max_blocks(T * k, E, bm)
    assert blk_e.shape == (nb,) and pair.shape == (nb * bm,) and len(blocks) <= nb
    assert count.item() == len(blocks)
    assert blk_e.tolist() == [e for e, _ in blocks] + [-1] * (nb - len(blocks))
    assert blk_rows.tolist() == [len(p) for _, p in blocks] + [0] * (nb - len(blocks))
    assert {r: pair[r].item() for r in rows} == rows          # stable: pair order per expert


def test_max_blocks_bounds_every_distribution():
    g = _gen(5)
    for _ in range(300):
        P, bm = int(torch.randint(1, 200, (1,), generator=g)), [16, 64][_ % 2]
        ids = torch.randint(0, int(torch.randint(1, E + 1, (1,), generator=g)), (P,), generator=g)
        used = sum(math.ceil(int((ids == e).sum()) / bm) for e in range(E))
        assert used <= moe.max_blocks(P, E, bm)


# ------------------------------------------------------------------------------------------------
# kernels against the reference
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def experts64():
    return _experts(64)


@pytest.fixture(scope="module")
def experts128():
    return _experts(128, seed=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,k,kind", [(1, 2, "random"), (7, 3, "random"), (19, 3, "one"),
                                      (13, 2, "few"), (11, 3, "holes")])
def test_matches_reference(T, k, kind, dtype, experts64):
    x = _x(T, 64, dtype, seed=T)
    ids, w = _routing(T, k, kind, seed=T + 1)
    y, ref = _run(x, ids, w, experts64)
    assert ref.isfinite().all() and ref.abs().amax() > 0
    _assert_close(y, ref, dtype)
    if kind == "holes":       # a token whose slots all lack an expert gets exactly 0
        ids2 = ids.clone()
        ids2[0] = -1
        y2 = moe.moe_experts_launch(x, ids2, w, *experts64, LIMIT)
        assert torch.equal(y2[0], torch.zeros(64)) and torch.equal(y2[1:], y[1:])


@pytest.mark.parametrize("plan", [moe.MoePlan(block_m=64, block_n=32, block_k=64, block_d=64),
                                  moe.MoePlan(block_m=16, block_n=64, block_k=32, block_p=16,
                                              block_d=32),
                                  moe.MoePlan(block_m=16, block_n=32, block_k=64, block_d=64,
                                              swap_ab=True),
                                  moe.MoePlan(block_m=64, block_n=64, block_k=32, block_d=64,
                                              swap_ab=True)],
                         ids=["bm64", "bk32", "swap", "swap-bm64"])
def test_gpu_tilings(plan, experts128):
    """64-row blocks, narrow N, K split into several steps, several combine programs a row,
    the weight rows on the MMA's M side (swap_ab)."""
    x = _x(21, 128, torch.bfloat16, seed=4)
    ids, w = _routing(21, 3, "random", seed=5)
    y, ref = _run(x, ids, w, experts128, plan=plan)
    _assert_close(y, ref, torch.bfloat16)
    assert torch.equal(y, moe.moe_experts_launch(x, ids, w, *experts128, LIMIT, plan=plan))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # silu(-huge)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # inf - inf
# (no finite overflow: where a sum of finite terms overflows depends on the summation order)
@pytest.mark.parametrize("limit", [LIMIT, 0.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_inf_propagate_as_reference(limit, dtype, experts64):
    x = _x(6, 64, dtype, seed=6)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3, 0] = -float("inf")
    ids, w = _routing(6, 2, "random", seed=7)
    y, ref = _run(x, ids, w, experts64, limit)
    assert ref[1].isnan().all() and ref[0].isfinite().all() and ref[5].isfinite().all()
    _assert_close(y, ref, dtype)


def test_padded_rows_stay_in_their_rows(experts64):
    """The step pads a bucket with the trash row (garbage, here NaN) routed like any row; live
    rows come out bit-equal to a run without the padding, which adds only rows behind them."""
    live = _x(5, 64, torch.bfloat16, seed=8)
    pad = torch.full((3, 64), float("nan"), dtype=torch.bfloat16)
    ids, w = _routing(8, 3, "random", seed=9)
    y_all = moe.moe_experts_launch(torch.cat([live, pad]), ids, w, *experts64, LIMIT)
    y_live = moe.moe_experts_launch(live, ids[:5], w[:5], *experts64, LIMIT)
    assert torch.equal(y_all[:5], y_live) and y_all[5:].isnan().all()
    ref = moe.moe_experts_reference(live, ids[:5], w[:5], *experts64, LIMIT)
    _assert_close(y_live, ref, torch.bfloat16)


def _cfg(hash_layer_vocab=50, k=3):
    return types.SimpleNamespace(n_routed_experts=E, hidden_size=64, vocab_size=hash_layer_vocab,
                                 num_experts_per_tok=k, norm_topk_prob=True,
                                 routed_scaling_factor=1.5)


@pytest.mark.parametrize("hash_layer", [True, False])
def test_hash_and_score_routed_gates(hash_layer, experts64):
    """Both gates' (ids, weights) through the same kernel; hash rows may repeat an expert."""
    gate = Gate(_cfg(), hash_layer)
    g = _gen(10)
    gate.weight.copy_(torch.randn(E, 64, generator=g).bfloat16())
    if hash_layer:
        gate.tid2eid.copy_(torch.randint(0, E, gate.tid2eid.shape, generator=g))
    else:
        gate.bias.copy_(torch.randn(E, generator=g) * 0.1)
    x = _x(9, 64, torch.bfloat16, seed=11)
    tokens = torch.randint(0, 50, (9,), generator=g)
    ids, w = gate(x, tokens)
    y, ref = _run(x, ids, w, experts64)
    _assert_close(y, ref, torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# the registered op, the plan, bad inputs
# ------------------------------------------------------------------------------------------------

SCHEMA = ("dspark::moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, "
          "Tensor s1, Tensor w3, Tensor s3, Tensor w2, Tensor s2, float swiglu_limit) -> Tensor")


def test_op_schema_and_cpu_dispatch(experts64):
    """Engines record op schemas: the fused kernel kept the op's. CPU runs the reference."""
    op = torch.ops.dspark.moe_experts
    assert str(op.default._schema) == SCHEMA
    assert KERNELS["moe_experts"].compile_configs
    x = _x(3, 64, torch.float64, seed=12)
    ids, w = _routing(3, 2, "random", seed=13)
    ref = moe.moe_experts_reference(x, ids, w.double(), *experts64, LIMIT)
    assert ref.dtype == torch.float64
    assert torch.equal(op(x, ids, w.double(), *experts64, LIMIT), ref)
    assert torch.equal(moe.moe_experts_launch(x, ids, w.double(), *experts64, LIMIT), ref)


def test_plan_choices():
    p = moe.moe_plan(36, 256, 4096, 2048)
    assert p.block_m == 16 and p.block_k == 128 and p.block_d == 1024 and p.swap_ab
    big = moe.moe_plan(8192 * 6, 256, 4096, 2048)
    assert big.block_m == 64 and not big.swap_ab
    f32 = moe.moe_plan(36, 256, 4096, 2048, torch.float32)
    assert f32.block_k == 64 and not f32.swap_ab
    assert moe.moe_plan(6, 8, 96, 64).block_k == 32
    with pytest.raises(Exception):
        p.block_m = 32                                        # frozen


def test_bad_inputs_name_the_argument(experts64):
    x = _x(2, 64, torch.bfloat16)
    ids, w = _routing(2, 2, "random")
    with pytest.raises(ValueError, match="topk_ids"):
        moe.moe_experts_launch(x, ids[:1], w, *experts64, LIMIT)
    with pytest.raises(ValueError, match="w2"):
        bad = list(experts64)
        bad[4] = bad[4][:, :32]
        moe.moe_experts_launch(x, ids, w, *bad, LIMIT)
    with pytest.raises(ValueError, match="block_k"):
        moe.moe_experts_launch(x, ids, w, *experts64, LIMIT, plan=moe.MoePlan(block_k=128))


def test_benchmark_cases_build_and_run_on_cpu():
    """benchmarks/kernels.py's moe_experts cases at a tiny size: inputs, reference, op, check."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, os.path.abspath(path))
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_kernels_moe",
                                                  os.path.join(path, "kernels.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cases = bench.moe_cases([1, 4], dims=bench.MoeDims(experts=8, hidden=64, inter=64, top_k=3))
    assert {c.params["routing"] for c in cases} == {"top6-random", "one-expert", "every-expert"}
    dev = torch.device("cpu")
    for c in cases:
        assert c.bytes_moved > 0 and c.params["touched"] >= 1
        assert c.check(dev) == ""
    d = cases[-1].make_inputs(dev, 0)
    ref = cases[-1].reference(d)
    for label, fn in cases[-1].extra.items():      # the baseline and the tuning plans
        assert bench.compare(label, fn(d), ref) == ""


# ------------------------------------------------------------------------------------------------
# GPU: Flash shapes, CUDA-graph replay with changing routing
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("swap", [False, True], ids=["no_swap", "swap_ab"])
@pytest.mark.parametrize("T", [6, 384])
def test_gpu_flash_shapes_and_graph_replay(T, swap):
    dev, D, Ie, En, k = "cuda", 4096, 2048, 256, 6
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g, device=dev)
    sc = lambda *s: torch.randint(118, 124, s, dtype=torch.uint8, generator=g, device=dev)
    ex = [rnd(En, Ie, D // 2), sc(En, Ie, D // 32), rnd(En, Ie, D // 2), sc(En, Ie, D // 32),
          rnd(En, D, Ie // 2), sc(En, D, Ie // 32)]
    x = torch.randn(T, D, generator=g, device=dev).bfloat16()
    ids = torch.rand(T, En, generator=g, device=dev).topk(k, -1).indices
    w = torch.rand(T, k, generator=g, device=dev)
    plan = dataclasses.replace(moe.moe_plan(T * k, En, D, Ie), swap_ab=swap)
    op = lambda: moe.moe_experts_launch(x, ids, w, *ex, LIMIT, plan=plan)
    _assert_close(op().cpu(), moe.moe_experts_reference(x, ids, w, *ex, LIMIT).cpu(),
                  torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op()
    for seed in range(3):                      # new routing each replay, same buffers
        ids.copy_(torch.rand(T, En, generator=g, device=dev).topk(k, -1).indices)
        if seed == 2:
            ids.fill_(7)                       # every pair on one expert
        graph.replay()
        assert torch.equal(out, op()), "replay differs from the uncaptured op"
