"""Block verification (Sun et al., arXiv 2403.10444) in the rejection op: the reference's output
distribution computed exactly by enumeration (drafts x the uniforms integrated analytically)
equals the target's, and never accepts fewer drafts in expectation than token-wise rejection;
chi-square through the op over many seeds, with a deliberately wrong variant (token-wise
residuals after a block decision) rejected; degenerate, masked and padded rows; top-k / top-p;
the fused kernel (interpreter) against the reference; GPU capture and replay with fresh noise."""
import itertools

import pytest
import torch

from dspark_compile.kernels.philox import STREAM_DRAFT, STREAM_RESAMPLE
from dspark_compile.kernels.sampling.plan import SamplerPlan
from dspark_compile.kernels.sampling.reference import (
    VERIFY_BLOCK, block_accepts, block_thresholds, gumbel_argmax, logprobs_from_processed,
    process_logits, rejection_sample_reference, request_probs)
from dspark_compile.kernels.sampling.rejection import rejection_sample_launch
from stats_utils import chi2_pvalue

NINF = float("-inf")


# ---- conditional tables: p(. | prefix), q(. | prefix) over a tiny vocabulary ----

def prefixes(V, N):
    """Every prefix of length 0 .. N, in table order."""
    return [t for n in range(N + 1) for t in itertools.product(range(V), repeat=n)]


def tables(seed, V, N, zeros=True):
    """Target and draft logits per prefix [P, V] (prefixes(V, N) order), fp64: the draft's
    sharper and shifted, some tokens excluded (-inf) in either, never all of a row."""
    g = torch.Generator().manual_seed(seed)
    n = len(prefixes(V, N))
    tp = torch.randn(n, V, generator=g, dtype=torch.float64) * 1.5
    tq = tp + torch.randn(n, V, generator=g, dtype=torch.float64) * 1.5
    if zeros:
        for t in (tp, tq):
            cut = torch.rand(n, generator=g, dtype=torch.float64) < 0.4
            col = torch.randint(0, V, (n,), generator=g)
            t[cut, col[cut]] = NINF
    return tp, tq


def index_of(V):
    """prefix tuple -> its row in the tables (prefixes() order)."""
    return lambda pre: sum(V ** n for n in range(len(pre))) + sum(
        x * V ** (len(pre) - 1 - k) for k, x in enumerate(pre))


def processed(logits, T, k, p):
    """Each table row's distribution under the request's sampling parameters, fp64."""
    n = logits.shape[0]
    full = lambda x, dt=torch.float32: torch.full((n,), x, dtype=dt)  # noqa: E731
    z = process_logits(logits, full(T), full(k, torch.int64), full(p))
    return torch.softmax(z.double(), -1)


def target_joint(P, V, N):
    """Target probability of every sequence of N + 1 tokens [V ** (N + 1)] (P: processed
    target table)."""
    idx = index_of(V)
    out = torch.zeros(V ** (N + 1), dtype=torch.float64)
    for c, seq in enumerate(itertools.product(range(V), repeat=N + 1)):
        pr = 1.0
        for i in range(N + 1):
            pr *= float(P[idx(seq[:i]), seq[i]])
        out[c] = pr
    return out


def enumerate_block(P, Q, V, N, residual="block"):
    """The exact distribution [V ** (N + 1)] of one block-verification step's output (the
    accepted drafts and the token after them), continued with exact target samples to N + 1
    tokens, and E[accepted drafts]: every draft sequence (probability under Q), the uniforms
    integrated analytically (tau = i with probability h_i prod_{j > i} (1 - h_j)), the
    reference's thresholds and weights (block_thresholds). residual: "block" (w_tau p - q, the
    algorithm), "token" (p - q: a deliberately wrong variant)."""
    idx = index_of(V)
    seqs = [x for x in itertools.product(range(V), repeat=N)
            if all(Q[idx(x[:i]), x[i]] > 0 for i in range(N))]
    X = torch.tensor(seqs)
    p = torch.stack([torch.stack([P[idx(x[:i])] for i in range(N + 1)]) for x in seqs])
    q = torch.stack([torch.stack([Q[idx(x[:i])] for i in range(N)]) for x in seqs])
    qprob = q.gather(2, X[..., None])[..., 0].prod(1)
    h, w = block_thresholds(p, X, q)
    out = torch.zeros(V ** (N + 1), dtype=torch.float64)
    mean = 0.0
    cont = target_joint(P, V, N)     # for the continuation: P(seq) / P(prefix)
    for m, x in enumerate(seqs):
        for tau in range(N + 1):
            pt = float(h[m, tau - 1]) if tau else 1.0
            for j in range(tau, N):
                pt *= 1.0 - float(h[m, j])
            if pt <= 0:
                continue
            mean += float(qprob[m]) * pt * tau
            if tau == N:
                r = p[m, N]
            else:
                wt = float(w[m, tau]) if residual == "block" else 1.0
                r = (wt * p[m, tau] - q[m, tau]).clamp_min(0)
                r = p[m, tau] if r.sum() <= 0 else r
            r = r / r.sum()
            for y in range(V):
                pre = x[:tau] + (y,)
                ppre = float(cont[_range(pre, V, N)].sum())   # target probability of pre
                if ppre == 0 or r[y] == 0:
                    continue
                sl = _range(pre, V, N)
                out[sl] += float(qprob[m]) * pt * float(r[y]) * cont[sl] / ppre
    return out, mean


def _range(pre, V, N):
    """The cells of the sequences of N + 1 tokens starting with `pre` (first token most
    significant): a contiguous slice."""
    lo = sum(t * V ** (N - k) for k, t in enumerate(pre))
    return slice(lo, lo + V ** (N + 1 - len(pre)))


def token_mean(P, Q, V, N):
    """E[accepted drafts] of token-wise rejection: sum over draft sequences x of q(x) times
    sum_i prod_{j <= i} min(1, p_j(x_j) / q_j(x_j))."""
    idx = index_of(V)
    mean = 0.0
    for x in itertools.product(range(V), repeat=N):
        qv = [float(Q[idx(x[:i]), x[i]]) for i in range(N)]
        if min(qv) == 0:
            continue
        qp, run, acc = 1.0, 1.0, 0.0
        for i in range(N):
            qp *= qv[i]
            run *= min(1.0, float(P[idx(x[:i]), x[i]]) / qv[i])
            acc += run
        mean += qp * acc
    return mean


def test_paper_example_accepts_more_than_token_wise():
    """Two context-free models over {a, b} (the paper's motivating example): p = (1/3, 2/3),
    q = (2/3, 1/3), 2 drafts. Token-wise rejection accepts 2/3 + 4/9 = 10/9 drafts on average,
    block verification 11/9 (the paper's numbers; a verifier that knew the joint distributions
    could reach sum_k (1 - TV(p^k, q^k)) = 12/9), with the output distributed exactly as the
    target's."""
    V, N = 2, 2
    n = len(prefixes(V, N))
    P = torch.tensor([[1 / 3, 2 / 3]], dtype=torch.float64).expand(n, V)
    Q = torch.tensor([[2 / 3, 1 / 3]], dtype=torch.float64).expand(n, V)
    out, mean = enumerate_block(P, Q, V, N)
    torch.testing.assert_close(out, target_joint(P, V, N), rtol=0, atol=1e-12)
    assert abs(mean - 11 / 9) < 1e-12 and abs(token_mean(P, Q, V, N) - 10 / 9) < 1e-12


@pytest.mark.parametrize("seed,V,N", [(0, 3, 2), (1, 3, 3), (2, 4, 2), (3, 2, 4), (4, 3, 3)])
def test_exact_output_distribution_is_the_target_and_never_accepts_less(seed, V, N):
    """Exact enumeration over every draft sequence, the uniforms integrated analytically, on
    prefix-conditioned p and q with excluded tokens on either side (q(x) = 0 where p(x) > 0
    and the reverse): block verification's output, continued by the target, is the target's
    joint distribution to 1e-12; E[accepted] >= token-wise."""
    tp, tq = tables(seed, V, N)
    P, Q = torch.softmax(tp, -1), torch.softmax(tq, -1)
    want = target_joint(P, V, N)
    out, mean = enumerate_block(P, Q, V, N)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert mean >= token_mean(P, Q, V, N) - 1e-12


# ---- through the op: many seeds, chi-square over the V ** (N + 1) continued sequences ----

def _offset(i, V):
    return sum(V ** n for n in range(i))


def sample_step(tp, tq, V, N, n, T=1.0, k=0, p=1.0, verify=VERIFY_BLOCK, wrong=False):
    """n requests (seed b * 104729 + 11, position 1000) of one speculative step on the tables:
    drafts drawn from the processed draft table (Gumbel-max on z, STREAM_DRAFT, as the Markov
    sampler does), target and draft logits per row following each request's own drafts, then
    rejection_sample_reference (or, `wrong`, a block decision with token-wise residuals), and
    the output continued with exact target samples to N + 1 tokens -> (cells [n], accepted [n],
    the op's arguments)."""
    seed = torch.arange(n, dtype=torch.int64) * 104729 + 11
    pos = torch.full((n,), 1000, dtype=torch.int64)
    Tt, kk, pp = (torch.full((n,), T), torch.full((n,), k, dtype=torch.int64), torch.full((n,), p))
    value = torch.zeros(n, dtype=torch.int64)
    drafts, dl, tl_ = [], [], []
    for i in range(N + 1):
        tl_.append(tp[_offset(i, V) + value])
        if i == N:
            break
        dl.append(tq[_offset(i, V) + value])
        z = process_logits(dl[-1].float(), Tt, kk, pp)
        drafts.append(gumbel_argmax(z, seed, pos + i, STREAM_DRAFT))
        value = value * V + drafts[-1]
    args = (torch.stack(tl_, 1).float(), torch.stack(drafts, 1), torch.stack(dl, 1).float(), Tt,
            kk, pp, seed, pos)
    verify_t = torch.full((n,), verify, dtype=torch.int64)
    if wrong:
        tokens, num = _wrong_block(*args)
    else:
        tokens, num = rejection_sample_reference(*args, verify_t)
    return _continue(tokens, num, tp, V, N, T, k, p), num - 1, args + (verify_t,)


def _wrong_block(target_logits, drafts, draft_logits, T, k, p, seed, pos):
    """A deliberately wrong variant: block verification's accepted count with the token-wise
    residual max(p - q, 0) (instead of max(w_tau p - q, 0))."""
    n, N = drafts.shape
    P = request_probs(target_logits, T, k, p)
    Q = request_probs(draft_logits, T, k, p)
    tau, _ = block_accepts(P, drafts, Q, seed, pos)
    rows = torch.arange(n)
    pa = P[rows, tau]
    qa = torch.cat((Q, torch.zeros(n, 1, Q.shape[-1])), 1)[rows, tau]
    resid = (pa - qa).clamp_min(0)
    use_p = (resid.sum(-1) <= 0) | (tau == N)
    logw = torch.where(use_p[:, None], torch.log(pa), torch.log(resid))
    last = gumbel_argmax(logw, seed, pos + tau, STREAM_RESAMPLE)
    tokens = torch.full((n, N + 1), -1, dtype=torch.int64)
    for j in range(N):
        tokens[:, j] = torch.where(j < tau, drafts[:, j], tokens[:, j])
    tokens[rows, tau] = last
    return tokens, tau + 1


def _continue(tokens, num, tp, V, N, T, k, p):
    """Each output continued to N + 1 tokens by the (processed) target, as the next steps
    would: its cell index (first token most significant)."""
    n = tokens.shape[0]
    P = processed(tp, T, k, p)
    g = torch.Generator().manual_seed(12345)
    seq = tokens.clone()
    value = torch.zeros(n, dtype=torch.int64)
    for j in range(N + 1):
        fill = j >= num
        if fill.any():
            draw = torch.multinomial(P[_offset(j, V) + value], 1, generator=g)[:, 0]
            seq[:, j] = torch.where(fill, draw, seq[:, j])
        value = value * V + seq[:, j]
    return value


# (table seed, V, N): seed 172's wrong variant is far from the target (its chi-square
# noncentrality 0.032 per sample, 630 at 20000 samples), block accepts 0.12 more drafts
CHI_CASE = (172, 3, 2)


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.8, 2, 1.0), (1.0, 0, 0.7)])
def test_block_op_follows_the_target_chi_square(T, k, p):
    """20000 seeds through the op's reference: the continued outputs follow the target's joint
    distribution (chi-square p > 1e-3), with top-k / top-p shaping both p and q; block accepts
    more drafts than token-wise rejection on the same drafts and uniforms; and the wrong
    variant (token-wise residuals after the block decision) is rejected (p < 1e-6)."""
    seed, V, N = CHI_CASE
    tp, tq = tables(seed, V, N)
    n = 20000
    want = target_joint(processed(tp, T, k, p), V, N)
    cells, acc, args = sample_step(tp, tq, V, N, n, T, k, p)
    assert chi2_pvalue(torch.bincount(cells, minlength=V ** (N + 1)), want) > 1e-3
    tok_cells, tok_acc, _ = sample_step(tp, tq, V, N, n, T, k, p, verify=0)
    assert chi2_pvalue(torch.bincount(tok_cells, minlength=V ** (N + 1)), want) > 1e-3
    assert acc.double().mean() > tok_acc.double().mean()
    if (T, k, p) == (1.0, 0, 1.0):
        P, Q = torch.softmax(tp, -1), torch.softmax(tq, -1)
        gap = enumerate_block(P, Q, V, N)[1] - token_mean(P, Q, V, N)
        assert gap > 0.1
        # 0.12 expected, the standard error of the difference ~0.01 at 20000 samples
        assert acc.double().mean() - tok_acc.double().mean() > 0.5 * gap
        bad, _, _ = sample_step(tp, tq, V, N, n, T, k, p, wrong=True)
        assert chi2_pvalue(torch.bincount(bad, minlength=V ** (N + 1)), want) < 1e-6


def test_chi_case_has_draft_zeros_where_the_target_has_mass():
    """The chi-square case's tables exclude draft tokens the target keeps (the residual must
    supply them) and target tokens the draft proposes (never accepted)."""
    tp, tq = tables(*CHI_CASE[:1], *CHI_CASE[1:])
    assert ((tq == NINF) & (tp > NINF)).any() and ((tp == NINF) & (tq > NINF)).any()


# ---- the fused kernel (interpreter) against the reference ----

def launch(*args, verify=None, **plan):
    """rejection_sample_launch of the 8 data tensors under SamplerPlan().replace(**plan)."""
    return rejection_sample_launch(*args, plan=SamplerPlan().replace(**plan), verify=verify)


def _mixed(seed, B, N, V):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N + 1, V, generator=g) * 2
    dl = logits[:, :N] + torch.randn(B, N, V, generator=g) * 0.7
    drafts = torch.multinomial(torch.softmax(dl, -1).reshape(-1, V), 1,
                               generator=g).reshape(B, N)
    return logits, drafts, dl


def test_fused_block_equals_reference_mixed_rows():
    """Block and token-wise requests side by side, greedy ones (verify ignored), top-k, top-p
    and both: the kernel's tokens are the reference's, at a tiling of several chunks."""
    B, N, V = 8, 4, 137
    logits, drafts, dl = _mixed(0, B, N, V)
    drafts[0] = logits[0, :N].argmax(-1)
    T = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.3, 1.0, 1.0, 0.9])
    k = torch.tensor([0, 0, 10, 0, 0, 3, 30, 5])
    p = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 1.0, 0.95, 0.5])
    verify = torch.tensor([1, 1, 1, 1, 0, 1, 1, 1])
    seed, pos = torch.arange(B) * 7 + 3, torch.arange(B) * 5
    want = rejection_sample_reference(logits, drafts, dl, T, k, p, seed, pos, verify)
    tok = rejection_sample_reference(logits, drafts, dl, T, k, p, seed, pos)
    assert not torch.equal(want[1], tok[1]), "no request decided otherwise: the case lost its point"
    got = launch(logits, drafts, dl, T, k, p, seed, pos, verify=verify, tile=64, chunk=64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fused_block_degenerate_masked_and_padded_rows():
    """Block requests with a NaN target row mid-block, a fully masked (-inf) target row, a
    NaN (degenerate: q = 0) draft row, a draft the draft gives no mass (q(x) = 0, p(x) > 0), a
    draft the target excludes (p(x) = 0), an out-of-range draft, and padded rows of garbage:
    the kernel equals the reference; every committed token is in range, never one the target
    excludes (outside degenerate rows), -1 after the committed ones."""
    B, N, V = 8, 3, 96
    logits, drafts, dl = _mixed(1, B, N, V)
    logits[0, 1, 7] = float("nan")                  # degenerate target row 1
    logits[1, 2] = NINF                             # fully masked target row 2
    dl[2, 1] = float("nan")                         # degenerate draft row: q = 0
    dl[3, 0, drafts[3, 0]] = NINF                   # q(x) = 0 where p(x) > 0
    logits[4, 1, drafts[4, 1]] = NINF               # p(x) = 0 where q(x) > 0
    drafts[5, 2] = V + 4                            # out of range
    logits[6:] = torch.randn(2, N + 1, V) * 50      # padded rows: garbage everywhere
    dl[6:] = float("nan")
    drafts[6:] = torch.tensor([[-1, V, 1 << 40], [0, 0, 0]])
    T = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.8, 1.0, float("nan"), 1.0])
    k = torch.tensor([0, 0, 0, 4, 0, 0, -3, 1 << 40])
    p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.95, 1.0, float("nan"), 0.0])
    seed = torch.tensor([1, 2, 3, 4, 5, 6, -5, 1 << 62])
    pos = torch.tensor([0, 4, 8, 12, 16, 20, -1, 1 << 40])
    verify = torch.tensor([1, 1, 1, 1, 1, 1, 7, -1])
    want = rejection_sample_reference(logits, drafts, dl, T, k, p, seed, pos, verify)
    got = launch(logits, drafts, dl, T, k, p, seed, pos, verify=verify, tile=32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    tokens, num = want
    assert ((num >= 1) & (num <= N + 1)).all()
    committed = torch.arange(N + 1)[None] < num[:, None]
    assert ((tokens >= 0) & (tokens < V) | ~committed).all() and (tokens[~committed] == -1).all()
    assert num[3] == 1 and num[4] <= 2 and num[5] <= 3      # never past those drafts
    P = request_probs(logits, T, k, p)
    for b in range(6):
        for j in range(int(num[b])):
            if P[b, j].sum() > 0:                           # not a degenerate target row
                assert P[b, j, tokens[b, j]] > 0, (b, j)


def test_fused_block_on_the_chi_square_requests():
    """The kernel decides the chi-square test's requests (its tiny vocabulary, one chunk) as
    the reference does: what the test shows of the reference holds for the kernel."""
    seed, V, N = CHI_CASE
    tp, tq = tables(seed, V, N)
    _, _, args = sample_step(tp, tq, V, N, 48)
    want = rejection_sample_reference(*args)
    got = launch(*args[:8], verify=args[8], tile=16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bound_walk_keeps_every_row_of_a_block_request():
    """Block verification reads every row's whole distribution: the walk flags all target and
    draft rows of a block request for the exact search and decides none of its tests, while
    the token-wise request beside it (the same rows) keeps its walk."""
    from dspark_compile.kernels.sampling import rejection as rj
    N, V, tile = 3, 300, 32
    g = torch.Generator().manual_seed(0)
    one = torch.randn(1, N + 1, V, generator=g)
    one[..., :4] += 12.0                            # confident rows: most tests decided
    logits = one.expand(2, -1, -1).contiguous()
    dl = logits[:, :N] + 0.1
    drafts = torch.zeros(2, N, dtype=torch.int64)
    T, k, p = torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.full((2,), 0.95)
    seed, pos = torch.tensor([3, 3]), torch.tensor([9, 9])
    st, dst = rj._stats(logits, T, tile), rj._stats(dl, T, tile)
    need = torch.full((2 * (N + 1),), -1, dtype=torch.int32)
    dneed = torch.full((2 * N,), -1, dtype=torch.int32)
    dec = torch.full((2 * (N + 1),), -1, dtype=torch.int32)
    rj._walk(logits, st, dl, dst, drafts, (T, k, p), seed, pos, torch.tensor([1, 0]), need,
             dneed, dec)
    need, dneed, dec = need.view(2, N + 1), dneed.view(2, N), dec.view(2, N + 1)[:, :N]
    assert (need[0] == 1).all() and (dneed[0] == 1).all() and (dec[0] == 0).all()
    assert (dec[1] != 0).any() and (need[1] == 0).any(), "the token-wise request lost its walk"


def test_engine_without_the_verify_state_is_refused():
    """A program exported before the decode state had `row.verify` is refused at load naming
    the field (artifact.check_state_layout, called by Engine), not failed at its first step."""
    from dspark_compile.engine_dir.format import ArtifactError
    from dspark_compile.engine_dir.graph_format import dump_program
    from dspark_compile.engine_dir.graph_read import read_program
    from dspark_compile.engine_dir.load import check_state_layout

    class Step(torch.nn.Module):
        def forward(self, rows, state):
            return state["row.seed"][rows] + 1

    old = {"row.seed": torch.zeros(3, dtype=torch.int64)}
    ep = read_program(*dump_program(torch.export.export(Step(), (torch.arange(2), old))))
    check_state_layout({2: ep}, old)
    with pytest.raises(ArtifactError, match=r"lacks the state fields \['row.verify'\]"):
        check_state_layout({2: ep}, {**old, "row.verify": torch.zeros(3, dtype=torch.int64)})


def test_sampling_params_verify():
    """SamplingParams.verify: "block" by default, "token" allowed, anything else named; the
    method a request's acceptance is counted under (greedy rows: "greedy")."""
    from dspark_compile.models.generate import GenerationResult
    from dspark_compile.models.request import SamplingParams
    assert SamplingParams().verify == "block" and SamplingParams().method == "greedy"
    assert SamplingParams(temperature=1.0).method == "block"
    assert SamplingParams(temperature=1.0, verify="token").method == "token"
    with pytest.raises(ValueError, match="verify must be one of"):
        SamplingParams(verify="joint").validate(10)
    res = GenerationResult(accepted_at=[0, 0])
    for n, m in ((3, "block"), (1, "token"), (2, "block")):
        res.record(n, m)
    assert res.accepted_at == [2, 1] and res.row_steps == 3
    assert res.by_method["block"].acceptance_per_position == [1.0, 0.5]
    assert res.by_method["block"].mean_accepted_length == 2.5
    assert res.by_method["token"].mean_accepted_length == 1.0


# ---- GPU: the Flash vocabulary, CUDA-graph capture and replay with fresh noise ----

def _gpu_case(B, seed, dev="cuda"):
    N, V = 5, 129280
    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.randn(B, N + 1, V, device=dev, generator=g) * 2
    hot = torch.randint(0, V, (B, N + 1, 16), device=dev, generator=g)
    logits.scatter_add_(-1, hot, torch.full((B, N + 1, 16), 8.0, device=dev))
    dl = logits[:, :N] + torch.randn(B, N, V, device=dev, generator=g) * 0.5
    T = torch.ones(B, device=dev)
    T[0] = 0.0                                              # greedy: verify ignored
    k = torch.zeros(B, dtype=torch.int64, device=dev)
    k[1 % B] = 50
    p = torch.full((B,), 0.95, device=dev)
    q = request_probs(dl, T, k, p)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, N)
    drafts[0] = logits[0, :N].argmax(-1)
    verify = torch.ones(B, dtype=torch.int64, device=dev)
    verify[B // 2:] = 0                                     # half token-wise
    seed_t = torch.randint(0, 2 ** 62, (B,), device=dev, generator=g)
    pos = torch.randint(0, 10000, (B,), device=dev, generator=g)
    return [logits, drafts, dl, T, k, p, seed_t, pos, verify]


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 6, 64])
def test_gpu_block_equals_reference_eager_and_replayed_with_fresh_noise(B):
    """At the Flash vocabulary, block and token-wise requests (top-p 0.95, one top-k, one
    greedy): the op equals the reference; captured in a CUDA graph and replayed with new seeds
    and positions copied into its inputs, each replay equals the reference on those inputs
    (fresh Philox noise per replay, nothing stale), and the replays' tokens differ."""
    args = _gpu_case(B, B)
    want = rejection_sample_reference(*args)
    got = torch.ops.dspark.rejection_sample(*args[:8], verify=args[8])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    static = [a.clone() for a in args]
    torch.ops.dspark.rejection_sample(*static[:8], verify=static[8])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dspark.rejection_sample(*static[:8], verify=static[8])
    seen = []
    for r in range(3):
        g = torch.Generator(device="cuda").manual_seed(1000 + r)
        static[6].copy_(torch.randint(0, 2 ** 62, (B,), device="cuda", generator=g))
        static[7].copy_(torch.randint(0, 10000, (B,), device="cuda", generator=g))
        graph.replay()
        want = rejection_sample_reference(*static)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), r
        seen.append(out[0].clone())
    if B > 1:
        assert not torch.equal(seen[0], seen[1]) or not torch.equal(seen[1], seen[2])
