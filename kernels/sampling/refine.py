"""Refinement of an overflowing bracket (radix-select style, exact): row_refine_kernel.

Near-flat rows (top-p 0.95 over a flat-ish distribution) put more than CAP tokens in select's
bracket (one 2-nat bin holds ~10^4 tokens at the Flash vocabulary). Select then records the
bracket's exact key range [klo, khi] (candidates are exactly the finite tokens with key in it),
the exact mass / count above it (rowa), and spills the bracket's z into its chunk's spill
region (CHUNK slots a chunk program: it cannot overflow). Each refine pass reads only the spill
regions -- a tenth of the row on near-flat rows, less on peaked ones:
  HIST    (state 1): the exact mass / count above khi and, for NB fp32 edges splitting the
          bracket's value range evenly, the count and mass above each edge; the last program
          narrows [klo, khi] to the edge interval(s) holding tau (~NB-fold a pass);
  GATHER  (state 2): once <= CAP tokens (or one key) remain, gathers and resolves them as
          select does.
Edges are explicit fp32 values, so an interval is exactly a key range (also across zero).
Row state (rst): [state (0 done, 1 HIST, 2 GATHER), klo, khi, tokens in select's bracket].
Anything resolve() cannot decide, or a row still open after the last pass, takes the exact scan.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_compile.kernels.sampling.device import (
    MASS_EPS, f32_key, fixed_mass, fixed_of, gather_candidates, key_f32, lane_hist_add, row_flags,
    row_t, store_hist, sum_hists)
from dspark_compile.kernels.sampling.row_passes import for_each_item
from dspark_compile.kernels.sampling.thresholds import (
    key_extent, resolve_candidates, scan_threshold, store_threshold, sum_above)
from dspark_compile.kernels.tl_helpers import pdl_enter, pdl_release


@triton.jit
def refine_edges(klo, khi, NB: tl.constexpr):
    """NB descending fp32 edges splitting [key_f32(klo), key_f32(khi)] into even intervals
    (interval i: t[i] < z <= t[i - 1]); the last edge is -inf, so it takes the rest."""
    zlo = key_f32(klo)
    zhi = key_f32(khi)
    i = tl.arange(0, NB)
    w = zhi / NB - zlo / NB                     # no overflow for any finite pair
    t = zhi - (i + 1).to(tl.float32) * w
    return tl.where(i == NB - 1, float("-inf"), t)


@triton.jit
def edge_bracket(cg, mg, t, klo, khi, am, ac, Zf, k, top_p, K_ON, P_ON,
                 NB: tl.constexpr, SCALE: tl.constexpr):
    """(klo', khi', n') from the bracket tokens' counts cg [NB] and fp32 masses mg [NB] (units of
    exp(z - max)) above each edge t [NB], and the exact fixed mass am / count ac of the tokens
    above khi. Same logic as bracket(), on cumulative sums and in fixed-point units (a token's
    fixed mass is floor(e * SCALE): up to one unit below e * SCALE). Without top-k the target is
    top_p times the whole row's mass Zf (the edges only cover the bracket)."""
    i = tl.arange(0, NB)
    msc = mg.to(tl.float64) * SCALE
    A = am.to(tl.float64)
    CH = A + msc * (1.0 + MASS_EPS)
    CL = A + tl.maximum(msc * (1.0 - MASS_EPS) - cg.to(tl.float64), 0.0)
    cc = ac + cg.to(tl.int64)
    ik = tl.minimum(tl.sum((cc < k).to(tl.int32), axis=0), NB - 1)
    zrow = Zf.to(tl.float64) * SCALE
    zk_lo = tl.where(K_ON, tl.max(tl.where(i < ik, CL, A), axis=0), zrow * (1.0 - MASS_EPS))
    zk_hi = tl.where(K_ON, tl.max(tl.where(i <= ik, CH, A), axis=0), zrow * (1.0 + MASS_EPS))
    p = top_p.to(tl.float64)
    t_lo = tl.maximum(zk_lo * p, 1.0)
    t_hi = tl.maximum(zk_hi * p, 1.0)
    ip_min = tl.minimum(tl.sum((CH < t_lo).to(tl.int32), axis=0), NB - 1)
    ip_max = tl.minimum(tl.sum((CL < t_hi).to(tl.int32), axis=0), NB - 1)
    ip_min = tl.where(K_ON, tl.minimum(ip_min, ik), ip_min)
    jlo = tl.where(P_ON, ip_min, ik)
    jhi = tl.where(K_ON, ik, ip_max)
    below = tl.sum(tl.where(i == jlo - 1, cg, 0), axis=0)          # 0 when jlo == 0
    n = tl.sum(tl.where(i == jhi, cg, 0), axis=0) - below
    t_top = tl.max(tl.where(i == jlo - 1, t, float("-inf")), axis=0)
    t_bot = tl.max(tl.where(i == jhi, t, float("-inf")), axis=0)
    nkhi = tl.where(jlo == 0, khi, f32_key(t_top).to(tl.int64))
    nklo = tl.where(jhi == NB - 1, klo, f32_key(t_bot).to(tl.int64) + 1)
    return nklo, nkhi, n.to(tl.int64)


@triton.jit
def resolve_one_key(key, n, am, ac, m, Zf, k, top_p, K_ON, P_ON, SCALE: tl.constexpr):
    """resolve() for n > CAP candidates that all share one key (exact ties)."""
    z = key_f32(key)
    zk = am + n * fixed_mass(z, m, SCALE)
    ok = n > 0
    if K_ON:
        ok = ok & (ac < k) & (ac + n >= k)
    if P_ON:
        T = tl.where(K_ON, zk.to(tl.float64), Zf.to(tl.float64) * SCALE) * top_p.to(tl.float64)
        T = tl.maximum(T, 1.0)
        ok = ok & (am.to(tl.float64) < T) & (zk.to(tl.float64) >= T)
    return z, zk, ok


@triton.jit
def _refine_partials(b, c, state, klo, khi, m, te, spill_ptr, spn_ptr, above_m_ptr, above_c_ptr,
                     hist_ptr, kext_ptr, ckey_ptr, cmass_ptr, ccount_ptr, C, CHUNK,
                     TILE: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
                     SCALE: tl.constexpr, PDL: tl.constexpr):
    """One pass over chunk c's spill region (the select bracket's tokens of its chunk: every
    token of the current bracket, and those the earlier passes narrowed away): the exact fixed
    mass / count above khi; in HIST state the edge histogram and the bracket's actual key
    range, in GATHER state the candidates gathered. Stores this program's partials."""
    pc = (b * C + c).to(tl.int64)
    n_c = tl.load(spn_ptr + pc)
    src = spill_ptr + pc * CHUNK
    ar = tl.arange(0, TILE)
    # per-lane partials over the region, reduced once at the end (no per-tile barriers)
    am_v = tl.zeros((TILE,), tl.int64)                 # exact fixed mass above khi
    ac_v = tl.zeros((TILE,), tl.int32)
    kmin_v = tl.full((TILE,), 2147483647, tl.int32)    # actual key range inside the bracket
    kmax_v = tl.full((TILE,), -2147483648, tl.int32)
    cg2 = tl.zeros((TILE, NB), tl.int32)               # bracket tokens above each edge
    mg2 = tl.zeros((TILE, NB), tl.float32)
    zn = tl.load(src + ar, mask=ar < n_c, other=float("-inf"))
    for v0 in range(0, n_c, TILE):
        z = zn
        zn = tl.load(src + v0 + TILE + ar, mask=v0 + TILE + ar < n_c, other=float("-inf"))
        fin = z > float("-inf")
        key = f32_key(z)
        above = fin & (key > khi)
        inb = fin & (key >= klo) & (key <= khi)
        e = tl.where(fin, tl.exp(z - m), 0.0)
        w = fixed_of(e, SCALE)
        am_v += tl.where(above, w, 0)
        ac_v += above.to(tl.int32)
        if state == 1:
            hit = (z[:, None] > te[None, :]) & inb[:, None]
            cg2, mg2 = lane_hist_add(cg2, mg2, hit, e)
            kmin_v = tl.minimum(kmin_v, tl.where(inb, key, 2147483647))
            kmax_v = tl.maximum(kmax_v, tl.where(inb, key, -2147483648))
        else:
            gather_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, inb, key, w, CAP)
    pdl_release(PDL)
    tl.store(above_m_ptr + b * C + c, tl.sum(am_v, axis=0))
    tl.store(above_c_ptr + b * C + c, tl.sum(ac_v.to(tl.int64), axis=0))
    if state == 1:
        store_hist(hist_ptr, (b * C + c) * 2 * NB, tl.sum(cg2, axis=0), tl.sum(mg2, axis=0),
                   NB)
        tl.store(kext_ptr + (b * C + c) * 2, tl.min(kmin_v, axis=0))
        tl.store(kext_ptr + (b * C + c) * 2 + 1, tl.max(kmax_v, axis=0))


@triton.jit
def _refine_finish(b, state, klo, khi, m, Z, t, te, k, p, k_on, p_on, zrow, V, C, LAST,
                   above_m_ptr, above_c_ptr, rowa_ptr, hist_ptr, kext_ptr, ckey_ptr, cmass_ptr,
                   ccount_ptr, rst_ptr, rowf_ptr, TILE: tl.constexpr, NB: tl.constexpr,
                   CAP: tl.constexpr, SCALE: tl.constexpr, C_P2: tl.constexpr,
                   FEW: tl.constexpr, SCAN: tl.constexpr):
    """The row's last program: sums the partials; in HIST state narrows the bracket to the
    edge interval(s) holding tau (resolving it at once when the bracket is one key), in GATHER
    state resolves the gathered candidates; the exact scan where neither decides. A finished
    row stores its threshold and leaves state 0."""
    am, ac = sum_above(above_m_ptr, above_c_ptr, b, C, C_P2)
    am += tl.load(rowa_ptr + b * 2)          # the tokens above the select bracket
    ac += tl.load(rowa_ptr + b * 2 + 1)
    finish = (state != 1) | (LAST != 0)
    tau = tl.zeros((), tl.float32)
    kept = tl.zeros((), tl.int64)
    if state == 1:
        tot, tm = sum_hists(hist_ptr, b * C * 2 * NB, C, NB, C_P2)
        kmin, kmax = key_extent(kext_ptr, b, C, C_P2)
        nklo, nkhi, n = edge_bracket(tot, tm, te, klo, khi, am, ac, Z, k, p, k_on, p_on,
                                     NB, SCALE)
        # no token of the bracket lies outside [kmin, kmax]: the same set, fewer keys
        nklo = tl.maximum(nklo, kmin)
        nkhi = tl.minimum(nkhi, kmax)
        tl.store(rst_ptr + b * 4 + 1, nklo.to(tl.int32))
        tl.store(rst_ptr + b * 4 + 2, nkhi.to(tl.int32))
        tl.store(rst_ptr + b * 4, tl.where((n <= CAP) | (nklo == nkhi), 2, 1))
        if kmin == kmax:
            # the whole bracket is one value (exact ties): resolved here, exactly
            finish = kmin == kmax
            tau, kept, ok = resolve_one_key(kmin, tl.max(tot, axis=0).to(tl.int64), am,
                                            ac, m, Z, k, p, k_on, p_on, SCALE)
            if ~ok:
                tau, kept = scan_threshold(zrow, V, m, t, Z, k, p, k_on, p_on, TILE, SCALE,
                                           SCAN)
        elif LAST != 0:
            tau, kept = scan_threshold(zrow, V, m, t, Z, k, p, k_on, p_on, TILE,
                                       SCALE, SCAN)
    else:
        tau, kept, ok, n = resolve_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, am, ac,
                                              Z, k, p, k_on, p_on, CAP, SCALE, FEW)
        if n > CAP:
            tau, kept, ok = resolve_one_key(klo, n, am, ac, m, Z, k, p, k_on, p_on,
                                            SCALE)
            ok = ok & (klo == khi)
        if ~ok:
            tau, kept = scan_threshold(zrow, V, m, t, Z, k, p, k_on, p_on, TILE,
                                       SCALE, SCAN)
    if finish:
        tl.store(rst_ptr + b * 4, 0)
        store_threshold(rowf_ptr, b, tau, kept, SCALE)


@triton.jit
def _refine_item(b, c, args, K: tl.constexpr):
    """row_refine_kernel's work item: chunk c of row b (its spill region)."""
    (temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, rst_ptr, above_m_ptr, above_c_ptr,
     rowa_ptr, hist_ptr, kext_ptr, spill_ptr, spn_ptr, ckey_ptr, cmass_ptr, ccount_ptr, done_ptr,
     V, C, CHUNK, stride_zb, RPR, LAST) = args
    TILE: tl.constexpr = K[0]
    NB: tl.constexpr = K[1]
    CAP: tl.constexpr = K[2]
    SCALE: tl.constexpr = K[3]
    C_P2: tl.constexpr = K[4]
    FEW: tl.constexpr = K[5]
    SCAN: tl.constexpr = K[6]
    SCALED: tl.constexpr = K[7]
    PDL: tl.constexpr = K[8]
    state = tl.load(rst_ptr + b * 4)
    if state != 0:
        _, k, p, _, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b // RPR, V)
        k_on = tl.load(rowi_ptr + b * 4 + 2) != 0
        klo = tl.load(rst_ptr + b * 4 + 1).to(tl.int64)
        khi = tl.load(rst_ptr + b * 4 + 2).to(tl.int64)
        m = tl.load(rowf_ptr + b * 4)
        Z = tl.load(rowf_ptr + b * 4 + 1)
        zrow = z_ptr + b.to(tl.int64) * stride_zb
        t = row_t(temp_ptr, b // RPR, SCALED)
        te = refine_edges(klo, khi, NB)
        _refine_partials(b, c, state, klo, khi, m, te, spill_ptr, spn_ptr, above_m_ptr,
                         above_c_ptr, hist_ptr, kext_ptr, ckey_ptr, cmass_ptr, ccount_ptr, C,
                         CHUNK, TILE, NB, CAP, SCALE, PDL)
        tl.debug_barrier()
        if tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == C - 1:
            _refine_finish(b, state, klo, khi, m, Z, t, te, k, p, k_on, p_on, zrow, V, C, LAST,
                           above_m_ptr, above_c_ptr, rowa_ptr, hist_ptr, kext_ptr, ckey_ptr,
                           cmass_ptr, ccount_ptr, rst_ptr, rowf_ptr, TILE, NB, CAP, SCALE, C_P2,
                           FEW, SCAN)


@triton.jit
def row_refine_kernel(temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, rst_ptr,
                      above_m_ptr, above_c_ptr, rowa_ptr, hist_ptr, kext_ptr, spill_ptr, spn_ptr,
                      ckey_ptr, cmass_ptr, ccount_ptr, done_ptr, need_ptr, V, C, CHUNK,
                      stride_zb, z_off, ccount_off, done_off, RPR, ROWS, LAST,
                      TILE: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
                      SCALE: tl.constexpr, C_P2: tl.constexpr, FEW: tl.constexpr,
                      SCAN: tl.constexpr = True, GATE: tl.constexpr = False,
                      SCALED: tl.constexpr = False, ROWS_P2: tl.constexpr = 1,
                      PERSIST: tl.constexpr = False,
                      PDL: tl.constexpr = 0):
    # Work items, GATE, PERSIST: as in row_select_kernel (rows select resolved or skipped have
    # state 0).
    # SCALED: as in row_reduce_kernel (only the scan fallback reads the row; the spill regions
    # hold scaled z)
    pdl_enter(PDL)
    z_ptr += z_off
    ccount_ptr += ccount_off
    done_ptr += done_off
    for_each_item(_refine_item, (
        temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, rst_ptr, above_m_ptr,
        above_c_ptr, rowa_ptr, hist_ptr, kext_ptr, spill_ptr, spn_ptr, ckey_ptr, cmass_ptr,
        ccount_ptr, done_ptr, V, C, CHUNK, stride_zb, RPR, LAST),
        (TILE, NB, CAP, SCALE, C_P2, FEW, SCAN, SCALED, PDL),
        need_ptr, ROWS, C, GATE, PERSIST, ROWS_P2)
