"""Shared sampling math: logits processing vs an independent implementation, Gumbel-max
distribution (chi-square, with a deliberately wrong sampler that must fail), degenerate rows,
id folding, plain target sampling (reference and the fused `dspark::sample` kernel)."""
import math

import pytest
import torch
import triton
import triton.language as tl

from dspark_compile.kernels.philox import (STREAM_TARGET, bits_to_uniform, philox,
                                           vocab_uniform)
from dspark_compile.kernels.sampling.device import (block_max_floor, f32_key, gather_candidates,
                                                    spill, sum_hists, tl_vocab_gumbel,
                                                    tl_vocab_uniform)
from dspark_compile.kernels.sampling.plan import SamplerPlan
from dspark_compile.kernels.sampling.reference import (argmax_tokens, fold_ids, gumbel_argmax,
                                                       gumbel_noise, probs_from_processed,
                                                       process_logits, sample_reference)
from dspark_compile.kernels.sampling.sample import sample_launch
from stats_utils import chi2_pvalue

NINF = float("-inf")



def test_chi2_pvalue_matches_closed_forms():
    # df = 2: Q(1, x/2) = exp(-x/2)
    counts = torch.tensor([30, 50, 20])
    probs = torch.tensor([0.25, 0.5, 0.25])
    x2 = ((30 - 25) ** 2 / 25 + 0 + (20 - 25) ** 2 / 25)
    assert chi2_pvalue(counts, probs) == pytest.approx(math.exp(-x2 / 2), rel=1e-9)
    assert chi2_pvalue(torch.tensor([5, 0]), torch.tensor([0.0, 1.0])) == 0.0


# ------------------------------------------------------------------------------------------
# logits processing vs an independent, per-row, sort-and-loop implementation

def simple_process(row: torch.Tensor, T: float, k: int, p: float) -> torch.Tensor:
    z = row.double() / T
    V = z.numel()
    order = sorted(range(V), key=lambda i: -float(z[i]))
    keep = [True] * V
    if 0 < k < V:
        kth = float(z[order[k - 1]])
        keep = [float(z[i]) >= kth for i in range(V)]
    if p < 1:
        zk = [float(z[i]) if keep[i] else NINF for i in range(V)]
        m = max(zk)
        w = [math.exp(v - m) for v in zk]
        tot = sum(w)
        new = [False] * V
        for i in range(V):
            if keep[i]:
                above = sum(w[j] for j in range(V) if zk[j] > zk[i])   # mass strictly above
                new[i] = above < p * tot or zk[i] == m
        keep = new
    return torch.tensor([float(z[i]) if keep[i] else NINF for i in range(V)], dtype=torch.float64)


def test_process_logits_matches_simple_implementation():
    g = torch.Generator().manual_seed(1)
    V, rows = 23, []
    for i in range(40):
        x = torch.randn(V, generator=g) * (0.5 + i % 4)
        if i % 5 == 0:
            x[3] = x[7] = x[11] = x.max() - 0.25           # ties near the top
        if i % 7 == 0:
            x = torch.round(x * 2) / 2                      # many ties everywhere
        rows.append(x)
    logits = torch.stack(rows)
    T = torch.tensor([0.5, 1.0, 1.7, 0.9] * 10)
    k = torch.tensor([0, 1, 3, 5, 23, 40, -1, 10] * 5)
    p = torch.tensor([1.0, 0.5, 0.9, 0.99, 0.3, 0.0, 1.5, 0.75, 0.95, 0.6] * 4)
    out = process_logits(logits, T, k, p)
    for i in range(len(rows)):
        want = simple_process(logits[i], float(T[i]), int(k[i]), float(p[i]))
        assert torch.equal(torch.isinf(out[i]), torch.isinf(want)), i
        fin = torch.isfinite(want)
        torch.testing.assert_close(out[i][fin].double(), want[fin], rtol=1e-6, atol=1e-6)
        assert torch.isfinite(out[i]).sum() >= 1         # the top token always survives


def test_top_p_keeps_smallest_set_reaching_mass():
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.8 -> {0, 1}; 0.81 -> {0, 1, 2}; 0.5 -> {0}
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = process_logits(logits, torch.ones(3), torch.zeros(3, dtype=torch.int64),
                         torch.tensor([0.79, 0.81, 0.5]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False],
                                             [True, True, True, False],
                                             [True, False, False, False]]


def test_degenerate_rows_token_zero_and_zero_probs():
    V = 9
    logits = torch.randn(6, V)
    logits[0] = NINF
    logits[1, 4] = float("nan")
    logits[2] = float("nan")
    logits[3, 2] = float("inf")
    T = torch.tensor([1.0, 1.0, 0.0, 0.5, float("nan"), 0.0])
    k = torch.zeros(6, dtype=torch.int64)
    p = torch.tensor([0.9, 1.0, 1.0, 0.8, 1.0, 1.0])
    z = process_logits(logits, T, k, p)
    probs = probs_from_processed(z)
    for r in (0, 1, 2, 3, 4):
        assert torch.isinf(z[r]).all() and (z[r] < 0).all()
        assert torch.isfinite(probs[r]).all() and (probs[r] == 0).all()
    tok = sample_reference(logits, T, k, p, torch.arange(6), torch.arange(6))
    assert tok[:5].tolist() == [0, 0, 0, 0, 0]
    assert argmax_tokens(logits).tolist()[:4] == [0, 0, 0, 0]


def test_fold_ids():
    ids = torch.tensor([-5, -1, 0, 3, 9, 10, 1 << 40])
    assert fold_ids(ids, 10).tolist() == [0, 0, 0, 3, 9, 0, 0]


def test_greedy_ties_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    tok = sample_reference(logits, torch.zeros(1), torch.zeros(1, dtype=torch.int64),
                           torch.ones(1), torch.zeros(1, dtype=torch.int64),
                           torch.zeros(1, dtype=torch.int64))
    assert tok.tolist() == [1]


# ------------------------------------------------------------------------------------------
# Gumbel-max distribution

def _target(V=6):
    logits = torch.tensor([1.2, -0.3, 0.4, 2.0, -1.5, 0.0])[:V]
    return logits, torch.softmax(logits.double(), 0)


def test_gumbel_max_follows_distribution_and_wrong_sampler_fails():
    n = 40000
    logits, probs = _target()
    rows = logits.expand(n, -1)
    seed = torch.arange(n, dtype=torch.int64) * 7919 + 3
    pos = torch.arange(n, dtype=torch.int64) % 97
    tok = gumbel_argmax(torch.log_softmax(rows, -1), seed, pos, STREAM_TARGET)
    counts = torch.bincount(tok, minlength=6)
    assert chi2_pvalue(counts, probs) > 1e-3
    # a sampler that is only slightly wrong (temperature 1.15) must be caught at this n
    wrong = gumbel_argmax(torch.log_softmax(rows / 1.15, -1), seed, pos, STREAM_TARGET)
    assert chi2_pvalue(torch.bincount(wrong, minlength=6), probs) < 1e-6


def test_sample_reference_distribution_with_top_p():
    n = 30000
    logits, probs = _target()
    # top_p 0.8 keeps the tokens of mass 0.49, 0.25, 0.11 (sorted) -> renormalised
    z = process_logits(logits[None], torch.ones(1), torch.zeros(1, dtype=torch.int64),
                       torch.tensor([0.8]))
    want = probs_from_processed(z)[0].double()
    assert int((want > 0).sum()) == 3
    tok = sample_reference(logits.expand(n, -1), torch.ones(n), torch.zeros(n, dtype=torch.int64),
                           torch.full((n,), 0.8), torch.arange(n), torch.full((n,), 5))
    assert chi2_pvalue(torch.bincount(tok, minlength=6), want) > 1e-3


def test_sample_reference_seed_position_determinism():
    logits = torch.randn(4, 50)
    args = (torch.ones(4), torch.zeros(4, dtype=torch.int64), torch.ones(4))
    seed, pos = torch.tensor([1, 2, 3, 4]), torch.tensor([10, 10, 10, 10])
    a = sample_reference(logits, *args, seed, pos)
    assert torch.equal(a, sample_reference(logits, *args, seed, pos))
    many = torch.stack([sample_reference(logits, *args, seed + 100 * s, pos) for s in range(20)])
    assert (many != many[0]).any(0).all()          # other seeds draw other tokens
    later = torch.stack([sample_reference(logits, *args, seed, pos + s) for s in range(20)])
    assert (later != later[0]).any(0).all()        # so do other positions


def test_bad_arguments_name_the_tensor():
    with pytest.raises(ValueError, match="top_k"):
        process_logits(torch.randn(2, 5), torch.ones(2), torch.zeros(3, dtype=torch.int64),
                       torch.ones(2))
    with pytest.raises(ValueError, match="temperature"):
        process_logits(torch.randn(2, 5), torch.ones(2, dtype=torch.int64),
                       torch.zeros(2, dtype=torch.int64), torch.ones(2))


# ------------------------------------------------------------------------------------------
# fused plain sampling (the rejection kernel with no drafts) under the interpreter

def test_fused_sample_equals_reference():
    g = torch.Generator().manual_seed(5)
    B, V = 8, 300
    logits = torch.randn(B, V, generator=g) * 3
    logits[2] = NINF
    logits[5, 17] = float("nan")
    T = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.3, 1.0, 0.8, 1.0])
    k = torch.tensor([0, 0, 5, 20, 0, 0, 1, 50])
    p = torch.tensor([1.0, 0.95, 1.0, 0.9, 0.6, 1.0, 1.0, 0.3])
    seed = torch.arange(B) * 13 + 1
    pos = torch.arange(B) + 100
    want = sample_reference(logits, T, k, p, seed, pos)
    got = sample_launch(logits, T, k, p, seed, pos, SamplerPlan().replace(tile=128, cap=64))
    assert torch.equal(got, want)
    assert got[2] == 0 and got[5] == 0


# ------------------------------------------------------------------------------------------
# vocabulary noise: four tokens per Philox block, kernel and reference bit for bit
# ------------------------------------------------------------------------------------------

@triton.jit
def _vocab_noise_kernel(seed_ptr, pos_ptr, u_ptr, g_ptr, V, TILE: tl.constexpr,
                        STREAM: tl.constexpr):
    b = tl.program_id(0)
    v0 = tl.program_id(1) * TILE
    offs = v0 + tl.arange(0, TILE)
    seed, pos = tl.load(seed_ptr + b), tl.load(pos_ptr + b)
    tl.store(u_ptr + b * V + offs, tl_vocab_uniform(seed, v0, pos, TILE, STREAM), mask=offs < V)
    tl.store(g_ptr + b * V + offs, tl_vocab_gumbel(seed, v0, pos, TILE, STREAM), mask=offs < V)


@pytest.mark.parametrize("tile", [16, 64])
def test_vocab_noise_kernel_equals_reference(tile):
    """Every token of an irregular vocabulary (V % 4 != 0, a partial last tile), seeds past 2^32
    and negative, positions past 2^32 (they wrap to 32 bits, as the reference's): the uniforms
    bit for bit, the Gumbel values within the logs' rounding."""
    V = 4 * 37 + 3
    seed = torch.tensor([0, 1, (1 << 62) + 12345, -7])
    pos = torch.tensor([0, 5, (1 << 33) + 9, 100000])
    u = torch.empty((4, V), dtype=torch.float32)
    g = torch.empty((4, V), dtype=torch.float32)
    _vocab_noise_kernel[(4, triton.cdiv(V, tile))](seed, pos, u, g, V, TILE=tile, STREAM=3)
    assert torch.equal(u.view(torch.int32), vocab_uniform(seed, pos, V, 3).view(torch.int32))
    # token v is word v % 4 of Philox block v // 4 (one token checked against philox() itself)
    words = philox(seed[:, None], torch.tensor([[9]]), pos[:, None], torch.tensor([[3]]))
    assert torch.equal(vocab_uniform(seed, pos, V, 3)[:, 4 * 9 + 2],
                       bits_to_uniform(words[2][:, 0]))
    want = gumbel_noise(seed, pos, V, 3)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)
    # the four words of a block are different draws, and streams / positions give other noise
    assert (want[:, 1:] != want[:, :-1]).all()
    assert not torch.equal(gumbel_noise(seed, pos, V, 4), want)
    assert not torch.equal(gumbel_noise(seed, pos + 1, V, 3), want)


def test_vocab_gumbel_is_standard_gumbel_in_every_word():
    """Each of the four word positions (token v % 4) follows the standard Gumbel law: a
    chi-square test of exp(-exp(-g)) (uniform under the law) in 20 bins, per word; a shifted
    law fails the same test."""
    g = gumbel_noise(torch.arange(64), torch.arange(64) * 3, 4 * 2000, 1)
    for w in range(4):
        u = torch.exp(-torch.exp(-g[:, w::4].double())).flatten()
        counts = torch.histc(u, bins=20, min=0.0, max=1.0)
        assert chi2_pvalue(counts, torch.full((20,), 0.05)) > 1e-4, w
    u = torch.exp(-torch.exp(-(g[:, 0::4].double() + 0.05))).flatten()
    assert chi2_pvalue(torch.histc(u, bins=20, min=0.0, max=1.0), torch.full((20,), 0.05)) < 1e-6


# ------------------------------------------------------------------------------------------
# the threshold search's two ways of collecting tokens (kernels/sampling/): `spill` into a
# chunk program's own region, `gather_candidates` into a row's shared, capped list

@triton.jit
def _collect_kernel(z_ptr, sel_ptr, spill_ptr, spn_ptr, ccount_ptr, ckey_ptr, cmass_ptr, NT,
                    CHUNK, TILE: tl.constexpr, CAP: tl.constexpr):
    """Program p walks its NT tiles: spills the selected z into region p and gathers (key, id)
    of the same tokens into row 0's candidate list, as the select/refine passes do."""
    pid = tl.program_id(0)
    n = tl.zeros((), tl.int32)
    for t in range(NT):
        offs = (pid * NT + t) * TILE + tl.arange(0, TILE)
        z = tl.load(z_ptr + offs)
        sel = tl.load(sel_ptr + offs) != 0
        n = spill(spill_ptr, pid, CHUNK, n, sel, z)
        gather_candidates(ccount_ptr, ckey_ptr, cmass_ptr, 0, sel, f32_key(z), offs.to(tl.int64),
                          CAP)
    tl.store(spn_ptr + pid, n)


@pytest.mark.parametrize("cap", [32, 256])
def test_spill_and_gather_collect_exactly_the_selected_tokens(cap):
    """Spill: each program's region holds its selected z in token order and its count (tiles
    selecting nothing, everything, or a few). Gather: the row's counter counts every selected
    token, also past CAP; the list holds min(count, CAP) distinct selected tokens with their
    keys (all of them when they fit)."""
    P, NT, TILE = 3, 4, 16
    CHUNK = NT * TILE
    g = torch.Generator().manual_seed(5)
    z = torch.randn(P * CHUNK, generator=g)
    sel = torch.rand(P * CHUNK, generator=g) < 0.4
    sel[0:TILE] = False                   # program 0, tile 0: nothing
    sel[CHUNK + TILE:CHUNK + 2 * TILE] = True      # program 1, tile 1: everything
    sel[2 * CHUNK:] = False
    sel[2 * CHUNK + 5] = True             # program 2: a single token
    spill_buf = torch.full((P, CHUNK), float("nan"))
    spn = torch.full((P,), -1, dtype=torch.int32)
    ccount = torch.zeros(1, dtype=torch.int32)
    ckey = torch.full((1, cap), -1, dtype=torch.int32)
    cmass = torch.full((1, cap), -1, dtype=torch.int64)
    _collect_kernel[(P,)](z, sel.to(torch.int32), spill_buf, spn, ccount, ckey, cmass, NT, CHUNK,
                          TILE=TILE, CAP=cap)
    for p in range(P):
        want = z[p * CHUNK:(p + 1) * CHUNK][sel[p * CHUNK:(p + 1) * CHUNK]]
        assert int(spn[p]) == want.numel()
        assert torch.equal(spill_buf[p, :want.numel()], want)
        assert torch.isnan(spill_buf[p, want.numel():]).all()      # nothing written past it
    total = int(sel.sum())
    assert (total > 32) and int(ccount[0]) == total     # cap 32 overflows
    kept = min(total, cap)
    ids = cmass[0, :kept]
    assert (ids >= 0).all() and ids.unique().numel() == kept and sel[ids].all()
    bits = z[ids].view(torch.int32)           # f32_key: order-preserving (no zeros drawn here)
    assert torch.equal(ckey[0, :kept], torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF))
    assert (cmass[0, kept:] == -1).all()
    if total <= cap:
        assert torch.equal(ids.sort().values, sel.nonzero()[:, 0])


# ------------------------------------------------------------------------------------------
# the top-p floor from block maxima (device.block_max_floor): the threshold search of reduce
# and select leaves out the tokens below it

@triton.jit
def _floor_kernel(z_ptr, out_ptr, V, BLOCK: tl.constexpr, NBLK_P2: tl.constexpr, top_p):
    """Row b's block maxima over blocks of BLOCK tokens, then its floor (one program per row)."""
    b = tl.program_id(0)
    o = tl.arange(0, NBLK_P2)
    t = tl.arange(0, BLOCK)
    offs = o[:, None] * BLOCK + t[None, :]
    z = tl.load(z_ptr + b * V + offs, mask=offs < V, other=float("-inf"))
    bm = tl.max(z, axis=1)
    m = tl.max(bm, axis=0)
    bs = tl.sum(tl.where(z > float("-inf"),
                         tl.exp(z - tl.where(bm > float("-inf"), bm, 0.0)[:, None]), 0.0), axis=1)
    Z = tl.sum(tl.where(bm > float("-inf"), bs * tl.exp(bm - m), 0.0), axis=0)
    e = tl.where(bm > float("-inf"), tl.exp(bm - m), 0.0)
    tl.store(out_ptr + b, block_max_floor(bm, e, m, Z, top_p))


def _grid_floor(z: torch.Tensor, block: int, top_p: float) -> float:
    """block_max_floor recomputed in float64: the smallest d on the 32 / 2^10 grid, by scan."""
    v = z.numel()
    zz = torch.cat((z.double(), torch.full((-v % block,), NINF, dtype=torch.float64)))
    bm = zz.view(-1, block).amax(1)
    m = bm.max()
    e = torch.exp(bm - m)
    T = top_p * torch.exp(zz - m).sum() * (1 + 1e-4)
    for i in range(1025):
        d = 32.0 * i / 1024
        if e[bm >= m - d].sum() >= T:
            return float(m - d)
    return NINF


@pytest.mark.parametrize("top_p", [0.5, 0.95, 0.999])
def test_block_max_floor_is_a_lower_bound_on_the_top_p_threshold(top_p):
    """On peaked rows (a few lifted tokens over a Gaussian bulk) the floor is high -- that is what
    lets reduce and select skip most of the row -- and on flat ones low or -inf; on every row it
    is at most the reference's threshold (the smallest kept value) and within a few grid steps
    of the float64 recomputation (fp32 sums differ near a grid point)."""
    v, block = 1000, 16
    g = torch.Generator().manual_seed(int(top_p * 1000))
    rows = torch.randn(8, v, generator=g) * 2.0
    for r in range(4):                                 # peaked rows: 3-12 lifted tokens
        hot = torch.randperm(v, generator=g)[:3 * (r + 1)]
        rows[r, hot] += 12.0 + torch.rand(hot.numel(), generator=g)
    rows[6] = torch.randn(v, generator=g) * 0.01       # near flat
    rows[7, :] = NINF
    rows[7, 5] = 1.0                                   # one finite token
    out = torch.empty(8)
    _floor_kernel[(8,)](rows, out, v, BLOCK=block, NBLK_P2=triton.next_power_of_2(
        triton.cdiv(v, block)), top_p=top_p)
    z = process_logits(rows, torch.ones(8), torch.zeros(8, dtype=torch.int64),
                       torch.full((8,), top_p))
    tau = torch.where(torch.isfinite(z), z, torch.inf).amin(1)
    step = 32.0 / 1024
    for r in range(8):
        assert float(out[r]) <= float(tau[r]), (r, float(out[r]), float(tau[r]))
        want = _grid_floor(rows[r], block, top_p)
        if want == NINF:
            assert float(out[r]) == NINF, r
        else:
            assert abs(float(out[r]) - want) <= 2 * step + 1e-5, (r, float(out[r]), want)
    # peaked rows: the floor lies well above the bulk (its maximum is ~7 over 1000 tokens); at
    # 0.999 the bulk's mass (~1e-3) is more than 3-12 lifted tokens leave, so no floor there
    # on most of them -- what the float64 recomputation above also says
    if top_p < 0.999:
        assert (out[:4] > rows[4:6].amax(1).max()).all()
    # a single token: the floor is one grid step below it (the grid never tries d = 0)
    assert float(out[7]) == 1.0 - step


@triton.jit
def _sum_hists_kernel(hist_ptr, tot_ptr, tm_ptr, C, NB: tl.constexpr, C_P2: tl.constexpr):
    tot, tm = sum_hists(hist_ptr, 0, C, NB, C_P2)
    tl.store(tot_ptr + tl.arange(0, NB), tot)
    tl.store(tm_ptr + tl.arange(0, NB), tm)


@pytest.mark.parametrize("C,NB", [(1, 16), (63, 16), (70, 16), (70, 128), (5, 4)])
def test_sum_hists_sums_every_program_histogram(C, NB):
    """The last program's sum over C chunk histograms (counts, then fp32 mass bits, 2 NB int32
    per program): one slab of 1024 / NB programs or several (C = 70 at 16 bins: 64 + 6; at 128
    bins: 9 slabs of 8)."""
    g = torch.Generator().manual_seed(C * NB)
    cnt = torch.randint(0, 1000, (C, NB), generator=g, dtype=torch.int32)
    mass = torch.rand(C, NB, generator=g) * 10
    hist = torch.cat((cnt, mass.view(torch.int32)), 1).contiguous()
    tot = torch.empty(NB, dtype=torch.int32)
    tm = torch.empty(NB)
    _sum_hists_kernel[(1,)](hist, tot, tm, C, NB=NB, C_P2=triton.next_power_of_2(C))
    assert torch.equal(tot, cnt.sum(0))
    torch.testing.assert_close(tm, mass.sum(0), rtol=1e-6, atol=1e-5)


def test_rejection_and_sample_refuse_plan_choices_they_do_not_take():
    """Markov-only plan fields (and a greedy plan for plain sampling) are refused by name, not
    silently ignored."""
    from dspark_compile.kernels.sampling.plan import SamplerPlan
    from dspark_compile.kernels.sampling.rejection import rejection_sample_launch
    from dspark_compile.kernels.sampling.sample import sample_launch
    B, N, V = 2, 3, 40
    args = (torch.randn(B, N + 1, V), torch.zeros(B, N, dtype=torch.int64), torch.randn(B, N, V),
            torch.ones(B), torch.zeros(B, dtype=torch.int64), torch.ones(B),
            torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64))
    for field, value in (("hist_bins", 8), ("refine_passes", 2), ("candidate", False)):
        with pytest.raises(ValueError, match=f"'{field}'.*Markov sampler only"):
            rejection_sample_launch(*args, plan=SamplerPlan().replace(**{field: value}))
    with pytest.raises(ValueError, match="plan.mode='greedy'"):
        sample_launch(torch.randn(B, V), torch.ones(B), torch.zeros(B, dtype=torch.int64),
                      torch.ones(B), torch.zeros(B, dtype=torch.int64),
                      torch.zeros(B, dtype=torch.int64), plan=SamplerPlan(mode="greedy"))
