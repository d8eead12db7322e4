"""dspark::indexer_topk: the Triton kernels (Triton's CPU interpreter without CUDA) against the
reference, and the reference's selection rule against a direct sort by (score desc, index asc).

Exactness: with small integer q / keys and weights in multiples of 1/2 every score is an exact
fp32 number in any summation order, so the kernel must pick exactly the reference's entries,
ties included (all-zero scores, equal scores, -0 vs +0). With random floats the kernel's scores
differ from the reference's by summation order only (within 1e-5 relative in fp32), so its
selection must be a top-k of the reference's scores up to that tolerance.
"""
import dataclasses

import pytest
import torch

from dspark_compile.kernels import indexer_topk as it


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@dataclasses.dataclass
class Case:
    B: int = 3
    T: int = 2
    HI: int = 3
    DI: int = 24
    R: int = 5
    NE: int = 40
    topk: int = 7
    ratio: int = 4
    dtype: torch.dtype = torch.float32


def make(c: Case, seed=0, integer=True, rows=None, start=None):
    g = _gen(seed)
    if integer:
        q = torch.randint(-2, 3, (c.B, c.T, c.HI, c.DI), generator=g).to(c.dtype)
        k = torch.randint(-2, 3, (c.R, c.NE, c.DI), generator=g).to(c.dtype)
        w = torch.randint(-2, 3, (c.B, c.T, c.HI), generator=g).float() * 0.5
    else:
        q = torch.randn(c.B, c.T, c.HI, c.DI, generator=g).to(c.dtype)
        k = torch.randn(c.R, c.NE, c.DI, generator=g).to(c.dtype)
        w = torch.randn(c.B, c.T, c.HI, generator=g)
    rows = torch.randint(0, c.R, (c.B,), generator=g) if rows is None else torch.tensor(rows)
    if start is None:
        start = torch.randint(0, c.NE * c.ratio + 8, (c.B, 1), generator=g)
    pos = torch.as_tensor(start).view(c.B, 1) + torch.arange(c.T)
    return dict(q=q, weights=w, k_cache=k, rows=rows, pos=pos, topk=c.topk, ratio=c.ratio)


def run_both(d, plan=None):
    return it.indexer_topk_launch(**d, plan=plan), it.indexer_topk_reference(**d)


def _direct(score, k):
    """sorted(visible entries, key=(-score, index))[:k], ascending, -1 padded; NaN first."""
    out = torch.full((*score.shape[:-1], k), -1)
    for i in range(score.shape[0]):
        for t in range(score.shape[1]):
            s = score[i, t].tolist()
            cand = [j for j, v in enumerate(s) if v != float("-inf")]
            cand.sort(key=lambda j: (0 if s[j] != s[j] else 1, -s[j] if s[j] == s[j] else 0, j))
            pick = sorted(cand[:k])
            out[i, t, :len(pick)] = torch.tensor(pick, dtype=torch.int64)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_rule_is_score_desc_index_asc(seed):
    d = make(Case(), seed=seed)
    score = it.index_scores_reference(d["q"], d["weights"], d["k_cache"], d["rows"], d["pos"], 4)
    assert torch.equal(it.indexer_topk_reference(**d), _direct(score, d["topk"]))
    score[0, 0, :5] = float("nan")
    assert torch.equal(it.select_topk_reference(score, 7), _direct(score, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", [2, 3])
def test_kernel_equals_reference_exact_scores(dtype, seed):
    o, r = run_both(make(Case(dtype=dtype), seed=seed))
    assert o.dtype == torch.int64 and torch.equal(o, r)


def test_all_zero_scores_pick_the_lowest_indices():
    """Zero q: every visible score is 0 (+0 or -0 from negative weights): ties everywhere."""
    d = make(Case(B=2), seed=4, rows=[1, 3], start=[[100], [9]])
    d["q"].zero_()
    o, r = run_both(d)
    assert torch.equal(o, r)
    assert o[0, 0].tolist() == list(range(7))
    assert o[1, 0].tolist() == [0, 1, -1, -1, -1, -1, -1]     # (9 + 1) // 4 = 2 visible


def test_equal_scores_at_the_boundary():
    """Keys repeated: the k-th best score is shared by several entries; the lowest win."""
    c = Case(B=1, T=1, NE=30, topk=5)
    d = make(c, seed=5, rows=[0], start=[[200]])
    d["k_cache"][0] = d["k_cache"][0, torch.arange(30) % 4]   # four distinct keys, 7-8 copies
    o, r = run_both(d)
    assert torch.equal(o, r)


def test_padded_rows_and_few_visible_entries():
    d = make(Case(B=4, T=3), seed=6, rows=[-1, 2, 5, 0], start=[[50], [0], [50], [5]])
    o, r = run_both(d)
    assert torch.equal(o, r)
    assert (o[0] == -1).all() and (o[2] == -1).all()       # rows outside [0, R): inert
    assert (o[1, :3] == -1).all()                           # positions 0..2: nothing visible
    assert o[3, 2, :2].tolist() == r[3, 2, :2].tolist() and (o[3, 2, 2:] == -1).all()


def test_batch_one_topk_larger_than_the_cache():
    d = make(Case(B=1, T=1, NE=6, topk=9), seed=7, start=[[40]])
    o, r = run_both(d)
    assert o.shape == (1, 1, 6) and torch.equal(o, r)


def test_long_context_many_chunks():
    """Scores over several score programs and several select chunks (the interpreter plan takes
    16 x 2 keys per program and 64 scores per select step)."""
    c = Case(B=2, T=2, NE=300, topk=70)
    d = make(c, seed=8, start=[[1100], [700]])
    assert torch.equal(*run_both(d))
    p = dataclasses.replace(it.indexer_topk_plan(4, 300, interpret=True), e_blocks=5,
                            select_block=128)
    assert torch.equal(*run_both(d, p))


def test_nan_scores_rank_first():
    d = make(Case(B=1, T=2), seed=9, rows=[1], start=[[80]])
    d["k_cache"][1, 3, 0] = float("nan")
    d["k_cache"][1, 11, 2] = float("nan")
    o, r = run_both(d)
    assert torch.equal(o, r)
    assert {3, 11} <= set(o[0, 0].tolist())


def test_random_floats_select_a_top_k():
    c = Case(B=2, T=3, HI=5, DI=40, NE=64, topk=9)
    d = make(c, seed=10, integer=False, start=[[250], [130]])
    o, r = run_both(d)
    score = it.index_scores_reference(d["q"], d["weights"], d["k_cache"], d["rows"], d["pos"], 4)
    for b in range(c.B):
        for t in range(c.T):
            s, chosen = score[b, t], o[b, t][o[b, t] >= 0]
            n = int((s > float("-inf")).sum())
            assert len(chosen) == min(n, c.topk) and len(set(chosen.tolist())) == len(chosen)
            rest = torch.ones_like(s, dtype=torch.bool)
            rest[chosen] = False
            rest &= s > float("-inf")
            if rest.any():
                assert s[rest].max() <= s[chosen].min() + 1e-5 * s.abs().max()
    assert (o == r).float().mean() > 0.9


def test_errors_name_the_argument():
    d = make(Case(), seed=11)
    with pytest.raises(ValueError, match="weights"):
        it.indexer_topk_launch(**dict(d, weights=d["weights"][..., :1]))
    with pytest.raises(ValueError, match="k_cache"):
        it.indexer_topk_launch(**dict(d, k_cache=d["k_cache"].to(torch.bfloat16)))
    with pytest.raises(ValueError, match="pos"):
        it.indexer_topk_launch(**dict(d, pos=d["pos"][:, :1]))
    with pytest.raises(ValueError, match="topk"):
        it.indexer_topk_launch(**dict(d, topk=0))


def test_op_runs_the_reference_on_cpu_and_fake_shapes():
    d = make(Case(), seed=12)
    assert torch.equal(torch.ops.dspark.indexer_topk(**d), it.indexer_topk_reference(**d))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.dspark.indexer_topk(**d)
    assert out.shape == (3, 2, 7) and out.dtype == torch.int64


# ---- GPU: Flash shapes ----------------------------------------------------------------------

def _flash(B, ctx, integer, seed):
    c = Case(B=B, T=6, HI=64, DI=128, R=B + 1, NE=32768 // 4, topk=512, dtype=torch.bfloat16)
    return make(c, seed=seed, integer=integer, start=torch.full((B, 1), ctx - 6))


def _cuda(d):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16, 64])
@pytest.mark.parametrize("ctx", [64, 1024, 8192, 32768])
def test_gpu_flash_shapes_exact(B, ctx):
    """Integer-valued inputs: exact scores, so exactly the reference's entries (ties too)."""
    d = _cuda(_flash(B, ctx, True, seed=13))
    assert torch.equal(torch.ops.dspark.indexer_topk(**d), it.indexer_topk_reference(**d))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager():
    d = _cuda(_flash(4, 4096, False, seed=14))
    eager = torch.ops.dspark.indexer_topk(**d)
    torch.ops.dspark.indexer_topk(**d)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.dspark.indexer_topk(**d)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
