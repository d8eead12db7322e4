"""The temperature rule at its edges, in the reference and the fused samplers alike
(kernels/sampling/reference.py GREEDY_BELOW; the Triton kernels under the interpreter on a
machine without CUDA):

- a temperature below GREEDY_BELOW is greedy: 1e-45 (subnormal: z = logits / T overflowed to
  inf and the row came out degenerate, token 0), 1e-40, 1e-38 and GREEDY_BELOW / 2 give the
  argmax, as T = 0 does;
- GREEDY_BELOW itself samples (an exact tie is broken by the noise, not by the lowest id), and
  its probabilities hold no NaN;
- a huge temperature (1e30, the largest float32) samples from the uniform distribution over
  the kept tokens, with no NaN, the fused samplers drawing the reference's tokens.

Every case's logits have their argmax away from token 0, so a degenerate row (token 0) fails.
"""
import pytest
import torch

from dspark_compile.kernels.sampling.markov import (markov_sample_launch,
                                                    markov_sample_mode_reference)
from dspark_compile.kernels.sampling.plan import SamplerPlan
from dspark_compile.kernels.sampling.reference import (GREEDY_BELOW, greedy_rows,
                                                       rejection_sample_reference,
                                                       request_probs, sample_reference)
from dspark_compile.kernels.sampling.rejection import rejection_sample_launch
from dspark_compile.kernels.sampling.sample import sample_launch

FLOAT32_MAX = torch.finfo(torch.float32).max
TINY = [1e-45, 1e-40, 1e-38, GREEDY_BELOW / 2]      # greedy
HUGE = [1e30, FLOAT32_MAX]                           # sampled, ~uniform
B, N, V, R = 4, 2, 97, 16
PLAN = SamplerPlan().replace(tile=128, chunk=128, cap=128)   # one program per row: fast


def case(seed=0):
    """(target logits [B, N+1, V], base logits [B, N, V], anchor, w1, w2, seed, position):
    logits of scale ~3 whose argmax is never token 0."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(B, N + 1, V, generator=g) * 3
    target[..., 0] = -10.0
    base = torch.randn(B, N, V, generator=g) * 3
    base[..., 0] = -10.0
    anchor = torch.randint(1, V, (B,), generator=g)
    w1 = (torch.randn(V, R, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(V, R, generator=g) * 0.1).bfloat16()
    return target, base, anchor, w1, w2, torch.arange(B) * 977 + 5, torch.arange(B) * 3 + 40


def meta(T, b=B):
    return (torch.full((b,), T, dtype=torch.float32), torch.zeros(b, dtype=torch.int64),
            torch.ones(b))


def markov(fused, base, anchor, w1, w2, T, k, p, seed, pos):
    if fused:
        return markov_sample_launch(base, anchor, w1, w2, T, k, p, seed, pos, plan=PLAN)
    return markov_sample_mode_reference(base, anchor, w1, w2, T, k, p, seed, pos, "full")


def rejection(fused, *args):
    if fused:
        return rejection_sample_launch(*args, plan=PLAN)
    return rejection_sample_reference(*args)


def sample(fused, *args):
    return sample_launch(*args, PLAN) if fused else sample_reference(*args)


def test_the_rule_in_fp32():
    t = torch.tensor([0.0, -1.0, 1e-45, 1e-40, 1e-38, GREEDY_BELOW / 2, GREEDY_BELOW, 1.0,
                      FLOAT32_MAX, float("nan")])
    assert greedy_rows(t).tolist() == [True] * 6 + [False] * 4
    # the comparison is in fp32 whatever the temperatures' dtype
    assert greedy_rows(t.double()).tolist() == greedy_rows(t).tolist()


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_temperatures_below_the_threshold_are_greedy(fused):
    """Each of TINY on two rows of one batch: every op gives what it gives at T = 0."""
    target, base, anchor, w1, w2, seed, pos = case()
    greedy_meta = meta(0.0)
    tiny_meta = (torch.tensor(TINY * (B // len(TINY)), dtype=torch.float32), *greedy_meta[1:])
    assert (tiny_meta[0] > 0).all()            # stored as nonzero fp32 values

    want = target[:, 0].argmax(-1)
    got = sample(fused, target[:, 0], *tiny_meta, seed, pos)
    assert torch.equal(got, want) and (got != 0).all()

    d0, lg0 = markov(fused, base, anchor, w1, w2, *greedy_meta, seed, pos)
    d, lg = markov(fused, base, anchor, w1, w2, *tiny_meta, seed, pos)
    assert torch.equal(d, d0) and (d != 0).all()
    assert torch.equal(d, torch.stack([lg0[:, k].argmax(-1) for k in range(N)], 1))
    assert not torch.isnan(lg).any()

    t0, n0 = rejection(fused, target, d0, lg0, *greedy_meta, seed, pos)
    t, n = rejection(fused, target, d, lg, *tiny_meta, seed, pos)
    assert torch.equal(t, t0) and torch.equal(n, n0)
    last = t.gather(1, (n - 1)[:, None])
    assert (last != 0).all()


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_the_threshold_itself_samples(fused):
    """T = GREEDY_BELOW: tokens 5 and 9 tie at the top of each of 8 rows. Greedy takes 5; a
    sampled row draws either (probability 1/2 each), by its seed."""
    b = 8
    logits = torch.randn(b, V, generator=torch.Generator().manual_seed(3))
    logits[:, 5] = logits[:, 9] = 10.0
    seed, pos = torch.arange(b) * 31 + 1, torch.arange(b)
    T = meta(GREEDY_BELOW, b)
    p = request_probs(logits[:, None], *T)[:, 0]
    assert not torch.isnan(p).any()
    torch.testing.assert_close(p[:, [5, 9]], torch.full((b, 2), 0.5))
    got = sample(fused, logits, *T, seed, pos)
    assert set(got.tolist()) == {5, 9}          # these seeds draw both (P(one only) = 2^-7)
    assert torch.equal(got, sample_reference(logits, *T, seed, pos))
    below = sample(fused, logits, *meta(GREEDY_BELOW / 2, b), seed, pos)
    assert (below == 5).all()


def test_huge_temperatures_sample_uniformly_over_the_kept_tokens():
    """1e30 on half the rows, the largest float32 on the others."""
    target, base, anchor, w1, w2, seed, pos = case(1)
    Tm = (torch.tensor(HUGE * (B // 2), dtype=torch.float32), *meta(1.0)[1:])
    q = request_probs(target, *Tm)
    assert not torch.isnan(q).any()
    torch.testing.assert_close(q, torch.full_like(q, 1 / V), rtol=1e-5, atol=0)
    # top-k keeps the k largest z (logits / T keeps their order; ties kept), all alike
    k = torch.full((B,), 7, dtype=torch.int64)
    qk = request_probs(target, Tm[0], k, Tm[2])
    kept = qk > 0
    assert (kept.sum(-1) >= 7).all()
    torch.testing.assert_close(qk[kept], (1 / kept.sum(-1, keepdim=True).expand_as(qk))[kept])

    # the fused samplers draw the reference's tokens (the same z bits, the same noise)
    want = sample_reference(target[:, 0], *Tm, seed, pos)
    assert torch.equal(sample_launch(target[:, 0], *Tm, seed, pos, PLAN), want)
    d, lg = markov(False, base, anchor, w1, w2, *Tm, seed, pos)
    fd, flg = markov(True, base, anchor, w1, w2, *Tm, seed, pos)
    assert torch.equal(fd, d)
    torch.testing.assert_close(flg, lg, rtol=1e-5, atol=1e-5)
    ref = rejection_sample_reference(target, d, lg, *Tm, seed, pos)
    got = rejection_sample_launch(target, d, lg, *Tm, seed, pos, plan=PLAN)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])

    # uniform: 4000 draws from one row, per temperature: every one of the 97 tokens drawn,
    # none more than 3x its share (a greedy or degenerate row puts all 4000 on one token)
    n = 4000
    rows = target[:1, 0].expand(n, V)
    for T in HUGE:
        draws = sample_reference(rows, torch.full((n,), T), torch.zeros(n, dtype=torch.int64),
                                 torch.ones(n), torch.arange(n),
                                 torch.zeros(n, dtype=torch.int64))
        counts = torch.bincount(draws, minlength=V)
        assert (counts > 0).all() and counts.max() < 3 * n / V, T
