"""The row passes shared by the fused samplers: reduce and select (refine: refine.py).

A row is one distribution over the vocabulary: its z (scaled logits, or with SCALED the logits
themselves, divided by the row's temperature where each tile is used: scale_z) and per-block
statistics of z from the kernel that read it (max, lowest-id argmax, sum exp(z - max), NaN flag
over BLOCK_V tokens). A pass's work items are (row, chunk) pairs over C chunks of a row
(for_each_item); whoever takes a row's last atomic ticket (acq_rel, after a CTA barrier;
partials read past L1) finishes the row, in a fixed order: no result depends on which item
finished first. Sampling parameters are per request: row // RPR.

    reduce  row max, Z, greedy rows' argmax; for searched rows the chunk's mass histogram
            (2 tiles a step, the next two in flight) and, last ticket, the bracket of tau
    select  the exact mass above the bracket and its candidates (or, > CAP, spilled tokens);
            last ticket: tau and the kept mass (thresholds.resolve)
Bytes: reduce and select read a searched row's z once each (4 V bytes); rows they skip cost
their flag (and chunk 0 of a greedy row the block statistics, 16 B a block).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_compile.kernels.sampling.device import (
    block_max_floor, d_bin, f32_key, fixed_mass, gather_candidates, hist_add_z, live_tiles,
    row_degenerate, row_flags, row_t, scale_z, spill, store_hist, sum_hists)
from dspark_compile.kernels.sampling.thresholds import (
    bracket, key_extent, resolve_candidates, scan_threshold, store_threshold, sum_above)
from dspark_compile.kernels.tl_helpers import pdl_enter, pdl_release


# ----------------------------------------------------------------------------------------------
# Which rows a row pass works on
# ----------------------------------------------------------------------------------------------
# A gated pass works on the rows a need vector flags (the rejection plan's bound walk, the
# Markov candidate plan's pick). Launched one program per (row, chunk) item, most programs may
# only read their row's flag and exit: at B = 64 with no row flagged the Markov plan's gated
# launches took ~34 us a step (benchmarks/results/README.md, PERSIST_FROM_ROWS, abbef14). A
# persistent pass (PERSIST) instead runs a grid of about one wave (row_launch.gated_grid) whose
# programs take the flagged rows' items in turn, each ranking the flagged rows itself (a prefix
# sum over the flags). The loop costs registers (plan.GATED_PER_SM), so a pass over many rows
# (rejection's, about two a request) keeps one program per item (plan.rejection_persistent).

@triton.jit
def row_list(need_ptr, ROWS, ROWS_P2: tl.constexpr):
    """(count, rank): the rows r < ROWS (ROWS_P2 >= ROWS) whose need_ptr[r] is nonzero (the
    rejection plan's bound walk marks the rows whose exact threshold its consumers read; the
    Markov candidate plan's pick, the rows whose candidate it could not keep), and
    rank[r] = r's index among them, in row order (-1 for the others)."""
    o = tl.arange(0, ROWS_P2)
    f = (tl.load(need_ptr + o, mask=o < ROWS, other=0) != 0).to(tl.int32)
    return tl.sum(f, axis=0), tl.where(f != 0, tl.cumsum(f, axis=0) - 1, -1)


@triton.jit
def list_row(rank, i, ROWS_P2: tl.constexpr):
    """Row number i of row_list's rows."""
    return tl.sum(tl.where(rank == i, tl.arange(0, ROWS_P2), 0), axis=0)


@triton.jit
def row_needed(need_ptr, b, GATE: tl.constexpr):
    """Whether row b is worked on by a row pass launched one program per (row, chunk): always
    without GATE; with it, where need_ptr[b] != 0."""
    if GATE:
        return tl.load(need_ptr + b) != 0
    return tl.full((), 1, tl.int1)




@triton.jit
def for_each_item(ITEM: tl.constexpr, args, K: tl.constexpr, need_ptr, ROWS, C,
                  GATE: tl.constexpr, PERSIST: tl.constexpr, ROWS_P2: tl.constexpr):
    """ITEM(b, c, args, K) for this program's work items (row b, chunk c): persistent (PERSIST,
    a grid of any size), the items of the rows among ROWS (ROWS_P2 >= ROWS) that need_ptr flags,
    in turn; else grid (rows, C), one item a program (GATE: only if need_ptr flags its row).
    args: the runtime values, K: the constexprs ITEM reads (a tuple each)."""
    if PERSIST:
        tl.static_assert(GATE, "a persistent pass takes the rows need_ptr flags")
        count, rank = row_list(need_ptr, ROWS, ROWS_P2)
        for item in range(tl.program_id(0), count * C, tl.num_programs(0)):
            ITEM(list_row(rank, item // C, ROWS_P2), item % C, args, K)
    else:
        b = tl.program_id(0)
        if row_needed(need_ptr, b, GATE):
            ITEM(b, tl.program_id(1), args, K)


# ----------------------------------------------------------------------------------------------
# reduce
# ----------------------------------------------------------------------------------------------

@triton.jit
def _reduce_stats(b, c, search, need_z, greedy, bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr,
                  rowf_ptr, rowi_ptr, drafts_ptr, prev_ptr, NBLK, stride_db,
                  NBLK_P2: tl.constexpr, ZIN: tl.constexpr):
    """Row b's (max m, degenerate, block maxima bm, their exp(bm - m) e, Z) from its block
    statistics; chunk 0 stores m, Z, the degenerate flag and a greedy row's token. Z's block
    sums are requested with the maxima, not after them (a round trip less)."""
    o = tl.arange(0, NBLK_P2)
    om = o < NBLK
    bm = tl.load(bmax_ptr + b * NBLK + o, mask=om, other=float("-inf"))
    bs = tl.load(bsum_ptr + b * NBLK + o, mask=om & need_z, other=0.0)
    m = tl.max(bm, axis=0)
    nan = tl.max(tl.load(bnan_ptr + b * NBLK + o, mask=om, other=0), axis=0)
    deg = row_degenerate(nan, m)
    e = tl.zeros((NBLK_P2,), tl.float32)        # exp(block max - m)
    Z = tl.zeros((), tl.float32)
    if need_z:
        e = tl.where(bm > float("-inf"), tl.exp(bm - m), 0.0)
        if ZIN:
            Z = tl.load(rowf_ptr + b * 4 + 1)
        else:
            Z = tl.sum(bs * e, axis=0)
    if c == 0:      # Z and the argmax: only the program that stores them reads their stats
        ba = tl.load(barg_ptr + b * NBLK + o, mask=om, other=2147483647)
        arg = tl.min(tl.where(bm == m, ba, 2147483647), axis=0)
        tl.store(rowf_ptr + b * 4, m)
        tl.store(rowf_ptr + b * 4 + 1, Z)
        tl.store(rowi_ptr + b * 4 + 3, deg.to(tl.int32))
        if greedy:
            tok = tl.where(deg, 0, arg).to(tl.int64)
            tl.store(drafts_ptr + b * stride_db, tok)
            tl.store(prev_ptr + b, tok)
    return m, deg, bm, e, Z


@triton.jit
def _reduce_hist(na, nb2, zrow, lo, hi, t, fl, m, b, c, C, bmax_ptr, live_ptr, NBLK,
                 TILE: tl.constexpr, NB: tl.constexpr, BLOCK_V: tl.constexpr,
                 NT_P2: tl.constexpr, SCALED: tl.constexpr):
    """Per-lane [TILE, NB] histograms (counts, masses) of the chunk's z in [lo, hi), two tiles a
    step (na, nb2: the first two, already requested), the next two loaded before these are
    binned. With a floor fl > -inf, tokens below it are left out and the spans of 2 TILE tokens
    whose block maxima do not reach it are neither read nor binned (live_tiles)."""
    ar = tl.arange(0, TILE)
    cnt2 = tl.zeros((TILE, NB), tl.int32)
    ms2 = tl.zeros((TILE, NB), tl.float32)
    if fl > float("-inf"):
        lrow = live_ptr + (b * C + c).to(tl.int64) * NT_P2
        live_tiles(lrow, bmax_ptr, b, NBLK, lo, hi, fl, m, NB - 1, 2 * TILE, BLOCK_V,
                   NT_P2, NB)
        one = tl.full((), 1, tl.int32)
        live = tl.load(lrow)        # span 0: loaded above, before fl was known
        ln = tl.load(lrow + one, mask=one < NT_P2, other=0)
        for v0 in range(lo, hi, 2 * TILE):
            za = scale_z(na, t, SCALED)
            zb = scale_z(nb2, t, SCALED)
            cur = live
            live = ln
            nx = v0 + 2 * TILE + ar
            na = tl.load(zrow + nx, mask=(nx < hi) & (ln != 0), other=float("-inf"))
            nb2 = tl.load(zrow + nx + TILE, mask=(nx + TILE < hi) & (ln != 0),
                          other=float("-inf"))
            t2 = (v0 - lo) // (2 * TILE) + 2
            ln = tl.load(lrow + t2, mask=t2 < NT_P2, other=0)
            if cur != 0:
                # tokens below the floor are left out (select leaves them out too)
                za = tl.where(za >= fl, za, float("-inf"))
                zb = tl.where(zb >= fl, zb, float("-inf"))
                cnt2, ms2 = hist_add_z(cnt2, ms2, za, m, NB)
                cnt2, ms2 = hist_add_z(cnt2, ms2, zb, m, NB)
    else:
        for v0 in range(lo, hi, 2 * TILE):
            za = scale_z(na, t, SCALED)
            zb = scale_z(nb2, t, SCALED)
            nx = v0 + 2 * TILE + ar
            na = tl.load(zrow + nx, mask=nx < hi, other=float("-inf"))
            nb2 = tl.load(zrow + nx + TILE, mask=nx + TILE < hi, other=float("-inf"))
            cnt2, ms2 = hist_add_z(cnt2, ms2, za, m, NB)
            cnt2, ms2 = hist_add_z(cnt2, ms2, zb, m, NB)
    return cnt2, ms2


@triton.jit
def _reduce_bracket(b, C, k, p, k_on, p_on, fl, Z, hist_ptr, rst_ptr, rowi_ptr,
                    NB: tl.constexpr, C_P2: tl.constexpr):
    """The row's last ticket: the summed histogram's bracket [jlo, jhi] of tau and its exact
    token count (select gathers only what fits CAP)."""
    tot, tm = sum_hists(hist_ptr, b * C * 2 * NB, C, NB, C_P2)
    # k beyond the finite tokens: keep all
    k_on = k_on & (k <= tl.sum(tot, axis=0))
    # the histogram lacks the tokens below the floor: the row's Z sets the target
    jlo, jhi = bracket(tot, tm, k, p, k_on, p_on, NB, tl.where(fl > float("-inf"), Z, -1.0))
    jj = tl.arange(0, NB)
    n_in = tl.sum(tl.where((jj >= jlo) & (jj <= jhi), tot, 0), axis=0)
    tl.store(rst_ptr + b * 4 + 3, n_in)
    tl.store(rowi_ptr + b * 4, jlo)
    tl.store(rowi_ptr + b * 4 + 1, jhi)
    tl.store(rowi_ptr + b * 4 + 2, k_on.to(tl.int32))


@triton.jit
def _reduce_item(b, c, args, K: tl.constexpr):
    """row_reduce_kernel's work item: chunk c of row b."""
    (bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, temp_ptr, topk_ptr, topp_ptr, z_ptr, drafts_ptr,
     prev_ptr, rowf_ptr, rowi_ptr, hist_ptr, rst_ptr, done_ptr, floor_ptr, live_ptr, V, NBLK, C,
     CHUNK, stride_zb, stride_db, RPR) = args
    NBLK_P2: tl.constexpr = K[0]
    TILE: tl.constexpr = K[1]
    NB: tl.constexpr = K[2]
    C_P2: tl.constexpr = K[3]
    BLOCK_V: tl.constexpr = K[4]
    NT_P2: tl.constexpr = K[5]
    FLOOR: tl.constexpr = K[6]
    SCALED: tl.constexpr = K[7]
    ZIN: tl.constexpr = K[8]
    PDL: tl.constexpr = K[9]
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b // RPR, V)
    # only chunk 0 has work for greedy / unsearched rows: the others skip reading the B x NBLK
    # block statistics (16 B per block: (C - 1) x 16 KB per row and step at the Flash vocabulary)
    search = (~greedy) & (k_on | p_on)
    if (c == 0) | search:
        t = row_t(temp_ptr, b // RPR, SCALED)
        zrow = z_ptr + b.to(tl.int64) * stride_zb
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        ar = tl.arange(0, TILE)
        # the histogram's first two tiles, requested before the row statistics they wait for:
        # binning costs ~4 instructions per token and bin, and without loads in flight behind
        # it the pass waited on memory as long as it computed (benchmarks/row_pass_probe.py)
        hs = tl.where(search, hi, lo)               # nothing to read without a search
        na = tl.load(zrow + lo + ar, mask=lo + ar < hs, other=float("-inf"))
        nb2 = tl.load(zrow + lo + TILE + ar, mask=lo + TILE + ar < hs, other=float("-inf"))
        # Z: chunk 0 stores it; the floor (top-p rows without top-k) needs it in every program
        need_z = c == 0
        if FLOOR:
            need_z = need_z | (search & p_on & (~k_on))
        m, deg, bm, e, Z = _reduce_stats(b, c, search, need_z, greedy, bmax_ptr, barg_ptr,
                                         bsum_ptr, bnan_ptr, rowf_ptr, rowi_ptr, drafts_ptr,
                                         prev_ptr, NBLK, stride_db, NBLK_P2, ZIN)
        if search & (~deg):
            fl = tl.full((), float("-inf"), tl.float32)
            if FLOOR:
                if p_on & (~k_on):
                    fl = block_max_floor(bm, e, m, Z, p)
            if c == 0:                  # select reads it for every row it searches
                tl.store(floor_ptr + b, fl)
            cnt2, ms2 = _reduce_hist(na, nb2, zrow, lo, hi, t, fl, m, b, c, C, bmax_ptr,
                                     live_ptr, NBLK, TILE, NB, BLOCK_V, NT_P2, SCALED)
            pdl_release(PDL)
            cnt = tl.sum(cnt2, axis=0)
            ms = tl.sum(ms2, axis=0)
            store_hist(hist_ptr, (b * C + c) * 2 * NB, cnt, ms, NB)
            tl.debug_barrier()   # every thread's stores happen before the releasing ticket
            if tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == C - 1:
                _reduce_bracket(b, C, k, p, k_on, p_on, fl, Z, hist_ptr, rst_ptr, rowi_ptr, NB,
                                C_P2)


@triton.jit
def row_reduce_kernel(bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, temp_ptr, topk_ptr, topp_ptr,
                      z_ptr, drafts_ptr, prev_ptr, rowf_ptr, rowi_ptr, hist_ptr, rst_ptr, done_ptr,
                      floor_ptr, live_ptr, need_ptr, V, NBLK, C, CHUNK, stride_zb, stride_db, z_off,
                      step, done_off, RPR, ROWS, NBLK_P2: tl.constexpr, TILE: tl.constexpr,
                      NB: tl.constexpr, C_P2: tl.constexpr = 1, BLOCK_V: tl.constexpr = 1,
                      NT_P2: tl.constexpr = 1, FLOOR: tl.constexpr = False,
                      GATE: tl.constexpr = False, SCALED: tl.constexpr = False,
                      ZIN: tl.constexpr = False, ROWS_P2: tl.constexpr = 1,
                      PERSIST: tl.constexpr = False, PDL: tl.constexpr = 0):
    # FLOOR: top-p rows (without top-k) leave out the tokens below block_max_floor, and the
    # spans of 2 TILE tokens that hold none are neither read nor binned; select does the same
    # (the floor goes to floor_ptr[b], which select reads). BLOCK_V: the statistics' blocks.
    # Work items, GATE, PERSIST, ROWS_P2: for_each_item; persistent, a program's pdl_release
    # comes after its first item's main loop, so with PDL 2 the next launch may start while
    # programs still hold items (it waits for this grid's end in pdl_enter all the same).
    # SCALED: z_ptr holds the logits, scaled where each tile is used (the statistics came from
    # the same z). ZIN: Z is read from rowf_ptr[b, 1], where an earlier launch wrote it from the
    # same statistics (the Markov candidate plan's rowstat, whose pick decided with that Z: the
    # threshold search must use its bits, not a sum that may round otherwise).
    pdl_enter(PDL)
    z_ptr += z_off
    drafts_ptr += step
    done_ptr += done_off
    for_each_item(_reduce_item, (
        bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, temp_ptr, topk_ptr, topp_ptr, z_ptr, drafts_ptr,
        prev_ptr, rowf_ptr, rowi_ptr, hist_ptr, rst_ptr, done_ptr, floor_ptr, live_ptr, V, NBLK,
        C, CHUNK, stride_zb, stride_db, RPR),
        (NBLK_P2, TILE, NB, C_P2, BLOCK_V, NT_P2, FLOOR, SCALED, ZIN, PDL),
        need_ptr, ROWS, C, GATE, PERSIST, ROWS_P2)


# ----------------------------------------------------------------------------------------------
# select
# ----------------------------------------------------------------------------------------------

@triton.jit
def _select_tile(z, m, jlo, jhi, nb, b, C, c, CHUNK, am_v, ac_v, kmin_v, kmax_v, n_sp,
                 ccount_ptr, ckey_ptr, cmass_ptr, spill_ptr, fl, NB: tl.constexpr,
                 CAP: tl.constexpr, SCALE: tl.constexpr):
    """One tile of row_select_kernel: the exact mass / count above the bracket into the lane
    partials, the bracket's tokens into the candidates (or, overflowing, the spill region).
    Tokens below the floor fl (reduce's block_max_floor, or -inf) are left out, as reduce's
    histogram left them out."""
    fin = (z > float("-inf")) & (z >= fl)
    j = d_bin(z, m, NB)
    above = fin & (j < jlo)
    cand = fin & (j >= jlo) & (j <= jhi)
    w = fixed_mass(z, m, SCALE)
    am_v += tl.where(above, w, 0)
    ac_v += above.to(tl.int32)
    key = f32_key(z)
    if nb <= CAP:
        gather_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, cand, key, w, CAP)
    else:
        # overflow: refine reads the bracket from this program's spill region (a fraction of
        # the chunk) instead of the row, and needs its key range
        kmin_v = tl.minimum(kmin_v, tl.where(cand, key, 2147483647))
        kmax_v = tl.maximum(kmax_v, tl.where(cand, key, -2147483648))
        n_sp = spill(spill_ptr, b * C + c, CHUNK, n_sp, cand, z)
    return am_v, ac_v, kmin_v, kmax_v, n_sp



@triton.jit
def _select_chunk(zrow, lo, hi, t, m, fl, jlo, jhi, nb, b, c, C, CHUNK, bmax_ptr, live_ptr,
                  ccount_ptr, ckey_ptr, cmass_ptr, spill_ptr, NBLK, TILE: tl.constexpr,
                  NB: tl.constexpr, CAP: tl.constexpr, SCALE: tl.constexpr,
                  BLOCK_V: tl.constexpr, NT_P2: tl.constexpr, SKIP: tl.constexpr,
                  SCALED: tl.constexpr):
    """_select_tile over the chunk [lo, hi), the next tile loaded before this one is used:
    per-lane partials (mass, count above the bracket; key range of the candidates) and the
    tokens spilled. SKIP: tiles wholly below the bracket (most of a peaked row) are neither
    read nor used; their flags (live_tiles) are read one per tile, two ahead."""
    # per-lane partials over the chunk, reduced once at the end (no per-tile barriers)
    am_v = tl.zeros((TILE,), tl.int64)               # exact fixed mass above the bracket
    ac_v = tl.zeros((TILE,), tl.int32)
    kmin_v = tl.full((TILE,), 2147483647, tl.int32)   # key range of the candidates
    kmax_v = tl.full((TILE,), -2147483648, tl.int32)
    n_sp = tl.zeros((), tl.int32)                      # tokens spilled (overflow)
    ar = tl.arange(0, TILE)
    lrow = live_ptr + (b * C + c).to(tl.int64) * NT_P2
    if SKIP:
        live_tiles(lrow, bmax_ptr, b, NBLK, lo, hi, fl, m, jhi, TILE, BLOCK_V, NT_P2, NB)
        one = tl.full((), 1, tl.int32)
        ln = tl.load(lrow)
        lnn = tl.load(lrow + one, mask=one < NT_P2, other=0)
    else:
        ln = tl.full((), 1, tl.int32)
        lnn = tl.full((), 1, tl.int32)
    zn = tl.load(zrow + lo + ar, mask=(lo + ar < hi) & (ln != 0), other=float("-inf"))
    for v0 in range(lo, hi, TILE):
        z = zn
        live = ln
        ln = lnn
        nx = v0 + TILE + ar
        zn = tl.load(zrow + nx, mask=(nx < hi) & (ln != 0), other=float("-inf"))
        if SKIP:
            t2 = (v0 - lo) // TILE + 2
            lnn = tl.load(lrow + t2, mask=t2 < NT_P2, other=0)
        if live != 0:
            am_v, ac_v, kmin_v, kmax_v, n_sp = _select_tile(
                scale_z(z, t, SCALED), m, jlo, jhi, nb, b, C, c, CHUNK, am_v, ac_v, kmin_v,
                kmax_v, n_sp, ccount_ptr, ckey_ptr, cmass_ptr, spill_ptr, fl, NB, CAP, SCALE)
    return am_v, ac_v, kmin_v, kmax_v, n_sp


@triton.jit
def _select_finish(b, C, nb, zrow, V, m, t, Z, k, p, k_on, p_on, rowf_ptr, rowa_ptr, rst_ptr,
                   above_m_ptr, above_c_ptr, kext_ptr, ccount_ptr, ckey_ptr, cmass_ptr,
                   TILE: tl.constexpr, CAP: tl.constexpr, SCALE: tl.constexpr,
                   C_P2: tl.constexpr, FEW: tl.constexpr, SCAN: tl.constexpr):
    """The row's last ticket: tau from the candidates, or (overflow) the refine state."""
    if nb > CAP:
        # overflow: the candidates are exactly the tokens with key in [kmin, kmax];
        # row_refine_kernel narrows that range (and resolves tau)
        kmin, kmax = key_extent(kext_ptr, b, C, C_P2)
        am, ac = sum_above(above_m_ptr, above_c_ptr, b, C, C_P2)
        tl.store(rowa_ptr + b * 2, am)         # refine sees only the spilled tokens
        tl.store(rowa_ptr + b * 2 + 1, ac)
        tl.store(rst_ptr + b * 4 + 1, kmin.to(tl.int32))
        tl.store(rst_ptr + b * 4 + 2, kmax.to(tl.int32))
        tl.store(rst_ptr + b * 4, tl.where(kmin == kmax, 2, 1))
    else:
        am, ac = sum_above(above_m_ptr, above_c_ptr, b, C, C_P2)
        tau, kept, ok, n = resolve_candidates(ccount_ptr, ckey_ptr, cmass_ptr, b, am, ac, Z, k,
                                              p, k_on, p_on, CAP, SCALE, FEW)
        ok = ok & (n == nb)      # every candidate gathered (reduce's count holds)
        if ~ok:
            tau, kept = scan_threshold(zrow, V, m, t, Z, k, p, k_on, p_on, TILE, SCALE, SCAN)
        store_threshold(rowf_ptr, b, tau, kept, SCALE)


@triton.jit
def _select_item(b, c, args, K: tl.constexpr):
    """row_select_kernel's work item: chunk c of row b."""
    (temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, above_m_ptr, above_c_ptr,
     rowa_ptr, ckey_ptr, cmass_ptr, ccount_ptr, done_ptr, kext_ptr, rst_ptr, spill_ptr, spn_ptr,
     bmax_ptr, live_ptr, floor_ptr, V, C, CHUNK, NBLK, stride_zb, RPR) = args
    TILE: tl.constexpr = K[0]
    NB: tl.constexpr = K[1]
    CAP: tl.constexpr = K[2]
    SCALE: tl.constexpr = K[3]
    C_P2: tl.constexpr = K[4]
    BLOCK_V: tl.constexpr = K[5]
    NT_P2: tl.constexpr = K[6]
    SKIP: tl.constexpr = K[7]
    FEW: tl.constexpr = K[8]
    SCAN: tl.constexpr = K[9]
    SCALED: tl.constexpr = K[10]
    PDL: tl.constexpr = K[11]
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b // RPR, V)
    search = (~greedy) & (k_on | p_on)
    deg = tl.load(rowi_ptr + b * 4 + 3, mask=search, other=1) != 0
    if search & (~deg):
        k_on = tl.load(rowi_ptr + b * 4 + 2) != 0
        if (~k_on) & (~p_on):
            # top-k beyond the finite tokens (reduce turned it off) and no top-p: every finite
            # token is kept, so there is nothing to search
            if c == 0:
                tl.store(rowf_ptr + b * 4 + 2, float("-inf"))
                tl.store(rowf_ptr + b * 4 + 3, tl.load(rowf_ptr + b * 4 + 1))
        else:
            jlo = tl.load(rowi_ptr + b * 4)
            jhi = tl.load(rowi_ptr + b * 4 + 1)
            m = tl.load(rowf_ptr + b * 4)
            Z = tl.load(rowf_ptr + b * 4 + 1)
            nb = tl.load(rst_ptr + b * 4 + 3)     # tokens in the bracket (exact, from reduce)
            fl = tl.load(floor_ptr + b)           # reduce's block_max_floor (or -inf)
            t = row_t(temp_ptr, b // RPR, SCALED)
            zrow = z_ptr + b.to(tl.int64) * stride_zb
            lo = c * CHUNK
            hi = tl.minimum(lo + CHUNK, V)
            am_v, ac_v, kmin_v, kmax_v, n_sp = _select_chunk(
                zrow, lo, hi, t, m, fl, jlo, jhi, nb, b, c, C, CHUNK, bmax_ptr, live_ptr,
                ccount_ptr, ckey_ptr, cmass_ptr, spill_ptr, NBLK, TILE, NB, CAP, SCALE, BLOCK_V,
                NT_P2, SKIP, SCALED)
            pdl_release(PDL)
            tl.store(above_m_ptr + b * C + c, tl.sum(am_v, axis=0))
            tl.store(above_c_ptr + b * C + c, tl.sum(ac_v.to(tl.int64), axis=0))
            tl.store(kext_ptr + (b * C + c) * 2, tl.min(kmin_v, axis=0))
            tl.store(kext_ptr + (b * C + c) * 2 + 1, tl.max(kmax_v, axis=0))
            tl.store(spn_ptr + b * C + c, n_sp)
            tl.debug_barrier()
            if tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == C - 1:
                _select_finish(b, C, nb, zrow, V, m, t, Z, k, p, k_on, p_on, rowf_ptr, rowa_ptr,
                               rst_ptr, above_m_ptr, above_c_ptr, kext_ptr, ccount_ptr,
                               ckey_ptr, cmass_ptr, TILE, CAP, SCALE, C_P2, FEW, SCAN)


@triton.jit
def row_select_kernel(temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, above_m_ptr,
                      above_c_ptr, rowa_ptr, ckey_ptr, cmass_ptr, ccount_ptr, done_ptr, kext_ptr,
                      rst_ptr, spill_ptr, spn_ptr, bmax_ptr, live_ptr, floor_ptr, need_ptr, V, C,
                      CHUNK, NBLK, stride_zb, z_off, ccount_off, done_off, RPR, ROWS,
                      TILE: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
                      SCALE: tl.constexpr, C_P2: tl.constexpr, BLOCK_V: tl.constexpr,
                      NT_P2: tl.constexpr, SKIP: tl.constexpr, FEW: tl.constexpr,
                      SCAN: tl.constexpr = True, GATE: tl.constexpr = False,
                      SCALED: tl.constexpr = False, ROWS_P2: tl.constexpr = 1,
                      PERSIST: tl.constexpr = False, PDL: tl.constexpr = 0):
    # SCAN: the scan_threshold test hook. SKIP: tiles whose block maxima (bmax, the statistics
    # pass's blocks of BLOCK_V tokens) lie below the bracket are neither read nor binned.
    # Work items, GATE, PERSIST, SCALED: as in row_reduce_kernel (refine takes the same flags:
    # a row select skips keeps refine state 0)
    pdl_enter(PDL)
    z_ptr += z_off
    ccount_ptr += ccount_off
    done_ptr += done_off
    for_each_item(_select_item, (
        temp_ptr, topk_ptr, topp_ptr, z_ptr, rowf_ptr, rowi_ptr, above_m_ptr, above_c_ptr,
        rowa_ptr, ckey_ptr, cmass_ptr, ccount_ptr, done_ptr, kext_ptr, rst_ptr, spill_ptr,
        spn_ptr, bmax_ptr, live_ptr, floor_ptr, V, C, CHUNK, NBLK, stride_zb, RPR),
        (TILE, NB, CAP, SCALE, C_P2, BLOCK_V, NT_P2, SKIP, FEW, SCAN, SCALED, PDL),
        need_ptr, ROWS, C, GATE, PERSIST, ROWS_P2)
