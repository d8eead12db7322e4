"""Triton kernels of rejection sampling (launched by kernels/sampling/rejection.py).

Full plan, every row in parallel, the vocabulary split over C programs a row; the draft rows
(the Markov sampler's logits, processed like the target's) take the same passes as the target
rows, in launches of their own:
  stats    x 2 (target, draft rows), grid (rows, blocks): block statistics of z = l / T (z is
           not stored: every later pass scales the logits it reads, scale_z, bit for bit)
  walk     grid (B,): the acceptance tests the statistics decide; flags the target and draft
           rows whose exact threshold is still read (_bound_walk_kernel)
  search   x 2: reduce, select, refine (row_passes.py, refine.py) over the flagged rows; the
           draft rows' beside the target rows' on a side stream (plan.overlap)
  sums     grid (B (N - 1), C), N >= 2: block verification's residual masses S_i (only block
           requests work; _block_sums_kernel)
  accept   grid (B,): the acceptance chain from per-row scalars (block requests: the joint
           decision from the ratios and S_i); a = accepted count, w_a = the residual's weight
  resample grid (B, C): residual / bonus Gumbel-max over row a; the last program writes it.
Greedy plan: _rows_argmax_kernel (each target row read once, packed atomic maxima), then
_greedy_accept_kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_compile.kernels.philox import STREAM_ACCEPT
from dspark_compile.kernels.sampling.device import (
    divisor_t, lane_argmax_finish, lane_argmax_update, load_z, pack_argmax, row_degenerate,
    row_flags, row_t, scale_z, tile_max, tl_uniform, tl_vocab_gumbel, unpack_token)
from dspark_compile.kernels.tl_helpers import pdl_enter, pdl_release

_STREAM_ACCEPT = tl.constexpr(STREAM_ACCEPT)


@triton.jit
def _add_or(s0, f0, s1, f1):
    return s0 + s1, tl.maximum(f0, f1)


@triton.jit
def _rows_stats_kernel(logits_ptr, temp_ptr, bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr,
                       V, NBLK, RPR, stride_lr, BLOCK: tl.constexpr):
    """Grid (rows, blocks): one block's (max, lowest argmax, sum exp(z - max), NaN flag) of
    z = l / T. The pass costs instructions more than bytes (H200, B = 64's 199 MB of target
    rows, benchmarks/stats_probe.py: the loads alone 48 us, the shipped loop of four blocks a
    program 103 us), so per token it does the least: no division at T = 1 (scale_z: bit for bit
    what the later passes compute), the max and its lowest index from one reduction, the sum
    and the NaN flag from another, and one block per program of 2 warps (67 us in the probe;
    4 warps 85 us, 8 warps 127 us). In the op at B = 64: 103 + 87 -> 61 + 61 us for the target
    and draft rows (benchmarks/results/README.md, statistics pass, 73155ea)."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    temp = tl.load(temp_ptr + r // RPR).to(tl.float32)
    t = divisor_t(temp)                             # greedy rows: z = l
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    vm = offs < V
    x = tl.load(logits_ptr + r.to(tl.int64) * stride_lr + offs, mask=vm, other=0.0)
    z = scale_z(x, t, True)
    isnan = (z != z) & vm
    zn = tl.where(isnan | ~vm, float("-inf"), z)
    bmax, barg = tl.max(zn, axis=0, return_indices=True, return_indices_tie_break_left=True)
    e = tl.where(zn > float("-inf"), tl.exp(zn - bmax), 0.0)
    bsum, bnan = tl.reduce((e, isnan.to(tl.int32)), 0, _add_or)   # one reduction
    so = r * NBLK + blk
    tl.store(bmax_ptr + so, bmax)
    tl.store(barg_ptr + so, barg + blk * BLOCK)
    tl.store(bsum_ptr + so, bsum)
    tl.store(bnan_ptr + so, bnan)


@triton.jit
def _rows_argmax_kernel(logits_ptr, packed_ptr, V, CHUNK, stride_lr, TILE: tl.constexpr):
    """Mode "greedy", grid (rows, chunks): the chunk's max / lowest-id argmax / NaN flag as one
    packed key, maxed into the row's slot. Reads each target row once; writes nothing else."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    row = logits_ptr + r.to(tl.int64) * stride_lr
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    ar = tl.arange(0, TILE)
    best_v = tl.full((TILE,), float("-inf"), tl.float32)
    id_v = tl.zeros((TILE,), tl.int32)
    nan_v = tl.zeros((TILE,), tl.int32)
    xn = tl.load(row + lo + ar, mask=lo + ar < hi, other=float("-inf"))
    for v0 in range(lo, hi, TILE):
        x = xn.to(tl.float32)
        offs = v0 + ar
        xn = tl.load(row + offs + TILE, mask=offs + TILE < hi, other=float("-inf"))  # in flight
        isnan = x != x
        nan_v = tl.maximum(nan_v, isnan.to(tl.int32))
        best_v, id_v = lane_argmax_update(best_v, id_v, tl.where(isnan, float("-inf"), x), offs)
    best, bid = lane_argmax_finish(best_v, id_v)
    tl.atomic_max(packed_ptr + r, pack_argmax(best, bid, tl.max(nan_v, axis=0) > 0),
                  sem="relaxed")


@triton.jit
def _greedy_accept_kernel(drafts_ptr, packed_ptr, tokens_ptr, num_ptr, B, N, V, stride_db,
                          stride_tb, BLOCK: tl.constexpr):
    """Mode "greedy", BLOCK requests per program: accept drafts while they equal their row's
    argmax, then that row's argmax (the correction, or the bonus after N accepted)."""
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bm = b < B
    acc = tl.zeros((BLOCK,), tl.int64)
    live = bm
    for i in range(0, N):
        d = tl.load(drafts_ptr + b * stride_db + i, mask=bm, other=-1).to(tl.int64)
        t = unpack_token(tl.load(packed_ptr + b * (N + 1) + i, mask=bm, other=0))
        live = live & (d >= 0) & (d < V) & (d == t)
        acc += live.to(tl.int64)
    last = unpack_token(tl.load(packed_ptr + b * (N + 1) + acc, mask=bm, other=0))
    for j in range(0, N + 1):
        dj = tl.load(drafts_ptr + b * stride_db + tl.minimum(j, N - 1), mask=bm & (j < N),
                     other=-1).to(tl.int64)
        tok = tl.where(j < acc, dj, tl.where(j == acc, last, -1))
        tl.store(tokens_ptr + b * stride_tb + j, tok, mask=bm)
    tl.store(num_ptr + b, acc + 1, mask=bm)


@triton.jit
def _row_p_params(rowf_ptr, rowi_ptr, r, trunc):
    """(m, kept mass, tau, degenerate) of row r after reduce/select."""
    m = tl.load(rowf_ptr + r * 4)
    Zk = tl.load(rowf_ptr + r * 4 + 1)
    deg = tl.load(rowi_ptr + r * 4 + 3) != 0
    tau = tl.full((), float("-inf"), tl.float32)
    if trunc & ~deg:
        tau = tl.load(rowf_ptr + r * 4 + 2)
        Zk = tl.load(rowf_ptr + r * 4 + 3)
    return m, Zk, tau, deg


@triton.jit
def _kept_prob(z, m, Zk, tau, deg):
    """p(token) of a row from its reduce/select parameters and the token's z: what the
    acceptance test and the residual read, for target and draft rows alike."""
    return tl.where((z >= tau) & (z > float("-inf")) & ~deg, tl.math.div_rn(tl.exp(z - m), Zk),
                    0.0)


# The bound walk (plan.bounds, on by default): most acceptance tests need no exact
# threshold, and a row whose threshold nothing reads is not searched. For a sampling row without
# top-k, from the statistics pass alone (row max m, Z = sum exp(z - m), per-block maxima and sums):
# - the kept mass Zk lies in [max(top_p Z, 1), Z]: the kept set reaches top_p Z (resolve()'s
#   target) and always holds the row's top token (mass 1);
# - x is kept iff the mass strictly above z_x is below max(top_p Z, 1 / SCALE) (resolve()'s
#   fixed-point target), and that mass is at least the sum of exp(bmax - m) over the blocks whose
#   maximum lies above z_x (each holds its maximum there; less up to 1 / SCALE per token for the
#   fixed point's floors) and at most the sum of those blocks' whole masses;
# so p(x) = exp(z_x - m) / Zk (0 if x is not kept) is bracketed. The draft distribution q is
# processed like p from the draft logits (their own statistics pass), so q(x) is bracketed the
# same way, and "q(x) > 0 and p(x) >= u q(x)" is often decided either way. Every bound carries a
# relative margin BOUND_EPS, far above the fp32 sums' and the fixed-point masses' error
# (<= 1e-5), and the divisions are correctly rounded (monotone), so a decision never differs
# from the exact one. Per request, in row order: sure accepts continue, the first sure rejection
# stops the walk (that row is resampled), undecided rows are tested exactly later (assuming
# acceptance, the walk goes on). The target and draft rows whose exact threshold is read
# (undecided tests: both; the stop row: the target row, and the draft row of a residual) are
# flagged in `need` / `dneed`; reduce and select skip the others. The acceptance kernel takes
# the walk's stored decisions (recomputing them there could round differently), and greedy and
# top-k requests keep every row (dec 0: exact; a greedy request's draft rows are never read).
BOUND_EPS = tl.constexpr(1e-3)


@triton.jit
def _block_stats(bmax_ptr, bsum_ptr, bnan_ptr, rows, rv, NBLK, NBLK_P2: tl.constexpr):
    """Rows rows[i]' (valid where rv) block statistics as [rows, NBLK_P2] tiles: (maxima, sums,
    NaN flags)."""
    o = tl.arange(0, NBLK_P2)
    so = rows[:, None] * NBLK + o[None, :]
    sm = rv[:, None] & (o < NBLK)[None, :]
    return (tl.load(bmax_ptr + so, mask=sm, other=float("-inf")),
            tl.load(bsum_ptr + so, mask=sm, other=0.0), tl.load(bnan_ptr + so, mask=sm, other=0))


@triton.jit
def _kept_bounds(bm, bs, bn, zx, rv, p, p_on, V, SCALE: tl.constexpr):
    """For a token of z value zx[i] in row i (valid where rv; _block_stats' bm, bs, bn):
    (surely kept, surely not kept -- a degenerate row keeps nothing --, exp(z_x - m), lower
    and upper bound of the kept mass Zk) (see the comment above). Loads nothing: the walk
    requests both sides' tiles before it computes either."""
    m = tl.max(bm, axis=1)
    deg = row_degenerate(tl.max(bn, axis=1), m)
    zx = tl.where(rv & ~deg, zx, float("-inf"))
    mm = tl.where(deg, 0.0, m)
    e = tl.where(bm > float("-inf"), tl.exp(bm - mm[:, None]), 0.0)
    Z = tl.where(rv & ~deg, tl.sum(bs * e, axis=1), 1.0)   # (1: no 0 / 0 in unused lanes)
    above = bm > zx[:, None]
    s_lo = tl.sum(tl.where(above, e, 0.0), axis=1)
    s_hi = tl.sum(tl.where(above, bs * e, 0.0), axis=1)
    T = p * Z
    # membership: sure in / sure out (a row without top-p keeps every finite token)
    fin = zx > float("-inf")
    # (tl.where, not | / &, mixes the row's scalar flag with the vectors)
    inside = fin & tl.where(p_on, (s_hi == 0.0)
                            | (s_hi * (1.0 + BOUND_EPS) < T * (1.0 - BOUND_EPS)), True)
    # (the exact masses are floors of e * SCALE: the mass above loses < 1 / SCALE a token)
    outside = (~fin) | tl.where(p_on, s_lo * (1.0 - BOUND_EPS) >= tl.maximum(
        T * (1.0 + BOUND_EPS), 1.0 / SCALE) + (V + 1.0) / SCALE, False)
    zk_lo = tl.where(p_on, tl.maximum(T, 1.0), Z) * (1.0 - BOUND_EPS)
    zk_hi = Z * (1.0 + BOUND_EPS)
    return inside & ~deg, (outside & ~inside) | deg, tl.exp(zx - mm), zk_lo, zk_hi


@triton.jit
def _bound_walk_kernel(drafts_ptr, z_ptr, bmax_ptr, bsum_ptr, bnan_ptr, dz_ptr, dbmax_ptr,
                       dbsum_ptr, dbnan_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr,
                       verify_ptr, need_ptr, dneed_ptr, dec_ptr, N, V, NBLK, stride_db, stride_zr,
                       stride_dr, N_P2: tl.constexpr, NBLK_P2: tl.constexpr,
                       SCALE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    b = tl.program_id(0)
    N1 = N + 1
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V)
    i = tl.arange(0, N_P2)
    iv = i < N
    r = b * N1 + i                              # target rows
    rd = b * N + i                              # draft rows
    dec = tl.zeros((N_P2,), tl.int32)          # 0 undecided (exact), 1 accept, 2 reject
    # every row's test at once from [rows, blocks] statistics, requested (with the drafts)
    # before anything waits on them, the row flags included (a greedy or top-k request reads
    # them for nothing: ~17 KB): 7.7 -> 8.0 us at B = 1, 9.8 -> 9.0 at B = 64 on the H200
    # (benchmarks/results/README.md, overlap, fdcdb5c)
    d = tl.load(drafts_ptr + b * stride_db + i, mask=iv, other=-1).to(tl.int64)
    pbm, pbs, pbn = _block_stats(bmax_ptr, bsum_ptr, bnan_ptr, r, iv, NBLK, NBLK_P2)
    qbm, qbs, qbn = _block_stats(dbmax_ptr, dbsum_ptr, dbnan_ptr, rd, iv, NBLK, NBLK_P2)
    # block verification reads every row's whole distribution (its residual masses): a block
    # request keeps every target and draft row, like a top-k one
    blk = tl.load(verify_ptr + b) != 0
    if (~greedy) & (~k_on) & (~blk):
        dvalid = (d >= 0) & (d < V)
        xf = tl.where(dvalid, d, 0)
        t = row_t(temp_ptr, b, True)
        pzx = load_z(z_ptr + r.to(tl.int64) * stride_zr + xf, iv, t, True)
        qzx = load_z(dz_ptr + rd.to(tl.int64) * stride_dr + xf, iv, t, True)
        u = tl_uniform(tl.load(seed_ptr + b), tl.zeros((N_P2,), tl.int32),
                       tl.load(pos_ptr + b) + i, _STREAM_ACCEPT)
        pin, pout, pex, pzlo, pzhi = _kept_bounds(pbm, pbs, pbn, pzx, iv, p, p_on, V, SCALE)
        qin, qout, qex, qzlo, qzhi = _kept_bounds(qbm, qbs, qbn, qzx, iv, p, p_on, V, SCALE)
        # q(x) as _accept_kernel computes it (_kept_prob) lies in [q_lo, q_hi] (correctly
        # rounded divisions are monotone in the divisor), u q(x) in [uq_lo, uq_hi]
        q_lo = tl.math.div_rn(qex, qzhi)
        q_hi = tl.math.div_rn(qex, qzlo)
        uq_lo = u * q_lo
        uq_hi = u * q_hi
        q_zero = (~dvalid) | qout | (qin & (q_hi == 0.0))      # q(x) = 0: never accepted
        q_pos = dvalid & qin & (q_lo > 0.0)
        # an exact zero product u q accepts whatever p(x) is
        acc_sure = q_pos & ((uq_hi == 0.0)
                            | (pin & (tl.math.div_rn(pex, pzhi) >= uq_hi * (1.0 + BOUND_EPS))))
        rej_sure = q_zero | (q_pos & (uq_lo > 0.0) & (
            pout | (pin & (tl.math.div_rn(pex, pzlo) < uq_lo * (1.0 - BOUND_EPS)))))
        dec = tl.where(rej_sure, 2, tl.where(acc_sure, 1, 0))
        # the walk: rows after the first sure rejection are never read
        stop = tl.min(tl.where(iv & (dec == 2), i, N), axis=0)
        need = (i <= stop) & ((dec == 0) | (i == stop))
        tl.store(need_ptr + r, need.to(tl.int32), mask=i <= N)
        tl.store(dneed_ptr + rd, need.to(tl.int32), mask=iv)
        tl.store(dec_ptr + r, tl.where(i <= stop, dec, 0), mask=iv)
    else:
        tl.store(need_ptr + r, tl.full((N_P2,), 1, tl.int32), mask=i <= N)
        tl.store(dneed_ptr + rd, tl.full((N_P2,), 1, tl.int32) - greedy.to(tl.int32), mask=iv)
        tl.store(dec_ptr + r, dec, mask=iv)


@triton.jit
def _draft_probs(b, i, drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr, drowi_ptr, t,
                 trunc, N, V, stride_db, stride_zr, stride_dr):
    """(p_i(x), q_i(x), x valid) of request b's draft i (x folded to 0 for the loads): what the
    acceptance test and block verification's ratios read."""
    r = b * (N + 1) + i
    rd = b * N + i
    d = tl.load(drafts_ptr + b * stride_db + i).to(tl.int64)
    dvalid = (d >= 0) & (d < V)
    xf = tl.where(dvalid, d, 0)
    m, Zk, tau, deg = _row_p_params(rowf_ptr, rowi_ptr, r, trunc)
    px = _kept_prob(load_z(z_ptr + r.to(tl.int64) * stride_zr + xf, xf < V, t, True), m, Zk, tau,
                    deg)
    m, Zk, tau, deg = _row_p_params(drowf_ptr, drowi_ptr, rd, trunc)
    qx = _kept_prob(load_z(dz_ptr + rd.to(tl.int64) * stride_dr + xf, xf < V, t, True), m, Zk,
                    tau, deg)
    return px, qx, dvalid


@triton.jit
def _next_weight(w, px, qx, dvalid):
    """Block verification's w_i = min(w_{i-1} p(x) / q(x), 1) (reference.block_weights): 0 for a
    draft out of range or with q(x) = 0; an overflowing quotient is +inf (w -> 1); 0 stays 0."""
    ok = dvalid & (qx > 0.0)
    r = tl.where(ok, tl.math.div_rn(px, tl.where(ok, qx, 1.0)), 0.0)
    return tl.where(w > 0.0, tl.minimum(w * r, 1.0), 0.0)


@triton.jit
def _block_weight(b, i, drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr, drowi_ptr, t,
                  trunc, N, V, stride_db, stride_zr, stride_dr):
    """w_i of request b (drafts 0 .. i - 1), bit for bit as _block_accept's chain computes it."""
    w = tl.full((), 1.0, tl.float32)
    for j in range(0, i):
        px, qx, dvalid = _draft_probs(b, j, drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr,
                                      drowf_ptr, drowi_ptr, t, trunc, N, V, stride_db,
                                      stride_zr, stride_dr)
        w = _next_weight(w, px, qx, dvalid)
    return w


@triton.jit
def _block_sums_kernel(drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr, drowi_ptr,
                       bmax_ptr, temp_ptr, topk_ptr, topp_ptr, verify_ptr, part_ptr, N, V, C,
                       CHUNK, NBLK, stride_db, stride_zr, stride_dr, TILE: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """Grid (B (N - 1), C): chunk c's part of S_i = sum_x max(w_i p_i(x) - q_i(x), 0) for
    draft row i in 1 .. N - 1 of a block request (reference.block_accepts), into
    part[b (N - 1) + i - 1, c]; other requests exit at once. Reads the block rows' target and
    draft logits once each (2 x 4 V bytes a row; tiles where p = 0 skipped: their residual is 0)
    and writes C floats a row."""
    pdl_enter(PDL)
    j = tl.program_id(0)
    c = tl.program_id(1)
    b = j // (N - 1)
    i = j % (N - 1) + 1
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V)
    if (~greedy) & (tl.load(verify_ptr + b) != 0):
        t = row_t(temp_ptr, b, True)
        trunc = k_on | p_on
        w = _block_weight(b, i, drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr,
                          drowi_ptr, t, trunc, N, V, stride_db, stride_zr, stride_dr)
        r = b * (N + 1) + i
        rd = b * N + i
        m, Zk, tau, deg = _row_p_params(rowf_ptr, rowi_ptr, r, trunc)
        qm, qZk, qtau, qdeg = _row_p_params(drowf_ptr, drowi_ptr, rd, trunc)
        zrow = z_ptr + r.to(tl.int64) * stride_zr
        qrow = dz_ptr + rd.to(tl.int64) * stride_dr
        acc = tl.zeros((TILE,), tl.float32)
        for v0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, V), TILE):
            if (tile_max(bmax_ptr, r, NBLK, v0, TILE, BLOCK) >= tau) & ~deg & (w > 0.0):
                offs = v0 + tl.arange(0, TILE)
                vm = offs < V
                pv = _kept_prob(load_z(zrow + offs, vm, t, True), m, Zk, tau, deg)
                qv = _kept_prob(load_z(qrow + offs, vm & ~qdeg, t, True), qm, qZk, qtau, qdeg)
                acc += tl.maximum(w * pv - qv, 0.0)
        pdl_release(PDL)
        tl.store(part_ptr + j * C + c, tl.sum(acc, axis=0))


@triton.jit
def _block_accept(b, drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr, drowi_ptr, t,
                  trunc, seed, sp, part_ptr, N, V, C, stride_db, stride_zr, stride_dr,
                  C_P2: tl.constexpr):
    """Block verification of request b (reference.block_accepts): (tau, w_tau). S_i from
    _block_sums_kernel's partials, summed in chunk order."""
    w = tl.full((), 1.0, tl.float32)
    acc = tl.zeros((), tl.int32)
    wa = tl.full((), 1.0, tl.float32)
    co = tl.arange(0, C_P2)
    for i in range(0, N):                   # eta_{i+1} against h_{i+1}
        px, qx, dvalid = _draft_probs(b, i, drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr,
                                      drowf_ptr, drowi_ptr, t, trunc, N, V, stride_db,
                                      stride_zr, stride_dr)
        w = _next_weight(w, px, qx, dvalid)
        h = w
        if i < N - 1:
            S = tl.sum(tl.load(part_ptr + (b * (N - 1) + i) * C + co, mask=co < C, other=0.0),
                       axis=0)
            den = (S + 1.0) - w
            h = tl.where(den > 0.0, tl.math.div_rn(S, tl.where(den > 0.0, den, 1.0)), 1.0)
        u = tl_uniform(seed, tl.zeros((), tl.int32), sp + i, _STREAM_ACCEPT)
        if u < h:
            acc = i + 1
            wa = w
    return acc, wa


@triton.jit
def _accept_kernel(drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr, drowi_ptr, targ_ptr,
                   temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, verify_ptr, dec_ptr,
                   part_ptr, tokens_ptr, num_ptr, a_ptr, wa_ptr, N, V, C, stride_db, stride_tb,
                   stride_zr, stride_dr, C_P2: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    b = tl.program_id(0)
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V)
    seed = tl.load(seed_ptr + b)
    sp = tl.load(pos_ptr + b)
    acc = tl.zeros((), tl.int32)
    wa = tl.full((), 1.0, tl.float32)       # the residual's weight: 1 but for block requests
    done = tl.zeros((), tl.int1)
    t = row_t(temp_ptr, b, True)
    if (~greedy) & (tl.load(verify_ptr + b) != 0):
        acc, wa = _block_accept(b, drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr,
                                drowi_ptr, t, k_on | p_on, seed, sp, part_ptr, N, V, C,
                                stride_db, stride_zr, stride_dr, C_P2)
        done = True
    for i in range(0, N):
        if ~done:
            r = b * (N + 1) + i
            d = tl.load(drafts_ptr + b * stride_db + i).to(tl.int64)
            dvalid = (d >= 0) & (d < V)
            dc = tl.load(dec_ptr + r)           # the bound walk's decision (0: none)
            if greedy:
                ok = dvalid & (d == tl.load(targ_ptr + r))
            elif dc != 0:
                ok = dc == 1
            else:
                px, qx, dvalid = _draft_probs(b, i, drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr,
                                              drowf_ptr, drowi_ptr, t, k_on | p_on, N, V,
                                              stride_db, stride_zr, stride_dr)
                u = tl_uniform(seed, tl.zeros((), tl.int32), sp + i, _STREAM_ACCEPT)
                ok = dvalid & (qx > 0.0) & (px >= u * qx)
            if ok:
                acc += 1
            else:
                done = True
    tl.store(a_ptr + b, acc)
    tl.store(wa_ptr + b, wa)
    last = tl.load(targ_ptr + b * (N + 1) + acc)          # greedy rows' final token
    for j in range(0, N + 1):
        dj = tl.load(drafts_ptr + b * stride_db + tl.minimum(j, N - 1), mask=j < N,
                     other=-1).to(tl.int64)
        tok = tl.where(j < acc, dj, tl.where((j == acc) & greedy, last, -1))
        tl.store(tokens_ptr + b * stride_tb + j, tok)
    tl.store(num_ptr + b, (acc + 1).to(tl.int64))


@triton.jit
def _resample_kernel(z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr, drowi_ptr, bmax_ptr,
                     temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, a_ptr, wa_ptr, tokens_ptr,
                     part_f_ptr, part_i_ptr, done_ptr, N, V, C, CHUNK, NBLK, stride_tb,
                     stride_zr, stride_dr, done_off,
                     TILE: tl.constexpr, BLOCK: tl.constexpr, C_P2: tl.constexpr,
                     STREAM: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    done_ptr += done_off
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V)
    if ~greedy:
        a = tl.load(a_ptr + b)
        wa = tl.load(wa_ptr + b)        # block verification's w_a (1: token-wise, exactly)
        r = b * (N + 1) + a
        m, Zk, tau, deg = _row_p_params(rowf_ptr, rowi_ptr, r, k_on | p_on)
        logz = tl.log(Zk)
        seed = tl.load(seed_ptr + b)
        pos = tl.load(pos_ptr + b) + a
        use_q = a < N
        # the draft distribution of row a (none for the bonus row: q = 0)
        rd = b * N + tl.minimum(a, N - 1)
        qm = tl.zeros((), tl.float32)
        qZk = tl.full((), 1.0, tl.float32)
        qtau = tl.full((), float("-inf"), tl.float32)
        qdeg = ~use_q
        if use_q:
            qm, qZk, qtau, qdeg = _row_p_params(drowf_ptr, drowi_ptr, rd, k_on | p_on)
        qrow = dz_ptr + tl.maximum(rd, 0).to(tl.int64) * stride_dr
        zrow = z_ptr + r.to(tl.int64) * stride_zr
        t = row_t(temp_ptr, b, True)
        # per-lane partials, reduced once at the end
        rsum_v = tl.zeros((TILE,), tl.float32)
        br_v = tl.full((TILE,), float("-inf"), tl.float32)
        bri_v = tl.zeros((TILE,), tl.int32)
        bp_v = tl.full((TILE,), float("-inf"), tl.float32)
        bpi_v = tl.zeros((TILE,), tl.int32)
        for v0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, V), TILE):
            # nothing of the row is kept in this tile: p = 0, so the residual is 0 too
            if (tile_max(bmax_ptr, r, NBLK, v0, TILE, BLOCK) >= tau) & ~deg:
                offs = v0 + tl.arange(0, TILE)
                vm = offs < V
                z = load_z(zrow + offs, vm, t, True)
                keep = (z >= tau) & (z > float("-inf"))
                pv = _kept_prob(z, m, Zk, tau, deg)
                qv = _kept_prob(load_z(qrow + offs, vm & ~qdeg, t, True), qm, qZk, qtau, qdeg)
                res = tl.maximum(wa * pv - qv, 0.0)
                rsum_v += res
                g = tl_vocab_gumbel(seed, v0, pos, TILE, STREAM)
                sr = tl.where(res > 0.0, tl.log(tl.where(res > 0.0, res, 1.0)) + g, float("-inf"))
                s = tl.where(keep, ((z - m) - logz) + g, float("-inf"))
                br_v, bri_v = lane_argmax_update(br_v, bri_v, sr, offs)
                bp_v, bpi_v = lane_argmax_update(bp_v, bpi_v, s, offs)
        pdl_release(PDL)
        rsum = tl.sum(rsum_v, axis=0)
        br, bri = lane_argmax_finish(br_v, bri_v)
        bp, bpi = lane_argmax_finish(bp_v, bpi_v)
        o = (b * C + c) * 3
        tl.store(part_f_ptr + o, rsum)
        tl.store(part_f_ptr + o + 1, br)
        tl.store(part_f_ptr + o + 2, bp)
        tl.store(part_i_ptr + o + 1, bri)
        tl.store(part_i_ptr + o + 2, bpi)
        tl.debug_barrier()
        if tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == C - 1:
            co = tl.arange(0, C_P2)
            cm = co < C
            po = (b * C + co) * 3
            rs = tl.sum(tl.load(part_f_ptr + po, mask=cm, other=0.0, cache_modifier=".cg"), axis=0)
            use_r = (rs > 0.0) & use_q          # residual unless it is all zero (or the bonus)
            off = tl.where(use_r, 1, 2)
            vals = tl.load(part_f_ptr + po + off, mask=cm, other=float("-inf"),
                           cache_modifier=".cg")
            ids = tl.load(part_i_ptr + po + off, mask=cm, other=0, cache_modifier=".cg")
            mb, tok = lane_argmax_finish(vals, ids)
            tok = tl.where(mb > float("-inf"), tok, 0).to(tl.int64)
            tl.store(tokens_ptr + b * stride_tb + a, tok)


