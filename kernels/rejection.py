"""Rejection sampling of the DSpark drafts against the target (reference; the Triton kernel and
the op follow below it).

Target row i (of N + 1) predicts position start_pos + i: the position of draft i for i < N, the
bonus position for i = N.

- Greedy rows (temperature <= 0): accept draft i while it equals argmax(target row i); at the first
  mismatch emit that argmax and stop; if all N pass, emit the bonus argmax of row N.
- Other rows (standard speculative sampling, Leviathan/Chen): p_i = softmax(process(target row i)),
  q_i = softmax(process(draft_logits[:, i])) (the draft distribution the Markov sampler drew
  draft i from: its logits are processed exactly like the target's),
  u_i = uniform(seed, 0, start_pos + i, STREAM_ACCEPT). Accept draft x iff
  q_i(x) > 0 and p_i(x) >= u_i * q_i(x). At the first rejection sample from the residual
  max(p_i - q_i, 0) (from p_i if that is all zero) by Gumbel-max keyed
  (seed, vocab, start_pos + i, STREAM_RESAMPLE); if all N pass, sample the bonus from p_N alike.
- Draft ids outside [0, V) are always rejected and never used as an index.

Outputs: tokens [B, N + 1] int64 (committed tokens first: the accepted drafts, then the
resampled/bonus token; -1 after them) and num_sampled [B] int64 in [1, N + 1].

Fused op `dspark::rejection_sample` (with N = 0 and STREAM_TARGET it is also the plain target
sampler `dspark::sample`): every row of every request at once, the vocabulary split over many
programs (the row passes of kernels/sampling.py; launches listed below). Its statistics passes
read all B * (N + 1) target and B * N draft rows, although a request only needs the rows up to
its first rejection: a serial path (one program per request walking its rows, stopping at the
first rejection) read fewer bytes but was latency-bound, and measured slower at every B on the
H200 (B = 64: 13.7 ms vs 5.2 ms at top-p 0.95, 404 vs 175 us greedy; B = 1: 6.4 ms vs 166 us),
so it was removed.

Mode "greedy" (every row greedy, whatever its temperature: the plan of the engine's all-greedy
step variant, dspark_compile/variants.py): one launch reads each target row once, (rows,
chunks) programs maxing packed (value, lowest id) keys into one int64 per row
(kernels/sampling.py pack_argmax), and one small launch walks the acceptance chain. No scratch
rows, draft_logits never read; B * (N + 1) * V * 4 bytes read (Flash, B = 64: 199 MB,
~47 us at 4.2 TB/s) against the full plan's several passes and ~200 MB of scratch (its spill
regions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.philox import STREAM_ACCEPT, STREAM_RESAMPLE, STREAM_TARGET, uniform
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.region import fusable
from dspark_compile.kernels.sampling import (
    CAND_CAP, HIST_BINS, REFINE_EDGES, REFINE_PASSES, argmax_tokens, check_int32_index,
    check_sampling_params, fold_ids, gated_grid, gated_per_sm, greedy_rows, gumbel_argmax,
    hist_tile, lane_argmax_finish, lane_argmax_update, launch_select_refine, load_z,
    logprobs_from_processed, mass_scale_bits, pack_argmax, probs_from_processed, process_requests,
    reduce_compile_config, refine_compile_config, request_probs, row_degenerate, row_flags,
    row_list_p2, row_reduce_kernel, row_t, row_tiling, sample_reference, scale_z,
    select_compile_config, threshold_scratch, tile_max, tl_uniform, tl_vocab_gumbel, unpack_token)
from dspark_compile.kernels.tl_helpers import (
    PDL_MODES, compile_config, launch, next_pow2, pdl_available, pdl_enter, pdl_launch, pdl_mode,
    pdl_release)


def check_rejection_inputs(target_logits, draft_tokens, draft_logits, temperature, top_k, top_p,
                           seed, start_pos):
    if target_logits.dim() != 3 or not target_logits.dtype.is_floating_point:
        raise ValueError(f"target_logits must be a float [B, N+1, V] tensor, got "
                         f"{target_logits.dtype} {tuple(target_logits.shape)}")
    B, N1, V = target_logits.shape
    N = N1 - 1
    if N < 0:
        raise ValueError("target_logits needs at least one row per request (N + 1 >= 1)")
    if draft_tokens.shape != (B, N) or draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an int [{B}, {N}] tensor, got "
                         f"{draft_tokens.dtype} {tuple(draft_tokens.shape)}")
    if draft_logits.shape != (B, N, V) or not draft_logits.dtype.is_floating_point:
        raise ValueError(f"draft_logits must be a float [{B}, {N}, {V}] tensor, got "
                         f"{draft_logits.dtype} {tuple(draft_logits.shape)}")
    check_sampling_params(B, temperature, top_k, top_p, seed, start_pos, "start_pos")


def sampled_accepts(p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor,
                    seed: torch.Tensor, start_pos: torch.Tensor) -> torch.Tensor:
    """Each draft's acceptance test for a sampling request, as if every earlier draft had been
    accepted: bool [B, N], x valid, q(x) > 0 and p(x) >= u q(x). p: target probabilities
    [B, >= N, V]; q: draft probabilities [B, N, V]."""
    B, N = draft_tokens.shape
    V = p.shape[-1]
    d = draft_tokens.to(torch.int64)
    x = fold_ids(d, V)[..., None]
    px = p[:, :N].gather(2, x).squeeze(2)
    qx = q.gather(2, x).squeeze(2)
    pos = start_pos.to(torch.int64)[:, None] + torch.arange(N, device=p.device)[None, :]
    zeros = torch.zeros_like(pos)
    u = uniform(seed.to(torch.int64)[:, None], zeros, pos, zeros + STREAM_ACCEPT)
    return (d >= 0) & (d < V) & (qx > 0) & (px >= u * qx)


@fusable("rejection_sample")
def rejection_sample_reference(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                               draft_logits: torch.Tensor, temperature: torch.Tensor,
                               top_k: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                               start_pos: torch.Tensor):
    """-> (tokens [B, N+1] int64, -1 past num_sampled; num_sampled [B] int64)."""
    check_rejection_inputs(target_logits, draft_tokens, draft_logits, temperature, top_k, top_p,
                           seed, start_pos)
    B, N1, V = target_logits.shape
    N = N1 - 1
    dev = target_logits.device
    greedy = greedy_rows(temperature)
    z = process_requests(target_logits, temperature, top_k, top_p)
    p = probs_from_processed(z).reshape(B, N1, V)
    logp = logprobs_from_processed(z).reshape(B, N1, V)
    target_arg = argmax_tokens(target_logits.reshape(B * N1, V).float()).reshape(B, N1)

    # acceptance of each draft, as if every earlier one had been accepted
    d = draft_tokens.to(torch.int64)
    q = request_probs(draft_logits, temperature, top_k, top_p)
    ok = torch.where(greedy[:, None], (d == target_arg[:, :N]) & (d >= 0) & (d < V),
                     sampled_accepts(p, d, q, seed, start_pos))
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)              # a in [0, N]

    # the token after the accepted prefix: resampled at row a (a < N) or the bonus (a = N)
    a = accepted
    rows = torch.arange(B, device=dev)
    pa, logpa = p[rows, a], logp[rows, a]
    qa = torch.cat((q, q.new_zeros((B, 1, V))), 1)[rows, a]  # q_N = 0 (also when N = 0)
    resid = (pa - qa).clamp_min(0.0)
    use_p = (resid.sum(-1) <= 0)[:, None] | (a == N)[:, None]
    logw = torch.where(use_p, logpa, torch.log(resid))
    last = gumbel_argmax(logw, seed, start_pos.to(torch.int64) + a, STREAM_RESAMPLE)
    last = torch.where(greedy, target_arg[rows, a], last)

    num_sampled = a + 1
    col = torch.arange(N1, device=dev)[None, :]
    drafts_ext = torch.cat((d, d.new_zeros((B, 1))), 1)
    tokens = torch.where(col < a[:, None], drafts_ext, torch.full_like(drafts_ext, -1))
    tokens = torch.where(col == a[:, None], last[:, None], tokens)
    return tokens, num_sampled


# ----------------------------------------------------------------------------------------------
# Triton kernels: every row in parallel, the vocabulary split over many programs
# ----------------------------------------------------------------------------------------------

_STREAM_ACCEPT = tl.constexpr(STREAM_ACCEPT)
MODES = ("full", "greedy")
#
# The row passes of kernels/sampling.py (C programs per row), then the acceptance chain. The
# draft rows (the Markov sampler's logits, processed like the target's) go through the same
# passes as the target rows, in launches of their own:
#   stats    x 2 (target, draft rows), grid (rows, blocks): block statistics of z = l / T
#            (z is not stored: every later pass scales the logits it reads, scale_z, bit for
#            bit as this pass does)
#   walk     grid (B,): the acceptance tests the statistics decide; flags the target and draft
#            rows whose exact threshold is still read (knob `bounds`; see _bound_walk_kernel)
#   search   x 2 (target, draft rows; sampling.py): reduce (row max, Z, argmax of greedy rows,
#            top-k/top-p histogram + bracket), select (exact thresholds) and the refinement
#            passes; rows the walk did not flag are skipped. The draft rows' search (and
#            statistics pass) runs on a side stream beside the target rows' (knob `overlap`;
#            a fork and a join, so a captured step is still one CUDA graph, with two branches
#            here): each search is a chain of launches over a few rows, and alone they left
#            most SMs idle (H200, s10_4, the searches only: -18 to -33 us at B = 1 and 4, -55
#            to -95 us at B = 16 and 64)
#   accept   grid (B,): the acceptance chain from per-row scalars; a = accepted count
#   resample grid (B, C): residual / bonus Gumbel-max over row a; the request's last program
#            writes the token.
# Every searched row is read ~3 times (from L2 at small B: rows * 0.5 MB): 5 launches +
# 2 x (2 + REFINE_PASSES) search launches (always launched; rows that need none exit at once).

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
    and draft rows (s10_3)."""
    r = tl.program_id(0)
    blk = tl.program_id(1)
    temp = tl.load(temp_ptr + r // RPR).to(tl.float32)
    t = tl.where(temp <= 0.0, 1.0, temp)            # greedy rows: z = l
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


# The bound walk (launch knob `bounds`, on by default): most acceptance tests need no exact
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
                       need_ptr, dneed_ptr, dec_ptr, N, V, NBLK, stride_db, stride_zr,
                       stride_dr, N_P2: tl.constexpr, NBLK_P2: tl.constexpr,
                       SCALE: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    b = tl.program_id(0)
    N1 = N + 1
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V, 2)
    i = tl.arange(0, N_P2)
    iv = i < N
    r = b * N1 + i                              # target rows
    rd = b * N + i                              # draft rows
    dec = tl.zeros((N_P2,), tl.int32)          # 0 undecided (exact), 1 accept, 2 reject
    # every row's test at once from [rows, blocks] statistics, requested (with the drafts)
    # before anything waits on them, the row flags included (a greedy or top-k request reads
    # them for nothing: ~17 KB). (Meant to shorten the walk's chain of round trips; it measured
    # no faster on the H200: 7.7 -> 8.0 us at B = 1, 9.8 -> 9.0 at B = 64, s10_5.)
    d = tl.load(drafts_ptr + b * stride_db + i, mask=iv, other=-1).to(tl.int64)
    pbm, pbs, pbn = _block_stats(bmax_ptr, bsum_ptr, bnan_ptr, r, iv, NBLK, NBLK_P2)
    qbm, qbs, qbn = _block_stats(dbmax_ptr, dbsum_ptr, dbnan_ptr, rd, iv, NBLK, NBLK_P2)
    if (~greedy) & (~k_on):
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
def _accept_kernel(drafts_ptr, z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr, drowi_ptr, targ_ptr,
                   temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, dec_ptr, tokens_ptr, num_ptr,
                   a_ptr, N, V, stride_db, stride_tb, stride_zr, stride_dr,
                   PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    b = tl.program_id(0)
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V, 2)
    seed = tl.load(seed_ptr + b)
    sp = tl.load(pos_ptr + b)
    acc = tl.zeros((), tl.int32)
    done = tl.zeros((), tl.int1)
    for i in range(0, N):
        if ~done:
            r = b * (N + 1) + i
            d = tl.load(drafts_ptr + b * stride_db + i).to(tl.int64)
            dvalid = (d >= 0) & (d < V)
            xf = tl.where(dvalid, d, 0)
            dc = tl.load(dec_ptr + r)           # the bound walk's decision (0: none)
            if greedy:
                ok = dvalid & (d == tl.load(targ_ptr + r))
            elif dc != 0:
                ok = dc == 1
            else:
                t = row_t(temp_ptr, b, True)
                m, Zk, tau, deg = _row_p_params(rowf_ptr, rowi_ptr, r, k_on | p_on)
                px = _kept_prob(load_z(z_ptr + r.to(tl.int64) * stride_zr + xf, xf < V, t, True),
                                m, Zk, tau, deg)
                rd = b * N + i
                m, Zk, tau, deg = _row_p_params(drowf_ptr, drowi_ptr, rd, k_on | p_on)
                qx = _kept_prob(load_z(dz_ptr + rd.to(tl.int64) * stride_dr + xf, xf < V, t,
                                       True), m, Zk, tau, deg)
                u = tl_uniform(seed, tl.zeros((), tl.int32), sp + i, _STREAM_ACCEPT)
                ok = dvalid & (qx > 0.0) & (px >= u * qx)
            if ok:
                acc += 1
            else:
                done = True
    tl.store(a_ptr + b, acc)
    last = tl.load(targ_ptr + b * (N + 1) + acc)          # greedy rows' final token
    for j in range(0, N + 1):
        dj = tl.load(drafts_ptr + b * stride_db + tl.minimum(j, N - 1), mask=j < N,
                     other=-1).to(tl.int64)
        tok = tl.where(j < acc, dj, tl.where((j == acc) & greedy, last, -1))
        tl.store(tokens_ptr + b * stride_tb + j, tok)
    tl.store(num_ptr + b, (acc + 1).to(tl.int64))


@triton.jit
def _resample_kernel(z_ptr, rowf_ptr, rowi_ptr, dz_ptr, drowf_ptr, drowi_ptr, bmax_ptr,
                     temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, a_ptr, tokens_ptr,
                     part_f_ptr, part_i_ptr, done_ptr, N, V, C, CHUNK, NBLK, stride_tb,
                     stride_zr, stride_dr, done_off,
                     TILE: tl.constexpr, BLOCK: tl.constexpr, C_P2: tl.constexpr,
                     STREAM: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    done_ptr += done_off
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V, 2)
    if ~greedy:
        a = tl.load(a_ptr + b)
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
                res = tl.maximum(pv - qv, 0.0)
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




def rejection_sample_launch(target_logits, draft_tokens, draft_logits, temperature, top_k,
                            top_p, seed, start_pos, mode: str = "full", *, tile=None, chunk=None,
                            cap=CAND_CAP, stream=STREAM_RESAMPLE, skip_below_bracket=True,
                            bounds=True, pdl=True, overlap=True, persistent=False):
    """Run the fused rejection sampler (CUDA, or CPU tensors under TRITON_INTERPRET=1).

    `mode` "full" reads every row's sampling parameters; "greedy" treats every row as greedy
    (the plan an all-greedy batch can capture: two launches, no scratch rows, draft_logits never
    read). `stream` keys the residual/bonus noise; plain target sampling is this with N = 0 and
    STREAM_TARGET (`sample_launch`). `tile`, `chunk`, `cap` are test hooks;
    `skip_below_bracket` (tuning) as in markov_sample_launch. `bounds` (tuning; default on):
    the bound walk decides what acceptance tests it can from the row statistics, and only the
    target and draft rows whose exact threshold is still read are searched (see
    _bound_walk_kernel). `pdl` (tuning; NVIDIA sm_90+ only): every launch of mode "full" after
    the statistics passes uses programmatic dependent launch: True (PDL_BY_REQUESTS' choice),
    False or a tl_helpers.PDL_MODES key, as markov_sample_launch's. `overlap` (tuning;
    default on, CUDA only): the draft rows' statistics pass and threshold search run on a side
    stream beside the target rows' (a fork and a join each: two branches of one CUDA graph when
    captured). `persistent` (tuning; default off): the searches run in grids of about one
    wave whose programs take the flagged rows' (row, chunk) items in turn
    (sampling.gated_grid), as the Markov sampler's do from 16 rows. Measured slower here
    (H200, s11_3: B = 64 375 -> 589 us peaked, 931 -> 1868 Gaussian): the walk leaves about
    two rows a request to search, many items for a loop that costs occupancy.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if not isinstance(persistent, bool):
        raise ValueError(f"persistent must be True or False, got {persistent!r}")
    check_rejection_inputs(target_logits, draft_tokens, draft_logits, temperature, top_k, top_p,
                           seed, start_pos)
    check_int32_index(target_logits=target_logits, draft_logits=draft_logits)
    B, N1, V = target_logits.shape
    N = N1 - 1
    dev = target_logits.device
    mode_pdl = _pdl_mode(pdl, B)            # checked everywhere, used where available
    tokens = torch.empty((B, N1), dtype=torch.int64, device=dev)
    num = torch.empty((B,), dtype=torch.int64, device=dev)
    if B == 0:
        return tokens, num
    if target_logits.stride(-1) != 1:
        target_logits = target_logits.contiguous()
    if draft_logits.stride(-1) != 1:
        draft_logits = draft_logits.contiguous()
    drafts = draft_tokens.contiguous()
    if N == 0:  # valid pointers for the draft loads, which are all masked: no fill needed
        drafts = torch.empty((B, 1), dtype=torch.int64, device=dev)
        draft_logits = torch.empty((B, 1, 1), dtype=torch.float32, device=dev)
    if mode == "greedy":
        _greedy(target_logits, drafts, tokens, num, tile, chunk)
        return tokens, num
    meta = [t.contiguous() for t in (temperature, top_k, top_p, seed, start_pos)]
    args = (target_logits, drafts, draft_logits, N, *meta, tokens, num)
    if not pdl_available(_accept_kernel, dev):
        mode_pdl = 0
    _parallel(*args, tile, chunk, cap, stream, skip_below_bracket, bounds, mode_pdl, overlap,
              persistent)
    return tokens, num


# The full plan's PDL mode per request count (tl_helpers.pdl_release), from the H200 A/B of
# session 8 (benchmarks/results/h200_sampler_2026-11-29/, s8_2): "late" 6 us faster than
# "early" at B = 1 on Gaussian rows (0.6 us on peaked ones), "early" 1-3 us faster at B = 4, 16
# and 64 (within 1 us at 64). PDL against none: -2 to -6 us per call. B = 2, 3 not measured.
PDL_BY_REQUESTS = ((2, "late"), (None, "early"))


def _pdl_mode(pdl, B: int) -> int:
    """The kernels' PDL constexpr for the launcher's `pdl` knob."""
    return pdl_mode(pdl, next(m for most, m in PDL_BY_REQUESTS if most is None or B <= most))


def _rows_view(logits):
    """logits [B, N+1, V] with row r = b * (N+1) + i at r * stride(1)."""
    B, N1, _ = logits.shape
    if logits.stride(0) != N1 * logits.stride(1):
        logits = logits.contiguous()
    return logits


def _greedy(logits, drafts, tokens, num, tile, chunk):
    """Mode "greedy": each row's argmax as packed atomic maxima, then the acceptance chain."""
    B, N1, V = logits.shape
    logits = _rows_view(logits)
    R = B * N1
    TILE, CHUNK, C = row_tiling(R, V, tile, chunk)
    packed = torch.zeros((R,), dtype=torch.int64, device=logits.device)
    launch(_rows_argmax_kernel)[(R, C)](logits, packed, V, CHUNK, logits.stride(1), TILE=TILE,
                                         num_warps=4)
    BLOCK = min(128, next_pow2(B))
    launch(_greedy_accept_kernel)[(triton.cdiv(B, BLOCK),)](
        drafts, packed, tokens, num, B, N1 - 1, V, drafts.stride(0), tokens.stride(0),
        BLOCK=BLOCK, num_warps=4)


def _stats(logits, temperature, TILE: int):
    """The statistics pass over logits [B, n, V] (a _rows_view, n rows per request): per-block
    (max, argmax, sum exp(z - max), NaN flag) of z = l / T over blocks of TILE tokens, as a
    dict. z itself is not stored: the later passes scale the logits as they read them (load_z)."""
    B, n, V = logits.shape
    R, NBLK, dev = B * n, triton.cdiv(V, TILE), logits.device
    st = dict(bmax=torch.empty((R, NBLK), dtype=torch.float32, device=dev),
              barg=torch.empty((R, NBLK), dtype=torch.int32, device=dev),
              bsum=torch.empty((R, NBLK), dtype=torch.float32, device=dev),
              bnan=torch.empty((R, NBLK), dtype=torch.int32, device=dev))
    launch(_rows_stats_kernel)[(R, NBLK)](
        logits, temperature, st["bmax"], st["barg"], st["bsum"], st["bnan"], V, NBLK,
        n, logits.stride(1), BLOCK=TILE, num_warps=2)
    return st


def _walk(logits, st, dlogits, dst, drafts, flags, seed, start_pos, need, dneed, dec, pdl=0):
    """The bound walk (one program per request) over the target and draft logits (_rows_views)
    and their statistics, into need [rows], dneed [draft rows] and dec [rows] (int32)."""
    B, N1, V = logits.shape
    NBLK = st["bmax"].shape[1]
    launch(_bound_walk_kernel)[(B,)](
        drafts, logits, st["bmax"], st["bsum"], st["bnan"], dlogits, dst["bmax"], dst["bsum"],
        dst["bnan"], *flags, seed, start_pos, need, dneed, dec, N1 - 1, V, NBLK,
        drafts.stride(0), logits.stride(1), dlogits.stride(1), N_P2=next_pow2(N1),
        NBLK_P2=next_pow2(NBLK), SCALE=float(2 ** mass_scale_bits(V)), PDL=pdl, num_warps=4,
        **pdl_launch(pdl))


def _search(z, st, flags, rowf, rowi, rst, thr, counters, need, tiling, cap, skip, pdl,
            persist):
    """Exact thresholds of the rows of z [B, n, V] (a _rows_view, n rows per request) that
    `need` flags (every row without it): reduce, select and the refinement passes, into rowf /
    rowi [B * n, 4]. counters: int32 [3 * rows + 2 * REFINE_PASSES * rows], zeroed; rst: the
    refine state [rows, 4], zeroed; thr: threshold_scratch for at least B * n rows;
    `persist`: the flagged rows in grids of about one wave (sampling.gated_grid)."""
    B, n, V = z.shape
    R, dev = B * n, z.device
    TILE, CHUNK, C = tiling
    NBLK = st["bmax"].shape[1]
    targ = torch.empty((R,), dtype=torch.int64, device=dev)     # greedy rows' argmax
    scratch = torch.empty((R,), dtype=torch.int64, device=dev)
    persist = persist and need is not None
    launch(row_reduce_kernel)[gated_grid(R, C, gated_per_sm("reduce", dev), dev, persist)](
        st["bmax"], st["barg"], st["bsum"], st["bnan"], *flags, z, targ, scratch, rowf, rowi,
        thr["hist"], rst, counters, thr["floor"], thr["live"], rowi if need is None else need, V,
        NBLK, C, CHUNK, z.stride(1), 1, 0, 0, 0, n, R, NBLK_P2=next_pow2(NBLK),
        TILE=hist_tile(TILE, HIST_BINS), NB=HIST_BINS, MODE=2, C_P2=next_pow2(C), BLOCK_V=TILE,
        NT_P2=thr["live"].shape[2], FLOOR=True, GATE=need is not None, SCALED=True,
        ROWS_P2=row_list_p2(R, persist), PERSIST=persist, PDL=pdl, num_warps=4,
        **pdl_launch(pdl))
    # exact thresholds; rows whose bracket overflowed CAP take the refinement passes
    launch_select_refine(
        flags, z, 0, z.stride(1), rowf, rowi, rst, thr, counters, (R, 2 * R),
        [(3 * R + 2 * r * R, 3 * R + (2 * r + 1) * R) for r in range(REFINE_PASSES)],
        V=V, C=C, CHUNK=CHUNK, RPR=n, TILE=TILE, NB=HIST_BINS, edges=REFINE_EDGES, cap=cap,
        scan=True, bmax=st["bmax"], BLOCK_V=TILE, skip=skip, need=need, pdl=pdl, scaled=True,
        persist=persist)
    return targ


def _side_by_side(side, on_main, on_side):
    """on_main() on the current stream and on_side() on `side` at the same time: a fork from the
    current stream's work so far, and a join once both are launched (also when a launch
    raised: a capture would otherwise end with the side stream unjoined). Without a side
    stream (None), on_main() then on_side(). -> (on_main(), on_side())."""
    if side is None:
        a = on_main()
        return a, on_side()
    main = torch.cuda.current_stream(side.device)
    side.wait_stream(main)
    try:
        with torch.cuda.stream(side):
            b = on_side()
        return on_main(), b
    finally:
        main.wait_stream(side)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(dev) -> torch.cuda.Stream:
    """The stream the draft rows' statistics pass and search run on, one per device (made
    once: a stream made while a graph is being captured would be made each capture)."""
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SIDE_STREAMS:
        _SIDE_STREAMS[i] = torch.cuda.Stream(device=i)
    return _SIDE_STREAMS[i]


def _search_counters(rows: int) -> int:
    """int32 ticket counters one _search over `rows` rows uses (reduce, select x 2, refine x 2
    per pass)."""
    return 3 * rows + 2 * REFINE_PASSES * rows


def _parallel(logits, drafts, dlogits, N, temperature, top_k, top_p, seed, start_pos, tokens,
              num, tile, chunk, cap, stream, skip, bounds, pdl, overlap, persist):
    B, N1, V = logits.shape
    R, RD, dev = B * N1, B * N, logits.device
    logits = _rows_view(logits)
    # the row passes' tiling follows the rows they search: with the bound walk about two per
    # request (the resampled or bonus target row and its draft row; the undecided tests' few
    # more), so shorter chunks at small B (H200, s9_4, `ours-chunk*`: B = 1 -7 / -12 us, B = 4
    # -21 / -28 us peaked / Gaussian; B = 16 and 64 keep 8192-token chunks, measured best there)
    TILE, CHUNK, C = tiling = row_tiling(2 * B if bounds and N > 0 else R, V, tile, chunk)
    f32, i32 = torch.float32, torch.int32
    # one memset, first (so the launches after it follow each other, for PDL): ticket counters
    # of the target and draft searches and of resample, the refine states per row, then the
    # bound walk's decisions (0: test exactly; the walk writes each request's, so without it
    # every test is exact)
    nt, nd = _search_counters(R), _search_counters(RD)
    sizes = (nt, nd, B, 4 * R, 4 * RD, R)
    zeroed = torch.zeros((sum(sizes),), dtype=i32, device=dev)
    cnt_t, cnt_d, cnt_r, rst, drst, dec = torch.split(zeroed, sizes)
    rst, drst = rst.view(R, 4), drst.view(RD, 4)
    # The draft rows' launches run beside the target rows' on a side stream (`overlap`): the
    # statistics passes, and after the walk the threshold searches. A search is a chain of
    # short launches over a few rows (at B = 1 a few programs each), so one runs in the
    # other's idle SMs. Then each search has its own threshold scratch (the draft rows' spill
    # regions: B N V fp32, 165 MB at B = 64 on the Flash vocabulary); run one after the other,
    # on one stream, they share it.
    side = _side_stream(dev) if overlap and N > 0 and logits.is_cuda else None
    if N > 0:
        dlogits = _rows_view(dlogits)
    # statistics blocks = tiles (tile_max skips). z is not stored: every later pass scales
    # the logits it reads (scale_z)
    st, dst = _side_by_side(side, lambda: _stats(logits, temperature, TILE),
                            lambda: _stats(dlogits, temperature, TILE) if N > 0 else None)
    flags = (temperature, top_k, top_p)
    rowf = torch.empty((R, 4), dtype=f32, device=dev)
    rowi = torch.empty((R, 4), dtype=i32, device=dev)
    drowf = torch.empty((max(RD, 1), 4), dtype=f32, device=dev)
    drowi = torch.empty((max(RD, 1), 4), dtype=i32, device=dev)
    # (no drafts, nothing to decide: plain sampling searches its one row per request)
    bounds = bounds and N > 0
    need = dneed = None
    thr = threshold_scratch(R, C, CHUNK, cap, HIST_BINS, REFINE_EDGES, dev, TILE)
    dthr = thr if side is None else threshold_scratch(RD, C, CHUNK, cap, HIST_BINS,
                                                      REFINE_EDGES, dev, TILE)
    if bounds:
        need = torch.empty((R,), dtype=i32, device=dev)
        dneed = torch.empty((RD,), dtype=i32, device=dev)
        _walk(logits, st, dlogits, dst, drafts, flags, seed, start_pos, need, dneed, dec, pdl)
    # the draft rows' thresholds: only those the walk flags are searched
    targ, _ = _side_by_side(
        side, lambda: _search(logits, st, flags, rowf, rowi, rst, thr, cnt_t, need, tiling, cap,
                              skip, pdl, persist),
        lambda: _search(dlogits, dst, flags, drowf, drowi, drst, dthr, cnt_d, dneed, tiling,
                        cap, skip, pdl, persist) if N > 0 else None)
    accepted = torch.empty((B,), dtype=i32, device=dev)
    part_f = torch.empty((B, C, 3), dtype=f32, device=dev)
    part_i = torch.empty((B, C, 3), dtype=i32, device=dev)
    sz, sd = logits.stride(1), dlogits.stride(1)
    launch(_accept_kernel)[(B,)](
        drafts, logits, rowf, rowi, dlogits, drowf, drowi, targ, *flags, seed, start_pos, dec,
        tokens, num, accepted, N, V, drafts.stride(0), tokens.stride(0), sz, sd, PDL=pdl,
        num_warps=1, **pdl_launch(pdl))
    launch(_resample_kernel)[(B, C)](
        logits, rowf, rowi, dlogits, drowf, drowi, st["bmax"], *flags, seed, start_pos, accepted,
        tokens, part_f, part_i, cnt_r, N, V, C, CHUNK, st["bmax"].shape[1], tokens.stride(0), sz,
        sd, 0, TILE=TILE, BLOCK=TILE, C_P2=next_pow2(C), STREAM=stream, PDL=pdl, num_warps=4,
        **pdl_launch(pdl))


def sample_launch(logits, temperature, top_k, top_p, seed, position, *, tile=None,
                  chunk=None, cap=CAND_CAP):
    """Fused plain target sampling (sampling.sample_reference): the rejection kernel with no
    drafts samples its single row's 'bonus' token with STREAM_TARGET at `position`."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be a float [B, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    B, V = logits.shape
    tokens, _ = rejection_sample_launch(
        logits[:, None], torch.zeros((B, 0), dtype=torch.int64, device=logits.device),
        torch.zeros((B, 0, V), dtype=torch.float32, device=logits.device), temperature, top_k,
        top_p, seed, position, tile=tile, chunk=chunk, cap=cap, stream=STREAM_TARGET)
    return tokens[:, 0]


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def rejection_sample_mode_reference(target_logits, draft_tokens, draft_logits, temperature,
                                    top_k, top_p, seed, start_pos, mode: str = "full"):
    """The reference under a launch mode: "greedy" treats every row as greedy."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if mode == "greedy":
        temperature = torch.zeros_like(temperature)
    return rejection_sample_reference(target_logits, draft_tokens, draft_logits, temperature,
                                      top_k, top_p, seed, start_pos)


def _rejection_fake(target_logits, draft_tokens, draft_logits, temperature, top_k, top_p, seed,
                    start_pos, mode="full"):
    B, N1, _ = target_logits.shape
    return (target_logits.new_empty((B, N1), dtype=torch.int64),
            target_logits.new_empty((B,), dtype=torch.int64))


@dspark_op("rejection_sample", reference=rejection_sample_mode_reference, fake=_rejection_fake)
def rejection_sample(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, seed: torch.Tensor, start_pos: torch.Tensor,
                     mode: str = "full") -> tuple[torch.Tensor, torch.Tensor]:
    """Fused rejection sampling; mode "greedy" treats every row as greedy (the module
    docstring's greedy plan)."""
    return rejection_sample_launch(target_logits, draft_tokens, draft_logits, temperature, top_k,
                                   top_p, seed, start_pos, mode)


def _sample_fake(logits, temperature, top_k, top_p, seed, position):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@dspark_op("sample", reference=sample_reference, fake=_sample_fake)
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return sample_launch(logits, temperature, top_k, top_p, seed, position)


# SM12x readiness: the configurations the launcher picks at the Flash vocabulary (1024-wide
# tiles), fp32 logits, int64 metadata.
def _parallel_configs(stream: int):
    """The op's own kernels and its row passes as it launches them (gated by the bound walk
    when it has drafts, reading unscaled logits), in both PDL modes PDL_BY_REQUESTS picks
    (late for 1-2 requests, early beyond)."""
    d16, flags = "i32:16", dict(temp_ptr="*fp32", topk_ptr="*i64", topp_ptr="*fp32")
    drafts = stream == STREAM_RESAMPLE      # rejection (N = 5) or plain sampling (N = 0)
    out = [compile_config(_rows_stats_kernel, dict(
        logits_ptr="*fp32", temp_ptr="*fp32", bmax_ptr="*fp32", barg_ptr="*i32",
        bsum_ptr="*fp32", bnan_ptr="*i32", V=d16, NBLK="i32", RPR="i32", stride_lr=d16),
        dict(BLOCK=1024), 2)]
    if drafts:
        out.append(compile_config(_rows_argmax_kernel, dict(
            logits_ptr="*fp32", packed_ptr="*i64", V=d16, CHUNK=d16, stride_lr=d16),
            dict(TILE=1024), 4))
        out.append(compile_config(_greedy_accept_kernel, dict(
            drafts_ptr="*i64", packed_ptr="*i64", tokens_ptr="*i64", num_ptr="*i64", B="i32",
            N="i32", V=d16, stride_db="i32", stride_tb="i32"), dict(BLOCK=64), 4))
    for pdl in (PDL_MODES["late"], PDL_MODES["early"]):
        if drafts:
            # the bound walk: Flash's N = 5 drafts, 6 rows per request
            out.append(compile_config(_bound_walk_kernel, dict(
                drafts_ptr="*i64", z_ptr="*fp32", bmax_ptr="*fp32", bsum_ptr="*fp32",
                bnan_ptr="*i32", dz_ptr="*fp32", dbmax_ptr="*fp32", dbsum_ptr="*fp32",
                dbnan_ptr="*i32", **flags, seed_ptr="*i64", pos_ptr="*i64", need_ptr="*i32",
                dneed_ptr="*i32", dec_ptr="*i32", N="i32", V=d16, NBLK="i32", stride_db="i32",
                stride_zr=d16, stride_dr=d16),
                dict(N_P2=8, NBLK_P2=next_pow2(triton.cdiv(129280, 1024)),
                     SCALE=float(2 ** mass_scale_bits(129280)), PDL=pdl), 4))
        out.append(compile_config(_accept_kernel, dict(
            drafts_ptr="*i64", z_ptr="*fp32", rowf_ptr="*fp32", rowi_ptr="*i32",
            dz_ptr="*fp32", drowf_ptr="*fp32", drowi_ptr="*i32", targ_ptr="*i64", **flags,
            seed_ptr="*i64", pos_ptr="*i64", dec_ptr="*i32", tokens_ptr="*i64", num_ptr="*i64",
            a_ptr="*i32", N="i32", V=d16, stride_db="i32", stride_tb="i32", stride_zr=d16,
            stride_dr=d16), dict(PDL=pdl), 1))
        # the tilings the launcher picks: plain sampling at B = 1 / 16 / 48 rows, rejection at
        # 2 B rows (the walk leaves about two a request to search) for B = 1 / 8 / 24; one
        # program per item (the default: `persistent` off)
        for rows in (1, 16, 48):
            _, CHUNK, C = row_tiling(rows, 129280)
            # statistics blocks are the 1024-token tiles
            out.append(reduce_compile_config(1024, CHUNK, C, 1024, 129280, 2, pdl, gate=drafts,
                                             scaled=True))
            out.append(select_compile_config(1024, CHUNK, C, 1024, 129280, pdl, gate=drafts,
                                             scaled=True))
            out.append(refine_compile_config(1024, C, 129280, pdl, scaled=True, gate=drafts))
            out.append(compile_config(_resample_kernel, dict(
                z_ptr="*fp32", rowf_ptr="*fp32", rowi_ptr="*i32", dz_ptr="*fp32",
                drowf_ptr="*fp32", drowi_ptr="*i32", bmax_ptr="*fp32", **flags,
                seed_ptr="*i64", pos_ptr="*i64", a_ptr="*i32", tokens_ptr="*i64",
                part_f_ptr="*fp32", part_i_ptr="*i32", done_ptr="*i32", N="i32", V=d16, C=d16,
                CHUNK=d16, NBLK="i32", stride_tb="i32", stride_zr=d16, stride_dr=d16,
                done_off="i32"),
                dict(TILE=1024, BLOCK=1024, C_P2=next_pow2(C), STREAM=stream, PDL=pdl), 4))
    return out


# fp32 logits (what the target head produces); a bf16 variant compiles alike
add_compile_configs("rejection_sample", _parallel_configs(STREAM_RESAMPLE))
add_compile_configs("sample", _parallel_configs(STREAM_TARGET))
