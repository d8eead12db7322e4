"""dspark::draft_attention (kernels/draft_attention.py) against the reference.

Without CUDA the launcher runs the Triton kernel in Triton's CPU interpreter (tests/conftest.py).
What must hold, on fresh random inputs at irregular shapes:
- each output element o = Σ_e P_e K_e within a bound on the scale of its terms, Σ_e P_e |K_e|
  (an output can cancel to ~0 while its terms do not), plus |o|: 16 fp32 ulps of that in fp32
  (an online softmax, another summation order); 2^-8 of it in bf16, where P enters the value
  product rounded to bf16 as flash attention does (the reference multiplies fp32 P) and both
  sides round the output;
- the window edge: a row whose last position L < W - 1 sees only slots holding positions >= 0
  (L = -1: the block alone); the sink's weight enters the denominator only;
- NaN where the reference has NaN: a NaN in any context slot (valid or not, as the reference's
  P·V includes masked slots with P = 0) or in q; none elsewhere.
"""
import pytest
import torch

from dspark_compile.kernels import draft_attention as da
from dspark_compile.kernels.registry import KERNELS


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(B, N, H, D, W, dtype, seed, last=None):
    g = _gen(seed)
    n_rows = B + 2
    rows = torch.randperm(n_rows, generator=g)[:B]
    if last is None:
        last = torch.randint(-1, 3 * W, (B,), generator=g)
    return dict(q=(torch.randn(B, N, H, D, generator=g) * 2).to(dtype),
                kv=torch.randn(B, N, D, generator=g).to(dtype),
                ring=torch.randn(n_rows, W, D, generator=g).to(dtype),
                rows=rows, last_pos=torch.as_tensor(last), sink=torch.randn(H, generator=g) * 2,
                scale=D ** -0.5)


def _assert_close(o, r):
    """Same dtype and shape, NaN exactly where the reference has NaN."""
    assert o.dtype == r.dtype and o.shape == r.shape
    assert torch.equal(o.isnan(), r.isnan()), "NaN where the reference has none, or vice versa"


def _weighted_abs(d):
    """Σ_e P_e |K_e| per output element, in fp64: the scale of each output's rounding error
    (an output can cancel to ~0 while its terms do not)."""
    q, kv = d["q"].double(), d["kv"].double()
    ctx = d["ring"][d["rows"]].double()
    W = ctx.shape[1]
    ok = (da.context_slot_positions(d["last_pos"], W) >= 0)[:, None, None, :]
    s_ctx = (torch.einsum("bthd,bnd->bthn", q, ctx) * d["scale"]).masked_fill(~ok, -float("inf"))
    s_blk = torch.einsum("bthd,bnd->bthn", q, kv) * d["scale"]
    B, N, H, _ = q.shape
    sink = d["sink"].double().view(1, 1, H, 1).expand(B, N, H, 1)
    p = torch.softmax(torch.cat((s_ctx, s_blk, sink), -1), -1)
    return (torch.einsum("bthn,bnd->bthd", p[..., :W], ctx.abs())
            + torch.einsum("bthn,bnd->bthd", p[..., W:W + N], kv.abs()))


def _check(d, plan=None):
    o = da.draft_attention_launch(**d, plan=plan)
    r = da.draft_attention_reference(**d)
    _assert_within(o, r, d)
    return o, r


def _assert_within(o, r, d):
    """The module docstring's bounds, for the inputs d (CPU tensors)."""
    _assert_close(o, r)
    ok = ~r.isnan()
    diff = (o.double() - r.double()).abs().nan_to_num()
    terms = _weighted_abs(d).nan_to_num()
    if d["q"].dtype == torch.float32:
        bound = 16 * torch.finfo(torch.float32).eps * (terms + r.double().abs())
    else:
        # P rounded to bf16 (relative 2^-9) in the value product, plus the output's own rounding
        # (half an ulp, 2^-9 |o|) on both sides
        bound = (terms + r.double().abs()) / 256
    assert (diff <= bound + 1e-30)[ok].all(), (diff / (bound + 1e-30))[ok].max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,N,H,D,W", [(1, 5, 4, 128, 8), (3, 3, 5, 64, 16), (2, 4, 2, 96, 20)])
def test_draft_attention_matches_reference(B, N, H, D, W, dtype):
    _check(_inputs(B, N, H, D, W, dtype, seed=B * 10 + N + H + D))


def test_window_edge_and_gpu_tiles():
    """Rows whose last position is before the ring's end (L = -1: only the block), the GPU's
    16-row tiles over several programs and BLOCK_N < W."""
    W = 24
    d = _inputs(5, 5, 3, 64, W, torch.bfloat16, seed=3, last=[-1, 0, 5, W - 1, 2 * W + 7])
    for plan in (None, da.DraftAttentionPlan(16, 16, 32, 4, 1)):
        _check(d, plan)
    # L = -1 sees only the block: the reference with every context slot replaced changes nothing
    o = da.draft_attention_launch(**d)
    d2 = dict(d, ring=d["ring"].clone())
    d2["ring"][d["rows"][0]] = 7.0
    assert torch.equal(da.draft_attention_launch(**d2)[0], o[0])


def test_sink_enters_the_denominator_only():
    d = _inputs(2, 3, 4, 64, 8, torch.float32, seed=4)
    lo = dict(d, sink=torch.full((4,), -float("inf")))
    hi = dict(d, sink=torch.full((4,), 30.0))
    o_lo, _ = _check(lo)
    o_hi, _ = _check(hi)
    assert o_hi.abs().max() < 1e-6 * o_lo.abs().max()     # a huge sink takes all the weight


def test_nan_propagates_as_in_the_reference():
    d = _inputs(3, 3, 2, 64, 8, torch.float32, seed=5, last=[2, 20, 4])
    d["ring"][d["rows"][0], 6, 3] = float("nan")   # row 0 (L = 2): slot 6 would hold -2, masked
    d["ring"][d["rows"][1], 1, 0] = float("nan")   # row 1: a valid slot
    d["q"][2, 1, 0, 5] = float("nan")              # row 2: one (token, head)
    o, r = _check(d)
    # masked slot: its score is -inf, but P = 0 times its NaN value is NaN in that channel only;
    # a valid slot's NaN reaches every score, so the whole row
    assert r[0, ..., 3].isnan().all() and not r[0, ..., :3].isnan().any()
    assert r[1].isnan().all()
    assert r[2, 1, 0].isnan().all() and not r[2, 0].isnan().any()


def test_registered_op_on_cpu_is_the_reference_and_exports_as_one_node():
    d = _inputs(2, 3, 2, 64, 8, torch.bfloat16, seed=6)
    args = (d["q"], d["kv"], d["ring"], d["rows"], d["last_pos"], d["sink"])
    assert torch.equal(torch.ops.dspark.draft_attention(*args, d["scale"]),
                       da.draft_attention_reference(**d))

    class M(torch.nn.Module):
        def forward(self, *ts):
            return torch.ops.dspark.draft_attention(*ts, d["scale"]).float() + 1

    ep = torch.export.export(M(), args, strict=False)
    assert sum(n.target == torch.ops.dspark.draft_attention.default for n in ep.graph.nodes) == 1
    assert torch.equal(ep.module()(*args), M()(*args))
    assert "draft_attention" in KERNELS and KERNELS["draft_attention"].compile_configs


def test_bad_inputs_name_the_argument():
    d = _inputs(2, 3, 2, 64, 8, torch.bfloat16, seed=8)
    with pytest.raises(ValueError, match="kv must be"):
        da.draft_attention_launch(**dict(d, kv=d["kv"][:, :2]))
    with pytest.raises(ValueError, match="ring must be"):
        da.draft_attention_launch(**dict(d, ring=d["ring"].float()))
    with pytest.raises(ValueError, match="last_pos"):
        da.draft_attention_launch(**dict(d, last_pos=d["last_pos"][:1]))
    with pytest.raises(ValueError, match="sink"):
        da.draft_attention_launch(**dict(d, sink=d["sink"][:1]))


def test_plan_choices():
    """Batch invariant plans keep 16 rows at every B; the batch-dependent variant widens
    sm_90's tile beyond one wave."""
    assert da.draft_attention_plan(1, 320, (9, 0)).block_m == 16
    assert da.draft_attention_plan(64, 320, (9, 0)).block_m == 16
    assert da.draft_attention_plan(64, 320, (9, 0), invariant=False).block_m == 32
    assert da.draft_attention_plan(64, 320, (12, 0)).block_m == 16      # SM12x: no 32-row tile


# ------------------------------------------------------------------------------------------------
# GPU (H200): Flash dims (H = 64, d = 512, W = 128, N = 5), tensor-core products, CUDA graphs
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16, 64])
def test_gpu_flash_dims(B):
    last = [5, 127, 3000] + [int(x) for x in torch.randint(0, 32768, (B,), generator=_gen(B))]
    d = _inputs(B, 5, 64, 512, 128, torch.bfloat16, seed=B, last=last[:B])
    dev = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in d.items()}
    o = torch.ops.dspark.draft_attention(dev["q"], dev["kv"], dev["ring"], dev["rows"],
                                         dev["last_pos"], dev["sink"], dev["scale"]).cpu()
    r = da.draft_attention_reference(**d)
    _assert_within(o, r, d)
    for tile in (da.TILE_16, da.TILE_32):
        if tile == da.TILE_32 and torch.cuda.get_device_capability()[0] != 9:
            continue
        _assert_within(da.draft_attention_launch(**dev, plan=da.DraftAttentionPlan(*tile)).cpu(),
                       r, d)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    d = _inputs(4, 5, 64, 512, 128, torch.bfloat16, seed=40)
    dev = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in d.items()}
    args = [dev[k] for k in ("q", "kv", "ring", "rows", "last_pos", "sink")]
    out = torch.ops.dspark.draft_attention(*args, d["scale"])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.dspark.draft_attention(*args, d["scale"])
    d2 = _inputs(4, 5, 64, 512, 128, torch.bfloat16, seed=41)
    for k, t in zip(("q", "kv", "ring", "rows", "last_pos", "sink"), args):
        t.copy_(d2[k])
    g.replay()
    torch.cuda.synchronize()
    _assert_within(out.cpu(), da.draft_attention_reference(**d2), d2)
