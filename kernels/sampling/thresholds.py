"""Exact top-k / top-p thresholds without sorting (Triton device helpers of the row passes).

A row's kept set is {z >= tau}; tau is found in steps that each touch the row once:
  1. reduce: a mass histogram of d = max - z (per bin of HIST_SPAN / NB nats the exact token
     count and the fp32 summed mass exp(z - max)), and `bracket`: the bin range that must hold
     tau (usually the one bin where the cumulative mass crosses top_p * Z);
  2. select: the exact fixed-point mass above the bracket, and the bracket's tokens gathered
     as candidates (at most CAP); `resolve` finds tau over their fp32 keys;
  3. overflow (> CAP candidates: near-flat rows) spills the bracket's tokens, and the refine
     passes narrow it ~REFINE_EDGES-fold each (kernels/sampling/refine.py);
  4. what that cannot decide falls back to `resolve_by_scan`: a row scan per bisection probe,
     exact and slow.
Masses that decide anything are exp(z - max) in int64 fixed point (2^SCALE_BITS a unit): their
sums are exact and order-independent, so no result depends on which program finished first.
The fp32 bin masses only place the bracket, and resolve() checks it exactly.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_compile.kernels.sampling.device import MASS_EPS, f32_key, fixed_mass, key_f32, load_z


@triton.jit
def bracket(cnt, mass, k, top_p, K_ON, P_ON, NB: tl.constexpr, Z=-1.0):
    """Bin range [jlo, jhi] that holds tau, from the summed histogram: exact counts cnt [NB] and
    fp32 masses [NB] (any common unit), bins in descending z.

    K_ON / P_ON: top-k / top-p active (K_ON must already mean 0 < k <= number of finite
    tokens). A bin's true mass lies within mass * (1 -+ MASS_EPS); the range covers every bin the
    bounds allow, and resolve() checks it exactly anyway. Z >= 0: the row's total mass in the
    same unit (top-p without top-k), for a histogram that left out the tokens below a floor
    (block_max_floor); otherwise the histogram's total is the row's.
    """
    j = tl.arange(0, NB)
    hi = mass * (1.0 + MASS_EPS)
    lo = mass * (1.0 - MASS_EPS)
    CH = tl.cumsum(hi, axis=0)
    CL = tl.cumsum(lo, axis=0)
    cc = tl.cumsum(cnt, axis=0)
    jk = tl.minimum(tl.sum((cc < k).to(tl.int32), axis=0), NB - 1)
    # the top-k set's mass (the whole row without top-k): bounds
    zk_lo = tl.sum(tl.where(K_ON & (j >= jk), 0.0, lo), axis=0)
    zk_hi = tl.sum(tl.where(K_ON & (j > jk), 0.0, hi), axis=0)
    zk_lo = tl.where(Z >= 0.0, Z * (1.0 - MASS_EPS), zk_lo)
    zk_hi = tl.where(Z >= 0.0, Z * (1.0 + MASS_EPS), zk_hi)
    jp_min = tl.minimum(tl.sum((CH < top_p * zk_lo).to(tl.int32), axis=0), NB - 1)
    jp_max = tl.minimum(tl.sum((CL < top_p * zk_hi).to(tl.int32), axis=0), NB - 1)
    jp_min = tl.where(K_ON, tl.minimum(jp_min, jk), jp_min)
    jlo = tl.where(P_ON, jp_min, jk)
    jhi = tl.where(K_ON, jk, jp_max)
    return jlo, jhi


@triton.jit
def largest_key(keys, w, base, target, lo, hi, COUNT: tl.constexpr):
    """Largest key kappa in [lo, hi) with base + sum(w[keys >= kappa]) >= target (w = 1 when
    COUNT). Assumes it holds at lo; keys int32 (invalid entries below every lo), target fp64."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        sel = keys >= mid.to(tl.int32)
        if COUNT:
            f = base + tl.sum(sel.to(tl.int64), axis=0)
        else:
            f = base + tl.sum(tl.where(sel, w, 0), axis=0)
        if f.to(tl.float64) >= target:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def largest_key_pairwise(keys, w, base, target, lo, hi, COUNT: tl.constexpr):
    """largest_key() for a few candidates, in two reductions instead of up to 32 dependent ones:
    the answer is lo or a candidate's key (base + sum(w[keys >= kappa]) only changes at them),
    so each candidate's sum over the candidates at or above it is computed at once."""
    ge = keys[None, :] >= keys[:, None]                  # [i, j]: key_j >= key_i
    if COUNT:
        f = base + tl.sum(ge.to(tl.int64), axis=1)
    else:
        f = base + tl.sum(tl.where(ge, w[None, :], 0), axis=1)
    kk = keys.to(tl.int64)
    ok = (kk >= lo) & (kk < hi) & (f.to(tl.float64) >= target)
    return tl.maximum(tl.max(tl.where(ok, kk, lo), axis=0), lo)


@triton.jit
def resolve(keys, w, valid, above_m, above_c, Zf, k, top_p, K_ON, P_ON,
            SCALE: tl.constexpr, PAIRWISE: tl.constexpr = False):
    """Exact (tau, kept mass int64, ok) from the candidates and the exact mass/count above them.

    ok is False when the candidates cannot decide (the caller then uses resolve_by_scan).
    PAIRWISE: the thresholds by largest_key_pairwise (few candidates), else by bisection.
    """
    keys = tl.where(valid, keys, -2147483648)       # below the key of -FLT_MAX
    w = tl.where(valid, w, 0)
    n = tl.sum(valid.to(tl.int64), axis=0)
    kmin = tl.min(tl.where(valid, keys, 2147483647), axis=0).to(tl.int64)
    kmax = tl.max(keys, axis=0).to(tl.int64)
    ok = n > 0
    kk = kmin
    if K_ON:
        ok = ok & (above_c < k) & (above_c + n >= k)
        if PAIRWISE:
            kk = largest_key_pairwise(keys, w, above_c, k.to(tl.float64), kmin, kmax + 1, True)
        else:
            kk = largest_key(keys, w, above_c, k.to(tl.float64), kmin, kmax + 1, True)
    zk = above_m + tl.sum(tl.where(keys >= kk.to(tl.int32), w, 0), axis=0)
    kp = kk
    if P_ON:
        T = tl.where(K_ON, zk.to(tl.float64), Zf.to(tl.float64) * SCALE) * top_p.to(tl.float64)
        T = tl.maximum(T, 1.0)                  # top_p <= 0 keeps the top token(s)
        ok = ok & (above_m.to(tl.float64) < T) & (zk.to(tl.float64) >= T)
        if PAIRWISE:
            kp = largest_key_pairwise(keys, w, above_m, T, kk, kmax + 1, False)
        else:
            kp = largest_key(keys, w, above_m, T, kk, kmax + 1, False)
    kept = above_m + tl.sum(tl.where(keys >= kp.to(tl.int32), w, 0), axis=0)
    return key_f32(kp), kept, ok


@triton.jit
def scan_ge(z_ptr, V, m, kappa, t, TILE: tl.constexpr, SCALE: tl.constexpr):
    """(count, fixed mass) of the finite z = row[v] / t with key >= kappa: one row scan."""
    cnt = tl.zeros((), tl.int64)
    mass = tl.zeros((), tl.int64)
    for v0 in range(0, V, TILE):
        offs = v0 + tl.arange(0, TILE)
        z = load_z(z_ptr + offs, offs < V, t, True)
        sel = (z > float("-inf")) & (f32_key(z).to(tl.int64) >= kappa)
        cnt += tl.sum(sel.to(tl.int64), axis=0)
        mass += tl.sum(tl.where(sel, fixed_mass(z, m, SCALE), 0), axis=0)
    return cnt, mass


@triton.jit
def resolve_by_scan(z_ptr, V, m, t, Zf, k, top_p, K_ON, P_ON, TILE: tl.constexpr,
                    SCALE: tl.constexpr):
    """resolve() by bisection over the whole key range, scanning the row for every probe."""
    lo = tl.full((), -2139095040, tl.int64)     # key of -FLT_MAX: every finite z is >= it
    hi = f32_key(m).to(tl.int64) + 1
    if K_ON:
        h = hi
        while h - lo > 1:
            mid = lo + (h - lo) // 2
            c, _ = scan_ge(z_ptr, V, m, mid, t, TILE, SCALE)
            if c >= k:
                lo = mid
            else:
                h = mid
    _, zk = scan_ge(z_ptr, V, m, lo, t, TILE, SCALE)
    if P_ON:
        T = tl.where(K_ON, zk.to(tl.float64), Zf.to(tl.float64) * SCALE) * top_p.to(tl.float64)
        T = tl.maximum(T, 1.0)
        h = hi
        while h - lo > 1:
            mid = lo + (h - lo) // 2
            _, s = scan_ge(z_ptr, V, m, mid, t, TILE, SCALE)
            if s.to(tl.float64) >= T:
                lo = mid
            else:
                h = mid
    _, kept = scan_ge(z_ptr, V, m, lo, t, TILE, SCALE)
    return key_f32(lo), kept


@triton.jit
def scan_threshold(zrow, V, m, t, Zf, k, top_p, K_ON, P_ON, TILE: tl.constexpr,
                   SCALE: tl.constexpr, SCAN: tl.constexpr):
    """resolve_by_scan for a row the brackets could not decide (row zrow / t); with SCAN False
    (test hook) tau is NaN instead, so a test can prove the bracket/refinement path alone
    resolved its rows."""
    tau, kept = resolve_by_scan(zrow, V, m, t, Zf, k, top_p, K_ON, P_ON, TILE, SCALE)
    if not SCAN:
        tau = tl.full((), float("nan"), tl.float32)
    return tau, kept


@triton.jit
def store_threshold(rowf_ptr, b, tau, kept, SCALE: tl.constexpr):
    """Row b's threshold and kept mass (fixed point -> units of exp(z - max))."""
    tl.store(rowf_ptr + b * 4 + 2, tau)
    tl.store(rowf_ptr + b * 4 + 3, (kept.to(tl.float64) / SCALE).to(tl.float32))


@triton.jit
def sum_above(above_m_ptr, above_c_ptr, b, C, C_P2: tl.constexpr):
    """(fixed mass, count) of the tokens above the bracket, summed over row b's C chunk
    programs (read past L1: other programs wrote them)."""
    co = tl.arange(0, C_P2)
    cm = co < C
    am = tl.sum(tl.load(above_m_ptr + b * C + co, mask=cm, other=0, cache_modifier=".cg"), axis=0)
    ac = tl.sum(tl.load(above_c_ptr + b * C + co, mask=cm, other=0, cache_modifier=".cg"), axis=0)
    return am, ac


@triton.jit
def key_extent(kext_ptr, b, C, C_P2: tl.constexpr):
    """(lowest, highest) key of the bracket's tokens over row b's C chunk programs (int64)."""
    co = tl.arange(0, C_P2)
    cm = co < C
    kmin = tl.min(tl.load(kext_ptr + (b * C + co) * 2, mask=cm, other=2147483647,
                          cache_modifier=".cg"), axis=0)
    kmax = tl.max(tl.load(kext_ptr + (b * C + co) * 2 + 1, mask=cm, other=-2147483648,
                          cache_modifier=".cg"), axis=0)
    return kmin.to(tl.int64), kmax.to(tl.int64)


@triton.jit
def load_candidates(ckey_ptr, cmass_ptr, b, n, CAP: tl.constexpr, LOAD: tl.constexpr):
    """The first LOAD (<= CAP) of row b's n gathered candidates: (keys, fixed masses, valid)."""
    idx = tl.arange(0, LOAD)
    valid = idx < n
    keys = tl.load(ckey_ptr + b * CAP + idx, mask=valid, other=0, cache_modifier=".cg")
    w = tl.load(cmass_ptr + b * CAP + idx, mask=valid, other=0, cache_modifier=".cg")
    return keys, w, valid




@triton.jit
def resolve_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, am, ac, Zf, k, top_p, K_ON, P_ON,
                       CAP: tl.constexpr, SCALE: tl.constexpr, FEW: tl.constexpr):
    """resolve() over row b's gathered candidates: (tau, kept, ok, count; the count may exceed
    CAP, the list holds the first CAP). Up to FEW (<= CAP; plan.FEW_CANDIDATES) candidates
    resolve pairwise: on peaked rows the bracket holds tens of tokens, and bisection's up to 32
    dependent reductions were most of the select pass's critical path."""
    n = tl.atomic_add(ccount_ptr + b, 0, sem="acq_rel").to(tl.int64)
    # (the branches' tensors differ in size, so they must not share names)
    FL: tl.constexpr = max(FEW, 1)          # FEW = 0: only an empty list goes this way
    if n <= FEW:
        fk, fw, fv = load_candidates(ckey_ptr, cmass_ptr, b, n, CAP, FL)
        tau, kept, ok = resolve(fk, fw, fv, am, ac, Zf, k, top_p, K_ON, P_ON, SCALE, True)
    else:
        keys, w, valid = load_candidates(ckey_ptr, cmass_ptr, b, n, CAP, CAP)
        tau, kept, ok = resolve(keys, w, valid, am, ac, Zf, k, top_p, K_ON, P_ON, SCALE, False)
    return tau, kept, ok, n

