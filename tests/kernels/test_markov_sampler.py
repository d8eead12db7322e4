"""DSpark Markov draft sampler: reference semantics, the fused Triton sampler (interpreter at toy
shapes) against it, the draft distribution (chi-square), degenerate/padded rows, the op."""
import pytest
import torch

from dspark_compile.kernels.philox import STREAM_DRAFT
from dspark_compile.kernels.sampling.markov import (markov_sample_launch,
                                                    markov_sample_mode_reference)
from dspark_compile.kernels.sampling.plan import HIST_BINS, PERSIST_FROM_ROWS, SamplerPlan
from dspark_compile.kernels.sampling.reference import (gumbel_noise, markov_bias,
                                                       markov_sample_reference,
                                                       probs_from_processed, process_logits,
                                                       request_probs)
from dspark_compile.kernels.sampling.row_launch import check_int32_index
from stats_utils import chi2_pvalue

V, R, N = 137, 16, 5
VF = 129280                     # Flash vocabulary (GPU tests)
NINF = float("-inf")
# one program per row pass (fast under the interpreter); MULTI splits rows over programs
ONE = dict(tile=256, chunk=256, cap=256)
MULTI = dict(tile=32, chunk=64, cap=64)


def launch(*args, **plan):
    """markov_sample_launch of the 9 data tensors under SamplerPlan().replace(**plan) (plan
    fields and test hooks); a 10th positional argument is the plan's mode."""
    if len(args) > 9:
        plan["mode"] = args[9]
    return markov_sample_launch(*args[:9], plan=SamplerPlan().replace(**plan))




def ref(*args):
    """The reference's (drafts, draft probabilities q [B, N, V]): q = softmax(process(
    draft_logits)) per step, greedy rows zeros (mode "greedy": every row)."""
    mode = args[9] if len(args) > 9 else "full"
    d, lg = markov_sample_mode_reference(*args[:9], mode)
    T, k, p = args[4:7]
    if mode == "greedy":
        return d, torch.zeros_like(lg)
    q = request_probs(lg, T, k, p)
    return d, torch.where((T <= 0)[:, None, None], torch.zeros_like(q), q)


def fused(*args, **kw):
    """The fused sampler's (drafts, q): the drafts of the default plan (the candidate pick)
    must equal those of the plan that searches every row (candidate=False), whose per-step
    thresholds (the `thresholds` hook) and draft logits give q as the exact path defines it:
    exp(z - m) / kept mass where z >= tau."""
    mode = kw.get("mode", args[9] if len(args) > 9 else "full")
    th = []
    d, lg = launch(*args, candidate=False, thresholds=th, **kw)
    dc, lgc = launch(*args, **kw)
    assert torch.equal(dc, d), "candidate pick and exact path disagree"
    if mode == "greedy":
        return d, torch.zeros_like(lg)
    torch.testing.assert_close(lgc, lg, rtol=0, atol=0, equal_nan=True)
    T, k, p = args[4:7]
    V = lg.shape[-1]
    trunc = (((k > 0) & (k < V)) | (p < 1.0)) if mode == "full" else torch.zeros_like(T).bool()
    t = torch.where(T > 0, T, torch.ones_like(T)).float()
    q = []
    for s, (rowf, rowi) in enumerate(th):
        z = lg[:, s] / t[:, None]
        deg = rowi[:, 3] != 0
        cut = trunc & ~deg
        tau = torch.where(cut, rowf[:, 2], torch.full_like(rowf[:, 2], NINF))
        zk = torch.where(cut, rowf[:, 3], rowf[:, 1])
        keep = (z >= tau[:, None]) & (z > NINF) & ~deg[:, None] & ~(T <= 0)[:, None]
        e = torch.exp(z - rowf[:, :1])
        q.append(torch.where(keep, e / zk[:, None], torch.zeros_like(z)))
    return d, torch.stack(q, 1)


def assert_probs_match(got, want):
    """The same kept sets (a token kept or dropped by one side only fails, however small its
    probability), then the values within fp32 rounding."""
    assert torch.equal(got > 0, want > 0), int(((got > 0) != (want > 0)).sum())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

def weights(seed=0, scale=0.3, dtype=torch.bfloat16, v=V):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(v, R, generator=g).to(dtype),
            (torch.randn(v, R, generator=g) * scale).to(dtype))


def params(B, T=1.0, k=0, p=1.0):
    full = lambda x, dt: x if torch.is_tensor(x) else torch.full((B,), x, dtype=dt)  # noqa: E731
    return (full(T, torch.float32), full(k, torch.int64), full(p, torch.float32))


def chain_weights(strength):
    """bias(prev, v) = strength for v = prev + 1, strength / 2 for the other v = prev + 1
    (mod 16), else 0."""
    w1 = torch.zeros(V, R)
    w2 = torch.zeros(V, R)
    ids = torch.arange(V)
    w1[ids, (ids + 1) % R] = strength
    w2[ids, ids % R] = torch.where(ids < R, 1.0, 0.5)
    return w1.bfloat16(), w2.bfloat16()


def rebuild_probs(base, anchor, drafts, w1, w2, T, k, p):
    """Reference probabilities of every step, from the sampled prefix [anchor, drafts...]."""
    prev = torch.cat((anchor[:, None], drafts[:, :-1]), 1)
    out = []
    for s in range(base.shape[1]):
        logits = base[:, s].float() + markov_bias(prev[:, s], w1, w2)
        out.append(probs_from_processed(process_logits(logits, T, k, p)))
    return torch.stack(out, 1)


# ------------------------------------------------------------------------------------------
# reference semantics

@pytest.mark.parametrize("use_fused", [False, True])
def test_markov_chaining(use_fused):
    w1, w2 = chain_weights(10.0)
    base = torch.zeros(2, N, V)
    anchor = torch.tensor([1, 1])
    T, k, p = params(2, T=torch.tensor([0.0, 0.05]))   # greedy, and nearly greedy sampling
    args = (base, anchor, w1, w2, T, k, p, torch.tensor([3, 4]), torch.tensor([10, 10]))
    drafts, probs = fused(*args, **ONE) if use_fused else ref(*args)
    assert drafts.tolist() == [[2, 3, 4, 5, 6]] * 2
    torch.testing.assert_close(probs[1].sum(-1), torch.ones(N))
    if use_fused:           # every row's draft logits, the greedy row's included
        _, lg = launch(*args, **ONE)
        torch.testing.assert_close(lg, markov_sample_reference(*args)[1])


def test_reference_draft_logits_are_base_plus_bias():
    """The op's draft_logits are base + W1[prev] W2^T per step, rebuilt from the sampled prefix;
    their draft distributions q are softmax(process(.)) of them."""
    w1, w2 = weights(1)
    g = torch.Generator().manual_seed(2)
    base = torch.randn(3, N, V, generator=g)
    anchor = torch.tensor([5, 0, 136])
    T, k, p = params(3, T=torch.tensor([1.0, 0.7, 1.0]), p=torch.tensor([1.0, 1.0, 0.8]))
    drafts, lg = markov_sample_reference(base, anchor, w1, w2, T, k, p, torch.arange(3),
                                         torch.arange(3))
    torch.testing.assert_close(lg[:, 0], base[:, 0] + w1[anchor].float() @ w2.float().T)
    _, probs = ref(base, anchor, w1, w2, T, k, p, torch.arange(3), torch.arange(3))
    torch.testing.assert_close(probs, rebuild_probs(base, anchor, drafts, w1, w2, T, k, p))


def test_draft_sampling_follows_its_distribution():
    """Chi-square over many seeds, one step; a sampler keyed on the wrong stream is fine too
    (all streams are uniform), so the wrong sampler here ignores the Markov bias."""
    v, n = 8, 20000
    w1, w2 = weights(3, scale=1.0, v=v)
    base = torch.tensor([0.5, -1.0, 0.0, 1.0, 0.2, -0.5, 0.8, -2.0]).expand(n, 1, v)
    anchor = torch.full((n,), 3)
    T, k, p = params(n, T=0.9)
    seed = torch.arange(n) * 31 + 7
    drafts, probs = ref(base, anchor, w1, w2, T, k, p, seed, torch.full((n,), 42))
    _, lg = markov_sample_reference(base[:5], anchor[:5], w1, w2, T[:5], k[:5], p[:5], seed[:5],
                                    torch.full((5,), 42))
    want = probs[0, 0].double()
    assert chi2_pvalue(torch.bincount(drafts[:, 0], minlength=v), want) > 1e-3
    no_bias = torch.softmax(base[0, 0] / 0.9, -1).double()
    assert chi2_pvalue(torch.bincount(drafts[:, 0], minlength=v), no_bias) < 1e-6
    # the noise is the documented key: Gumbel(seed, vocab, start_pos, STREAM_DRAFT), added to
    # z = logits / T
    g = gumbel_noise(seed[:5], torch.full((5,), 42), v, STREAM_DRAFT)
    assert torch.equal(torch.argmax(lg[:, 0] / 0.9 + g, -1), drafts[:5, 0])


# ------------------------------------------------------------------------------------------
# fused sampler vs reference

def _case(B, seed=0, base_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, V, generator=g) * base_scale, torch.randint(0, V, (B,), generator=g)


def test_fused_equals_reference_probabilistic_and_greedy():
    w1, w2 = weights(4)
    base, anchor = _case(8, 4)
    T = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.0, 2.0, 0.5])
    k, p = torch.zeros(8, dtype=torch.int64), torch.ones(8)
    seed, sp = torch.arange(8) * 1000 + 17, torch.arange(8) * 3 + 50
    want_d, want_p = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    got_d, got_p = fused(base, anchor, w1, w2, T, k, p, seed, sp, **ONE)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)
    # the op's draft_logits: every row, greedy ones included (fully specified outputs)
    _, got_lg = launch(base, anchor, w1, w2, T, k, p, seed, sp, **ONE)
    _, want_lg = markov_sample_reference(base, anchor, w1, w2, T, k, p, seed, sp)
    torch.testing.assert_close(got_lg, want_lg, rtol=1e-5, atol=1e-5)
    ng = T > 0
    # per step from the fused prefix: rows sum to 1, the drawn token has positive probability
    torch.testing.assert_close(got_p[ng], rebuild_probs(base, anchor, got_d, w1, w2, T, k, p)[ng],
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_p[ng].sum(-1), torch.ones(int(ng.sum()), N))
    assert (got_p[ng].gather(2, got_d[ng][..., None]) > 0).all()


def test_fused_equals_reference_on_many_seeds():
    """Same Philox noise in kernel and reference: identical tokens on 16 x 4 draws (a
    difference would need two Gumbel scores within an ulp of each other)."""
    w1, w2 = weights(5)
    B, n = 16, 4
    base, anchor = _case(B, 5)
    base = base[:, :n]
    T, k, p = params(B, T=1.0)
    seed = torch.randint(0, 2 ** 62, (B,), generator=torch.Generator().manual_seed(9))
    sp = torch.arange(B) * 11
    want, _ = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    got, _ = fused(base, anchor, w1, w2, T, k, p, seed, sp, **ONE)
    assert torch.equal(got, want)
    # the same seeds again: the same tokens; other seeds: other tokens
    again, _ = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    assert torch.equal(again, want)
    other, _ = ref(base, anchor, w1, w2, T, k, p, seed + 1, sp)
    assert (other != want).any(1).float().mean() > 0.5


@pytest.mark.parametrize("persistent", [True, False])
def test_candidate_pick_keeps_kept_candidates_and_searches_the_rest(persistent):
    """The default plan takes a step's Gumbel candidate (argmax of z + g above the top-p floor)
    where it lies in the top-p set and searches the rest: on rows where both happen (flat and
    peaked rows, top-p from 0 to 0.99, a top-k row, T != 1, multi-program chunks), the tokens
    equal the reference's, and pick's own flags show both paths taken. The searched rows go
    through persistent grids (on the CPU one program per "SM": every program takes many rows'
    items in turn) or one program per row and chunk."""
    w1, w2 = weights(16)
    B, n = 24, 3
    g = torch.Generator().manual_seed(16)
    base = torch.randn(B, n, V, generator=g) * torch.tensor([0.5, 2.0, 4.0]).repeat(8)[:, None,
                                                                                     None]
    base[::4, :, :5] += 6.0                                   # peaked rows
    anchor = torch.randint(0, V, (B,), generator=g)
    T = torch.tensor([1.0, 0.8, 1.3]).repeat(8)
    k = torch.zeros(B, dtype=torch.int64)
    k[5] = 20
    p = torch.tensor([0.0, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 0.6]).repeat(3)
    seed, sp = torch.arange(B) * 13 + 1, torch.arange(B) * 5
    args = (base, anchor, w1, w2, T, k, p, seed, sp)
    want_d, _ = markov_sample_reference(*args)
    needs = []
    got_d, _ = launch(*args, needs=needs, persistent=persistent, **MULTI)
    assert torch.equal(got_d, want_d)
    # pick's own flags: both paths taken (the top-k row always searched)
    need = torch.stack(needs, 1).bool()
    assert need[5].all()
    searched, kept = int(need.sum()) - n, int((~need).sum())
    assert searched >= 5 and kept >= 30, (searched, kept)


def test_fused_top_k_top_p():
    """vLLM's case (T = [0.7, 1.3], top_k = [1, V], top_p = [1.0, 0.75]) plus combined and
    top-p-only rows; multi-program row passes."""
    w1, w2 = weights(6)
    base, anchor = _case(4, 6)
    base = base[:, :3]
    T = torch.tensor([0.7, 1.3, 1.0, 0.9])
    k = torch.tensor([1, V, 10, 0])
    p = torch.tensor([1.0, 0.75, 0.8, 0.95])
    seed, sp = torch.tensor([11, 12, 13, 14]), torch.tensor([0, 5, 9, 100])
    want_d, want_p = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    got_d, got_p = fused(base, anchor, w1, w2, T, k, p, seed, sp, **MULTI)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)
    assert ((got_p[0] > 0).sum(-1) == 1).all()            # top-k 1
    assert ((got_p[2] > 0).sum(-1) <= 10).all()


def test_fused_more_rows_than_a_batch_tile():
    """20 rows over batch tiles of 16 (the W2 block is reused from the first tile's load)."""
    w1, w2 = weights(10)
    g = torch.Generator().manual_seed(10)
    B = 20
    base = torch.randn(B, 2, V, generator=g) * 2
    anchor = torch.randint(0, V, (B,), generator=g)
    T = torch.where(torch.arange(B) % 3 == 0, 0.0, 1.0)
    k, p = torch.zeros(B, dtype=torch.int64), torch.ones(B)
    seed, sp = torch.arange(B) + 77, torch.arange(B)
    want_d, want_p = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    got_d, got_p = fused(base, anchor, w1, w2, T, k, p, seed, sp,
                         logits_config=(16, 128, 16, 4, 1), **ONE)
    assert torch.equal(got_d, want_d)
    ng = T > 0
    assert_probs_match(got_p[ng], want_p[ng])


def test_logits_blocks_smaller_than_a_tile_in_mode_full():
    """The logits kernel at 32-token blocks (5 over V = 137, a ragged last one) and a 16-wide
    rank chunk, mode "full" with greedy, top-k and top-p rows; bad tilings raise."""
    w1, w2 = weights(14)
    base, anchor = _case(4, 14)
    T = torch.tensor([0.0, 1.0, 0.8, 1.2])
    k, p = torch.tensor([0, 0, 7, 0]), torch.tensor([1.0, 1.0, 1.0, 0.9])
    seed, sp = torch.arange(4) + 3, torch.arange(4) * 7
    args = (base[:, :3], anchor, w1, w2, T, k, p, seed, sp)
    want_d, want_p = ref(*args)
    got_d, got_p = fused(*args, logits_config=(16, 32, 16, 4, 1), **ONE)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)
    for bad in ((16, 32, 16, 4), (16, 32, 16, 4, 1, 1)):   # the persistent 6th entry is gone
        with pytest.raises(ValueError, match="logits config"):
            fused(*args, logits_config=bad)


def test_fused_threshold_fallback_when_candidates_overflow():
    """cap = 2 candidates: brackets overflow at once, so rows resolve through the refinement
    passes or, where those cannot decide, the exact full-scan fallback."""
    w1, w2 = weights(7)
    base, anchor = _case(2, 7, base_scale=0.5)            # flat rows: many near the boundary
    base = base[:, :2]
    T, k, p = torch.tensor([1.0, 1.0]), torch.tensor([0, 40]), torch.tensor([0.9, 0.7])
    seed, sp = torch.tensor([1, 2]), torch.tensor([3, 4])
    want_d, want_p = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    got_d, got_p = fused(base, anchor, w1, w2, T, k, p, seed, sp,
                                        tile=256, chunk=256, cap=2)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)


def test_fused_degenerate_out_of_range_and_padded_rows():
    w1, w2 = weights(8)
    base, anchor = _case(3, 8)
    T, k, p = torch.tensor([1.0, 0.0, 0.8]), torch.tensor([0, 0, 7]), torch.tensor([0.9, 1.0, 1.0])
    seed, sp = torch.tensor([5, 6, 7]), torch.tensor([20, 21, 22])
    alone = fused(base[:, :2], anchor, w1, w2, T, k, p, seed, sp, **ONE)
    # padded rows: NaN logits, all -inf, out-of-range anchors, garbage sampling parameters
    pad = torch.randn(4, N, V)
    pad[0] = float("nan")
    pad[1] = NINF
    pad[2, :, 7] = float("inf")
    base2 = torch.cat((base, pad))[:, :2]
    anchor2 = torch.cat((anchor, torch.tensor([-3, V, 1 << 40, 0])))
    T2 = torch.cat((T, torch.tensor([1.0, 1.0, 0.0, float("nan")])))
    k2 = torch.cat((k, torch.tensor([5, -4, 1 << 40, 3])))
    p2 = torch.cat((p, torch.tensor([0.5, float("nan"), 0.1, 2.0])))
    seed2 = torch.cat((seed, torch.tensor([-1, 0, 1 << 62, 9])))
    sp2 = torch.cat((sp, torch.tensor([-7, 0, 1 << 40, 3])))
    d, q = fused(base2, anchor2, w1, w2, T2, k2, p2, seed2, sp2, **ONE)
    assert torch.equal(d[:3], alone[0]) and torch.equal(q[[0, 2]], alone[1][[0, 2]])
    assert (d >= 0).all() and (d < V).all()
    assert d[3:5].eq(0).all() and d[6].eq(0).all()        # NaN / -inf / NaN-temperature rows
    for r in (3, 4, 6):                                    # non-greedy degenerate: zero probs
        assert torch.isfinite(q[r]).all() and (q[r] == 0).all()
    want_d, want_q = ref(base2, anchor2, w1, w2, T2, k2, p2, seed2, sp2)
    assert torch.equal(d, want_d)
    ng = T2 > 0
    torch.testing.assert_close(q[ng], want_q[ng], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("B,kw", [
    (1, {}), (5, {}),                                     # the launcher's pick
    (20, dict(greedy_config=(16, 4, 1, 0))),              # one program per block (9 blocks)
    # persistent (2 "SMs" in the interpreter): 2 programs over 9 blocks / 4 over 5, odd steps
    # reversed (each program walks its own run backwards) or not
    (20, dict(greedy_config=(16, 4, 2, 1))),
    (20, dict(greedy_config=(32, 4, 2, 2), reverse_odd_steps=False)),
    (70, dict(greedy_config=(16, 4, 1, 1)))])             # two batch tiles of 64 rows
def test_greedy_mode_packed_maxima(B, kw):
    """Mode "greedy" reduces rows with atomic maxima of packed (value, id) keys and decodes
    `prev` in the next step's programs: ties across vocab blocks go to the lowest id, NaN /
    all -inf / +inf rows give 0, out-of-range anchors fold to 0, every step chains."""
    w1, w2 = weights(11)
    g = torch.Generator().manual_seed(B)
    base = torch.randn(B, N, V, generator=g) * 2
    anchor = torch.randint(0, V, (B,), generator=g)
    anchor[0] = -5 if B > 1 else V + 3
    if B >= 5:
        base[1] = float("nan")
        base[2] = NINF
        base[3, :, 50] = float("inf")
        base[4] = 0.0                                   # ties everywhere: the bias decides
    tie_w2 = torch.zeros_like(w2)                       # no bias: ties in the base decide
    tb = torch.randn(B, N, V, generator=g)
    tb[:, :, 3] = tb[:, :, 100] = tb.amax(-1) + 1.0     # equal maxima in two vocab blocks
    T, k, p = params(B, 0.0)
    seed, sp = torch.arange(B), torch.arange(B)
    for bl, ww2 in ((base, w2), (tb, tie_w2)):
        args = (bl, anchor, w1, ww2, T, k, p, seed, sp)
        want, _ = markov_sample_mode_reference(*args, "greedy")
        got, _ = fused(*args, "greedy", **kw, **ONE)
        assert torch.equal(got, want)
    assert got.eq(3).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wide_weights(dtype):
    """fp32 W1/W2 (mode "greedy" takes GREEDY_CONFIGS_FP32) and fp64 ones (computed in fp32, as
    the reference does), greedy and probabilistic."""
    w1, w2 = weights(12, dtype=dtype)
    base, anchor = _case(3, 12)
    for mode, (T, k, p) in (("greedy", params(3, 0.0)), ("full", params(3, 1.0, p=0.9))):
        args = (base, anchor, w1, w2, T, k, p, torch.arange(3), torch.arange(3))
        want_d, want_p = ref(*args, mode)
        got_d, got_p = fused(*args, mode, **ONE)
        assert torch.equal(got_d, want_d)
        if mode == "full":
            assert_probs_match(got_p, want_p)


def test_modes_and_op_dispatch():
    w1, w2 = weights(9)
    base, anchor = _case(2, 9)
    base = base[:, :3]
    T, k, p = torch.tensor([1.0, 0.0]), torch.tensor([5, 0]), torch.tensor([0.9, 1.0])
    seed, sp = torch.tensor([1, 2]), torch.tensor([3, 4])
    args = (base, anchor, w1, w2, T, k, p, seed, sp)
    want_d, want_q = ref(*args, "greedy")
    got_d, got_q = fused(*args, "greedy", **ONE)
    assert torch.equal(got_d, want_d)
    # the registered op runs the reference on CPU tensors
    d, q = torch.ops.dspark.markov_sample(*args)
    want_d, want_q = markov_sample_reference(*args)
    assert torch.equal(d, want_d) and torch.equal(q, want_q)
    with pytest.raises(ValueError, match="mode"):
        launch(*args, "fast")
    with pytest.raises(ValueError, match="w2"):
        markov_sample_reference(base, anchor, w1, w2[:, :8], T, k, p, seed, sp)
    # 2^31 elements (expanded: no memory) would wrap the kernels' int32 indexing
    B2 = 2 ** 16
    big = torch.zeros(1, 1, 1).expand(B2, 2 ** 8, 2 ** 7)
    wb = torch.zeros(2 ** 7, 16, dtype=torch.bfloat16)
    Tb, kb, pb = params(B2, 0.0)
    ib = torch.zeros(B2, dtype=torch.int64)
    with pytest.raises(ValueError, match="base_logits spans 2147483648 elements"):
        launch(big, ib, wb, wb, Tb, kb, pb, ib, ib, "greedy")
    # a strided view whose largest offset passes 2^31: 8 elements, far apart (no storage)
    far = torch.empty(2 ** 31 + 8, device="meta").as_strided((2, 2, 2), (2 ** 31, 1, 1))
    with pytest.raises(ValueError, match="base_logits spans 2147483651 elements"):
        check_int32_index(base_logits=far)
    check_int32_index(base_logits=far[:1])                 # 4 elements: fine
    for bad in ((32, 4, 3), (8, 4, 3, 2), (32, 4, -1, 2), (32.0, 4, 3, 2), (48, 4, 3, 2),
                (32, 3, 3, 2), (32, 4, 0, 2), ()):
        with pytest.raises(ValueError, match="greedy config"):
            launch(*args, "greedy", greedy_config=bad)
    with pytest.raises(ValueError, match="V >= 1"):
        launch(base[:, :, :0], anchor, w1[:0], w2[:0], T, k, p, seed, sp)
    for mode in ("greedy", "full"):
        with pytest.raises(ValueError, match="pdl must be"):
            launch(*args, mode, pdl="sometimes")
    with pytest.raises(ValueError, match="persistent must be"):
        launch(*args, persistent="yes")


# ------------------------------------------------------------------------------------------
# GPU (H200): Flash dims, CUDA-graph replay

@pytest.mark.gpu
def test_gpu_flash_dims_match_reference_and_replay_in_a_graph():
    dev = "cuda"
    B = 4
    g, w1, w2 = flash_weights(0)
    base = torch.randn(B, N, VF, device=dev, generator=g) * 3
    anchor = torch.tensor([1, 5, 100000, 7], device=dev)
    T = torch.tensor([0.0, 1.0, 1.0, 0.7], device=dev)
    k = torch.tensor([0, 0, 0, 50], device=dev)
    p = torch.tensor([1.0, 1.0, 0.95, 0.9], device=dev)
    seed = torch.tensor([1, 2, 3, 4], device=dev)
    sp = torch.tensor([10, 20, 30, 40], device=dev)
    args = [base, anchor, w1, w2, T, k, p, seed, sp]
    want_d, want_p = markov_sample_reference(*args)
    got_d, got_p = torch.ops.dspark.markov_sample(*args)
    assert torch.equal(got_d, want_d)
    ng = T > 0
    same = (got_d == want_d).all(1)
    # draft logits: the bias summed in another order on tensor cores (~1e-7 relative)
    torch.testing.assert_close(got_p[same], want_p[same], rtol=1e-5, atol=1e-5)
    static = [a.clone() for a in args]
    torch.ops.dspark.markov_sample(*static)             # warm-up (compile) outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_d, out_p = torch.ops.dspark.markov_sample(*static)
    static[7].copy_(seed + 1000)
    graph.replay()
    eager_d, eager_p = torch.ops.dspark.markov_sample(*[*args[:7], seed + 1000, sp])
    assert torch.equal(out_d, eager_d)
    torch.testing.assert_close(out_p[ng], eager_p[ng])


@pytest.mark.gpu
@pytest.mark.parametrize("B", [4, 40], ids=["tile16", "tile64"])
def test_gpu_full_plan_pdl_modes_equal_plain_launches(B):
    """The full plan's launches with programmatic dependent launch, the next launch started
    early (at every program's start) or late (after every program's main loop), give the bits
    of plain launches -- eagerly and replayed from a CUDA graph -- on mixed rows: greedy,
    temperature, top-k, top-p over peaked and Gaussian logits (the fused sampler is
    deterministic, so a launch reading before its predecessor finished shows up here). B = 40
    takes the 64-row tile, whose default is "early"; B = 4 the 16-row tile ("late"). The
    searched rows also the other way than the default for B (persistent grids from 16 rows,
    one program per row and chunk below)."""
    dev = "cuda"
    g, w1, w2 = flash_weights(2)
    base = torch.randn(B, N, VF, device=dev, generator=g) * 3
    base[::2, :, :64] += 14.0                               # peaked rows
    anchor = torch.randint(0, VF, (B,), device=dev, generator=g)
    T = torch.tensor([0.0, 1.0, 0.7, 1.0], device=dev).repeat(B // 4)
    k = torch.tensor([0, 0, 50, 0], device=dev).repeat(B // 4)
    p = torch.tensor([1.0, 0.95, 0.9, 0.95], device=dev).repeat(B // 4)
    seed = torch.arange(B, device=dev) + 3
    sp = torch.arange(B, device=dev) * 7
    args = [base, anchor, w1, w2, T, k, p, seed, sp]
    want_d, want_p = launch(*args, pdl=False)
    for mode in ("early", "late"):
        got_d, got_p = launch(*args, pdl=mode)
        assert torch.equal(got_d, want_d), mode
        assert torch.equal(got_p, want_p), mode
        # the searched rows' launches the other way (persistent grids or one program per item)
        got_d, got_p = launch(*args, pdl=mode, persistent=B < PERSIST_FROM_ROWS)
        assert torch.equal(got_d, want_d), mode
        assert torch.equal(got_p, want_p), mode
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_d, out_p = launch(*args, pdl=mode)
        out_d.fill_(-1)
        out_p.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_d, want_d), mode
        assert torch.equal(out_p, want_p), mode


def flash_weights(seed):
    """(generator on cuda, W1, W2) at Flash dims (V = 129280, r = 256, bf16) for the GPU tests."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w1, w2 = ((torch.randn(VF, 256, device="cuda", generator=g) * 0.05).bfloat16()
              for _ in range(2))
    return g, w1, w2


def assert_only_near_ties_differ(got, want, base, anchor, w1, w2, rel=1e-5, max_rows=2):
    """Greedy drafts equal the reference's, except at a near-tie: the bias is summed in another
    order on tensor cores, so where the two best logits (fp64 from the reference prefix) lie
    within rounding of each other the fused kernel may pick the other one. Rows agree up to the
    first such step; at most `max_rows` rows may differ."""
    bad = (got != want).any(1).nonzero().flatten().tolist()
    assert len(bad) <= max_rows, f"{len(bad)} rows differ"
    prev = torch.cat((anchor[:, None], want[:, :-1]), 1)
    for b in bad:
        st = int((got[b] != want[b]).nonzero()[0])
        z = base[b, st].double() + markov_bias(prev[b, st:st + 1], w1, w2)[0].double()
        gap = (z[want[b, st]] - z[got[b, st]]).abs().item()
        assert gap <= rel * z.abs().max().item(), (b, st, gap)


def test_near_tie_check_accepts_only_ties():
    """The GPU test's allowance, checked: a draft that differs at an exact tie of the two best
    logits passes, one that picks a clearly worse token fails."""
    w1, _ = weights(15)
    w2 = torch.zeros_like(w1)                           # no bias: the base decides
    base, anchor = _case(2, 15)
    base[0, 0, 9] = base[0, 0, 20] = base[0, 0].max() + 1.0      # exact tie: ids 9 and 20
    T, k, p = params(2, 0.0)
    want, _ = ref(base, anchor, w1, w2, T, k, p, torch.arange(2),
                                      torch.arange(2))
    assert want[0, 0] == 9
    tie = want.clone()
    tie[0, 0] = 20
    assert_only_near_ties_differ(tie, want, base, anchor, w1, w2)
    worse = want.clone()
    worse[1, 2] = int(base[1, 2].argmin())
    with pytest.raises(AssertionError):
        assert_only_near_ties_differ(worse, want, base, anchor, w1, w2)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 2, 3, 64])
def test_gpu_greedy_mode_flash_dims(B):
    """Mode "greedy" (one launch per step: packed atomic row maxima) against
    the reference at Flash dims, and replayed in a CUDA graph with new anchors."""
    _gpu_greedy_case(B)


@pytest.mark.gpu
@pytest.mark.parametrize("B,kw", [
    (20, {}),                                            # the 32-row tile
    (70, {}),                                            # two batch tiles of 64 rows
    (3, dict(pdl=False)),                                # steps without PDL
    (5, dict(greedy_config=(64, 4, 1, 0))),              # one program per vocab block
    (5, dict(greedy_config=(32, 4, 3, 1), reverse_odd_steps=False))])
def test_gpu_greedy_mode_tilings_and_launch_knobs(B, kw):
    """The greedy step kernel's other tilings and launch knobs at Flash dims, graph replay
    included (the interpreter runs them too, but never PDL nor the GPU's scheduling)."""
    _gpu_greedy_case(B, **kw)


def _gpu_greedy_case(B, **kw):
    dev = "cuda"
    g, w1, w2 = flash_weights(B)
    base = torch.randn(B, N, VF, device=dev, generator=g) * 3
    anchor = torch.randint(0, VF, (B,), device=dev, generator=g)
    T, k, p = (t.to(dev) for t in params(B, 0.0))
    seed, sp = torch.arange(B, device=dev), torch.arange(B, device=dev)
    args = [base, anchor, w1, w2, T, k, p, seed, sp]
    want, _ = ref(*args)
    run = (lambda *a: launch(*a, "greedy", **kw)) if kw else \
        (lambda *a: torch.ops.dspark.markov_sample(*a, mode="greedy"))
    got, _ = run(*args)
    assert_only_near_ties_differ(got, want, base, anchor, w1, w2)
    static = [a.clone() for a in args]
    run(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = run(*static)
    static[1].copy_((anchor + 17) % VF)
    graph.replay()
    eager, _ = run(*[base, (anchor + 17) % VF, *args[2:]])
    assert torch.equal(out, eager)


@pytest.mark.gpu
def test_gpu_greedy_mode_fp32_weights():
    """fp32 W1/W2 (GREEDY_CONFIGS_FP32) at Flash dims."""
    dev = "cuda"
    B = 3
    g, w1, w2 = flash_weights(B)
    w1, w2 = w1.float(), w2.float()
    base = torch.randn(B, N, VF, device=dev, generator=g) * 3
    anchor = torch.randint(0, VF, (B,), device=dev, generator=g)
    T, k, p = (t.to(dev) for t in params(B, 0.0))
    args = [base, anchor, w1, w2, T, k, p, torch.arange(B, device=dev),
            torch.arange(B, device=dev)]
    want, _ = ref(*args)
    got, _ = torch.ops.dspark.markov_sample(*args, mode="greedy")
    assert_only_near_ties_differ(got, want, base, anchor, w1, w2)


def _flat_case(v, rows, seed, spread):
    """Near-flat rows (logits spread ~`spread` nats) over a v-token vocabulary: top-k/top-p
    brackets hold most of the row, far more than a small candidate cap."""
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(v, R, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(v, R, generator=g) * 0.1).bfloat16()
    base = torch.randn(rows, 2, v, generator=g) * spread
    anchor = torch.randint(0, v, (rows,), generator=g)
    return base, anchor, w1, w2


@pytest.mark.parametrize("spread", [0.3, 0.02])
def test_fused_threshold_refinement_on_near_flat_rows(spread):
    """The bracket overflows cap = 64 by far (the old full-scan fallback path); the radix
    refinement alone (scan fallback disabled: it would yield NaN) must give the reference's
    exact thresholds for top-p, top-k and both, its launches one program per item or in
    persistent grids."""
    v = 2048
    base, anchor, w1, w2 = _flat_case(v, 4, 11, spread)
    T = torch.tensor([1.0, 1.0, 0.7, 1.0])
    k = torch.tensor([0, 900, 0, 1500])
    p = torch.tensor([0.95, 1.0, 0.5, 0.9])
    seed, sp = torch.arange(4), torch.arange(4) + 7
    want_d, want_p = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    # rows 0-2 (top-p or top-k alone) resolve without the scan; row 3 (top-k and top-p with
    # ~600 tokens between their thresholds, more than cap) still needs it
    for rows, scan in ((slice(0, 3), False), (slice(3, 4), True)):
        args = (base[rows], anchor[rows], w1, w2, T[rows], k[rows], p[rows], seed[rows],
                sp[rows])
        got_d, got_p = fused(*args, tile=256, chunk=512, cap=64, scan_fallback=scan)
        assert torch.equal(got_d, want_d[rows])
        assert_probs_match(got_p, want_p[rows])
        # the searched rows' refinement in persistent grids (several items a program)
        got_d, _ = launch(*args, tile=256, chunk=512, cap=64,
                                        scan_fallback=scan, persistent=True)
        assert torch.equal(got_d, want_d[rows])


# Both switches on at every peak shape and tiling; each alone once, on the peak shape its pass
# acts on most (the skip on the gather case, the floor on the spill case). The full 12-case
# product cost 700 s of a 2-core machine under the interpreter for no path these miss.
_PEAKED, _MILDER, _SMALL_BLOCKS, _LARGE_BLOCKS = (14.0, 64, 0.999), (6.0, 8, 0.95), \
    (16, 64, 256), (32, 16, 64)


@pytest.mark.parametrize("skip,floor,boost,cap,p4,block,tile,chunk", [
    pytest.param(True, True, *_PEAKED, *_SMALL_BLOCKS, id="blocks<tiles-peaked-gather-skip-floor"),
    pytest.param(True, True, *_MILDER, *_SMALL_BLOCKS, id="blocks<tiles-milder-spill-skip-floor"),
    pytest.param(True, True, *_PEAKED, *_LARGE_BLOCKS, id="blocks>tiles-peaked-gather-skip-floor"),
    pytest.param(True, True, *_MILDER, *_LARGE_BLOCKS, id="blocks>tiles-milder-spill-skip-floor"),
    pytest.param(True, False, *_PEAKED, *_LARGE_BLOCKS, id="blocks>tiles-peaked-gather-skip"),
    pytest.param(False, True, *_MILDER, *_SMALL_BLOCKS, id="blocks<tiles-milder-spill-floor"),
])
def test_select_skips_tiles_below_the_bracket_exactly(skip, floor, boost, cap, p4, block, tile,
                                                      chunk):
    """Peaked rows (a few boosted tokens over a Gaussian bulk, as a confident draft head gives):
    the select pass skips the tiles whose logits blocks all lie below the bracket
    (skip_below_bracket), top-p rows' threshold search (reduce and select) leaves out the tokens
    below the block maxima's floor and the spans holding none (block_floor), and the thresholds
    stay the reference's exactly -- top-p, top-k,
    boosted tokens at tile and chunk edges, a tile holding only -inf, with the candidates in
    CAP (cap 64) and, on milder peaks (100-300 tokens kept), overflowing into the spill and
    refinement (cap 8). (At cap 8 a 0.999 row is left to the scan: its threshold lies where
    the fp32 bin masses' error bound exceeds the tokens' masses.) Logits blocks smaller than
    the select tile (16 vs 64: four per tile, as the Markov sampler's 64/128-token blocks against
    select's 512-token tiles) and larger (32 vs 16, as rejection's 1024-token blocks against
    select's 512). The scan fallback is off: it would
    repair a wrongly skipped tile (select checks its candidate count against reduce's), so here
    such a tile fails the test."""
    v = 997                                              # a ragged last block, tile and chunk
    g = torch.Generator().manual_seed(cap)
    # no Markov bias: z is then base / T exactly on both sides, whatever order a tiling sums
    # the bias in (at top-p 0.999 hundreds of small tokens straddle the threshold, and a
    # one-ulp difference in one of them can move it)
    w1, w2 = weights(5, v=v)
    w2 = torch.zeros_like(w2)
    B = 6
    base = torch.randn(B, 2, v, generator=g) * 2.0
    hot = torch.tensor([0, 15, 16, 63, 64, 500, 511, 512, 996])
    base[:, :, hot] += boost + torch.rand(B, 2, len(hot), generator=g)
    base[2, :, 128:160] = NINF                           # a whole logits block is -inf
    anchor = torch.randint(0, v, (B,), generator=g)
    T = torch.tensor([1.0, 1.0, 0.8, 1.0, 1.3, 1.0])
    k = torch.tensor([0, 5, 0, 20, 0, 0])
    p = torch.tensor([0.95, 1.0, 0.9, 1.0, p4, 0.5])
    seed, sp = torch.arange(B) + 3, torch.arange(B) * 11
    want_d, want_p = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    got_d, got_p = fused(base, anchor, w1, w2, T, k, p, seed, sp, tile=tile,
                                        chunk=chunk, cap=cap, skip_below_bracket=skip,
                                        block_floor=floor, logits_config=(16, block, 16, 4, 1),
                                        scan_fallback=False)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)


@pytest.mark.parametrize("few", [0, 64])    # each path alone on every row
def test_thresholds_pairwise_and_by_bisection_agree(few):
    """The candidates' threshold is found pairwise up to `few_candidates` candidates and by
    bisection beyond (0: always bisection; 64 = cap: always pairwise): both give the
    reference's exact thresholds for top-k, top-p and both, with tied logits, on peaked rows
    (tens of candidates) and milder ones (up to cap). Scan fallback off, so neither path can
    lean on it."""
    v = 611
    g = torch.Generator().manual_seed(17)
    w1, w2 = weights(8, v=v)
    B = 6
    base = torch.randn(B, 2, v, generator=g) * 2.0
    hot = torch.randint(0, v, (B, 2, 40), generator=g)
    base.scatter_add_(-1, hot, torch.full((B, 2, 40), 9.0) + torch.rand(B, 2, 40, generator=g))
    base[1, :, 200:230] = base[1, :, 199:200] + 0.0       # a run of equal logits
    anchor = torch.randint(0, v, (B,), generator=g)
    T = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.2, 0.8])
    k = torch.tensor([0, 30, 12, 0, 50, 0])
    p = torch.tensor([0.95, 1.0, 0.8, 0.7, 1.0, 0.99])
    seed, sp = torch.arange(B) + 1, torch.arange(B) * 3
    want_d, want_p = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    got_d, got_p = fused(base, anchor, w1, w2, T, k, p, seed, sp, **MULTI,
                                        few_candidates=few, scan_fallback=False)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)
    for bad in (12, 128, -1):        # not a power of two; a [128, 128] matrix per program
        with pytest.raises(ValueError, match="few"):
            launch(base, anchor, w1, w2, T, k, p, seed, sp, **MULTI,
                                 few_candidates=bad)


@pytest.mark.parametrize("hist_bins", [8, 128])    # coarser and finer than the default 16
def test_threshold_histogram_bins_are_a_tuning_knob(hist_bins):
    """Other histogram sizes (the same 32 nats, coarser or finer bins) give the same exact
    thresholds: top-k, top-p and both, on peaked and near-flat rows, through bracket, gather
    and refinement (scan fallback disabled where the refinement must resolve the rows)."""
    w1, w2 = weights(6)
    base, anchor = _case(4, 6)
    T = torch.tensor([0.7, 1.3, 1.0, 0.9])
    k = torch.tensor([1, V, 10, 0])
    p = torch.tensor([1.0, 0.75, 0.8, 0.95])
    seed, sp = torch.tensor([11, 12, 13, 14]), torch.tensor([0, 5, 9, 100])
    args = (base[:, :2], anchor, w1, w2, T, k, p, seed, sp)
    want_d, want_p = ref(*args)
    got_d, got_p = fused(*args, hist_bins=hist_bins, **MULTI)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)
    v = 2048
    base, anchor, w1, w2 = _flat_case(v, 3, 11, 0.3)
    T, k, p = torch.ones(3), torch.tensor([0, 900, 0]), torch.tensor([0.95, 1.0, 0.5])
    seed, sp = torch.arange(3), torch.arange(3) + 7
    args = (base, anchor, w1, w2, T, k, p, seed, sp)
    want_d, want_p = ref(*args)
    # coarser bins than the default narrow a bracket more slowly: at this toy cap they may need
    # more refinement passes than REFINE_PASSES, so only they may take the exact scan
    got_d, got_p = fused(*args, tile=256, chunk=512, cap=64,
                                        scan_fallback=hist_bins < HIST_BINS, hist_bins=hist_bins)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)
    with pytest.raises(ValueError, match="hist_bins"):
        launch(*args, hist_bins=hist_bins + 1)


def test_fused_threshold_refinement_exact_ties_beyond_cap():
    """Quantised logits: far more than cap tokens share the threshold value exactly (all kept:
    ties at tau are kept); a single-key bracket is resolved without gathering."""
    v = 2048
    base, anchor, w1, _ = _flat_case(v, 2, 12, 1.0)
    w2 = torch.zeros_like(w1)                               # bias 0: logits = base exactly
    base = (base * 2).round() / 64                          # ~5 distinct values, ~400 each
    T, k, p = torch.tensor([1.0, 1.0]), torch.tensor([0, 100]), torch.tensor([0.6, 1.0])
    seed, sp = torch.tensor([3, 4]), torch.tensor([0, 9])
    want_d, want_p = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    got_d, got_p = fused(base, anchor, w1, w2, T, k, p, seed, sp, tile=256,
                                        chunk=512, cap=64, scan_fallback=False)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)


@pytest.mark.gpu
def test_gpu_flash_top_p_rows_resolve_without_the_scan_fallback():
    """The benchmark's markov_topp rows (randn * 3, T = 1, top-p 0.95: ~10^4 tokens in the first
    bracket), flatter ones and bf16-quantised ones resolve through the refinement alone (the scan
    fallback disabled yields NaN thresholds, i.e. all-zero probabilities) and match the
    reference."""
    dev = "cuda"
    B = 4
    g, w1, w2 = flash_weights(1)
    base = torch.randn(B, N, VF, device=dev, generator=g)
    base = base * torch.tensor([3.0, 3.0, 0.3, 1.0], device=dev)[:, None, None]
    base[3] = base[3].bfloat16().float()
    anchor = torch.tensor([1, 5, 100000, 7], device=dev)
    T = torch.tensor([1.0, 1.0, 1.0, 1.0], device=dev)
    k = torch.tensor([0, 4000, 0, 0], device=dev)
    p = torch.tensor([0.95, 1.0, 0.95, 0.9], device=dev)
    seed = torch.tensor([1, 2, 3, 4], device=dev)
    sp = torch.tensor([10, 20, 30, 40], device=dev)
    args = [base, anchor, w1, w2, T, k, p, seed, sp]
    got_d, got_p = fused(*args, scan_fallback=False)
    torch.testing.assert_close(got_p.double().sum(-1), torch.ones(B, N, dtype=torch.float64,
                                                                 device=dev), atol=1e-4, rtol=0)
    want_d, want_p = ref(*args)
    assert torch.equal(got_d, want_d)
    same = (got_d == want_d).all(1)
    # The bias is summed in another order on tensor cores (z differs by ~1e-7 relative), so a
    # token whose mass-above lies within that noise of top_p * Z may be kept by one side only
    # (seen once in 2.6M probabilities on the H200). Such a flip must sit exactly on the top-p
    # boundary; everything else must match.
    assert_close_but_top_p_boundary(got_p, want_p, same, base, anchor, want_d, w1, w2, T, p)


def assert_close_but_top_p_boundary(got_p, want_p, same, base, anchor, drafts, w1, w2, T, p,
                                    max_flips=4):
    """Probabilities of rows `same` match, except that a token whose mass-above (fp64, from the
    reference logits) lies within 1e-6 * Z of top_p * Z may be kept by one side only."""
    flips = ((got_p > 0) != (want_p > 0)) & same[:, None, None]
    assert flips.sum() <= max_flips
    prev = torch.cat((anchor[:, None], drafts[:, :-1]), 1)
    for b, st, v in flips.nonzero().tolist():
        z = ((base[b, st].double() + markov_bias(prev[b, st:st + 1], w1, w2)[0].double())
             / T[b].double())
        e = torch.exp(z - z.max())
        above = e[z > z[v]].sum()
        assert abs(above - p[b].double() * e.sum()) <= 1e-6 * e.sum(), (b, st, v)
    ok = (same[:, None] & ~flips.any(-1))[..., None].expand_as(got_p)
    torch.testing.assert_close(got_p[ok], want_p[ok], rtol=1e-4, atol=1e-6)


def test_boundary_flip_check_accepts_only_the_boundary_token():
    """The GPU test's allowance, checked: dropping the last token top-p keeps (renormalised)
    passes only when its mass-above is on the boundary; dropping another kept token fails."""
    w1, w2 = weights(13)
    base, anchor = _case(1, 13)
    T, k, p = params(1, 1.0, 0, 0.9)
    seed, sp = torch.tensor([3]), torch.tensor([5])
    d, q = ref(base, anchor, w1, w2, T, k, p, seed, sp)
    same = torch.tensor([True])
    prev = torch.cat((anchor[:, None], d[:, :-1]), 1)
    z = base[0, 0].double() + markov_bias(prev[0, :1], w1, w2)[0].double()
    e = torch.exp(z - z.max())
    kept = (q[0, 0] > 0).nonzero().flatten()
    last = kept[z[kept].argmin()]
    # move top_p onto the boundary: the mass above the last kept token, exactly
    p_edge = (e[z > z[last]].sum() / e.sum()).float()
    for victim, should_pass in ((last, True), (kept[z[kept].argmax()], False)):
        got = q.clone()
        got[0, 0, victim] = 0
        got[0, 0] /= got[0, 0].sum()
        want = q.clone()
        if should_pass:
            assert_close_but_top_p_boundary(got, want, same, base, anchor, d, w1, w2, T,
                                            torch.tensor([p_edge]).double())
        else:
            with pytest.raises(AssertionError):
                assert_close_but_top_p_boundary(got, want, same, base, anchor, d, w1, w2, T,
                                                torch.tensor([p_edge]).double())


def test_top_k_beyond_the_finite_tokens_keeps_them_all_without_a_search():
    """0 < k < V but more than the row's finite tokens (the rest -inf), top-p off: every finite
    token is kept (the reference's k-th value is -inf). The select pass settles it at once: with
    the scan fallback disabled (unresolved rows would come out all-zero) the result is exact.
    Also with top-p on, where the search runs as usual."""
    w1, w2 = weights(9)
    base, anchor = _case(3, 9)
    base = base[:, :2].clone()
    base[:, :, 40:] = NINF                     # 40 finite tokens per row (of V = 137)
    T = torch.tensor([1.0, 0.8, 1.0])
    k = torch.tensor([100, 41, 100])
    p = torch.tensor([1.0, 1.0, 0.9])
    seed, sp = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    args = (base, anchor % 40, w1, w2, T, k, p, seed, sp)
    want_d, want_p = ref(*args)
    got_d, got_p = fused(*args, tile=32, chunk=64, cap=64, scan_fallback=False)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)
    assert ((got_p[:2] > 0).sum(-1) == 40).all()      # rows 0-1: all finite tokens kept


def test_production_tiling_refinement_matches_reference():
    """The launcher's own tiling (tile 1024 for the select/final passes, the histogram passes'
    smaller tile, 2 chunks per row) on near-flat rows whose brackets overflow a small cap: the
    refinement alone (scan disabled) gives the reference's exact kept sets, for top-p, top-k and
    both."""
    v = 4096
    base, anchor, w1, w2 = _flat_case(v, 3, 13, 0.3)
    T = torch.tensor([1.0, 0.9, 1.0])
    k = torch.tensor([0, 1500, 0])
    p = torch.tensor([0.95, 1.0, 0.6])
    seed, sp = torch.arange(3) + 20, torch.arange(3)
    args = (base, anchor, w1, w2, T, k, p, seed, sp)
    want_d, want_p = ref(*args)
    got_d, got_p = fused(*args, cap=64, scan_fallback=False)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)


def test_production_tiling_floor_on_peaked_rows_matches_reference():
    """The launcher's own tiling (logits blocks of 128, the histogram's spans of 256 tokens, 2
    chunks per row) on peaked rows, where the block maxima's floor lies above the bulk and
    reduce and select read a few spans of each row: the scan disabled, the exact reference
    thresholds (top-p 0.95 and 0.999, a lifted token on a span and a chunk edge)."""
    v = 4096
    g = torch.Generator().manual_seed(23)
    w1, w2 = weights(7, v=v)
    w2 = torch.zeros_like(w2)       # z = base / T exactly on both sides (see the skip test)
    B = 3
    base = torch.randn(B, N, v, generator=g) * 2.0
    hot = torch.tensor([3, 255, 256, 2047, 2048, 4000])
    base[:, :, hot] += 11.0 + 4 * torch.rand(B, N, len(hot), generator=g)
    T = torch.tensor([1.0, 1.0, 0.7])
    k = torch.zeros(B, dtype=torch.int64)
    p = torch.tensor([0.95, 0.999, 0.95])
    anchor, seed, sp = torch.arange(B), torch.arange(B) + 5, torch.arange(B) * 3
    args = (base, anchor, w1, w2, T, k, p, seed, sp)
    want_d, want_p = ref(*args)
    got_d, got_p = fused(*args, scan_fallback=False)
    assert torch.equal(got_d, want_d)
    assert_probs_match(got_p, want_p)
