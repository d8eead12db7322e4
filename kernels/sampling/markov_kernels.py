"""Triton kernels of the Markov draft sampler (launched by kernels/sampling/markov.py).

Full plan, per step: logits (draft_logits and block statistics; every row's packed maximum),
rowstat (Z and the top-p floor per row), cand (the Gumbel candidate above the floor), pick (the
token where no threshold is needed, else a need flag), then for the flagged rows the row passes
(row_passes.py, refine.py) and final (the Gumbel-max above the exact threshold). Greedy plan:
one step kernel a step, then one launch writing the drafts.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dspark_compile.kernels.philox import STREAM_DRAFT
from dspark_compile.kernels.sampling.device import (
    block_max_floor, divisor_t, fixed_mass, lane_argmax_finish, lane_argmax_update, load_z,
    pack_argmax, row_degenerate, row_flags, row_t, scale_z, tile_max, tl_vocab_gumbel,
    unpack_token, unpack_value)
from dspark_compile.kernels.sampling.row_passes import for_each_item
from dspark_compile.kernels.tl_helpers import pdl_enter, pdl_release

_STREAM_DRAFT = tl.constexpr(STREAM_DRAFT)


@triton.jit
def _markov_logits_kernel(base_ptr, w1_ptr, w2_ptr, anchor_ptr, prev_ptr, temp_ptr,
                          z_ptr, bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, rowkey_ptr,
                          B, V, NBLK, stride_bb, stride_zb, base_off, z_off, step,
                          R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCK_R: tl.constexpr, STAGES: tl.constexpr, EVEN_V: tl.constexpr,
                          DOT_F32: tl.constexpr, REVERSE_ODD: tl.constexpr,
                          CAND: tl.constexpr = False, PDL: tl.constexpr = 0):
    """Mode "full", one Markov step, grid (NBLK,): vocab block `blk` for every row
    (see the module docstring). W1/W2 are contiguous [V, R] with R a compile-time constant: the
    compiler sees aligned, contiguous rows and issues wide loads (a runtime stride costs ~3x
    the registers). CAND: each row's packed (max, lowest argmax) key is atomically maxed into
    rowkey_ptr[step, row] (zero-filled). (The Gumbel candidate is drawn by _markov_gumbel_kernel,
    only above the top-p floor: drawn here, for every token of every row, the noise took this
    kernel from 59 to 115 us per step at B = 64 on the H200.)"""
    pdl_enter(PDL)
    base_ptr += base_off            # this step's slice of [B, N, V] (no views: export-friendly)
    z_ptr += z_off
    # Odd steps walk the vocab blocks from the end (programs start roughly in id order): W2 is
    # larger than the L2, so a step that repeats the last one's order finds nothing of it there
    # (least-recently-used eviction), while the reversed walk starts on the blocks the last
    # step read most recently, still in the L2.
    flip = REVERSE_ODD & (step % 2 == 1)
    blk = tl.where(flip, NBLK - 1 - tl.program_id(0), tl.program_id(0))
    offs_v = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = offs_v < V
    offs_r = tl.arange(0, BLOCK_R)
    for b0 in range(0, B, BLOCK_B):
        rows = b0 + tl.arange(0, BLOCK_B)
        rmask = rows < B
        if step == 0:               # the anchor, an id >= V folded to 0
            a = tl.load(anchor_ptr + rows, mask=rmask, other=0).to(tl.int64)
            prev = tl.where((a >= 0) & (a < V), a, 0)
        else:                       # written by the previous step's reduce / final programs
            prev = tl.load(prev_ptr + rows, mask=rmask, other=0)
        acc = tl.zeros((BLOCK_B, BLOCK_V), tl.float32)
        for r0 in tl.range(0, R, BLOCK_R, num_stages=STAGES):
            rr = r0 + offs_r
            a = tl.load(w1_ptr + prev[:, None] * R + rr[None, :])
            # W2 keeps the default L2 priority: the next step re-reads what is left of it (see
            # flip). A masked load costs ~3x the registers, so only a ragged last block pays
            # for the mask.
            if EVEN_V:
                w = tl.load(w2_ptr + offs_v[:, None] * R + rr[None, :])
            else:
                w = tl.load(w2_ptr + offs_v[:, None] * R + rr[None, :], mask=vmask[:, None],
                            other=0.0)
            if DOT_F32:
                acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
        # PDL "late": after the first batch tile's rank loop (B <= 64 rows: the only one)
        pdl_release(PDL)
        # read once: first out of the L2, which is better spent on W2 (see flip)
        base = tl.load(base_ptr + rows[:, None] * stride_bb + offs_v[None, :],
                       mask=rmask[:, None] & vmask[None, :], other=0.0,
                       eviction_policy="evict_first").to(tl.float32)
        lg = base + acc
        # the op's draft_logits (every row): the later passes scale them as they read them
        # (scale_z, bit for bit as here), rejection processes them like the target's
        tl.store(z_ptr + rows[:, None] * stride_zb + offs_v[None, :], lg,
                 mask=rmask[:, None] & vmask[None, :])
        t = tl.load(temp_ptr + rows, mask=rmask, other=1.0).to(tl.float32)
        z = tl.math.div_rn(lg, divisor_t(t)[:, None])
        zn, bmax, barg, bnan = _block_maxima(z, vmask, blk, BLOCK_V)
        e = tl.where(zn > float("-inf"), tl.exp(zn - bmax[:, None]), 0.0)
        bsum = tl.sum(e, axis=1)
        so = rows * NBLK + blk
        tl.store(bmax_ptr + so, bmax, mask=rmask)
        tl.store(barg_ptr + so, barg, mask=rmask)
        tl.store(bsum_ptr + so, bsum, mask=rmask)
        tl.store(bnan_ptr + so, bnan, mask=rmask)
        if CAND:
            # the row's maximum (value, lowest id) for the candidate plan's later launches
            tl.atomic_max(rowkey_ptr + step * B + rows, pack_argmax(bmax, barg, bnan > 0),
                          mask=rmask, sem="relaxed")


@triton.jit
def _markov_greedy_step_kernel(base_ptr, w1_ptr, w2_ptr, anchor_ptr, packed_ptr, B, V, NBLK,
                               stride_bb, base_off, step, NPROG,
                               R: tl.constexpr, R_P2: tl.constexpr, BLOCK_B: tl.constexpr,
                               BLOCK_V: tl.constexpr, STAGES: tl.constexpr,
                               EVEN_V: tl.constexpr, DOT_F32: tl.constexpr,
                               PERSIST: tl.constexpr, REVERSE_ODD: tl.constexpr,
                               PDL: tl.constexpr):
    """Mode "greedy", one Markov step: grid (NPROG, batch tiles). A program owns a run of vocab
    blocks for BLOCK_B rows; it gathers the rows' W1[prev] once, streams the blocks' W2 rows
    (the whole rank per block as one tile, STAGES - 1 tiles in flight), keeps each row's best
    packed (value, lowest id) key over its blocks and atomically maxes it into the step's row
    slot -- one atomic per row and program, order-independent, so deterministic."""
    if PDL:
        # the next step's programs may start once all of these have: they prefetch their first
        # W2 tile (a weight, never written in the op) while this step finishes, then wait
        gdc_launch_dependents()
    base_ptr += base_off
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < B
    flip = REVERSE_ODD & (step % 2 == 1)
    # odd steps walk the vocabulary backwards, so a step starts on the W2 rows the previous one
    # read last (still in the L2). Persistent programs reverse their own run, one block per
    # program reverses the program order (programs start roughly in id order).
    q = pid if PERSIST else tl.where(flip, NPROG - 1 - pid, pid)
    # in int64: q * NBLK passes 2^31 with one program per block from ~46k blocks on
    lo = (q.to(tl.int64) * NBLK // NPROG).to(tl.int32)
    hi = ((q + 1).to(tl.int64) * NBLK // NPROG).to(tl.int32)
    n = hi - lo
    offs_r = tl.arange(0, R_P2)
    blk = tl.where(flip, hi - 1, lo)
    w = _w2_tile(w2_ptr, blk, V, R, R_P2, BLOCK_V, EVEN_V)
    if PDL:
        gdc_wait()                  # the previous step's row maxima are complete from here on
    if step == 0:                   # the anchor, an id >= V folded to 0
        a_id = tl.load(anchor_ptr + rows, mask=rmask, other=0).to(tl.int64)
        prev = tl.where((a_id >= 0) & (a_id < V), a_id, 0)
    else:                           # the previous step's packed row maxima
        prev = unpack_token(tl.load(packed_ptr + (step - 1) * B + rows, mask=rmask, other=0))
    if R == R_P2:
        a = tl.load(w1_ptr + prev[:, None] * R + offs_r[None, :])
    else:
        a = tl.load(w1_ptr + prev[:, None] * R + offs_r[None, :], mask=offs_r[None, :] < R,
                    other=0.0)
    best = _greedy_block_key(a, w, base_ptr, blk, rows, rmask, V, stride_bb, BLOCK_V, DOT_F32)
    for j in tl.range(1, n, num_stages=STAGES):
        blk = tl.where(flip, hi - 1 - j, lo + j)
        w = _w2_tile(w2_ptr, blk, V, R, R_P2, BLOCK_V, EVEN_V)
        best = tl.maximum(best, _greedy_block_key(a, w, base_ptr, blk, rows, rmask, V, stride_bb,
                                                  BLOCK_V, DOT_F32))
    tl.atomic_max(packed_ptr + step * B + rows, best, mask=rmask, sem="relaxed")


@triton.jit
def _w2_tile(w2_ptr, blk, V, R: tl.constexpr, R_P2: tl.constexpr, BLOCK_V: tl.constexpr,
             EVEN_V: tl.constexpr):
    """W2[block] over the whole rank, [BLOCK_V, R_P2] (columns past R are zeros). A masked load
    costs ~3x the registers, so only a ragged last block or a rank not a power of two pays."""
    offs_v = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, R_P2)
    ptrs = w2_ptr + offs_v[:, None] * R + offs_r[None, :]
    if EVEN_V and R == R_P2:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_v[:, None] < V) & (offs_r[None, :] < R), other=0.0)


@triton.jit
def _greedy_block_key(a, w, base_ptr, blk, rows, rmask, V, stride_bb, BLOCK_V: tl.constexpr,
                      DOT_F32: tl.constexpr):
    """Packed (max, lowest argmax, NaN) key per row of base + W1[prev] . W2[block]^T."""
    offs_v = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = offs_v < V
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w))        # bf16 products are exact, fp32 accumulation
    # read once: first out of the L2, which is better spent on W2
    base = tl.load(base_ptr + rows[:, None] * stride_bb + offs_v[None, :],
                   mask=rmask[:, None] & vmask[None, :], other=0.0,
                   eviction_policy="evict_first").to(tl.float32)
    _, bmax, barg, bnan = _block_maxima(base + acc, vmask, blk, BLOCK_V)
    return pack_argmax(bmax, barg, bnan > 0)


@triton.jit
def _block_maxima(z, vmask, blk, BLOCK_V: tl.constexpr):
    """Per row of a [rows, BLOCK_V] block of z: (z with NaN and out-of-vocabulary entries as
    -inf, max, lowest-id argmax (a vocabulary id), NaN flag)."""
    isnan = z != z
    zn = tl.where(isnan | ~vmask[None, :], float("-inf"), z)
    bmax = tl.max(zn, axis=1)
    barg = tl.argmax(zn, axis=1, tie_break_left=True) + blk * BLOCK_V
    bnan = tl.max((isnan & vmask[None, :]).to(tl.int32), axis=1)
    return zn, bmax, barg, bnan


@triton.jit
def _markov_greedy_tokens_kernel(packed_ptr, drafts_ptr, B, stride_db, BLOCK: tl.constexpr):
    """Mode "greedy": drafts[:, k] from step k's packed row maxima (grid (N,))."""
    k = tl.program_id(0)
    for b0 in range(0, B, BLOCK):
        rows = b0 + tl.arange(0, BLOCK)
        m = rows < B
        key = tl.load(packed_ptr + k * B + rows, mask=m, other=0)
        tl.store(drafts_ptr + rows * stride_db + k, unpack_token(key), mask=m)


@triton.jit
def _row_argmax(best_v, bid_v, best_v_ptr, best_i_ptr, done_ptr, b, c, C, C_P2: tl.constexpr):
    """A chunk program's per-lane argmax (value, lowest id) into the row's partials; the row's
    last program (atomic ticket) reduces them in chunk order: (last, token: the lowest id of
    the maximum, 0 if every value was -inf). The token is meaningful where last is."""
    best, bid = lane_argmax_finish(best_v, bid_v)
    tl.store(best_v_ptr + b * C + c, best)
    tl.store(best_i_ptr + b * C + c, bid)
    tl.debug_barrier()          # every thread's stores happen before the releasing ticket
    last = tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == C - 1
    tok = tl.zeros((), tl.int64)
    if last:
        co = tl.arange(0, C_P2)
        vals = tl.load(best_v_ptr + b * C + co, mask=co < C, other=float("-inf"),
                       cache_modifier=".cg")
        ids = tl.load(best_i_ptr + b * C + co, mask=co < C, other=0, cache_modifier=".cg")
        mb, tok = lane_argmax_finish(vals, ids)
        tok = tl.where(mb > float("-inf"), tok, 0).to(tl.int64)
    return last, tok


@triton.jit
def _markov_rowstat_kernel(temp_ptr, topk_ptr, topp_ptr, rowkey_ptr, bmax_ptr, bsum_ptr,
                           rowf_ptr, floor_ptr, step, B, V, NBLK,
                           NBLK_P2: tl.constexpr, PDL: tl.constexpr = 0):
    """Grid (B,), candidate plan, mode "full": a sampled row's Z into rowf_ptr[b, 1] and, for
    top-p rows without top-k, the block maxima's floor (block_max_floor) into
    floor_ptr[b], once per row for cand's and pick's programs (each of them deriving both read
    the row's statistics: ~16 KB a program at B = 64's 64-token blocks). Pick decides with this
    Z and reduce reads it (ZIN), so the exact path's target is the same bits."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V)
    _, m, deg = _row_max(rowkey_ptr, step, B, b)
    Z = tl.zeros((), tl.float32)
    fl = tl.full((), float("-inf"), tl.float32)
    if (~greedy) & (~deg):
        o = tl.arange(0, NBLK_P2)
        bm = tl.load(bmax_ptr + b * NBLK + o, mask=o < NBLK, other=float("-inf"))
        bs = tl.load(bsum_ptr + b * NBLK + o, mask=o < NBLK, other=0.0)
        e = tl.where(bm > float("-inf"), tl.exp(bm - m), 0.0)
        Z = tl.sum(bs * e, axis=0)
        if p_on & (~k_on):
            fl = block_max_floor(bm, e, m, Z, p)
    pdl_release(PDL)
    tl.store(rowf_ptr + b * 4 + 1, Z)
    tl.store(floor_ptr + b, fl)


@triton.jit
def _row_max(rowkey_ptr, step, B, b):
    """(packed key, value, degenerate) of row b's maximum from the logits kernel's atomic
    maxima (CAND): degenerate as row_degenerate decides it (a NaN: the largest key,
    whose value reads NaN; a maximum not finite)."""
    rkey = tl.load(rowkey_ptr + step * B + b)
    m = unpack_value(rkey)
    return rkey, m, row_degenerate(tl.zeros((), tl.int32), m)


@triton.jit
def _gumbel_item(b, c, args, K: tl.constexpr):
    """_markov_gumbel_kernel's work item: chunk c of row b."""
    (temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, z_ptr, rowkey_ptr, floor_ptr, rowf_ptr,
     rowi_ptr, bmax_ptr, best_v_ptr, best_i_ptr, out_ptr, prev_ptr, done_ptr, step, B, V, C,
     CHUNK, NBLK, stride_zb, stride_db) = args
    TILE: tl.constexpr = K[0]
    C_P2: tl.constexpr = K[1]
    BLOCK_V: tl.constexpr = K[2]
    CAND: tl.constexpr = K[3]
    PDL: tl.constexpr = K[4]
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V)
    if CAND:
        _, _, deg = _row_max(rowkey_ptr, step, B, b)
        run = (~greedy) & (~deg) & (~k_on)
    else:
        deg = tl.zeros((), tl.int1)
        run = ~greedy
    if run:
        if CAND:
            thr = tl.full((), float("-inf"), tl.float32)
            if p_on:
                thr = tl.load(floor_ptr + b)
        else:
            deg = tl.load(rowi_ptr + b * 4 + 3) != 0
            thr = tl.full((), float("-inf"), tl.float32)
            if (k_on | p_on) & ~deg:
                thr = tl.load(rowf_ptr + b * 4 + 2)
        t = row_t(temp_ptr, b, True)
        seed = tl.load(seed_ptr + b)
        pos = tl.load(pos_ptr + b) + step
        zrow = z_ptr + b.to(tl.int64) * stride_zb
        # per-lane best, reduced once at the end
        best_v = tl.full((TILE,), float("-inf"), tl.float32)
        bid_v = tl.zeros((TILE,), tl.int32)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        ar = tl.arange(0, TILE)
        # the next tile's block maxima and (where they reach the threshold) logits in flight
        # while this tile is scored (a tile decided, then loaded, waited on two round trips)
        # (a degenerate row scores nothing: token 0)
        tmn = tile_max(bmax_ptr, b, NBLK, lo, TILE, BLOCK_V)
        ln = tl.load(zrow + lo + ar, mask=lo + ar < tl.where((tmn >= thr) & ~deg, hi, 0),
                     other=float("-inf"))
        for v0 in range(lo, hi, TILE):
            x = ln
            tm = tmn
            nx = v0 + TILE + ar
            tmn = tile_max(bmax_ptr, b, NBLK, v0 + TILE, TILE, BLOCK_V)
            ln = tl.load(zrow + nx, mask=nx < tl.where((tmn >= thr) & ~deg, hi, 0),
                         other=float("-inf"))
            if (tm >= thr) & ~deg:
                z = scale_z(x, t, True)
                g = tl_vocab_gumbel(seed, v0, pos, TILE, _STREAM_DRAFT)
                sc = tl.where((z >= thr) & (z > float("-inf")), z + g, float("-inf"))
                best_v, bid_v = lane_argmax_update(best_v, bid_v, sc, v0 + ar)
        pdl_release(PDL)
        last, tok = _row_argmax(best_v, bid_v, best_v_ptr, best_i_ptr, done_ptr, b, c, C, C_P2)
        if last:
            if CAND:
                tl.store(out_ptr + b, tok)
            else:
                tl.store(out_ptr + step + b * stride_db, tok)
                tl.store(prev_ptr + b, tok)
    else:
        pdl_release(PDL)


@triton.jit
def _markov_gumbel_kernel(temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, z_ptr, rowkey_ptr,
                          floor_ptr, rowf_ptr, rowi_ptr, bmax_ptr, best_v_ptr, best_i_ptr,
                          out_ptr, prev_ptr, done_ptr, need_ptr, step, B, V, C, CHUNK, NBLK,
                          stride_zb, stride_db, z_off, done_off, TILE: tl.constexpr,
                          C_P2: tl.constexpr, BLOCK_V: tl.constexpr,
                          CAND: tl.constexpr = False, GATE: tl.constexpr = False,
                          ROWS_P2: tl.constexpr = 1, PERSIST: tl.constexpr = False,
                          PDL: tl.constexpr = 0):
    """Per (row, chunk) item: the Gumbel-max of z + g (lowest id on ties, Philox in-kernel)
    over a row's tokens at or above a threshold; the row's last ticket writes the token.
    Noise is drawn only for the tiles whose block maxima reach the threshold, whose logits are
    the only ones loaded. z: the step's draft_logits scaled as read (scale_z).
    - CAND (`cand`): sampled rows without top-k, above the block maxima's top-p floor
      (_markov_rowstat_kernel; -inf without top-p): the candidate, into out_ptr[b];
    - else (`final`): non-greedy rows (with GATE only those need_ptr flags), above select's
      exact threshold tau (every finite token without top-k / top-p): the draft, into the
      step's column of out_ptr (the drafts) and `prev`.
    Work items, GATE, PERSIST: row_passes.for_each_item (cand runs grid (B, C), one
    program per item; final is gated, persistent from PERSIST_FROM_ROWS rows).
    """
    pdl_enter(PDL)
    z_ptr += z_off
    done_ptr += done_off
    for_each_item(_gumbel_item, (
        temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, z_ptr, rowkey_ptr, floor_ptr, rowf_ptr,
        rowi_ptr, bmax_ptr, best_v_ptr, best_i_ptr, out_ptr, prev_ptr, done_ptr, step, B, V, C,
        CHUNK, NBLK, stride_zb, stride_db), (TILE, C_P2, BLOCK_V, CAND, PDL),
        need_ptr, B, C, GATE, PERSIST, ROWS_P2)


@triton.jit
def _markov_pick_kernel(temp_ptr, topk_ptr, topp_ptr, z_ptr, rowkey_ptr, cand_ptr, bmax_ptr,
                        rowf_ptr, drafts_ptr, prev_ptr, need_ptr, part_ptr, done_ptr, step, B, V,
                        C, CHUNK, NBLK, stride_zb, stride_db, z_off, done_off,
                        TILE: tl.constexpr, C_P2: tl.constexpr,
                        BLOCK_V: tl.constexpr, SCALE: tl.constexpr, PDL: tl.constexpr = 0):
    """Grid (B, C), after cand (_markov_gumbel_kernel): the step's token without a threshold
    where the row allows it, else need_ptr[b] = 1 (the gated search and final take the row).

    - greedy rows: the row maximum's id; degenerate rows (a NaN, a maximum not finite): 0;
    - rows without top-k / top-p: the candidate c, the argmax of
      z + g over the whole row, is the Gumbel-max over the kept set (all of it);
    - top-p rows without top-k: c (the argmax of z + g above a lower bound of tau) is the
      argmax over the kept set whenever it is kept, and c is
      kept iff the fixed-point mass strictly above z_c is below resolve()'s target
      max(top_p Z SCALE, 1), with rowstat's Z (which reduce reads too, ZIN). The chunk
      programs sum that mass over the tiles whose block maxima lie above z_c (on peaked rows a
      few tiles); the row's last program (atomic ticket) decides. Not kept (probability about
      1 - top_p on flat rows, less on peaked ones): the row takes the exact path;
    - top-k rows: the exact path.
    """
    pdl_enter(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1)
    z_ptr += z_off
    drafts_ptr += step
    done_ptr += done_off
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V)
    rkey, m, deg = _row_max(rowkey_ptr, step, B, b)
    cid = tl.load(cand_ptr + b)             # (read for sampled rows without top-k only)
    if (~greedy) & (~deg) & p_on & (~k_on):
        t = row_t(temp_ptr, b, True)
        zrow = z_ptr + b.to(tl.int64) * stride_zb
        zc = load_z(zrow + cid, cid < V, t, True)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        ar = tl.arange(0, TILE)
        acc = tl.zeros((TILE,), tl.int64)
        # the next tile's block maxima and (where they reach above z_c) logits in flight
        # while this tile is summed
        tmn = tile_max(bmax_ptr, b, NBLK, lo, TILE, BLOCK_V)
        ln = tl.load(zrow + lo + ar, mask=lo + ar < tl.where(tmn > zc, hi, 0),
                     other=float("-inf"))
        for v0 in range(lo, hi, TILE):
            x = ln
            nx = v0 + TILE + ar
            tmn = tile_max(bmax_ptr, b, NBLK, v0 + TILE, TILE, BLOCK_V)
            ln = tl.load(zrow + nx, mask=nx < tl.where(tmn > zc, hi, 0), other=float("-inf"))
            z = scale_z(x, t, True)
            acc += tl.where(z > zc, fixed_mass(z, m, SCALE), 0)
        pdl_release(PDL)
        tl.store(part_ptr + b * C + c, tl.sum(acc, axis=0))
        tl.debug_barrier()   # every thread's stores happen before the releasing ticket
        if tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == C - 1:
            co = tl.arange(0, C_P2)
            above = tl.sum(tl.load(part_ptr + b * C + co, mask=co < C, other=0,
                                   cache_modifier=".cg"), axis=0)
            # Z from _markov_rowstat_kernel, which reduce reads too (ZIN)
            Z = tl.load(rowf_ptr + b * 4 + 1)
            T = tl.maximum(Z.to(tl.float64) * SCALE * p.to(tl.float64), 1.0)
            kept = above.to(tl.float64) < T
            tl.store(need_ptr + b, (~kept).to(tl.int32))
            if kept:
                tl.store(drafts_ptr + b * stride_db, cid)
                tl.store(prev_ptr + b, cid)
    else:
        pdl_release(PDL)
        if c == 0:
            exact = (~greedy) & (~deg) & k_on
            tok = tl.where(greedy, unpack_token(rkey), tl.where(deg, 0, cid))
            tl.store(need_ptr + b, exact.to(tl.int32))
            if ~exact:
                tl.store(drafts_ptr + b * stride_db, tok)
                tl.store(prev_ptr + b, tok)


