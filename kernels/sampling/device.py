"""Triton device library of the samplers: Philox uniforms and Gumbel noise bit for bit as
kernels/philox.py, order-preserving fp32 keys, packed argmax keys, fixed-point masses, per-lane
histograms and argmaxes, the block maxima's top-p floor, and a row's sampling flags.

Everything here is a `@triton.jit` helper, inlined where it is called. Per-lane partials
(lane_hist_add, lane_argmax_update) are reduced once per program, after its loop: a reduction
per tile costs a CTA barrier each, which made the row passes ~10x slower than their bytes.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_compile.kernels.sampling.reference import GREEDY_BELOW

# nats below the row max that the threshold histograms' bins split evenly (the last bin is open)
HIST_SPAN = tl.constexpr(32.0)
# relative error allowed for an fp32 bin mass (sums of <= 10^4 fp32 terms a program, then <= 64
# chunk partials: < 1e-5; exp error ~1e-7): it only widens a bracket
MASS_EPS = tl.constexpr(1e-4)
# temperatures below this are greedy (reference.GREEDY_BELOW: the reason and the number)
_GREEDY_BELOW = tl.constexpr(GREEDY_BELOW)


@triton.jit
def bits_uniform(r):
    """kernels.philox.bits_to_uniform of uint32 Philox words."""
    x = r.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, -x - 1, x)
    return x.to(tl.float32) * 4.6566127342e-10


@triton.jit
def tl_uniform(seed, c0, c1, STREAM: tl.constexpr):
    """kernels.philox.uniform(seed, c0, c1, STREAM), bit for bit (c0, c1 wrap to 32 bits)."""
    r, _, _, _ = tl.philox(seed, c0.to(tl.uint32), c1.to(tl.uint32), STREAM, 0)
    return bits_uniform(r)


@triton.jit
def tl_vocab_uniform(seed, v0, pos, TILE: tl.constexpr, STREAM: tl.constexpr):
    """The uniforms behind kernels.philox.vocab_gumbel, bit for bit, for tokens v0 .. v0 + TILE - 1
    (v0 a multiple of 4): one Philox block per 4 tokens, its words interleaved into token order."""
    c0 = (v0 // 4 + tl.arange(0, TILE // 4)).to(tl.uint32)
    c1 = (pos + tl.zeros((TILE // 4,), tl.int64)).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, STREAM, 0)
    return bits_uniform(tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3)))


@triton.jit
def tl_vocab_gumbel(seed, v0, pos, TILE: tl.constexpr, STREAM: tl.constexpr):
    """kernels.philox.vocab_gumbel for tokens v0 .. v0 + TILE - 1 (the logs round like the
    device's, within an ulp or two of torch's)."""
    u = tl.maximum(tl_vocab_uniform(seed, v0, pos, TILE, STREAM), 1e-20)
    return -tl.log(-tl.log(u))


@triton.jit
def f32_key(x):
    """Order-preserving int32 key of finite fp32 x (-0 and +0 share the key of +0)."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def key_f32(k):
    k = k.to(tl.int32)
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def is_greedy_t(t):
    """reference.greedy_rows of fp32 temperature(s) t: t < GREEDY_BELOW (NaN: not greedy)."""
    return t < _GREEDY_BELOW


@triton.jit
def divisor_t(t):
    """The divisor of a row's logits, as process_logits scales them: its fp32 temperature t,
    1 for greedy rows (their z are read only where they stay unscaled)."""
    return tl.where(is_greedy_t(t), 1.0, t)


@triton.jit
def row_t(temp_ptr, r, SCALED: tl.constexpr):
    """The divisor of request r's logits when a row pass reads them unscaled (SCALED):
    divisor_t of its temperature; 1.0 otherwise."""
    t = tl.full((), 1.0, tl.float32)
    if SCALED:
        t = divisor_t(tl.load(temp_ptr + r).to(tl.float32))
    return t


@triton.jit
def scale_z(x, t, SCALED: tl.constexpr):
    """A row pass's z from the tile it loaded: x itself (stored z), or with SCALED the logits x
    in fp32 divided by t (IEEE division, as process_logits; none at t = 1, where it is exact:
    the deployed temperature costs nothing). Applied where the tile is used, not where it is
    requested: scaled at the load, the passes that request a tile or two ahead waited for it
    there (select 176 -> 216 us at B = 64 in the rejection plan, H200)."""
    if SCALED:
        x = x.to(tl.float32)
        if t != 1.0:
            x = tl.math.div_rn(x, t)
    return x


@triton.jit
def load_z(ptr, mask, t, SCALED: tl.constexpr):
    """scale_z of a tile loaded and used at once (-inf where masked)."""
    return scale_z(tl.load(ptr, mask=mask, other=float("-inf")), t, SCALED)


@triton.jit
def d_bin(z, m, NB: tl.constexpr):
    """Histogram bin of z below the row max m (monotone in z; only used for finite z)."""
    return tl.minimum((m - z) * (NB / HIST_SPAN), NB - 1.0).to(tl.int32)


@triton.jit
def fixed_of(e, SCALE: tl.constexpr):
    """A mass e = exp(z - m) in int64 fixed point (floor of e * SCALE)."""
    return (e * SCALE).to(tl.int64)


@triton.jit
def fixed_mass(z, m, SCALE: tl.constexpr):
    """exp(z - m) as int64 fixed point (0 for -inf)."""
    return fixed_of(tl.where(z > float("-inf"), tl.exp(z - m), 0.0), SCALE)


@triton.jit
def lane_hist_add(cnt2, ms2, hit, e):
    """Add the tokens of a tile to per-lane histograms cnt2 / ms2 [TILE, NB]: hit [TILE, NB]
    says which bins each token counts in, e [TILE] its mass.

    Nothing crosses threads here: a program sums its lanes once, after its loop (a histogram
    reduced per tile costs a CTA barrier per tile, which is what bounded these passes)."""
    return cnt2 + hit.to(tl.int32), ms2 + tl.where(hit, e[:, None], 0.0)


@triton.jit
def hist_add(cnt2, ms2, j, e, valid, NB: tl.constexpr):
    """lane_hist_add of tokens in bin j in [0, NB) (valid ones only)."""
    return lane_hist_add(cnt2, ms2, (j[:, None] == tl.arange(0, NB)[None, :]) & valid[:, None], e)


@triton.jit
def hist_add_z(cnt2, ms2, z, m, NB: tl.constexpr):
    """hist_add for a tile of z (-inf: nothing) below the row max m."""
    fin = z > float("-inf")
    e = tl.where(fin, tl.exp(z - m), 0.0)
    return hist_add(cnt2, ms2, d_bin(z, m, NB), e, fin, NB)


@triton.jit
def gather_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, sel, key, w, CAP: tl.constexpr):
    """Append the selected tokens' (key, fixed mass) to row b's candidate list: a scan over the
    tile places them, and one atomic per tile that selects anything reserves their slots
    (an atomic slot per token made every tile wait on a contended round trip). ccount[b] ends
    as the number of candidates, also past CAP; their order is arbitrary, which resolve() does
    not depend on."""
    pos = tl.cumsum(sel.to(tl.int32), axis=0)
    n = tl.max(pos, axis=0)
    if n > 0:
        slot = tl.atomic_add(ccount_ptr + b, n, sem="relaxed") + pos - 1
        ok = sel & (slot < CAP)
        tl.store(ckey_ptr + b * CAP + slot, key, mask=ok)
        tl.store(cmass_ptr + b * CAP + slot, w, mask=ok)


@triton.jit
def spill(spill_ptr, pc, CHUNK, n, sel, z):
    """Append the selected z of a tile to chunk program pc's spill region, which holds n tokens
    so far (CHUNK slots: a chunk never overflows it), in token order; returns the new count.
    A scan over the tile places them: no atomics (per-token atomic slots on the program's
    counter made the select pass ~2x slower on the H200: each tile waited on its round trip)."""
    pos = tl.cumsum(sel.to(tl.int32), axis=0)
    tl.store(spill_ptr + pc.to(tl.int64) * CHUNK + n + pos - 1, z, mask=sel)
    return n + tl.max(pos, axis=0)


# Greedy rows' argmax as one atomic maximum per block (the Markov sampler's and rejection's
# greedy plans): the row's slot starts at 0 and every block maxes its packed key into it.
_NAN_KEY = tl.constexpr(2 ** 63 - 1)


@triton.jit
def pack_argmax(bmax, barg, nan):
    """int64 key whose maximum over a row's blocks is the row's greedy answer: the value first
    (order-preserving bits, offset to be non-negative: zero-filled slots are below every key),
    then the lowest id; a block holding a NaN gives the largest key."""
    hi = (f32_key(bmax).to(tl.int64) + 2147483648) << 31
    return tl.where(nan, _NAN_KEY, hi | (2147483647 - barg).to(tl.int64))


@triton.jit
def unpack_token(key):
    """The token of a packed row maximum; 0 for a degenerate row (a NaN, or a maximum that is
    not finite: all -inf, or +inf present), as argmax_tokens defines."""
    v = key_f32((key >> 31) - 2147483648)
    ok = (key != _NAN_KEY) & (v > float("-inf")) & (v < float("inf"))
    return tl.where(ok, 2147483647 - (key & 2147483647), 0)


@triton.jit
def unpack_value(key):
    """The value of a packed row maximum (NaN for a row holding a NaN)."""
    v = key_f32((key >> 31) - 2147483648)
    return tl.where(key != _NAN_KEY, v, float("nan"))


@triton.jit
def lane_argmax_update(best_v, id_v, s, offs):
    """Per-lane running argmax: a lane takes a later token only if strictly greater, so it keeps
    its lowest id on ties (no cross-thread work per tile)."""
    upd = s > best_v
    return tl.where(upd, s, best_v), tl.where(upd, offs, id_v)


@triton.jit
def lane_argmax_finish(best_v, id_v):
    """(max, lowest id reaching it) over the lanes; all -inf -> (-inf, lowest id held: 0 when
    no lane ever updated)."""
    best = tl.max(best_v, axis=0)
    return best, tl.min(tl.where(best_v == best, id_v, 2147483647), axis=0)


@triton.jit
def store_hist(hist_ptr, o, cnt, mass, NB: tl.constexpr):
    """A program's histogram at hist[o : o + 2 NB]: counts, then the masses' fp32 bits."""
    idx = tl.arange(0, NB)
    tl.store(hist_ptr + o + idx, cnt)
    tl.store(hist_ptr + o + NB + idx, mass.to(tl.int32, bitcast=True))


@triton.jit
def sum_hists(hist_ptr, o, C, NB: tl.constexpr, C_P2: tl.constexpr):
    """(counts, masses) summed over the C program histograms from hist[o] on, in a fixed order (read
    past L1: other programs wrote them). Up to 1024 / NB programs' histograms (64 at the default
    16 bins) are requested at once, in slabs beyond that (plan.chunk, plan.hist_bins), so the
    registers stay bounded. A loop over the C = 16-64 programs waited on one round trip each: 23
    us per call at B = 1 on the H200."""
    SLAB: tl.constexpr = min(C_P2, max(1024 // NB, 1))
    cc = tl.arange(0, SLAB)
    idx = tl.arange(0, NB)
    tot = tl.zeros((NB,), tl.int32)
    tm = tl.zeros((NB,), tl.float32)
    for c0 in range(0, C, SLAB):
        ptrs = hist_ptr + o + (c0 + cc)[:, None] * (2 * NB) + idx[None, :]
        ok = (c0 + cc < C)[:, None]
        tot += tl.sum(tl.load(ptrs, mask=ok, other=0, cache_modifier=".cg"), axis=0)
        tm += tl.sum(tl.load(ptrs + NB, mask=ok, other=0, cache_modifier=".cg").to(
            tl.float32, bitcast=True), axis=0)
    return tot, tm


@triton.jit
def tile_max(bmax_ptr, b, NBLK, v0, TILE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Max z over tokens [v0, v0 + TILE) from the logits kernel's block maxima: the sampling
    passes skip the noise (and the resample pass the reads) of tiles with nothing kept."""
    NBT: tl.constexpr = 2 * max(TILE // BLOCK_V, 1)     # a power of two >= blocks touched
    blk = v0 // BLOCK_V + tl.arange(0, NBT)
    ok = (blk <= (v0 + TILE - 1) // BLOCK_V) & (blk < NBLK)
    return tl.max(tl.load(bmax_ptr + b * NBLK + blk, mask=ok, other=float("-inf")), axis=0)


# Bisection steps of block_max_floor over HIST_SPAN nats: its bound is within 2^-10 of that
# (0.03 nats) of the tightest the block maxima give
FLOOR_STEPS = tl.constexpr(10)


@triton.jit
def block_max_floor(bm, e, m, Z, top_p):
    """A lower bound on row's top-p threshold tau from its block maxima bm (-inf: none), their
    masses e = exp(bm - m) (0 for -inf), row max m and Z = sum exp(z - m) (fp32, the one tau's
    target uses): v = m - d for the smallest d on a grid of HIST_SPAN / 2^FLOOR_STEPS nats at
    which the blocks whose maximum is >= v hold, in those maxima alone, a mass
    >= top_p * Z (1 + MASS_EPS). Each maximum is a token >= v, so
    mass(z >= v) reaches the target and tau >= v: the threshold search can leave out every token
    below v (on peaked rows, all but a few tiles of the row). -inf when m - HIST_SPAN is no such
    v. The margin covers fp32 sums; resolve() checks the result exactly anyway (a search over
    the tokens >= v that cannot reach the target falls back to the exact scan)."""
    T = top_p * Z * (1.0 + MASS_EPS)
    lo = tl.zeros((), tl.float32)
    hi = tl.zeros((), tl.float32) + HIST_SPAN
    fl = tl.full((), float("-inf"), tl.float32)
    if tl.sum(tl.where(bm >= m - hi, e, 0.0), axis=0) >= T:    # else no floor (flat rows)
        for _ in tl.static_range(FLOOR_STEPS):
            mid = (lo + hi) * 0.5
            reach = tl.sum(tl.where(bm >= m - mid, e, 0.0), axis=0) >= T
            hi = tl.where(reach, mid, hi)
            lo = tl.where(reach, lo, mid)
        fl = m - hi
    return fl


@triton.jit
def live_tiles(live_ptr, bmax_ptr, b, NBLK, lo, hi, floor, m, jhi, STEP: tl.constexpr,
               BLOCK_V: tl.constexpr, NT_P2: tl.constexpr, NB: tl.constexpr):
    """Flags (int32, one per STEP tokens of [lo, hi), at live_ptr) of the spans a row pass must
    read: those whose block maxima (blocks of BLOCK_V tokens) reach both the floor and histogram
    bin jhi below the row max m (d_bin is monotone, so a span whose maximum lies in a later bin
    holds nothing in bins <= jhi; jhi = NB - 1: no ceiling). Decided once per program and read
    back a span or two ahead of the loads they gate: a check in front of every load put a
    dependent load and a reduction there, and the passes waited on them (H200)."""
    BPT: tl.constexpr = 2 * max(STEP // BLOCK_V, 1)     # a power of two >= blocks touched
    ti = tl.arange(0, NT_P2)
    t0 = lo + ti * STEP
    blk = t0[:, None] // BLOCK_V + tl.arange(0, BPT)[None, :]
    okb = (t0[:, None] < hi) & (blk <= (t0[:, None] + STEP - 1) // BLOCK_V) & (blk < NBLK)
    tmx = tl.max(tl.load(bmax_ptr + b * NBLK + blk, mask=okb, other=float("-inf")), axis=1)
    alive = (tmx > float("-inf")) & (tmx >= floor) & (d_bin(tmx, m, NB) <= jhi)
    tl.store(live_ptr + ti, alive.to(tl.int32))
    tl.debug_barrier()          # the flags are read back by other threads


@triton.jit
def row_degenerate(nan, m):
    """A degenerate row, from its statistics: a NaN in it (nan > 0), or a maximum m that is not
    finite (all -inf, or +inf present). Reduce and the rejection plan's bound walk decide it
    alike (the walk's decision must agree with what reduce tells the later passes)."""
    return (nan > 0) | ~((m > float("-inf")) & (m < float("inf")))


@triton.jit
def row_flags(temp_ptr, topk_ptr, topp_ptr, b, V):
    """(greedy, k, top_p, k_on, p_on) of request b: its temperature, top-k and top-p."""
    greedy = is_greedy_t(tl.load(temp_ptr + b).to(tl.float32))
    k = tl.load(topk_ptr + b).to(tl.int64)
    p = tl.load(topp_ptr + b).to(tl.float32)
    k_on = (k > 0) & (k < V)
    p_on = p < 1.0
    return greedy, k, p, k_on, p_on
