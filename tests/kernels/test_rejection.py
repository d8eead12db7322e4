"""Rejection sampling of the drafts: greedy perfect-match / early-mismatch / multi-sequence cases,
losslessness (chi-square: draft + rejection output follows the target; a deliberately wrong
rejection rule must fail), out-of-range ids, degenerate and padded rows, and the fused Triton
kernel (interpreter) against the reference."""
import pytest
import torch

from dspark_compile.kernels.philox import STREAM_DRAFT
from dspark_compile.kernels.sampling.plan import SamplerPlan
from dspark_compile.kernels.sampling.reference import (gumbel_argmax, probs_from_processed,
                                                       process_logits, rejection_sample_reference,
                                                       request_probs)
from dspark_compile.kernels.sampling.rejection import (rejection_sample_launch,
                                                       rejection_sample_mode_reference)
from stats_utils import chi2_pvalue

NINF = float("-inf")


def launch(*args, persistent=None, **plan):
    """rejection_sample_launch of the 8 data tensors under SamplerPlan().replace(**plan) (plan
    fields and test hooks; `persistent`: plan.rejection_persistent); a 9th positional argument
    is the plan's mode."""
    if len(args) > 8:
        plan["mode"] = args[8]
    if persistent is not None:
        plan["rejection_persistent"] = persistent
    return rejection_sample_launch(*args[:8], plan=SamplerPlan().replace(**plan))



def meta(B, T=0.0, k=0, p=1.0):
    return (torch.full((B,), T), torch.full((B,), k, dtype=torch.int64), torch.full((B,), p))


def onehot_logits(ids, V, hi=5.0):
    """Target logits whose argmax at row i is ids[..., i]."""
    x = torch.zeros(*ids.shape, V)
    x.scatter_(-1, ids[..., None], hi)
    return x


def _fn(fused):
    """The reference, the fused sampler, or (fused == "greedy-mode") its all-greedy plan."""
    if fused == "greedy-mode":
        return lambda *a, **kw: launch(*a, "greedy", **kw)
    return launch if fused else rejection_sample_reference


IMPLS = [False, True]
GREEDY_IMPLS = [False, True, "greedy-mode"]


@pytest.mark.parametrize("fused", GREEDY_IMPLS)
def test_greedy_perfect_match_early_mismatch_multi_sequence(fused):
    V, N = 50, 4
    drafts = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [7, 8, 9, 10], [1, 2, 3, 4]])
    target_ids = torch.tensor([[3, 4, 5, 6, 11],        # all accepted + bonus 11
                               [3, 4, 9, 6, 12],        # mismatch at 2: emits 9
                               [0, 8, 9, 10, 13],       # mismatch at 0: emits 0
                               [1, 2, 3, 4, 49]])
    logits = onehot_logits(target_ids, V)
    q = torch.zeros(4, N, V)
    args = (logits, drafts, q, *meta(4), torch.arange(4), torch.full((4,), 100))
    tokens, num = _fn(fused)(*args)
    assert num.tolist() == [5, 3, 1, 5]
    assert tokens.tolist() == [[3, 4, 5, 6, 11], [3, 4, 9, -1, -1], [0, -1, -1, -1, -1],
                               [1, 2, 3, 4, 49]]


@pytest.mark.parametrize("fused", IMPLS)
def test_out_of_range_drafts_are_rejected(fused):
    V, N = 20, 3
    drafts = torch.tensor([[2, -1, 4], [V, 1, 1], [2, 3, 1 << 40]])
    logits = onehot_logits(torch.tensor([[2, 0, 4, 5], [0, 1, 1, 1], [2, 3, 0, 9]]), V)
    q = torch.full((3, N, V), 1.0 / V)
    fn = _fn(fused)
    # greedy: -1 is not argmax 0; V folds to 0 = argmax but is out of range: rejected anyway
    zero = torch.zeros(3, dtype=torch.int64)
    tokens, num = fn(logits, drafts, q, *meta(3), torch.arange(3), zero)
    assert num.tolist() == [2, 1, 3]
    assert tokens[:, :num.max()].tolist() == [[2, 0, -1], [0, -1, -1], [2, 3, 0]]
    if fused:   # the all-greedy plan, whatever the rows' temperatures say
        tokens, num = launch(logits, drafts, q, *meta(3, T=1.0),
                                              torch.arange(3), zero, "greedy")
        assert num.tolist() == [2, 1, 3]
        assert tokens[:, :num.max()].tolist() == [[2, 0, -1], [0, -1, -1], [2, 3, 0]]
    # probabilistic: out-of-range drafts are never accepted either
    tokens, num = fn(logits, drafts, q, *meta(3, T=1.0), torch.arange(3),
                     torch.zeros(3, dtype=torch.int64))
    assert (num[:2] <= torch.tensor([2, 1])).all() and num[2] <= 3


def test_probabilistic_q_equal_p_accepts_everything():
    V, N, B = 30, 5, 64
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, N + 1, V, generator=g)
    T, k, p = meta(B, T=0.8)
    probs = request_probs(logits, T, k, p)
    drafts = torch.randint(0, V, (B, N), generator=g)
    drafts = torch.where(probs[:, :N].gather(2, drafts[..., None])[..., 0] > 0, drafts, 0)
    # the draft logits are the target's: q = p
    tokens, num = rejection_sample_reference(logits, drafts, logits[:, :N].contiguous(), T, k, p,
                                             torch.arange(B), torch.arange(B))
    assert (num == N + 1).all()
    assert torch.equal(tokens[:, :N], drafts)


def _lossless_setup(n, V=5, N=2):
    target = torch.tensor([[1.0, 0.2, -0.5, 0.7, -1.0],
                           [0.0, 1.5, 0.3, -0.7, 0.4],
                           [-0.3, 0.2, 1.1, 0.0, 0.6]])[: N + 1, :V]
    draft = torch.tensor([[0.2, 1.0, 0.0, 0.3, -0.2],          # q differs from p on purpose
                          [0.5, 0.1, 0.9, -1.0, 0.0]])[:N, :V]
    p = torch.softmax(target.double(), -1)
    q = torch.softmax(draft, -1).float()
    seed = torch.arange(n, dtype=torch.int64) * 104729 + 11
    pos = torch.full((n,), 1000, dtype=torch.int64)
    # drafts sampled from q with the draft stream at their own positions
    drafts = torch.stack([gumbel_argmax(torch.log(q[i]).expand(n, -1), seed, pos + i, STREAM_DRAFT)
                          for i in range(N)], 1)
    return (target.expand(n, -1, -1), drafts, draft.expand(n, -1, -1).contiguous(), q, p, seed,
            pos)


def test_draft_plus_rejection_follows_target_distribution():
    n, V, N = 20000, 5, 2
    logits, drafts, dl, q, p, seed, pos = _lossless_setup(n, V, N)
    T, k, tp = meta(n, T=1.0)
    tokens, num = rejection_sample_reference(logits, drafts, dl, T, k, tp, seed, pos)
    assert chi2_pvalue(torch.bincount(tokens[:, 0], minlength=V), p[0]) > 1e-3
    second = num >= 2                      # draft 0 accepted: token 1 must follow p_1
    assert chi2_pvalue(torch.bincount(tokens[second, 1], minlength=V), p[1]) > 1e-3
    third = num >= 3
    assert chi2_pvalue(torch.bincount(tokens[third, 2], minlength=V), p[2]) > 1e-3
    # the draft distribution alone is far from the target (the test has power)...
    assert chi2_pvalue(torch.bincount(drafts[:, 0], minlength=V), p[0]) < 1e-6
    # rejecting every draft (a degenerate draft row: q = 0) and resampling from p is lossless
    never, nn = rejection_sample_reference(logits, drafts, torch.full_like(dl, float("nan")), T,
                                           k, tp, seed, pos)
    assert (nn == 1).all()
    assert chi2_pvalue(torch.bincount(never[:, 0], minlength=V), p[0]) > 1e-3
    # ...while a wrong acceptance rule is caught
    accept_only, _ = _wrong_accept_by_p_only(logits, drafts, q.expand(n, -1, -1), seed, pos)
    assert chi2_pvalue(torch.bincount(accept_only, minlength=V), p[0]) < 1e-6


def _wrong_accept_by_p_only(logits, drafts, q, seed, pos):
    """A broken first step: accept draft 0 iff p(x) >= u (forgetting q), else resample from the
    residual. This biases the output towards the drafts."""
    from dspark_compile.kernels.philox import STREAM_ACCEPT, STREAM_RESAMPLE, uniform
    p0 = torch.softmax(logits[:, 0].float(), -1)
    x = drafts[:, 0]
    u = uniform(seed, torch.zeros_like(seed), pos, torch.full_like(seed, STREAM_ACCEPT))
    acc = p0.gather(1, x[:, None])[:, 0] >= u
    resid = (p0 - q[:, 0]).clamp_min(0)
    res = gumbel_argmax(torch.log(resid), seed, pos, STREAM_RESAMPLE)
    return torch.where(acc, x, res), acc


def test_seeded_determinism():
    logits, drafts, q, _, _, seed, pos = _lossless_setup(256)
    T, k, tp = meta(256, T=1.0)
    a = rejection_sample_reference(logits, drafts, q, T, k, tp, seed, pos)
    b = rejection_sample_reference(logits, drafts, q, T, k, tp, seed, pos)
    c = rejection_sample_reference(logits, drafts, q, T, k, tp, seed + 1, pos)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert ((a[1] >= 1) & (a[1] <= 3)).all()


def _mixed_case(seed=0, B=8, N=4, V=137):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N + 1, V, generator=g) * 2
    draft_logits = logits[:, :N] + torch.randn(B, N, V, generator=g) * 0.5
    q = torch.softmax(draft_logits, -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, N)
    q = draft_logits            # what the op takes
    T = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.3, 0.0, 1.0, 0.9])[:B]
    k = torch.tensor([0, 0, 10, 0, 0, 0, 30, 5])[:B]
    p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 1.0, 0.95, 1.0])[:B]
    # greedy rows: drafts that mostly match the target argmax
    am = logits[:, :N].argmax(-1)
    drafts[0] = am[0]
    if B > 5:
        drafts[5, :2] = am[5, :2]
    return logits, drafts, q.contiguous(), T, k, p


def test_fused_equals_reference_mixed_rows():
    logits, drafts, q, T, k, p = _mixed_case()
    for s in range(2):
        seed = torch.arange(8) * 7 + 1000 * s
        pos = torch.arange(8) + 3 * s
        want = rejection_sample_reference(logits, drafts, q, T, k, p, seed, pos)
        got = launch(logits, drafts, q, T, k, p, seed, pos,
                                      tile=64, chunk=64 if s else None, cap=64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), s
    # the exact-threshold fallback (2 candidates) decides the same
    got = launch(logits, drafts, q, T, k, p, seed, pos, tile=256,
                                  cap=2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_no_drafts_samples_the_bonus_only(T):
    """N = 0 (the shape plain target sampling uses): one token per request, the bonus from
    p_0, fused equal to the reference (which used to fail indexing an empty q)."""
    g = torch.Generator().manual_seed(3)
    B, V = 4, 97
    logits = torch.randn(B, 1, V, generator=g) * 2
    drafts, q = torch.zeros((B, 0), dtype=torch.int64), torch.zeros((B, 0, V))
    T_, k, p = meta(B, T, 5, 0.9)     # (q: no draft logits)
    seed, pos = torch.arange(B) + 11, torch.arange(B) * 3
    want = rejection_sample_reference(logits, drafts, q, T_, k, p, seed, pos)
    assert torch.equal(want[1], torch.ones(B, dtype=torch.int64))
    if T == 0.0:
        assert torch.equal(want[0][:, 0], logits[:, 0].argmax(-1))
    got = launch(logits, drafts, q, T_, k, p, seed, pos, tile=32, cap=8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fused_degenerate_and_padded_rows():
    logits, drafts, q, T, k, p = _mixed_case(1, B=4)
    seed, pos = torch.arange(4), torch.arange(4) * 5
    alone = launch(logits, drafts, q, T, k, p, seed, pos, tile=256)
    N, V = drafts.shape[1], logits.shape[-1]
    pl = torch.randn(3, N + 1, V)
    pl[0] = float("nan")
    pl[1] = NINF
    pq = torch.full((3, N, V), float("nan"))
    pq[2] = -1.0                                  # flat draft rows: q uniform
    pd = torch.tensor([[-1, V, 0, 5], [0, 0, 0, 0], [1 << 40, 3, 3, 3]])
    L = torch.cat((logits, pl))
    D = torch.cat((drafts, pd))
    Q = torch.cat((q, pq))
    T2 = torch.cat((T, torch.tensor([1.0, 1.0, float("nan")])))
    k2 = torch.cat((k, torch.tensor([-1, 1 << 40, 2])))
    p2 = torch.cat((p, torch.tensor([float("nan"), 0.0, 0.5])))
    s2 = torch.cat((seed, torch.tensor([-5, 1 << 62, 0])))
    pos2 = torch.cat((pos, torch.tensor([-1, 1 << 40, 7])))
    tokens, num = launch(L, D, Q, T2, k2, p2, s2, pos2, tile=256)
    assert torch.equal(tokens[:4], alone[0]) and torch.equal(num[:4], alone[1])
    assert ((num >= 1) & (num <= N + 1)).all()
    committed = torch.arange(N + 1)[None] < num[:, None]
    assert ((tokens >= 0) & (tokens < V) | ~committed).all()
    assert (tokens[~committed] == -1).all()
    want = rejection_sample_reference(L, D, Q, T2, k2, p2, s2, pos2)
    assert torch.equal(tokens, want[0]) and torch.equal(num, want[1])


@pytest.mark.parametrize("B,N,V,tile,chunk", [(1, 5, 300, 32, 64), (5, 3, 257, 16, 48),
                                              (3, 0, 97, 16, None), (9, 2, 1000, 64, 128)])
def test_greedy_mode_equals_reference_on_random_degenerate_and_padded_rows(B, N, V, tile, chunk):
    """Mode "greedy" (rows' argmax as packed atomic maxima over chunk programs, then the
    acceptance chain) against the reference with every row greedy: drafts that follow the
    argmax for a while, ties across chunks (lowest id wins), NaN / all -inf / +inf rows
    (token 0), out-of-range drafts, garbage q and parameters (never read), bf16 logits."""
    g = torch.Generator().manual_seed(B * 100 + V)
    logits = torch.randn(B, N + 1, V, generator=g) * 3
    drafts = logits[:, :N].argmax(-1)
    cut = torch.randint(0, N + 1, (B,), generator=g)          # the first wrong draft
    for b in range(B):
        if cut[b] < N:
            drafts[b, cut[b]] = (drafts[b, cut[b]] + 1) % V
    if B >= 5:
        logits[1, 0, 7] = logits[1, 0, V - 3] = logits[1, 0].max() + 1   # tie: 7 wins
        drafts[1, 0] = 7 if N else 0
        logits[2, -1] = float("nan")
        logits[3, 0] = NINF
        logits[4, 0, 11] = float("inf")
        if N:
            drafts[4, 0] = V + 2                                  # out of range: rejected
    q = torch.full((B, N, V), float("nan"))                       # never read
    T = torch.rand(B, generator=g) + 0.5                          # ignored by the mode
    k, p = torch.full((B,), 3), torch.full((B,), 0.5)
    seed, pos = torch.arange(B), torch.arange(B) * 7
    args = (logits, drafts, q, T, k, p, seed, pos)
    want = rejection_sample_mode_reference(*args, mode="greedy")
    got = launch(*args, "greedy", tile=tile, chunk=chunk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if B >= 5:
        assert got[0][3, 0] == 0 and (N == 0 or got[1][4] == 1)
        if N:
            assert got[0][1, 0] == 7
    # the same on bf16 target logits, and the registered op (CPU: the mode's reference)
    args16 = (logits.bfloat16(), *args[1:])
    want16 = rejection_sample_mode_reference(*args16, mode="greedy")
    got16 = launch(*args16, "greedy", tile=tile, chunk=chunk)
    assert torch.equal(got16[0], want16[0]) and torch.equal(got16[1], want16[1])
    op = torch.ops.dspark.rejection_sample(*args, mode="greedy")
    assert torch.equal(op[0], want[0]) and torch.equal(op[1], want[1])


def test_op_dispatch_and_errors():
    logits, drafts, q, T, k, p = _mixed_case(2, B=2)
    seed, pos = torch.arange(2), torch.arange(2)
    got = torch.ops.dspark.rejection_sample(logits, drafts, q, T, k, p, seed, pos)
    want = rejection_sample_reference(logits, drafts, q, T, k, p, seed, pos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="draft_logits"):
        rejection_sample_reference(logits, drafts, q[:, :, :-1], T, k, p, seed, pos)
    with pytest.raises(ValueError, match="draft_tokens"):
        rejection_sample_reference(logits, drafts[:, :2], q, T, k, p, seed, pos)
    with pytest.raises(ValueError, match="mode"):
        launch(logits, drafts, q, T, k, p, seed, pos, "fast")
    # 2^31 elements (expanded: no memory) would wrap the kernels' int32 indexing
    B2, V2 = 2 ** 16, 2 ** 14
    big = torch.zeros(1, 1, 1).expand(B2, 2, V2)
    z2 = torch.zeros(B2, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_logits spans 2147483648 elements"):
        launch(big, z2[:, None], big[:, :1], torch.zeros(B2), z2,
                                torch.ones(B2), z2, z2, "greedy")
    with pytest.raises(ValueError, match="mode"):
        torch.ops.dspark.rejection_sample(logits, drafts, q, T, k, p, seed, pos, mode="fast")


@pytest.mark.gpu
def test_gpu_flash_vocab_matches_reference():
    dev = "cuda"
    B, N, V = 8, 5, 129280
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(B, N + 1, V, device=dev, generator=g) * 3
    q = logits[:, :N] + torch.randn(B, N, V, device=dev, generator=g) * 0.3    # draft logits
    drafts = torch.multinomial(torch.softmax(q, -1).reshape(-1, V), 1, generator=g).reshape(B, N)
    drafts[0] = logits[0, :N].argmax(-1)
    T = torch.tensor([0.0, 1.0, 1.0, 0.7, 1.0, 0.0, 1.2, 1.0], device=dev)
    k = torch.tensor([0, 0, 0, 40, 0, 0, 0, 100], device=dev)
    p = torch.tensor([1.0, 1.0, 0.95, 1.0, 0.9, 1.0, 0.8, 0.95], device=dev)
    seed, pos = torch.arange(B, device=dev), torch.arange(B, device=dev) * 9
    want = rejection_sample_reference(logits, drafts, q, T, k, p, seed, pos)
    got = torch.ops.dspark.rejection_sample(logits, drafts, q, T, k, p, seed, pos)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 3, 64])
def test_gpu_greedy_mode_flash_vocab_and_graph_replay(B):
    """Mode "greedy" at the Flash vocabulary against the reference, and replayed in a CUDA
    graph with new drafts."""
    dev = "cuda"
    N, V = 5, 129280
    g = torch.Generator(device=dev).manual_seed(B)
    logits = torch.randn(B, N + 1, V, device=dev, generator=g) * 3
    drafts = logits[:, :N].argmax(-1)
    drafts[B // 2:, 2] = (drafts[B // 2:, 2] + 1) % V       # half the requests reject draft 2
    if B > 2:
        logits[1, 1] = float("nan")
    q = torch.empty(B, N, V, device=dev)
    T, k, p = (t.to(dev) for t in meta(B, 1.0, 0, 0.95))
    seed, pos = torch.arange(B, device=dev), torch.arange(B, device=dev)
    args = [logits, drafts, q, T, k, p, seed, pos]
    want = rejection_sample_mode_reference(*args, mode="greedy")
    got = torch.ops.dspark.rejection_sample(*args, mode="greedy")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    static = [a.clone() for a in args]
    torch.ops.dspark.rejection_sample(*static, mode="greedy")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dspark.rejection_sample(*static, mode="greedy")
    new_drafts = drafts.clone()
    new_drafts[:, 0] = (new_drafts[:, 0] + 3) % V               # every request rejects draft 0
    static[1].copy_(new_drafts)
    graph.replay()
    want = rejection_sample_mode_reference(logits, new_drafts, *args[2:], mode="greedy")
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert (out[1] == 1).all()


def test_fused_threshold_refinement_on_near_flat_rows():
    """Near-flat target rows whose top-k/top-p brackets overflow cap = 64 by far: the exact
    radix refinement must reproduce the reference."""
    g = torch.Generator().manual_seed(21)
    B, v = 3, 2048
    logits = torch.randn(B, 2, v, generator=g) * 0.3
    logits[2] = (logits[2] * 4).round() / 64             # exact ties, hundreds per value
    drafts = torch.randint(0, v, (B, 1), generator=g)
    q = torch.randn(B, 1, v, generator=g)                # draft logits
    T = torch.tensor([1.0, 0.8, 1.0])
    k = torch.tensor([0, 1000, 0])
    p = torch.tensor([0.95, 1.0, 0.7])
    seed, sp = torch.tensor([5, 6, 7]), torch.tensor([0, 3, 9])
    want = rejection_sample_reference(logits, drafts, q, T, k, p, seed, sp)
    for persistent in (False, True):        # the searches' refinement in persistent grids too
        got = launch(logits, drafts, q, T, k, p, seed, sp, tile=256,
                                      chunk=512, cap=64, persistent=persistent)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), persistent


# ---- the bound walk: acceptance tests decided from the row statistics alone ----

def _confident_case(seed, B, N, V):
    """Target rows of a confident head (8 tokens 6-11 nats above a std-2 bulk) and drafts from
    a nearby q: most acceptance tests are decided by the bound walk."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N + 1, V, generator=g) * 2
    hot = torch.randint(0, V, (B, N + 1, 8), generator=g)
    lift = 6 + 5 * torch.rand(B, N + 1, 1, generator=g)
    logits = x.scatter_add_(-1, hot, lift.expand(B, N + 1, 8).contiguous())
    dl = logits[:, :N] + 0.5 * torch.randn(B, N, V, generator=g)
    drafts = torch.multinomial(torch.softmax(dl, -1).reshape(-1, V), 1, generator=g).reshape(B, N)
    return logits, drafts, dl


def _walk(logits, drafts, dl, T, k, p, seed, pos, tile, verify=None):
    """The statistics passes and the bound walk alone: (need [B, N+1], dneed [B, N],
    dec [B, N]) for target logits [B, N+1, V] and draft logits dl [B, N, V] (verify: the
    block-verified requests, none by default)."""
    from dspark_compile.kernels.sampling import rejection as rj
    B, N1, V = logits.shape
    logits, dl = logits.contiguous(), dl.contiguous()
    st, dst = rj._stats(logits, T, tile), rj._stats(dl, T, tile)
    need = torch.full((B * N1,), -1, dtype=torch.int32)
    dneed = torch.full((B * (N1 - 1),), -1, dtype=torch.int32)
    dec = torch.full((B * N1,), -1, dtype=torch.int32)
    if verify is None:
        verify = torch.zeros(B, dtype=torch.int64)
    rj._walk(logits, st, dl, dst, drafts, (T, k, p), seed, pos, verify, need, dneed, dec)
    return need.view(B, N1), dneed.view(B, N1 - 1), dec.view(B, N1)[:, :N1 - 1]


def _exact_accepts(logits, drafts, dl, T, k, p, seed, pos):
    """Each draft's acceptance test as the reference decides it (as if the earlier ones passed)."""
    from dspark_compile.kernels.sampling.reference import sampled_accepts
    return sampled_accepts(request_probs(logits, T, k, p), drafts, request_probs(dl, T, k, p),
                           seed, pos)


def test_bound_walk_decisions_agree_with_exact_tests_and_skip_rows():
    """Every decision the walk takes is the exact test's; the target and draft rows it flags are
    exactly the ones whose exact threshold is read (undecided tests, the resampled or bonus row,
    the draft row of a residual); greedy and top-k requests keep every target row (top-k ones
    every draft row, greedy ones none); and on confident rows it decides most tests (so most
    rows are never searched)."""
    B, N, V = 36, 4, 600
    decided = flagged = tested = rows = 0
    for s in range(2):
        logits, drafts, q = _confident_case(s, B, N, V)
        # requests 12..23: flatter rows (a std-2 bulk, nothing raised), where the blocks above
        # a draft hold much more mass than their maxima; 24..35: confident rows under a sharper
        # draft (q(x) > p(x) on the kept tokens), where the kept mass's bounds decide
        g = torch.Generator().manual_seed(100 + s)
        logits[12:24] = torch.randn(12, N + 1, V, generator=g) * 2
        q[12:24] = logits[12:24, :N] + 0.3 * torch.randn(12, N, V, generator=g)
        q[24:] = 2.5 * logits[24:, :N]
        drafts[12:] = torch.multinomial(torch.softmax(q[12:], -1).reshape(-1, V), 1,
                                        generator=g).view(-1, N)
        T = torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0] + [1.0] * 24)
        k = torch.tensor([0, 0, 0, 0, 0, 0, 0, 20, 0, 0, 0, 0] + [0] * 24)
        p = torch.tensor([0.95, 0.9, 0.95, 1.0, 0.0, 0.5, 1.0, 0.95, 0.95, 0.95, 0.8, 0.99]
                         + [0.3, 0.5, 0.7, 0.9, 0.95, 1.0] * 2 + [0.4, 0.5, 0.6, 0.8] * 3)
        logits[8, 1, 5] = float("nan")                  # a degenerate row mid-chain
        drafts[9, 1] = V + 3                            # an out-of-range draft
        q[10, 0, drafts[10, 0]] = NINF                  # a draft its q gives no mass
        logits[11, :, : V // 2] = NINF                  # whole -inf blocks
        q[11, 1:, V // 3:] = NINF                       # and in draft rows
        q[7, 2, 0] = float("nan")                       # a degenerate draft row
        seed = torch.randint(0, 2 ** 62, (B,), generator=torch.Generator().manual_seed(s))
        pos = torch.arange(B) * 11 + s
        need, dneed, dec = _walk(logits, drafts, q, T, k, p, seed, pos, tile=64)
        exact = _exact_accepts(logits, drafts, q, T, k, p, seed, pos)
        for b in range(B):
            if T[b] <= 0 or k[b] > 0:
                assert (need[b] == 1).all() and (dec[b] == 0).all(), b
                assert (dneed[b] == int(T[b] > 0)).all(), b
                continue
            rej = (dec[b] == 2).nonzero()
            stop = int(rej[0]) if len(rej) else N
            for i in range(stop + 1):
                if i < N and dec[b, i] == 1:
                    assert exact[b, i], (s, b, i)
                if i < N and dec[b, i] == 2:
                    assert not exact[b, i] and i == stop, (s, b, i)
                assert need[b, i] == int(i == stop or dec[b, i] == 0), (s, b, i)
                if i < N:
                    assert dneed[b, i] == need[b, i], (s, b, i)
            assert (need[b, stop + 1:] == 0).all(), (s, b)
            assert (dneed[b, stop + 1:] == 0).all(), (s, b)
            if b < 6:                                   # the confident, well-formed requests
                decided += int((dec[b, :min(stop + 1, N)] != 0).sum())
                tested += min(stop + 1, N)
                flagged += int(need[b].sum())
                rows += N + 1
    assert decided >= 0.6 * tested, (decided, tested)
    assert flagged <= 0.5 * rows, (flagged, rows)


def test_fused_with_bound_walk_equals_reference_on_confident_rows():
    """The whole op with the walk (rows skipped by reduce / select, decided tests taken as
    stored; their searches one program per row and chunk or in persistent grids) and without
    it: the reference's tokens, at tilings with several chunks."""
    B, N, V, seed = 9, 4, 500, 0
    logits, drafts, q = _confident_case(10 + seed, B, N, V)
    # requests 6..8: flat rows, where the walk leaves tests to the exact path while it skips
    # other rows of the same request
    g = torch.Generator().manual_seed(20 + seed)
    logits[6:] = torch.randn(3, N + 1, V, generator=g) * 2
    q[6:] = logits[6:, :N] + 0.3 * torch.randn(3, N, V, generator=g)
    drafts[6:] = torch.multinomial(torch.softmax(q[6:], -1).reshape(-1, V), 1,
                                   generator=g).view(-1, N)
    T = torch.tensor([1.0, 0.8, 1.0, 1.2, 1.0, 1.0, 1.0, 0.9, 1.0])
    k = torch.tensor([0, 0, 0, 0, 7, 0, 0, 0, 0])
    p = torch.tensor([0.95, 0.9, 1.0, 0.95, 0.9, 0.3, 0.9, 0.95, 0.7])
    sd = torch.arange(B) * 31 + seed
    pos = torch.arange(B) * 7
    need, _, dec = _walk(logits, drafts, q, T, k, p, sd, pos, tile=32)
    mixed = [b for b in range(B) if k[b] == 0 and (need[b] == 0).any() and any(
        dec[b, i] == 0 and need[b, i] == 1 and not (dec[b, :i] == 2).any() for i in range(N))]
    assert mixed, "no request with an exact test and skipped rows: the case lost its point"
    want = rejection_sample_reference(logits, drafts, q, T, k, p, sd, pos)
    # the searches one program per row and chunk (the default), or persistent grids (on the
    # CPU one program per "SM", which takes every flagged row's items in turn)
    for bounds, persistent in ((True, False), (False, False), (True, True)):
        got = launch(logits, drafts, q, T, k, p, sd, pos, tile=32, chunk=128,
                                      bounds=bounds, persistent=persistent)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), bounds
    # bf16 target and draft logits: every pass reads and scales them itself (no fp32 copy)
    l16, q16 = logits.bfloat16(), q.bfloat16()
    want = rejection_sample_reference(l16, drafts, q16, T, k, p, sd, pos)
    got = launch(l16, drafts, q16, T, k, p, sd, pos, tile=32, chunk=128)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_pdl_knob_is_checked():
    logits, drafts, q = _confident_case(0, 2, 2, 64)
    args = (logits, drafts, q, *meta(2, 1.0, 0, 0.9), torch.arange(2), torch.arange(2))
    for mode in ("full", "greedy"):
        with pytest.raises(ValueError, match="pdl must be"):
            launch(*args, mode, pdl="sometimes")
        with pytest.raises(ValueError, match="persistent must be"):
            launch(*args, mode, persistent=1)


def _gpu_confident_case(B, dev):
    """Flash-vocabulary target rows for the GPU tests: confident and flat requests, greedy,
    top-k and low top-p ones, a degenerate row and an out-of-range draft."""
    N, V = 5, 129280
    g = torch.Generator(device=dev).manual_seed(B)
    x = torch.randn(B, N + 1, V, device=dev, generator=g) * 2
    hot = torch.randint(0, V, (B, N + 1, 32), device=dev, generator=g)
    lift = 9 + 6 * torch.rand(B, N + 1, 1, device=dev, generator=g)
    logits = x.scatter_add_(-1, hot, lift.expand(B, N + 1, 32).contiguous())
    logits[B // 2:] = torch.randn(B - B // 2, N + 1, V, device=dev, generator=g) * 3
    q = logits[:, :N] + torch.randn(B, N, V, device=dev, generator=g) * 0.5   # draft logits
    drafts = torch.multinomial(torch.softmax(q, -1).reshape(-1, V), 1, generator=g).reshape(B, N)
    T = torch.ones(B, device=dev)
    T[0] = 0.0
    k = torch.zeros(B, dtype=torch.int64, device=dev)
    k[1] = 50
    p = torch.full((B,), 0.95, device=dev)
    p[2 % B] = 0.5
    if B > 3:
        logits[3, 2, 7] = float("nan")
        drafts[-1, 1] = V + 5
    seed = torch.randint(0, 2 ** 62, (B,), device=dev, generator=g)
    pos = torch.arange(B, device=dev) * 13
    return [logits, drafts, q, T, k, p, seed, pos]


@pytest.mark.gpu
@pytest.mark.parametrize("B", [4, 40])
def test_gpu_bound_walk_and_pdl_modes_equal_reference_eager_and_replayed(B):
    """At the Flash vocabulary: the bound walk on and off, with PDL off / early / late, the
    draft rows' statistics and search beside the target rows' (side stream) or after them,
    give the reference's tokens; captured in a CUDA graph (with overlap, its forks and joins
    branches of the graph) and replayed on new inputs too."""
    args = _gpu_confident_case(B, "cuda")
    want = rejection_sample_reference(*args)
    for bounds in (True, False):
        for pdl in (False, "early", "late"):
            for overlap in (True, False):
                got = launch(*args, bounds=bounds, pdl=pdl, overlap=overlap)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), \
                    (bounds, pdl, overlap)
    for pdl in (False, "early", "late"):        # the searches in persistent grids
        got = launch(*args, pdl=pdl, persistent=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), pdl
    new = _gpu_confident_case(B + 1, "cuda")
    new = [n[:B] for n in new]
    want = rejection_sample_reference(*new)
    for overlap in (True, False):
        # the op itself (overlap, its default), and the launcher without it
        run = torch.ops.dspark.rejection_sample if overlap else \
            (lambda *a: launch(*a, overlap=False))
        static = [a.clone() for a in args]
        run(*static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(*static)
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), overlap


def test_statistics_pass_per_block():
    """The statistics pass gives every block's max, lowest-id argmax, sum exp(z - max) and NaN
    flag of z = logits / T (greedy rows at T = 1), the ragged last block included, and writes
    nothing past its rows' blocks."""
    from dspark_compile.kernels.sampling import rejection as rj
    g = torch.Generator().manual_seed(5)
    B, N1, V, tile = 4, 2, 1000, 64
    logits = torch.randn(B, N1, V, generator=g) * 3
    logits[0, 1, 70] = logits[0, 1, 71] = float("nan")     # two in a block: still flag 1
    logits[1, 0, 128:256] = NINF                        # whole -inf blocks
    logits[2, 1, 5] = logits[2, 1, 9] = 50.0            # a tie: the lower id
    logits[3, 0, 990] = logits[3, 0, 999] = 60.0        # a tie in the ragged last block
    T = torch.tensor([0.7, 0.0, 1.3, 1.0])
    z = logits / torch.where(T > 0, T, torch.ones_like(T)).repeat_interleave(N1)[:, None] \
        .view(B, N1, 1)
    z = z.reshape(B * N1, V)
    nblk = -(-V // tile)
    zp = torch.nn.functional.pad(z, (0, nblk * tile - V), value=NINF).view(B * N1, nblk, tile)
    nan = torch.isnan(zp)
    zn = torch.where(nan, torch.full_like(zp, NINF), zp)
    bmax = zn.amax(-1)
    st = rj._stats(logits, T, tile)
    assert torch.equal(st["bmax"], bmax)
    assert torch.equal(st["bnan"], nan.any(-1).to(torch.int32))      # a 0 / 1 flag
    fin = bmax > NINF
    assert torch.equal(st["barg"][fin], (zn.argmax(-1) + torch.arange(nblk) * tile)[fin])
    assert st["barg"][3 * N1, nblk - 1] == 990         # request 3, row 0
    want = torch.where(zn > NINF, torch.exp(zn - bmax[..., None]), 0.0).sum(-1)
    torch.testing.assert_close(st["bsum"][fin], want[fin], rtol=2e-6, atol=0)
    # nothing written past the rows' blocks (padded buffers; the interpreter runs programs in
    # order, so a stray write into the next row would be overwritten: the pad shows it)
    R = B * N1
    pad = [torch.full((R * nblk + 8,), -7, dtype=dt) for dt in (torch.float32, torch.int32,
                                                                   torch.float32, torch.int32)]
    rj._rows_stats_kernel[(R, nblk)](logits, T, *pad, V, nblk, N1, V, BLOCK=tile)
    for t in pad:
        assert (t[R * nblk:] == -7).all()
        assert (t[:R * nblk] != -7).any()


def test_bound_walk_edge_decisions():
    """u q(x) == 0 accepts whatever p(x) is, as the exact test does (q(x) a subnormal the
    product rounds away); a test 1e-4 from its boundary, either side, is left to the exact
    path."""
    from dspark_compile.kernels.philox import STREAM_ACCEPT, uniform
    V = 256
    u_of = lambda s, pos: float(uniform(torch.tensor([s]), torch.tensor([0]),  # noqa: E731
                                        torch.tensor([pos]), torch.tensor([STREAM_ACCEPT]))[0])
    # request 0: one dominant target token, the draft 70 nats below it; the draft row holds
    # two tokens, the draft's 100 nats below the other: q(x) = e^-100 (~26 times the smallest
    # subnormal), so u q(x) rounds to 0 for u < 0.015
    s0 = next(s for s in range(10000) if u_of(s, 0) < 0.015)
    logits = torch.randn(3, 2, V, generator=torch.Generator().manual_seed(0))
    logits[0, 0, 3], logits[0, 0, 9] = 40.0, -30.0
    drafts = torch.tensor([[9], [0], [0]])
    q = torch.randn(3, 1, V, generator=torch.Generator().manual_seed(1))     # draft logits
    q[0, 0] = NINF
    q[0, 0, 3], q[0, 0, 9] = 0.0, -100.0
    # requests 1 and 2 (top-p 0.9): a confident row, the draft its top token, q(x) = p(x) / u
    # (1 -+ 1e-4); the draft row's other tokens tie, so its top-p set is the whole row
    logits[1:, 0] = 0.0
    logits[1:, 0, :4] = torch.tensor([8.0, 7.5, 7.0, 6.0])
    T, k, p = meta(3, 1.0, 0, 1.0)
    p[1:] = 0.9
    s1 = [s for s in range(100) if u_of(s, 3) > 0.6][:2]
    seed, pos = torch.tensor([s0, *s1]), torch.tensor([0, 3, 3])
    pr = probs_from_processed(process_logits(logits[:, 0], T, k, p))
    for b, f in ((1, 1 - 1e-4), (2, 1 + 1e-4)):
        c = float(pr[b, 0]) / u_of(int(seed[b]), int(pos[b])) * f
        qv = torch.full((V,), (1 - c) / (V - 1), dtype=torch.float64)
        qv[0] = c
        q[b, 0] = torch.log(qv).float()
    assert torch.isclose(request_probs(q, T, k, p)[0, 0, 9], torch.tensor(3.7e-44), rtol=0.1)
    need, dneed, dec = _walk(logits, drafts, q, T, k, p, seed, pos, tile=32)
    exact = _exact_accepts(logits, drafts, q, T, k, p, seed, pos)
    assert exact[0, 0] and dec[0, 0] == 1
    assert exact[1, 0] and not exact[2, 0]
    assert dec[1, 0] == 0 and dec[2, 0] == 0 and (need[1:, 0] == 1).all()
    assert (dneed[1:, 0] == 1).all()
    want = rejection_sample_reference(logits, drafts, q, T, k, p, seed, pos)
    got = launch(logits, drafts, q, T, k, p, seed, pos, tile=32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bound_walk_uses_the_draft_rows_kept_mass_bounds():
    """A draft row whose top-p set holds ~90 % of its mass (a long tail, cut at top-p 0.9) and a
    target row whose set holds ~all of its mass: q(x)'s bracket is ~10 % wide, p(x)'s lower
    bound tight. With p(x) = u q(x) / 1.05 the exact test rejects; a walk that bracketed q(x)
    with the wrong kept-mass bound (q's bounds swapped) would take it as a sure accept."""
    from dspark_compile.kernels.philox import STREAM_ACCEPT, uniform
    V = 256
    u_of = lambda s, pos: float(uniform(torch.tensor([s]), torch.tensor([0]),  # noqa: E731
                                        torch.tensor([pos]), torch.tensor([STREAM_ACCEPT]))[0])
    s0 = next(s for s in range(1000) if 0.4 < u_of(s, 7) < 0.85)
    T, k, p = meta(1, 1.0, 0, 0.9)
    # draft row: x = token 0 with weight 0.3, a tail of 255 distinct small weights (0.7)
    wq = torch.linspace(1.0, 0.9, V - 1, dtype=torch.float64)
    wq = torch.cat((torch.tensor([0.3], dtype=torch.float64), 0.7 * wq / wq.sum()))
    dl = torch.log(wq).float().view(1, 1, V)
    q = request_probs(dl, T, k, p)[0, 0, 0]
    assert 0.3 < q < 0.34                                   # kept mass ~0.9 of the row
    # target row: five tokens hold 0.999 (x the smallest of them), a tail of 0.001
    tx = 0.999 * u_of(s0, 7) * float(q) / 1.05
    wp = torch.full((V,), 0.001 / (V - 5), dtype=torch.float64)
    wp[:5] = torch.tensor([tx, *((0.999 - tx) * torch.tensor([0.26, 0.25, 0.25, 0.24]))],
                          dtype=torch.float64)
    wp[5:] *= torch.linspace(1.0, 0.5, V - 5, dtype=torch.float64)
    logits = torch.stack((torch.log(wp), torch.zeros(V, dtype=torch.float64))).float()[None]
    drafts = torch.tensor([[0]])
    seed, pos = torch.tensor([s0]), torch.tensor([7])
    pr = request_probs(logits, T, k, p)[0, 0]
    assert int((pr > 0).sum()) == 5                         # the target keeps the five
    assert pr[0] < u_of(s0, 7) * q < 1.06 * pr[0]
    need, dneed, dec = _walk(logits, drafts, dl, T, k, p, seed, pos, tile=32)
    exact = _exact_accepts(logits, drafts, dl, T, k, p, seed, pos)
    assert not exact[0, 0]
    assert dec[0, 0] == 0 and need[0, 0] == 1 and dneed[0, 0] == 1
    want = rejection_sample_reference(logits, drafts, dl, T, k, p, seed, pos)
    got = launch(logits, drafts, dl, T, k, p, seed, pos, tile=32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert want[1][0] == 1
