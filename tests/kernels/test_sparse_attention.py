"""dspark::sparse_attention: the Triton kernel (Triton's CPU interpreter without CUDA) against the
reference, and the reference against a direct per-token softmax.

Shapes keep the cache's structure at small sizes: nope parts of 64k dims stored FP8 with one
E8M0 byte per 64 (made by the SWA insert's own quantizer, kv_quant_reference) + a bf16 rope part,
or the float cache of Precision.kv_fp8 off; few, irregular heads; rings a little larger than the
window. Tolerances: fp32 q 2e-6 x max|o| (the same products, summed in another order); bf16 q
one bf16 ulp of max|o| (2^-7 relative: o is rounded once to bf16 and the kernel's p is rounded to
bf16 for the PV product, FlashAttention's convention). NaN must match NaN exactly.
"""
import dataclasses

import pytest
import torch

from dspark_compile.kernels import sparse_attention as sa
from dspark_compile.kernels.qkv_postprocess import kv_quant_reference


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@dataclasses.dataclass
class Case:
    B: int = 3
    T: int = 2
    H: int = 3
    nope: int = 128
    rope: int = 16
    R: int = 5            # cache rows (the last is the trash row in the model)
    ring: int = 10
    window: int = 7
    ratio: int = 0
    NE: int = 9
    K: int = 0            # C4 list length (0: C128 takes every visible entry)
    fp8: bool = True
    dtype: torch.dtype = torch.float32

    @property
    def D(self):
        return self.nope + self.rope


def _cache(c, n, g):
    kv = torch.randn(c.R, n, c.D, generator=g) * 2
    if not c.fp8:
        return kv.to(c.dtype), None, None
    return kv_quant_reference(kv, c.nope)


def make(c: Case, seed=0, rows=None, start=None):
    g = _gen(seed)
    q = torch.randn(c.B, c.T, c.H, c.D, generator=g).to(c.dtype)
    swa = _cache(c, c.ring, g)
    cmp = _cache(c, c.NE, g) if c.ratio else (None, None, None)
    rows = torch.randint(0, c.R, (c.B,), generator=g) if rows is None else torch.tensor(rows)
    if start is None:
        start = torch.randint(0, c.NE * max(c.ratio, 1) + 3, (c.B, 1), generator=g)
    pos = torch.as_tensor(start).view(c.B, 1) + torch.arange(c.T)
    idx = torch.randint(-2, c.NE + 3, (c.B, c.T, c.K), generator=g) if c.ratio and c.K else None
    sink = torch.randn(c.H, generator=g)
    return dict(q=q, swa_kv=swa[0], swa_scale=swa[1], swa_rope=swa[2], cmp_kv=cmp[0],
                cmp_scale=cmp[1], cmp_rope=cmp[2], cmp_idx=idx, rows=rows, pos=pos, sink=sink,
                scale=c.D ** -0.5, window=c.window, ratio=c.ratio)


def assert_close(o, r):
    assert o.dtype == r.dtype and o.shape == r.shape
    assert torch.equal(o.isnan(), r.isnan()), "NaN where the reference has none (or vice versa)"
    rel = 2e-6 if r.dtype == torch.float32 else 2 ** -7
    o, r = o.float().nan_to_num(), r.float().nan_to_num()
    tol = rel * max(1.0, r.abs().max().item())
    err = (o - r).abs().max().item()
    assert err <= tol, f"max |kernel - reference| = {err:.3g} > {tol:.3g}"


def run_both(d, plan=None):
    return sa.sparse_attention_launch(**d, plan=plan), sa.sparse_attention_reference(**d)


def _direct(d):
    """Per token and head, a plain softmax over the valid candidates listed one by one (fp64)."""
    q, B, (T, H, D) = d["q"].double(), d["q"].shape[0], d["q"].shape[1:]
    R, ring = d["swa_kv"].shape[:2]

    def entry(kv, scale, rope, r, j):
        if scale is None:
            return kv[r, j].double()
        nope = kv[r, j].double() * torch.exp2(scale[r, j].double() - 127).repeat_interleave(64)
        return torch.cat((nope, rope[r, j].double()))

    o = torch.zeros(B, T, H, D, dtype=torch.float64)
    for b in range(B):
        r = int(d["rows"][b])
        for t in range(T):
            P = int(d["pos"][b, t])
            if not 0 <= r < R:
                continue
            ks = [entry(d["swa_kv"], d["swa_scale"], d["swa_rope"], r, p % ring)
                  for p in range(max(0, P - d["window"] + 1), P + 1)]
            if d["ratio"]:
                NE, vis = d["cmp_kv"].shape[1], (P + 1) // d["ratio"]
                js = range(NE) if d["cmp_idx"] is None else d["cmp_idx"][b, t].tolist()
                ks += [entry(d["cmp_kv"], d["cmp_scale"], d["cmp_rope"], r, j)
                       for j in js if 0 <= j < min(NE, vis)]
            if not ks:
                continue
            k = torch.stack(ks)
            s = torch.cat((q[b, t] @ k.T * d["scale"], d["sink"].double()[:, None]), 1)
            o[b, t] = torch.softmax(s, 1)[:, :-1] @ k
    return o


MODES = [dict(ratio=0), dict(ratio=8), dict(ratio=4, K=6)]
IDS = ["swa", "c128-all-visible", "c4-list"]


@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8-cache", "float-cache"])
def test_reference_equals_direct_softmax(mode, fp8):
    d = make(Case(fp8=fp8, dtype=torch.float64, **mode), seed=1)
    ref = sa.sparse_attention_reference(**d)
    assert torch.allclose(ref, _direct(d), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8-cache", "float-cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(mode, fp8, dtype):
    assert_close(*run_both(make(Case(fp8=fp8, dtype=dtype, **mode), seed=2)))


def test_batch_one_and_odd_shapes():
    c = Case(B=1, T=1, H=5, nope=64, rope=32, ring=6, window=5, ratio=4, NE=4, K=3)
    assert_close(*run_both(make(c, seed=3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nope_not_a_power_of_two(dtype):
    """3 quant groups (Flash has 7: 448 dims) padded to a 256-wide tile."""
    c = Case(H=17, nope=192, rope=64, ratio=128, NE=3, dtype=dtype)
    assert_close(*run_both(make(c, seed=3, start=[[300], [260], [100]])))


def test_padded_rows_are_inert():
    """Rows outside [0, R) (-1, R) read nothing and give o = 0; the NaN cache row of an
    out-of-range row never leaks in."""
    c = Case(B=4, ratio=8)
    d = make(c, seed=4, rows=[-1, 2, c.R, 0])
    nan = torch.tensor(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for cache in ("swa_kv", "cmp_kv"):      # row -1 would alias the last row if indexed
        d[cache][c.R - 1] = nan
    o, r = run_both(d)
    assert not o.isnan().any() and not r.isnan().any()
    assert_close(o, r)
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.equal(o[2], torch.zeros_like(o[2]))


def test_no_valid_candidate_gives_zero():
    """Position -1 (nothing written yet) and C4 lists of -1 only: the sink takes all the mass."""
    c = Case(B=2, T=1, ratio=4, K=5)
    d = make(c, seed=5, start=[[-1], [30]])
    d["cmp_idx"][1] = -1
    d["window"] = 1
    d["pos"][1] = 30
    o, r = run_both(d)
    assert_close(o, r)
    assert torch.equal(o[0], torch.zeros_like(o[0]))


def test_masked_nan_entries_never_leak():
    """NaN bytes (0x7F) in ring slots outside the window and in invisible compressed entries."""
    c = Case(B=1, T=1, ratio=8)
    d = make(c, seed=6, rows=[1], start=[[20]])
    nan = torch.tensor(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for slot in {(20 - k) % c.ring for k in range(c.window, c.ring)}:
        d["swa_kv"][1, slot, 3] = nan
    d["cmp_kv"][1, 21 // 8:, 0] = nan
    o, r = run_both(d)
    assert not r.isnan().any()
    assert_close(o, r)


def test_nan_in_q_propagates_to_its_head_only():
    c = Case(ratio=4, K=6)
    d = make(c, seed=7, rows=[0, 1, 2], start=[[40], [41], [42]])
    d["q"][1, 0, 2, 5] = float("nan")
    o, r = run_both(d)
    assert r[1, 0, 2].isnan().all() and not r[1, 0, :2].isnan().any()
    assert_close(o, r)


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_chunks_split_or_merged_in_registers_give_the_same_bits(chunk):
    """Long context (3 SWA + 4 compressed blocks of 16): chunks of `chunk` blocks, one program
    each merged by the combine launch, or merged by one program: equal to the reference, and
    to each other bit for bit (the split is chosen by the token count, so it must not change a
    row's result); one chunk (no merge) agrees with them up to rounding."""
    c = Case(B=2, T=2, ratio=4, NE=80, K=50, ring=40, window=35)
    d = make(c, seed=8, start=[[300], [319]])
    base = sa.sparse_attention_plan(4, c.H, 100, interpret=True)
    o, r = run_both(d, dataclasses.replace(base, chunk=chunk, split=True))
    assert_close(o, r)
    merged = sa.sparse_attention_launch(**d, plan=dataclasses.replace(base, chunk=chunk))
    assert torch.equal(o, merged)
    assert_close(o, sa.sparse_attention_launch(**d, plan=base))


def test_split_c128_splits_with_nothing_to_do():
    """Splits past a token's last visible block see no candidate (their partial is empty)."""
    c = Case(B=2, T=1, ratio=8, NE=40)
    d = make(c, seed=9, start=[[3], [300]])
    base = sa.sparse_attention_plan(2, c.H, 47, interpret=True)
    plan = dataclasses.replace(base, chunk=1, split=True)
    o, r = run_both(d, plan)
    assert_close(o, r)
    assert torch.equal(o, sa.sparse_attention_launch(**d, plan=dataclasses.replace(plan,
                                                                                  split=False)))


def test_plan_splits_only_when_the_grid_is_small():
    """The chunks follow the capacity alone; the split (bit-neutral) follows the tokens."""
    few = sa.sparse_attention_plan(6, 64, 128 + 512)
    many = sa.sparse_attention_plan(384, 64, 128 + 512)
    assert few.split and not many.split and few.chunk == many.chunk
    assert sa.n_blocks(few, 128, 512) // few.chunk > 1
    assert few.block_h * few.block_n and few.block_h <= 64


def test_errors_name_the_argument():
    d = make(Case(ratio=4, K=3), seed=10)
    with pytest.raises(ValueError, match="cmp_scale"):
        sa.sparse_attention_launch(**dict(d, cmp_scale=d["cmp_scale"][..., :1]))
    with pytest.raises(ValueError, match="rows"):
        sa.sparse_attention_launch(**dict(d, rows=d["rows"][:1]))
    with pytest.raises(ValueError, match="window"):
        sa.sparse_attention_launch(**dict(d, window=100))
    with pytest.raises(ValueError, match="cmp_idx"):
        sa.sparse_attention_launch(**dict(d, cmp_idx=d["cmp_idx"][:, :1]))


def test_op_runs_the_reference_on_cpu_and_fake_shapes():
    d = make(Case(ratio=4, K=3), seed=11)
    assert torch.equal(torch.ops.dspark.sparse_attention(**d), sa.sparse_attention_reference(**d))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.dspark.sparse_attention(**d)
    assert out.shape == d["q"].shape and out.dtype == d["q"].dtype


# ---- GPU: Flash shapes ----------------------------------------------------------------------

FLASH = dict(H=64, nope=448, rope=64, window=128, dtype=torch.bfloat16)


def _flash(B, T, ctx, ratio, K, seed):
    c = Case(B=B, T=T, R=B + 1, ring=128 + T, NE=max(1, ctx // max(ratio, 1)), ratio=ratio, K=K,
             **FLASH)
    d = make(c, seed=seed, start=torch.full((B, 1), ctx - T))
    if K:   # a C4 list as the indexer writes it: distinct visible entries, ascending, -1 last
        vis = (ctx - T + 1) // 4
        perm = torch.stack([torch.randperm(max(vis, 1), generator=_gen(seed + i))[:K]
                            for i in range(B * T)]).view(B, T, -1)
        d["cmp_idx"] = torch.full((B, T, K), -1)
        d["cmp_idx"][..., :perm.shape[-1]] = perm.sort(-1).values
    return d


def _cuda(d):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("ctx,ratio,K", [(64, 0, 0), (1024, 128, 0), (8192, 4, 512),
                                         (32768, 128, 0)])
def test_gpu_flash_shapes(B, ctx, ratio, K):
    d = _cuda(_flash(B, 6, ctx, ratio, K, seed=12))
    assert_close(torch.ops.dspark.sparse_attention(**d).cpu(),
                 sa.sparse_attention_reference(**d).cpu())


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager():
    d = _cuda(_flash(4, 6, 2048, 4, 512, seed=13))
    eager = torch.ops.dspark.sparse_attention(**d)
    g = torch.cuda.CUDAGraph()
    torch.ops.dspark.sparse_attention(**d)          # warm-up outside the capture
    with torch.cuda.graph(g):
        out = torch.ops.dspark.sparse_attention(**d)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
