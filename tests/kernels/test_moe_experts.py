"""dspark::moe_experts: the Triton kernels (under TRITON_INTERPRET=1 on CPU) against the reference.

Tiny shapes (8 experts, hidden 128 / 256, intermediate 128: the kernel layout's K tile is
128 or 256), both weight layouts (the
checkpoint's and the kernel's tiled one, kernels/moe_layout.py): 1 token, token counts that
are no multiple of the 16-row block, all pairs on one expert, experts never hit, slots without
an expert (-1, >= E), padded rows holding garbage or flagged not `valid`, NaN / +-inf
activations, wide scale bytes (0, > 128, 255), hash- and score-routed gates, other tilings;
batch invariance (a token's output bits alone and at every position of larger batches).
Routing buffers are compared exactly.

Tolerances (outputs are fp32): fp32 activations 1e-5 x the row's largest |y| (fp32 sums in
another order); bf16 activations 2^-6 x the row's largest |y| (the kernel rounds g, u, h and o
to bf16 like the reference, and a different fp32 summation order may flip one of those
roundings by a bf16 ulp, 2^-8 relative). NaN and inf positions must match exactly (NaN never
passes a comparison), finite elements must be finite on both sides.
"""
import math
import os
import sys
import types

import pytest
import torch

from dspark_compile.kernels import common, moe
from dspark_compile.kernels import moe_layout as ml
from dspark_compile.kernels.registry import KERNELS
from dspark_compile.models.moe import Experts, Gate, sync_kernel_layouts, use_kernel_layouts
from dspark_compile.models.quant_formats import mxfp4_quant

E, I = 8, 128
H = 128                 # hidden of the `experts_h` fixture; `experts_2h` has 2 H
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


LAYOUTS = ("checkpoint", "tiled")


def _laid_out(experts, layout):
    """(six tensors, layout name) of checkpoint-layout `experts` in `layout`."""
    if layout == "checkpoint":
        return tuple(experts), ml.CHECKPOINT
    return ml.experts_to_kernel(*experts)


def _run(x, ids, w, experts, limit=LIMIT, plan=None, layout="checkpoint", valid=None):
    tensors, name = _laid_out(experts, layout)
    y = moe.moe_experts_launch(x, ids, w, *tensors, limit, name, valid, plan=plan)
    ref = moe.moe_experts_reference(x, ids, w, *experts, limit, valid=valid)
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

def _expected_layout(ids, bm, n_experts=E):
    flat = ids.reshape(-1).tolist()
    rows, blocks = {}, []
    for e in range(n_experts):
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


@pytest.mark.parametrize("n_experts", [256, 72])
def test_route_layout_at_flash_expert_counts(n_experts):
    """256 experts (a power of two: no spare histogram bin for the pairs that are none) and 72,
    with padded tokens, ids out of range and -1 slots."""
    T, k, bm = 64, 6, 16
    g = _gen(n_experts)
    ids = torch.randint(0, n_experts, (T, k), generator=g)
    ids[::5, 1] = -1
    ids[3::7, 0] = n_experts
    valid = torch.rand(T, generator=g) > 0.2
    pair, blk_e, blk_rows, count = moe.moe_route_launch(ids, n_experts, bm, valid=valid)
    blocks, rows = _expected_layout(torch.where(valid[:, None], ids, -1), bm, n_experts)
    nb = moe.max_blocks(T * k, n_experts, bm)
    assert count.item() == len(blocks)
    assert blk_e.tolist() == [e for e, _ in blocks] + [-1] * (nb - len(blocks))
    assert blk_rows.tolist() == [len(p) for _, p in blocks] + [0] * (nb - len(blocks))
    assert {r: pair[r].item() for r in rows} == rows


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
def experts_h():
    return _experts(H)


@pytest.fixture(scope="module")
def experts_2h():
    return _experts(2 * H, seed=3)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,k,kind", [(1, 2, "random"), (7, 3, "random"), (19, 3, "one"),
                                      (13, 2, "few"), (11, 3, "holes")])
def test_matches_reference(T, k, kind, dtype, layout, experts_h):
    x = _x(T, H, dtype, seed=T)
    ids, w = _routing(T, k, kind, seed=T + 1)
    y, ref = _run(x, ids, w, experts_h, layout=layout)
    assert ref.isfinite().all() and ref.abs().amax() > 0
    _assert_close(y, ref, dtype)
    if kind == "holes":       # a token whose slots all lack an expert gets exactly 0
        ids2 = ids.clone()
        ids2[0] = -1
        tensors, name = _laid_out(experts_h, layout)
        y2 = moe.moe_experts_launch(x, ids2, w, *tensors, LIMIT, name)
        assert torch.equal(y2[0], torch.zeros(H)) and torch.equal(y2[1:], y[1:])


def test_layouts_agree_at_the_same_tiles(experts_2h):
    """Both layouts decode to the same exact weights; the tiled kernel sums a K tile slab by
    slab (moe_layout.py), the checkpoint kernel in natural K order, so the two agree within the
    dtype's tolerance at the same tiles, and the tiled call twice is bit-equal."""
    x = _x(9, 2 * H, torch.bfloat16, seed=14)
    ids, w = _routing(9, 3, "random", seed=15)
    tensors, name = ml.experts_to_kernel(*experts_2h)
    lay = ml.parse_layout(name)
    plan = moe.MoePlan(lay.gate_up_tile, lay.down_tile)
    y_ckpt = moe.moe_experts_launch(x, ids, w, *experts_2h, LIMIT, plan=plan)
    y_tiled = moe.moe_experts_launch(x, ids, w, *tensors, LIMIT, name)
    _assert_close(y_tiled, y_ckpt, torch.bfloat16)
    assert torch.equal(moe.moe_experts_launch(x, ids, w, *tensors, LIMIT, name), y_tiled)


def test_other_tilings(experts_2h):
    """Narrow N tiles, K in several steps (gate/up), several combine programs a row; the tiled
    layout built at the same tiles (its name carries them)."""
    gu, dn = (32, 128), (16, 128)
    x = _x(5, 2 * H, torch.bfloat16, seed=4)
    ids, w = _routing(5, 2, "random", seed=5)
    plan = moe.MoePlan(gu, dn, block_d=32)
    y, ref = _run(x, ids, w, experts_2h, plan=plan)
    _assert_close(y, ref, torch.bfloat16)
    w1, s1, w3, s3, w2, s2 = experts_2h
    laid = ml.to_kernel(w1, s1, gu) + ml.to_kernel(w3, s3, gu) + ml.to_kernel(w2, s2, dn)
    name = ml.TiledLayout(gu, dn).name
    _assert_close(moe.moe_experts_launch(x, ids, w, *laid, LIMIT, name), ref, torch.bfloat16)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # silu(-huge)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # inf - inf
# (no finite overflow: where a sum of finite terms overflows depends on the summation order)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("limit", [LIMIT, 0.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_inf_propagate_as_reference(limit, dtype, layout, experts_h):
    x = _x(6, H, dtype, seed=6)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3, 0] = -float("inf")
    ids, w = _routing(6, 2, "random", seed=7)
    y, ref = _run(x, ids, w, experts_h, limit, layout=layout)
    assert ref[1].isnan().all() and ref[0].isfinite().all() and ref[5].isfinite().all()
    _assert_close(y, ref, dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # 0 * inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wide_scale_bytes_as_reference(dtype, experts_h):
    """Scale bytes 0 (2^-127), 129..200 (weights up to 6 * 2^13) and 255 (inf: 0 * inf is NaN)
    in some experts: the tiled layout is named wide and multiplies twice; both layouts give
    the reference's values, infs and NaNs."""
    ex = [t.clone() for t in experts_h]
    ex[1][2, :4] = 0                       # w1 of expert 2: tiny
    ex[1][5, 1, :] = 140                   # w1 of expert 5, row 1: huge
    ex[3][6, 3, 0] = 255                   # w3 of expert 6, row 3, first 32: inf
    ex[5][2, :, 1] = 129                   # w2 of expert 2
    tensors, name = ml.experts_to_kernel(*ex)
    assert name.endswith(":wide")
    x = _x(8, H, dtype, seed=16, scale=1e-3)
    ids, w = _routing(8, 3, "random", seed=17)
    ids[0] = torch.tensor([2, 5, 6])
    ref = moe.moe_experts_reference(x, ids, w, *ex, 0.0)
    assert not ref[0].isfinite().all() and ref.isfinite().any()
    for t, lay in ((ex, ml.CHECKPOINT), (tensors, name)):
        _assert_close(moe.moe_experts_launch(x, ids, w, *t, 0.0, lay), ref, dtype)


def test_padded_rows_stay_in_their_rows(experts_h):
    """The step pads a bucket with the trash row (garbage, here NaN) routed like any row; live
    rows come out bit-equal to a run without the padding, which adds only rows behind them."""
    live = _x(5, H, torch.bfloat16, seed=8)
    pad = torch.full((3, H), float("nan"), dtype=torch.bfloat16)
    ids, w = _routing(8, 3, "random", seed=9)
    y_all = moe.moe_experts_launch(torch.cat([live, pad]), ids, w, *experts_h, LIMIT)
    y_live = moe.moe_experts_launch(live, ids[:5], w[:5], *experts_h, LIMIT)
    assert torch.equal(y_all[:5], y_live) and y_all[5:].isnan().all()
    ref = moe.moe_experts_reference(live, ids[:5], w[:5], *experts_h, LIMIT)
    _assert_close(y_live, ref, torch.bfloat16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_not_valid_read_no_expert(layout, experts_h):
    """`valid` False (the step's padded rows): the row's pairs are no pairs (no expert block,
    output 0, NaN garbage never read); the live rows are bit-equal to a run without it."""
    x = _x(9, H, torch.bfloat16, seed=18)
    x[[2, 7]] = float("nan")
    ids, w = _routing(9, 3, "random", seed=19)
    valid = torch.ones(9, dtype=torch.bool)
    valid[[2, 7]] = False
    y, ref = _run(x, ids, w, experts_h, layout=layout, valid=valid)
    assert torch.equal(y[[2, 7]], torch.zeros(2, H)) and torch.equal(ref[[2, 7]], y[[2, 7]])
    _assert_close(y, ref, torch.bfloat16)
    tensors, name = _laid_out(experts_h, layout)
    gone = ids.clone()
    gone[[2, 7]] = -1
    assert torch.equal(y, moe.moe_experts_launch(x, gone, w, *tensors, LIMIT, name))
    pair, blk_e, blk_rows, count = moe.moe_route_launch(ids, E, valid=valid)
    assert int(blk_rows.sum()) == 7 * 3                         # 2 rows x 3 slots dropped


def _cfg(hash_layer_vocab=50, k=3):
    return types.SimpleNamespace(n_routed_experts=E, hidden_size=H, vocab_size=hash_layer_vocab,
                                 num_experts_per_tok=k, norm_topk_prob=True,
                                 routed_scaling_factor=1.5)


@pytest.mark.parametrize("hash_layer", [True, False])
def test_hash_and_score_routed_gates(hash_layer, experts_h):
    """Both gates' (ids, weights) through the same kernel; hash rows may repeat an expert."""
    gate = Gate(_cfg(), hash_layer)
    g = _gen(10)
    gate.weight.copy_(torch.randn(E, H, generator=g).bfloat16())
    if hash_layer:
        gate.tid2eid.copy_(torch.randint(0, E, gate.tid2eid.shape, generator=g))
    else:
        gate.bias.copy_(torch.randn(E, generator=g) * 0.1)
    x = _x(9, H, torch.bfloat16, seed=11)
    tokens = torch.randint(0, 50, (9,), generator=g)
    ids, w = gate(x, tokens)
    y, ref = _run(x, ids, w, experts_h)
    _assert_close(y, ref, torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# the registered op, the plan, bad inputs
# ------------------------------------------------------------------------------------------------

SCHEMA = ("dspark::moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w1, "
          "Tensor s1, Tensor w3, Tensor s3, Tensor w2, Tensor s2, float swiglu_limit, "
          "str layout=\"checkpoint\", Tensor? valid=None) -> Tensor")


def test_op_schema_and_cpu_dispatch(experts_h):
    """Engines record op schemas (a change refuses an older engine). CPU runs the reference,
    for the tiled layout too (laid back first: the same bits)."""
    op = torch.ops.dspark.moe_experts
    assert str(op.default._schema) == SCHEMA
    assert KERNELS["moe_experts"].compile_configs
    x = _x(3, H, torch.float64, seed=12)
    ids, w = _routing(3, 2, "random", seed=13)
    ref = moe.moe_experts_reference(x, ids, w.double(), *experts_h, LIMIT)
    assert ref.dtype == torch.float64
    assert torch.equal(op(x, ids, w.double(), *experts_h, LIMIT), ref)
    assert torch.equal(moe.moe_experts_launch(x, ids, w.double(), *experts_h, LIMIT), ref)
    tensors, name = ml.experts_to_kernel(*experts_h)
    assert torch.equal(op(x, ids, w.double(), *tensors, LIMIT, name), ref)


def test_reference_decode_cache_follows_the_weights(experts_h):
    """The reference keeps decoded experts between eager CPU calls: a second call, a fresh view
    of the same weights, an in-place write to them and a tiled copy each give the bits of a
    decode from scratch (the per-expert path, cache bypassed)."""
    x = _x(5, H, torch.float32, seed=21)
    ids, w = _routing(5, 3, "random", seed=22)

    def uncached(*tensors, layout=ml.CHECKPOINT):
        saved = common.DECODE_CACHE_BYTES
        common.DECODE_CACHE_BYTES = 0
        try:
            return moe.moe_experts_reference(x, ids, w, *tensors, LIMIT, layout)
        finally:
            common.DECODE_CACHE_BYTES = saved

    mine = [t.clone() for t in experts_h]
    want = uncached(*mine)
    assert torch.equal(moe.moe_experts_reference(x, ids, w, *mine, LIMIT), want)
    assert torch.equal(moe.moe_experts_reference(x, ids, w, *[t[:] for t in mine], LIMIT), want)
    mine[0][ids[0, 0]] = mine[0][ids[0, 1]]                  # an in-place write to one expert
    changed = uncached(*mine)
    assert not torch.equal(changed, want)
    assert torch.equal(moe.moe_experts_reference(x, ids, w, *mine, LIMIT), changed)
    tensors, name = ml.experts_to_kernel(*mine)
    assert torch.equal(moe.moe_experts_reference(x, ids, w, *tensors, LIMIT, name), changed)
    assert torch.equal(uncached(*tensors, layout=name), changed)


def test_plan_is_a_function_of_the_weights_only():
    """Flash dims: the tiled layout's tiles (64 x 256 both GEMMs at bf16, BK 128 at fp32), the
    checkpoint layout's 64 x 128; no field depends on the token count."""
    bf = ml.TiledLayout(ml.tile_for(2048, 4096), ml.tile_for(4096, 2048))
    assert bf.gate_up_tile == bf.down_tile == (64, 256)
    p = moe.moe_plan(256, 4096, 2048, bf.name)
    assert p.tiled and not p.wide and p.gate_up_tile == (64, 256) and p.down_tile == (64, 256)
    assert moe.max_bk(torch.float32, True) == 128 and moe.max_bk(torch.bfloat16, True) == 256
    ck = moe.moe_plan(256, 4096, 2048)
    assert not ck.tiled and ck.gate_up_tile == ck.down_tile == (64, 128)
    assert moe.moe_plan(8, 96, 64).gate_up_tile == (64, 32)
    assert moe.moe_plan(256, 4096, 2048, bf.name + ":wide").wide
    with pytest.raises(Exception):
        p.num_warps = 8                                       # frozen


def test_bad_inputs_name_the_argument(experts_h):
    x = _x(2, H, torch.bfloat16)
    ids, w = _routing(2, 2, "random")
    with pytest.raises(ValueError, match="topk_ids"):
        moe.moe_experts_launch(x, ids[:1], w, *experts_h, LIMIT)
    with pytest.raises(ValueError, match="w2"):
        bad = list(experts_h)
        bad[4] = bad[4][:, :32]
        moe.moe_experts_launch(x, ids, w, *bad, LIMIT)
    with pytest.raises(ValueError, match="plan tiles"):
        moe.moe_experts_launch(x, ids, w, *experts_h, LIMIT,
                               plan=moe.MoePlan((64, 256), (64, 128)))
    tensors, name = ml.experts_to_kernel(*experts_h)
    old = name.replace("mxfp4-slab-v2", "mxfp4-tiled-v1")        # an older build's layout
    with pytest.raises(ValueError, match="mxfp4-tiled-v1.*rebuild the engine"):
        moe.moe_experts_launch(x, ids, w, *tensors, LIMIT, old)
    buf = torch.empty(tensors[1].numel() + 1, dtype=torch.uint8)
    shifted = buf[1:].view(tensors[1].shape)
    shifted.copy_(tensors[1])
    with pytest.raises(ValueError, match="s1 .*8-byte boundary"):    # read as 64-bit words
        moe.moe_experts_launch(x, ids, w, tensors[0], shifted, *tensors[2:], LIMIT, name)
    with pytest.raises(ValueError, match="w1 and w2 must be 5-d"):    # checkpoint bytes, tiled name
        moe.moe_experts_launch(x, ids, w, *experts_h, LIMIT, name)
    with pytest.raises(ValueError, match="valid"):
        moe.moe_experts_launch(x, ids, w, *experts_h, LIMIT, valid=torch.ones(3, dtype=torch.bool))


# ------------------------------------------------------------------------------------------------
# batch invariance: a token's bits do not depend on the rest of the launch
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["tiled"])   # the checkpoint loader shares all but the decode
def test_a_tokens_output_is_the_same_in_every_batch(layout, experts_h):
    """One token alone, then n copies of it (n = 2, 7, 17, 64: every row of a 16-row block,
    several blocks of one expert) and inside random batches at the first, a middle and the last
    position: bit-equal every time."""
    tensors, name = _laid_out(experts_h, layout)
    run = lambda x, ids, w: moe.moe_experts_launch(x, ids, w, *tensors, LIMIT, name)
    x1 = _x(1, H, torch.bfloat16, seed=20)
    ids1, w1 = _routing(1, 3, "random", seed=21)
    alone = run(x1, ids1, w1)
    for n in (2, 7, 17, 64):
        y = run(x1.expand(n, -1), ids1.expand(n, -1), w1.expand(n, -1))
        assert torch.equal(y, alone.expand(n, -1)), f"{n} copies"
    for n in (5, 33):
        x = _x(n, H, torch.bfloat16, seed=22 + n)
        ids, w = _routing(n, 3, "random", seed=23 + n)
        for at in (0, n // 2, n - 1):
            xb, ib, wb = x.clone(), ids.clone(), w.clone()
            xb[at], ib[at], wb[at] = x1[0], ids1[0], w1[0]
            assert torch.equal(run(xb, ib, wb)[at], alone[0]), f"batch {n}, row {at}"


# ------------------------------------------------------------------------------------------------
# the model's experts: the layout applied once, the same outputs
# ------------------------------------------------------------------------------------------------

def test_experts_module_kernel_layout_gives_the_same_outputs(experts_h):
    """models/moe.py Experts: use_kernel_layout swaps the buffers for the tiled layout and
    names it; the op's outputs agree with the checkpoint layout's (interpreted kernels, another
    K order) and are bit-equal to the reference (CPU dispatch: the same decoded weights)."""
    cfg = types.SimpleNamespace(n_routed_experts=E, hidden_size=H, moe_intermediate_size=I)
    mod = Experts(cfg)
    for name, t in zip(Experts.NAMES, experts_h):
        getattr(mod, name).copy_(t.view(getattr(mod, name).dtype))
    x = _x(5, H, torch.bfloat16, seed=30)
    ids, w = _routing(5, 3, "random", seed=31)
    before = moe.moe_experts_launch(x, ids, w, *mod.tensors(), LIMIT, mod.layout)
    ref = torch.ops.dspark.moe_experts(x, ids, w, *mod.tensors(), LIMIT, mod.layout)
    holder = torch.nn.Sequential(mod)
    assert use_kernel_layouts(holder, torch.bfloat16) == [mod.layout]
    assert mod.layout.startswith(ml.VERSION) and mod.w1_weight.dtype == torch.int32
    assert dict(holder.named_buffers())["0.w1_weight"] is mod.w1_weight
    _assert_close(moe.moe_experts_launch(x, ids, w, *mod.tensors(), LIMIT, mod.layout), before,
                  torch.bfloat16)
    assert torch.equal(torch.ops.dspark.moe_experts(x, ids, w, *mod.tensors(), LIMIT,
                                                    mod.layout), ref)
    assert mod.use_kernel_layout(torch.bfloat16) == mod.layout          # idempotent


def test_a_model_loading_tiled_weights_takes_their_layout_name(experts_h):
    """The runtime shapes an empty model's buffers with use_kernel_layouts, loads the engine's
    tiled weights and names the layout from them: wide when the loaded scales need it."""
    cfg = types.SimpleNamespace(n_routed_experts=E, hidden_size=H, moe_intermediate_size=I)
    ex = [t.clone() for t in experts_h]
    ex[1][0, 0, 0] = ml.WIDE_FROM
    stored, name = ml.experts_to_kernel(*ex)
    holder = torch.nn.Sequential(Experts(cfg))
    use_kernel_layouts(holder, torch.bfloat16)                        # zeros: not wide
    assert not holder[0].layout.endswith(":wide")
    holder.load_state_dict({f"0.{n}": t for n, t in zip(Experts.NAMES, stored)}, assign=True)
    assert sync_kernel_layouts(holder) == [name] and name.endswith(":wide")
    assert ml.layout_of(*experts_h) == ml.CHECKPOINT


def test_benchmark_cases_build_and_run_on_cpu():
    """benchmarks/kernel_bench.py's moe_experts cases at a tiny size: inputs, reference, op, check."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, os.path.abspath(path))
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_kernels_moe",
                                                  os.path.join(path, "kernel_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cases = bench.moe_cases([1, 4], dims=bench.MoeDims(experts=8, hidden=128, inter=128, top_k=3))
    assert {c.params["routing"] for c in cases} == {"top6-random", "one-expert", "every-expert"}
    dev = torch.device("cpu")
    for c in cases:
        assert c.bytes_moved > 0 and c.params["touched"] >= 1
        assert c.check(dev) == ""
    d = cases[-1].make_inputs(dev, 0)
    ref = cases[-1].reference(d)
    for label, fn in cases[-1].extra.items():      # the baselines and the tile sweep
        if not label.startswith("part-"):          # the parts time pieces (GPU only)
            assert bench.compare(label, fn(d), ref) == ""


# ------------------------------------------------------------------------------------------------
# GPU: Flash shapes, CUDA-graph replay with changing routing, batch invariance
# ------------------------------------------------------------------------------------------------

def _flash_experts(dev, seed=0, wide=False):
    g = torch.Generator(device=dev).manual_seed(seed)
    D, Ie, En = 4096, 2048, 256
    rnd = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g, device=dev)
    sc = lambda *s: torch.randint(118, 124, s, dtype=torch.uint8, generator=g, device=dev)
    ex = [rnd(En, Ie, D // 2), sc(En, Ie, D // 32), rnd(En, Ie, D // 2), sc(En, Ie, D // 32),
          rnd(En, D, Ie // 2), sc(En, D, Ie // 32)]
    if wide:                       # bytes 0 and 129..131 in a few experts' scales
        ex[1][:, :, 3] = torch.where(torch.arange(Ie, device=dev) % 7 == 0, 0, ex[1][:, :, 3])
        ex[5][:, ::5, 2] = 129 + torch.randint(0, 3, ex[5][:, ::5, 2].shape, generator=g,
                                               device=dev).to(torch.uint8)
    return ex, g


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["checkpoint", "tiled", "tiled-wide"])
@pytest.mark.parametrize("T", [6, 384])
def test_gpu_flash_shapes_and_graph_replay(T, layout):
    dev, D, En, k = "cuda", 4096, 256, 6
    ex, g = _flash_experts(dev, wide=layout == "tiled-wide")
    tensors, name = _laid_out(ex, "checkpoint" if layout == "checkpoint" else "tiled")
    assert name.endswith(":wide") == (layout == "tiled-wide")
    x = torch.randn(T, D, generator=g, device=dev).bfloat16() * 0.05
    ids = torch.rand(T, En, generator=g, device=dev).topk(k, -1).indices
    w = torch.rand(T, k, generator=g, device=dev)
    op = lambda: moe.moe_experts_launch(x, ids, w, *tensors, LIMIT, name)
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
    if layout == "tiled":                      # the checkpoint kernel sums in other K tiles
        _assert_close(out.cpu(), moe.moe_experts_launch(x, ids, w, *ex, LIMIT).cpu(),
                      torch.bfloat16)


@pytest.mark.gpu
def test_gpu_batch_invariance_at_flash_shapes():
    """A token alone and at every position of batches of 2..64 (the others random): bit-equal
    on the tensor cores, tiled layout."""
    dev, D, En, k = "cuda", 4096, 256, 6
    ex, g = _flash_experts(dev, seed=1)
    tensors, name = ml.experts_to_kernel(*ex)
    run = lambda x, ids, w: moe.moe_experts_launch(x, ids, w, *tensors, LIMIT, name)
    x1 = torch.randn(1, D, generator=g, device=dev).bfloat16() * 0.05
    ids1 = torch.rand(1, En, generator=g, device=dev).topk(k, -1).indices
    w1 = torch.rand(1, k, generator=g, device=dev)
    alone = run(x1, ids1, w1)
    for n in range(2, 65):
        x = torch.randn(n, D, generator=g, device=dev).bfloat16() * 0.05
        ids = torch.rand(n, En, generator=g, device=dev).topk(k, -1).indices
        ids[n // 3] = ids1[0]                  # a neighbour on the same experts
        w = torch.rand(n, k, generator=g, device=dev)
        for at in range(n):
            xb, ib, wb = x.clone(), ids.clone(), w.clone()
            xb[at], ib[at], wb[at] = x1[0], ids1[0], w1[0]
            assert torch.equal(run(xb, ib, wb)[at], alone[0]), f"batch {n}, row {at}"
