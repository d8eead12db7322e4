"""DSpark Markov draft sampler: reference, fused Triton kernels, launcher, `dspark::markov_sample`.

    prev = anchor
    for k in 0..N-1:                       # draft k is the token at position start_pos + k
        l_k = base_logits[:, k] + W1[prev] @ W2^T             (fp32 math)
        draft_logits[:, k] = l_k                               (every row)
        greedy rows: x_k = argmax(l_k)
        other rows:  z_k = process(l_k) (temperature, top-k, top-p: -inf outside the kept set);
                     x_k = argmax(z_k + g), g = Gumbel(seed, vocab, start_pos + k, STREAM_DRAFT)
                     -- a sample of q_k = softmax(z_k)
        prev = x_k

The op returns the drafts and draft_logits, not q: rejection sampling processes the draft
logits exactly as it processes the target's (kernels/rejection.py) and computes q where it
reads it -- mostly from row statistics, a threshold search only for the few rows it still
needs. Writing q here needed each step's exact top-p threshold for every row; the token alone
does not (below). Conventions (temperature/top-k/top-p, degenerate rows, Gumbel keys, id
folding) are those of kernels/sampling.py; the draft's Gumbel-max adds the noise to z itself
(log q up to a per-row constant).

Bytes one call must move (Flash: V = 129280, r = 256, N = 5, bf16 W1/W2, fp32 base logits):
W2 once per step, 5 x 66.2 MB = 331 MB (the floor, ~78 us on an H200), + base logits B*N*V*4
(2.6 MB per request) + W1 rows B*N*r*2, + draft_logits B*N*V*4 written (modes "full" and
"plain").

Fused plan (modes "full" / "plain"), per step (fixed launches, so the op captures into one CUDA
graph):
  logits  grid (cdiv(V, BLOCK_V),): a program owns a vocab block for *all* B rows, so W2 is read
          exactly once per step; bias = W1[prev] . W2[block]^T on tensor cores (bf16 operands
          give exact products, fp32 accumulation; a CUDA-core GEMV for one row measured 1.3-2.6x
          slower on the H200 than padding it to a 16-row tile), + base -> the step's
          draft_logits slot; z = l / T: per-block max, lowest-id argmax, sum exp(z - max) and
          NaN flag; then (`candidate`) each row's packed (max, lowest id) key is atomically
          maxed into a per-step row slot. Step 0 folds the anchor itself. The [B, V] bias
          never exists anywhere else. Odd steps walk the blocks from the end, so a step starts
          on the W2 rows the last one left in the L2 (9-10 % off the greedy plan on the H200:
          ~11 of W2's 66 MB per step came from the L2).
          Mode "greedy" has its own step kernel instead (the whole plan is one launch per
          step): persistent programs, each over a run of vocab blocks for a batch tile, gather
          the rows' W1[prev] once, stream whole-rank W2 tiles with STAGES - 1 in flight, keep
          each row's best packed int64 key (order-preserving value bits, then the inverted id,
          NaN = the largest key) and atomically max it into the step's row slot once; the next
          step's programs decode `prev` from it. Steps 1.. use programmatic dependent launch:
          a step's programs start while the previous step finishes and load their first W2
          tile before they wait for it. One small launch at the end writes the N drafts.
  rowstat grid (B,), mode "full": a sampled row's Z and top-p floor from the block
          statistics, once (pick decides with that Z, and reduce reads it).
  cand    grid (B, C), sampled rows without top-k: the Gumbel candidate c, the argmax of
          z + g (Philox in-kernel) over the tokens at or above the block maxima's top-p floor
          (a lower bound of tau; the whole row without top-p), so noise is drawn only for the
          few tiles of a peaked row that reach the floor.
  pick    grid (B, C): the token where no threshold is needed (_markov_pick_kernel): greedy
          rows, degenerate rows, rows without top-k / top-p, and top-p rows whose candidate c
          is kept -- then c is the argmax over the kept set too. Kept iff the fixed-point mass
          strictly above z_c is below resolve()'s target (kernels/sampling.py), summed over the
          tiles whose block maxima lie above z_c (a few tiles of a peaked row). The rest
          (top-k rows; candidates outside the top-p set: about 1 - top_p of flat rows, fewer of
          peaked ones) are flagged for:
  reduce  grid (B, C chunks), flagged rows: row max, Z, the top-k/top-p histogram, bracket.
  select  grid (B, C), flagged rows: exact thresholds (see below).
  refine  grid (B, C) x REFINE_PASSES: rows whose select overflowed CAP candidates only.
  final   grid (B, C), flagged rows: Gumbel-max of z + g over the kept tokens; the row's last
          program (atomic ticket) reduces the chunk winners into the token and `prev`. cand
          and final are one kernel (_markov_gumbel_kernel): a Gumbel-max above a threshold.
          (reduce, select, refine and final: persistent grids from PERSIST_FROM_ROWS rows,
          below.)
The row passes of this plan take the one-row tiling (row_tiling(1, V): 2048-token chunks) at
every B: a search now runs on a few rows, and its time is its slowest program's. From
PERSIST_FROM_ROWS rows on, the gated launches (reduce, select, refine, final) run persistent
grids of about one wave whose programs take the flagged rows' (row, chunk) items in turn
(sampling.gated_grid): launched one program per row and chunk, at B = 64 their programs were
4096 a launch, nearly all of them reading a flag and exiting (34 us a step on the H200 with
no row flagged, now 9). Mode "plain"
(top-k / top-p ignored) takes every token from pick: three launches per step. Without
`candidate` (a launch knob) every non-greedy row goes through the search and final, the plan
of earlier sessions, at row_tiling(B, V).
A "last program" of a row is the one whose atomic ticket (acq_rel, after a CTA barrier) comes
last; it reads the others' partials (bypassing L1) in a fixed order, so results never depend on
which program finished first. Ticket counters and key slots are one zeroed tensor per call.

Top-k / top-p cost (exact thresholds without sorting, kernels/sampling.py): for rows that use
them, reduce also builds a 16-bin mass histogram of its chunk (one more read of z, its loads
two tiles ahead) and the extra `select` launch reads z once more to collect the exact masses
and the candidates the threshold is resolved from, when they fit CAP; it skips the tiles whose
logits blocks all lie below the bracket (most of a peaked row), and resolves up to
FEW_CANDIDATES candidates pairwise rather than by bisection. Near-flat rows overflow
it (top-p 0.95 keeps most of the vocabulary, one 2-nat bin holds ~10^4 tokens): select then
spills the bracket's tokens and the `refine` launches, reading only those, narrow the bracket
~16-fold per pass (typically one histogram pass and one gathering pass; REFINE_PASSES are
always launched, rows already resolved exit at once). On top-p rows without top-k the search
covers only the tokens above a floor the block maxima give (sampling.block_max_floor: their
masses alone reach top_p * Z there): reduce and select skip the spans below it, which on
peaked rows is most of the row. `final` skips the noise for tiles with nothing kept. Every
row pass keeps per-lane partials over its chunk and reduces them once (a reduction per tile, a
CTA barrier each, made these passes ~10x slower than their bytes) and loads the next tile
before it uses the current one. Every launch after the first uses programmatic dependent
launch (PDL_BY_TILE). H200 timings: benchmarks/results/h200_sampler_2026-11-29/.

`mode` (static): "full" launches everything; "plain" ignores top-k/top-p; "greedy" (every row
greedy) runs the greedy step kernel alone -- graphs the engine can capture for batches whose
sampling parameters the host knows. Mode "plain" draws from softmax(l / T) whatever a row's
top-k / top-p, while rejection builds q with them: its drafts are lossless only for batches
without top-k / top-p (the runtime never picks it; a graph for such batches could). Modes
"full" and "plain" write every row's draft_logits,
greedy rows' included, like the reference. Mode "greedy" leaves draft_logits unwritten
(unspecified; the reference gives the logits): rejection never reads a greedy row's q, and
writing B*N*V floats would cost more than the whole greedy sampler (the runtime runs
all-greedy batches with the "greedy" variant, dspark_compile/variants.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dspark_compile.kernels.philox import STREAM_DRAFT
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.region import fusable
from dspark_compile.kernels.sampling import (
    CAND_CAP, FEW_CANDIDATES, HIST_BINS, REFINE_EDGES, REFINE_PASSES, argmax_tokens,
    block_max_floor, check_int32_index, check_pow2, check_sampling_params, fixed_mass, fold_ids,
    gated_grid, gated_per_sm, greedy_rows, gumbel_argmax, hist_tile, lane_argmax_finish,
    lane_argmax_update, launch_select_refine, list_row, load_z, mass_scale_bits, pack_argmax,
    process_logits, reduce_compile_config, refine_compile_config, row_degenerate, row_flags,
    row_list, row_list_p2, row_needed, row_reduce_kernel, row_t, row_tiling, scale_z,
    select_compile_config, threshold_scratch, tile_max, tl_vocab_gumbel, unpack_token, unpack_value)
from dspark_compile.kernels.tl_helpers import (
    compile_config, interpreting, launch, next_pow2, pdl_available, pdl_enter, pdl_launch, pdl_mode,
    pdl_release)


def check_markov_inputs(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos):
    if base_logits.dim() != 3 or not base_logits.dtype.is_floating_point:
        raise ValueError(f"base_logits must be a float [B, N, V] tensor, got {base_logits.dtype} "
                         f"{tuple(base_logits.shape)}")
    B, N, V = base_logits.shape
    if V == 0:
        raise ValueError(f"base_logits must have a vocabulary (V >= 1), got "
                         f"{tuple(base_logits.shape)}")
    if w1.dim() != 2 or w1.shape[0] != V or not w1.dtype.is_floating_point:
        raise ValueError(f"w1 must be a float [{V}, r] tensor, got {w1.dtype} {tuple(w1.shape)}")
    if w2.shape != w1.shape or not w2.dtype.is_floating_point:
        raise ValueError(f"w2 must be a float {tuple(w1.shape)} tensor like w1, got {w2.dtype} "
                         f"{tuple(w2.shape)}")
    if anchor.shape != (B,) or anchor.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"anchor must be an int [{B}] tensor, got {anchor.dtype} "
                         f"{tuple(anchor.shape)}")
    check_sampling_params(B, temperature, top_k, top_p, seed, start_pos, "start_pos")


def markov_bias(prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """W1[prev] @ W2^T in fp32: [B, V] (prev already folded into [0, V))."""
    return w1[prev].float() @ w2.float().T


@fusable("markov_sample")
def markov_sample_reference(base_logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor,
                            w2: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor, seed: torch.Tensor, start_pos: torch.Tensor):
    """-> (drafts [B, N] int64, draft_logits [B, N, V] fp32: step k's base + bias, unscaled,
    every row). The draft distribution of step k is q_k = softmax(process(draft_logits[:, k]));
    rejection sampling computes it where it reads it (sampling.request_probs in its
    reference)."""
    check_markov_inputs(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos)
    B, N, V = base_logits.shape
    greedy = greedy_rows(temperature)
    prev = fold_ids(anchor.to(torch.int64), V)
    drafts, out = [], []
    for k in range(N):
        logits = base_logits[:, k].float() + markov_bias(prev, w1, w2)
        # Gumbel-max over the kept tokens' z itself (log q up to a constant): the fused kernel
        # can then pick the argmax of z + g over the whole row before it knows the kept set
        z = process_logits(logits, temperature, top_k, top_p)
        x = gumbel_argmax(z, seed, start_pos + k, STREAM_DRAFT)
        x = torch.where(greedy, argmax_tokens(logits), x)
        out.append(logits)
        drafts.append(x)
        prev = x
    return torch.stack(drafts, 1), torch.stack(out, 1)



# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

MODES = {"greedy": 0, "plain": 1, "full": 2}
_STREAM_DRAFT = tl.constexpr(STREAM_DRAFT)


@triton.jit
def _markov_logits_kernel(base_ptr, w1_ptr, w2_ptr, anchor_ptr, prev_ptr, temp_ptr,
                          z_ptr, bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, rowkey_ptr,
                          B, V, NBLK, stride_bb, stride_zb, base_off, z_off, step,
                          R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
                          BLOCK_R: tl.constexpr, STAGES: tl.constexpr, EVEN_V: tl.constexpr,
                          DOT_F32: tl.constexpr, REVERSE_ODD: tl.constexpr,
                          CAND: tl.constexpr = False, PDL: tl.constexpr = 0):
    """Modes "full" / "plain", one Markov step, grid (NBLK,): vocab block `blk` for every row
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
        # (sampling.scale_z, bit for bit as here), rejection processes them like the target's
        tl.store(z_ptr + rows[:, None] * stride_zb + offs_v[None, :], lg,
                 mask=rmask[:, None] & vmask[None, :])
        t = tl.load(temp_ptr + rows, mask=rmask, other=1.0).to(tl.float32)
        greedy = t <= 0.0
        z = tl.math.div_rn(lg, tl.where(greedy, 1.0, t)[:, None])
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
                           rowf_ptr, floor_ptr, step, B, V, NBLK, MODE: tl.constexpr,
                           NBLK_P2: tl.constexpr, PDL: tl.constexpr = 0):
    """Grid (B,), candidate plan, mode "full": a sampled row's Z into rowf_ptr[b, 1] and, for
    top-p rows without top-k, the block maxima's floor (sampling.block_max_floor) into
    floor_ptr[b], once per row for cand's and pick's programs (each of them deriving both read
    the row's statistics: ~16 KB a program at B = 64's 64-token blocks). Pick decides with this
    Z and reduce reads it (ZIN), so the exact path's target is the same bits."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V, MODE)
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
    maxima (CAND): degenerate as sampling.row_degenerate decides it (a NaN: the largest key,
    whose value reads NaN; a maximum not finite)."""
    rkey = tl.load(rowkey_ptr + step * B + b)
    m = unpack_value(rkey)
    return rkey, m, row_degenerate(tl.zeros((), tl.int32), m)


@triton.jit
def _gumbel_item(b, c, temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, z_ptr, rowkey_ptr,
                 floor_ptr, rowf_ptr, rowi_ptr, bmax_ptr, best_v_ptr, best_i_ptr, out_ptr,
                 prev_ptr, done_ptr, step, B, V, C, CHUNK, NBLK, stride_zb, stride_db, TILE, MODE,
                 C_P2, BLOCK_V, CAND, PDL):
    """_markov_gumbel_kernel's work item: chunk c of row b."""
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V, MODE)
    if CAND:
        _, _, deg = _row_max(rowkey_ptr, step, B, b)
        run = (~greedy) & (~deg) & (~k_on)
    else:
        deg = tl.zeros((), tl.int1)
        run = ~greedy
    if run:
        if CAND:
            thr = tl.full((), float("-inf"), tl.float32)
            if p_on:                            # (mode "plain" launches no rowstat)
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
                          MODE: tl.constexpr, C_P2: tl.constexpr, BLOCK_V: tl.constexpr,
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
    Work items, GATE, PERSIST: as in sampling.row_reduce_kernel (cand runs grid (B, C), one
    program per item; final is gated, persistent from PERSIST_FROM_ROWS rows).
    """
    pdl_enter(PDL)
    z_ptr += z_off
    done_ptr += done_off
    if PERSIST:
        tl.static_assert(GATE, "a persistent pass takes the rows need_ptr flags")
        count, rank = row_list(need_ptr, B, ROWS_P2)
        for item in range(tl.program_id(0), count * C, tl.num_programs(0)):
            _gumbel_item(list_row(rank, item // C, ROWS_P2), item % C, temp_ptr, topk_ptr,
                topp_ptr, seed_ptr, pos_ptr, z_ptr, rowkey_ptr, floor_ptr, rowf_ptr, rowi_ptr,
                bmax_ptr, best_v_ptr, best_i_ptr, out_ptr, prev_ptr, done_ptr, step, B, V, C,
                CHUNK, NBLK, stride_zb, stride_db, TILE, MODE, C_P2, BLOCK_V, CAND, PDL)
    else:
        b = tl.program_id(0)
        if row_needed(need_ptr, b, GATE):
            _gumbel_item(b, tl.program_id(1), temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr,
                z_ptr, rowkey_ptr, floor_ptr, rowf_ptr, rowi_ptr, bmax_ptr, best_v_ptr,
                best_i_ptr, out_ptr, prev_ptr, done_ptr, step, B, V, C, CHUNK, NBLK, stride_zb,
                stride_db, TILE, MODE, C_P2, BLOCK_V, CAND, PDL)


@triton.jit
def _markov_pick_kernel(temp_ptr, topk_ptr, topp_ptr, z_ptr, rowkey_ptr, cand_ptr, bmax_ptr,
                        rowf_ptr, drafts_ptr, prev_ptr, need_ptr, part_ptr, done_ptr, step, B, V,
                        C, CHUNK, NBLK, stride_zb, stride_db, z_off, done_off,
                        TILE: tl.constexpr, MODE: tl.constexpr, C_P2: tl.constexpr,
                        BLOCK_V: tl.constexpr, SCALE: tl.constexpr, PDL: tl.constexpr = 0):
    """Grid (B, C), after cand (_markov_gumbel_kernel): the step's token without a threshold
    where the row allows it, else need_ptr[b] = 1 (the gated search and final take the row).

    - greedy rows: the row maximum's id; degenerate rows (a NaN, a maximum not finite): 0;
    - rows without top-k / top-p (and every row in mode "plain"): the candidate c, the argmax of
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
    greedy, k, p, k_on, p_on = row_flags(temp_ptr, topk_ptr, topp_ptr, b, V, MODE)
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


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

# (BLOCK_B, BLOCK_V, BLOCK_R, num_warps, STAGES) of the logits kernel per batch tile, one
# program per vocab block. STAGES pipelines the r-loop's W2 loads (cp.async into shared memory:
# STAGES - 1 tiles in flight), which is what a memory-bound stream needs (a persistent grid of
# this kernel measured no better in session 3 and was removed in session 6; the greedy step
# kernel's persistent runs are a different loop). No spills and <= 99 KB shared memory on sm_120
# (tests/kernels/test_sm12x_resources.py). Picked from the H200 sweeps of sessions 2-3
# (benchmarks/results/h200_sampler_2026-11-29/; the sweep's tilings were the greedy plan's
# until session 6, which gave that plan its own kernel): used by modes "full" and "plain".
LOGITS_CONFIGS = {16: (16, 128, 64, 8, 3), 32: (32, 128, 32, 8, 3), 64: (64, 64, 64, 4, 3)}


# From how many rows the candidate plan's gated launches (the search and final of the rows pick
# flags) run persistent grids, from the H200 A/B of session 11 (s11_3, benchmarks/results/
# h200_sampler_2026-11-29/): at B = 64 -125 us per call on peaked rows, -31 on Gaussian ones; at
# B = 16 -13 / +7; at B = 1 and 4 +4 (nothing to save: 64 programs a launch either way, and the
# item loop costs registers).
PERSIST_FROM_ROWS = 16


def _persistent(persistent, B: int) -> bool:
    """The launcher's `persistent` knob (None: PERSIST_FROM_ROWS' choice for B rows)."""
    if persistent is None:
        return B >= PERSIST_FROM_ROWS
    if not isinstance(persistent, bool):
        raise ValueError(f"persistent must be True, False or None, got {persistent!r}")
    return persistent


# Programs per SM of `final`'s persistent grid (sampling.gated_grid, GATED_PER_SM):
# _markov_gumbel_kernel's PERSIST build keeps 4 resident per SM at its registers (80-114) on
# sm_90 and sm_120.
FINAL_PER_SM = 4


def _batch_tile(B: int) -> int:
    """Rows per program of the logits kernels (16, 32 or 64; more rows take more tiles)."""
    return min(64, max(16, next_pow2(B)))


def _logits_config(B: int, R: int, override=None):
    """(BLOCK_B, BLOCK_V, BLOCK_R, num_warps, STAGES) for B rows."""
    if R % 16:
        raise ValueError(f"w1/w2 rank r = {R} must be a multiple of 16 (tensor-core K step)")
    cfg = tuple(override or LOGITS_CONFIGS[_batch_tile(B)])
    if len(cfg) != 5:
        raise ValueError(f"logits config must be (BLOCK_B, BLOCK_V, BLOCK_R, num_warps, "
                         f"STAGES), got {cfg!r}")
    BB, BV, BR, warps, stages = cfg
    while R % BR:
        BR //= 2
    return BB, BV, BR, warps, stages


# (BLOCK_V, num_warps, STAGES, PROGS_PER_SM) of mode "greedy"'s step kernel per batch tile
# (BLOCK_B rows), for 2-byte W1/W2. A W2 tile is [BLOCK_V, r] (the whole rank); PROGS_PER_SM >
# 0: persistent programs, each over a run of about NBLK / (PROGS_PER_SM * SMs) blocks with
# STAGES - 1 tiles in flight; 0: one program per vocab block. <= 99 KB shared memory and no
# spills on sm_120 (tests/kernels/test_sm12x_resources.py). From the H200 sweeps of session 6
# (benchmarks/results/h200_sampler_2026-11-29/, s6_*): what matters is W2 bytes in flight per
# SM (programs x (STAGES - 1) x tile): 128 KB for the 16-row tile (2 programs x 2 tiles x 32 KB;
# the 64-row tile, 64 KB, holds its W1 rows in shared memory too); one program per block (its
# tile all in flight, then an epilogue with nothing in flight) was 25-50 % slower, 8 warps 1.6x
# slower. The 32-row tile (B = 17..32) was not measured: it takes the 16-row tile's shape
# (100,352 B on sm_120, just under the limit).
GREEDY_CONFIGS = {16: (64, 4, 3, 2), 32: (64, 4, 3, 2), 64: (32, 4, 3, 2)}
# fp32 W1/W2 (fp64 ones are computed in fp32, as the reference does): the same tile bytes,
# and one tile in flight for 32 and 64 rows, whose W1 rows take twice the shared memory
GREEDY_CONFIGS_FP32 = {16: (32, 4, 3, 2), 32: (32, 4, 2, 2), 64: (16, 4, 2, 2)}


def _greedy_config(B: int, override=None, wide=False):
    """(BLOCK_B, BLOCK_V, num_warps, STAGES, PROGS_PER_SM) of the greedy step kernel; `wide`:
    4-byte weights."""
    BLOCK_B = _batch_tile(B)
    cfg = tuple(override) if override is not None else \
        (GREEDY_CONFIGS_FP32 if wide else GREEDY_CONFIGS)[BLOCK_B]
    ok = len(cfg) == 4 and all(isinstance(c, int) for c in cfg)
    if ok:
        bv, warps, stages, pps = cfg
        ok = bv >= 16 and bv & (bv - 1) == 0 and warps in (1, 2, 4, 8, 16) and stages >= 1 \
            and pps >= 0
    if not ok:
        raise ValueError(f"greedy config must be ints (BLOCK_V: a power of two >= 16, "
                         f"num_warps: a power of two <= 16, STAGES >= 1, PROGS_PER_SM >= 0), "
                         f"got {cfg!r}")
    return (BLOCK_B, *cfg)


def _num_programs(nblk: int, progs_per_sm: int, device, interpret: bool) -> int:
    """Grid of the greedy step kernel: one program per vocab block, or a persistent grid of
    progs_per_sm programs per SM."""
    if not progs_per_sm:
        return nblk
    # the interpreter has no SMs: 2 "SMs" still make every program loop over several blocks
    sms = 2 if interpret else torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(nblk, progs_per_sm * sms))


def markov_sample_launch(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos,
                         mode: str = "full", *, tile=None, chunk=None, cap=CAND_CAP,
                         logits_config=None, scan_fallback=True,
                         refine_passes=REFINE_PASSES, hist_bins=HIST_BINS,
                         refine_edges=REFINE_EDGES, reverse_odd_steps=True,
                         skip_below_bracket=True, few_candidates=FEW_CANDIDATES,
                         greedy_config=None, pdl=True, block_floor=True, candidate=True,
                         persistent=None, thresholds=None, needs=None):
    """Run the fused sampler (CUDA, or CPU tensors under TRITON_INTERPRET=1).

    `tile`, `chunk`, `cap` are test hooks (small values exercise the multi-program and the
    overflow/refinement paths at toy vocabularies); `scan_fallback=False` (test hook) makes rows
    the bracket + refinement passes cannot resolve come out NaN instead of taking the slow exact
    scan; `logits_config` overrides LOGITS_CONFIGS and `refine_passes` (>= 1) REFINE_PASSES
    (tuning: each pass is one launch per step, near-empty for rows that need none).
    `hist_bins` (tuning; a power of two in [4, 128]) replaces HIST_BINS: the threshold mass
    histograms' bins, always spanning 32 nats below the row max. Their cost per token grows
    with the bin count; the brackets' width shrinks with it (fewer tokens spilled, fewer
    refinement passes). `refine_edges` (tuning; a power of two in [4, 128]) replaces
    REFINE_EDGES: the edges each refinement pass splits an overflowing bracket at.
    `reverse_odd_steps` (tuning; default on): odd steps' logits programs walk the vocab blocks
    from the end, so they start on the W2 rows the step before left in the L2.
    `skip_below_bracket` (tuning; default on): the select pass neither reads nor bins tiles
    whose logits blocks all lie below the threshold bracket. `few_candidates` (tuning, test
    hook; 0 or a power of two): thresholds over up to this many candidates are found pairwise,
    over more by bisection. `logits_config` applies to modes "full" and "plain" only,
    `greedy_config` (overrides GREEDY_CONFIGS / GREEDY_CONFIGS_FP32) to mode "greedy" only.
    `pdl` (tuning; NVIDIA sm_90+ only): every launch of the call but the first uses
    programmatic dependent launch: True, False or a tl_helpers.PDL_MODES key. Mode "greedy":
    on unless False / "off". Modes "full" / "plain": the next launch may start once every
    program of this one has started ("early") or has finished its main loop ("late"); True
    takes PDL_BY_TILE's choice for B rows. `block_floor` (tuning; default on): top-p rows without
    top-k search their threshold only over the tokens above a floor the block maxima give
    (sampling.block_max_floor): reduce and select skip the rest of the row. `candidate`
    (tuning; default on): modes "full" / "plain" draw each step's Gumbel candidate above the
    block maxima's top-p floor (cand) and keep it where the kept set holds it (pick); the
    threshold search and final run only for the rows it leaves (top-k rows, candidates outside
    the top-p set). Off: every non-greedy row is searched and sampled by final. `persistent`
    (tuning, with `candidate`; None: from PERSIST_FROM_ROWS rows on): those gated launches
    run grids of about one wave whose programs take the flagged rows' (row, chunk) items in
    turn (sampling.gated_grid), not one program per row and chunk, most of which would only
    read a flag and exit.
    `thresholds`, `needs` (test hooks, lists; modes "full" / "plain"): each step appends
    copies of its row parameters (rowf [B, 4]: m, Z, tau, kept mass; rowi [B, 4]: ...,
    degenerate) after final -- meaningful with `candidate` off, where every row is searched --
    and of pick's flags (need [B] int32, 1: the row took the search; `candidate` on).
    """
    if not isinstance(refine_passes, int) or refine_passes < 1:
        raise ValueError(f"refine_passes must be an int >= 1, got {refine_passes!r}")
    check_pow2("hist_bins", hist_bins, 4, 128)
    check_pow2("refine_edges", refine_edges, 4, 128)
    NB = hist_bins
    check_markov_inputs(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos)
    check_int32_index(base_logits=base_logits, w2=w2)   # draft_logits has base_logits' shape
    persist = _persistent(persistent, base_logits.shape[0])
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    MODE = MODES[mode]
    B, N, V = base_logits.shape
    R = w1.shape[1]
    dev = base_logits.device
    # every token is written (by pick, reduce, final or the packed maxima), and every
    # draft_logits row by the logits kernel (modes "full" / "plain"), so no fill
    drafts = torch.empty((B, N), dtype=torch.int64, device=dev)
    out = torch.empty((B, N, V), dtype=torch.float32, device=dev)
    if B == 0 or N == 0:
        return drafts.zero_(), out
    if base_logits.stride(-1) != 1:
        base_logits = base_logits.contiguous()
    w1 = w1.contiguous()
    w2 = w2.contiguous()
    if w1.dtype != w2.dtype:
        raise ValueError(f"w1 and w2 must share a dtype, got {w1.dtype} and {w2.dtype}")
    if w1.dtype == torch.float64:       # the bias is fp32 math, as in the reference
        w1, w2 = w1.float(), w2.float()
    anchor = anchor.contiguous()
    if MODE == 0:
        # one launch per step, its row reduction an atomic max of packed keys (zero-filled: zero
        # is below every key), then one launch writing the tokens
        packed = torch.zeros((N, B), dtype=torch.int64, device=dev)
        _greedy_steps(base_logits, w1, w2, anchor, packed, greedy_config, _pdl_mode(pdl) > 0,
                      reverse_odd_steps)
        launch(_markov_greedy_tokens_kernel)[(N,)](packed, drafts, B, drafts.stride(0),
                                                   BLOCK=min(1024, next_pow2(B)), num_warps=4)
        return drafts, out
    kern = _markov_logits_kernel
    dot_f32 = interpreting(kern) or w1.dtype == torch.float32
    # programmatic dependent launch for every launch after the first (the first waits for the
    # op's inputs the plain way): each kernel enters with pdl_enter, so only the launch latency
    # between the launches of a step overlaps
    pdl = _pdl_mode(pdl, B)             # checked everywhere, used where available
    if not pdl_available(kern, dev):
        pdl = 0
    BLOCK_B, BLOCK_V, BLOCK_R, warps1, stages1 = _logits_config(B, R, logits_config)
    NBLK = triton.cdiv(V, BLOCK_V)
    # the candidate plan's row passes search only the few rows its pick leaves, so they take the
    # one-row tiling (short chunks, many programs per row: a search is its slowest program)
    TILE, CHUNK, C = row_tiling(1 if candidate else B, V, tile, chunk)
    HTILE = hist_tile(TILE, NB)
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    prev = torch.empty((B,), dtype=i64, device=dev)     # step 0 folds the anchor itself
    temperature = temperature.contiguous()
    top_k, top_p, seed, start_pos = (t.contiguous() for t in (top_k, top_p, seed, start_pos))
    bmax = torch.empty((B, NBLK), dtype=f32, device=dev)
    bsum = torch.empty((B, NBLK), dtype=f32, device=dev)
    barg = torch.empty((B, NBLK), dtype=i32, device=dev)
    bnan = torch.empty((B, NBLK), dtype=i32, device=dev)
    rowf = torch.empty((B, 4), dtype=f32, device=dev)
    rowi = torch.empty((B, 4), dtype=i32, device=dev)
    # one memset for every ticket/slot counter of the call, [step, counter, row], then (mode
    # "full") the refine state per row, then (candidate) the packed row maxima [step, row] as
    # int64
    NCNT = 6 + 2 * refine_passes
    nrst = 4 * B if MODE == 2 else 0
    ncnt = N * NCNT * B + nrst
    nkey = N * B if candidate else 0
    zeroed = torch.zeros((ncnt + ncnt % 2 + 2 * nkey,), dtype=i32, device=dev)
    counters = zeroed[:N * NCNT * B].view(N, NCNT, B)
    rst = zeroed[N * NCNT * B:ncnt].view(B, 4) if MODE == 2 else zeroed[:1]
    rowkey = zeroed[ncnt + ncnt % 2:].view(i64) if candidate else prev
    thr = threshold_scratch(B if MODE == 2 else 1, C, CHUNK, cap, NB, refine_edges, dev, TILE)
    best_v = torch.empty((B, C), dtype=f32, device=dev)
    best_i = torch.empty((B, C), dtype=i32, device=dev)
    need = torch.empty((B,), dtype=i32, device=dev) if candidate else None
    gate = need is not None     # the search and final take the rows pick flags
    persist = gate and persist      # ... in grids of about one wave (gated_grid)
    part = torch.empty((B, C), dtype=i64, device=dev) if candidate else None
    cand = torch.empty((B,), dtype=i64, device=dev) if candidate else None
    rowfl = torch.empty((B,), dtype=f32, device=dev) if candidate else None
    C_P2 = next_pow2(C)
    sb, sz = base_logits.stride(0), out.stride(0)
    scale = float(2 ** mass_scale_bits(V))
    for k in range(N):
        # step k's slices are passed as offsets rather than views (plainer for export)
        zo = k * out.stride(1)
        cnt = [(k * NCNT + j) * B for j in range(NCNT)]
        launch(_markov_logits_kernel)[(NBLK,)](
            base_logits, w1, w2, anchor, prev, temperature, out, bmax, barg, bsum, bnan, rowkey,
            B, V, NBLK, sb, sz,
            k * base_logits.stride(1), zo, k,
            R=R, BLOCK_B=BLOCK_B, BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R, STAGES=stages1,
            EVEN_V=V % BLOCK_V == 0, DOT_F32=dot_f32, REVERSE_ODD=reverse_odd_steps,
            CAND=bool(candidate), PDL=pdl, num_warps=warps1, **pdl_launch(pdl > 0 and k > 0))
        if candidate:
            if MODE == 2:
                launch(_markov_rowstat_kernel)[(B,)](
                    temperature, top_k, top_p, rowkey, bmax, bsum, rowf, rowfl, k, B, V, NBLK,
                    MODE=MODE, NBLK_P2=next_pow2(NBLK), PDL=pdl, num_warps=4,
                    **pdl_launch(pdl > 0))
            launch(_markov_gumbel_kernel)[(B, C)](       # cand
                temperature, top_k, top_p, seed, start_pos, out, rowkey, rowfl, rowf, rowi, bmax,
                best_v, best_i, cand, prev, counters, rowi, k, B, V, C, CHUNK, NBLK, sz,
                drafts.stride(0), zo, cnt[5 + 2 * refine_passes], TILE=TILE, MODE=MODE,
                C_P2=C_P2, BLOCK_V=BLOCK_V, CAND=True, PDL=pdl, num_warps=4,
                **pdl_launch(pdl > 0))
            launch(_markov_pick_kernel)[(B, C)](
                temperature, top_k, top_p, out, rowkey, cand, bmax, rowf, drafts, prev, need,
                part, counters, k, B, V, C, CHUNK, NBLK, sz, drafts.stride(0), zo,
                cnt[4 + 2 * refine_passes], TILE=TILE, MODE=MODE, C_P2=C_P2, BLOCK_V=BLOCK_V,
                SCALE=scale, PDL=pdl, num_warps=4, **pdl_launch(pdl > 0))
            if MODE == 1:       # every token is final: nothing to search or sample
                if needs is not None:
                    needs.append(need.clone())
                continue
        # only top-k/top-p rows (mode "full") use the chunk programs; otherwise one per row
        CR = C if MODE == 2 else 1
        launch(row_reduce_kernel)[gated_grid(B, CR, gated_per_sm("reduce", dev), dev,
                                             persist)](
            bmax, barg, bsum, bnan, temperature, top_k, top_p, out, drafts, prev, rowf,
            rowi, thr["hist"], rst, counters, thr["floor"], thr["live"],
            rowi if need is None else need, V, NBLK, CR, CHUNK, sz,
            drafts.stride(0), zo, k, cnt[0], 1, B, NBLK_P2=next_pow2(NBLK), TILE=HTILE, NB=NB,
            MODE=MODE, C_P2=C_P2, BLOCK_V=BLOCK_V, NT_P2=thr["live"].shape[2],
            FLOOR=bool(block_floor) and MODE == 2, GATE=gate, SCALED=True,
            ZIN=bool(candidate), ROWS_P2=row_list_p2(B, persist), PERSIST=persist, PDL=pdl,
            num_warps=4, **pdl_launch(pdl > 0))
        if MODE == 2:
            # exact thresholds; rows whose bracket overflowed CAP take the refinement passes
            launch_select_refine(
                (temperature, top_k, top_p), out, zo, sz, rowf, rowi, rst, thr, counters,
                (cnt[1], cnt[2]), [(cnt[4 + 2 * r], cnt[5 + 2 * r]) for r in range(refine_passes)],
                V=V, C=C, CHUNK=CHUNK, RPR=1, TILE=TILE, NB=NB, edges=refine_edges, cap=cap,
                scan=scan_fallback, bmax=bmax, BLOCK_V=BLOCK_V, skip=skip_below_bracket,
                few=few_candidates, pdl=pdl, need=need, scaled=True, persist=persist)
        launch(_markov_gumbel_kernel)[gated_grid(B, C, FINAL_PER_SM, dev, persist)](  # final
            temperature, top_k, top_p, seed, start_pos, out, rowkey, bmax, rowf, rowi, bmax,
            best_v, best_i, drafts, prev, counters, rowi if need is None else need, k, B, V, C,
            CHUNK, NBLK, sz, drafts.stride(0), zo, cnt[3], TILE=TILE, MODE=MODE, C_P2=C_P2,
            BLOCK_V=BLOCK_V, GATE=gate, ROWS_P2=row_list_p2(B, persist), PERSIST=persist,
            PDL=pdl, num_warps=4, **pdl_launch(pdl > 0))
        if thresholds is not None:
            thresholds.append((rowf.clone(), rowi.clone()))
        if needs is not None and need is not None:
            needs.append(need.clone())
    return drafts, out


# When the full plan's next launch may start (tl_helpers.pdl_release), per batch tile, from the
# H200 A/B of session 7 (benchmarks/results/h200_sampler_2026-11-29/, s7_3): "late" was 9-37 us
# faster per call at B = 4 and 27 us at B = 1 on Gaussian rows (5 us slower on peaked ones),
# equal at B = 16; "early" 10-19 us faster at B = 64. B = 17..32 was not measured.
PDL_BY_TILE = {16: "late", 32: "late", 64: "early"}


def _pdl_mode(pdl, B: int = 1) -> int:
    """The kernels' PDL constexpr for the launcher's `pdl` knob (full / plain plans)."""
    return pdl_mode(pdl, PDL_BY_TILE[_batch_tile(B)])


def _greedy_steps(base_logits, w1, w2, anchor, packed, config, pdl, reverse_odd):
    """Mode "greedy": one step-kernel launch per Markov step into `packed` [N, B]."""
    B, N, V = base_logits.shape
    R = w1.shape[1]
    if R % 16:
        raise ValueError(f"w1/w2 rank r = {R} must be a multiple of 16 (tensor-core K step)")
    BLOCK_B, BLOCK_V, warps, stages, pps = _greedy_config(B, config, w1.element_size() > 2)
    kern = _markov_greedy_step_kernel
    interp = interpreting(kern)
    NBLK = triton.cdiv(V, BLOCK_V)
    NPROG = _num_programs(NBLK, pps, base_logits.device, interp)
    # programmatic dependent launch (sm_90+): step k + 1 starts while step k finishes (4-7 us
    # per call on the H200). Step 0 is launched plainly, so whatever wrote the op's inputs has
    # finished before any step reads them; a later step reads only W2 before its wait.
    pdl = pdl and pdl_available(kern, base_logits.device)
    for k in range(N):
        extra = pdl_launch(pdl and k > 0)
        launch(kern)[(NPROG, triton.cdiv(B, BLOCK_B))](
            base_logits, w1, w2, anchor, packed, B, V, NBLK, base_logits.stride(0),
            k * base_logits.stride(1), k, NPROG,
            R=R, R_P2=next_pow2(R), BLOCK_B=BLOCK_B, BLOCK_V=BLOCK_V, STAGES=stages,
            EVEN_V=V % BLOCK_V == 0, DOT_F32=interp or w1.dtype == torch.float32,
            PERSIST=NPROG < NBLK, REVERSE_ODD=reverse_odd, PDL=pdl, num_warps=warps, **extra)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def markov_sample_mode_reference(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed,
                                 start_pos, mode: str = "full"):
    """The reference under a launch mode: "greedy" treats every row as greedy, "plain" ignores
    top-k/top-p, "full" is markov_sample_reference itself."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if mode == "greedy":
        temperature = torch.zeros_like(temperature)
    elif mode == "plain":
        top_k, top_p = torch.zeros_like(top_k), torch.ones_like(top_p)
    return markov_sample_reference(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed,
                                   start_pos)


def _markov_fake(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos,
                 mode="full"):
    B, N, V = base_logits.shape
    return (base_logits.new_empty((B, N), dtype=torch.int64),
            base_logits.new_empty((B, N, V), dtype=torch.float32))


@dspark_op("markov_sample", reference=markov_sample_mode_reference, fake=_markov_fake)
def markov_sample(base_logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, seed: torch.Tensor, start_pos: torch.Tensor,
                  mode: str = "full") -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Markov sampler: (drafts, draft_logits). draft_logits are unspecified on CUDA in
    mode "greedy" (never read; the module docstring says why)."""
    return markov_sample_launch(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed,
                                start_pos, mode)


# SM12x readiness: every configuration the launcher picks at the Flash dims (V = 129280,
# r = 256, bf16 W1/W2, fp32 base logits as the draft head produces them), batch tiles 16/32/64.
# "i32:16": integers the launch passes as multiples of 16 (V, N*V strides, chunk sizes), which
# Triton's JIT specialises on, so the check compiles what runs. Configurations that differ only
# in a runtime integer compile to the same kernel and are listed once.
_V_FLASH, _R_FLASH = 129280, 256
_D16 = "i32:16"


def _markov_configs():
    out = []
    flags = dict(temp_ptr="*fp32", topk_ptr="*i64", topp_ptr="*fp32")
    for B in (1, 32, 64):
        BLOCK_B, BLOCK_V, BLOCK_R, warps, stages = _logits_config(B, _R_FLASH)
        out.append(compile_config(_markov_logits_kernel, dict(
            base_ptr="*fp32", w1_ptr="*bf16", w2_ptr="*bf16", anchor_ptr="*i64",
            prev_ptr="*i64", temp_ptr="*fp32", z_ptr="*fp32",
            bmax_ptr="*fp32", barg_ptr="*i32", bsum_ptr="*fp32", bnan_ptr="*i32",
            rowkey_ptr="*i64", B="i32",
            V=_D16, NBLK="i32", stride_bb=_D16, stride_zb=_D16, base_off=_D16, z_off=_D16,
            step="i32"),
            dict(R=_R_FLASH, BLOCK_B=BLOCK_B, BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R, STAGES=stages,
                 EVEN_V=_V_FLASH % BLOCK_V == 0, DOT_F32=False, REVERSE_ODD=True, CAND=True,
                 PDL=_pdl_mode(True, B)),
            warps))
        for wide in (False, True):          # bf16 weights (Flash), fp32 ones
            BLOCK_B, BLOCK_V, warps, stages, pps = _greedy_config(B, wide=wide)
            wt = "*fp32" if wide else "*bf16"
            out.append(compile_config(_markov_greedy_step_kernel, dict(
                base_ptr="*fp32", w1_ptr=wt, w2_ptr=wt, anchor_ptr="*i64",
                packed_ptr="*i64", B="i32", V=_D16, NBLK="i32", stride_bb=_D16, base_off=_D16,
                step="i32", NPROG="i32"),
                dict(R=_R_FLASH, R_P2=_R_FLASH, BLOCK_B=BLOCK_B, BLOCK_V=BLOCK_V, STAGES=stages,
                     EVEN_V=_V_FLASH % BLOCK_V == 0, DOT_F32=wide, PERSIST=bool(pps),
                     REVERSE_ODD=True, PDL=True),
                warps))
    out.append(compile_config(_markov_greedy_tokens_kernel, dict(
        packed_ptr="*i64", drafts_ptr="*i64", B="i32", stride_db="i32"), dict(BLOCK=64), 4))
    # the default (candidate) plan's row passes take the one-row tiling at every B; per batch
    # size the logits kernel's block differs (BLOCK_V: 128 up to 32 rows, then 64), and so do
    # the PDL mode and the block statistics' count
    TILE, CHUNK, C = row_tiling(1, _V_FLASH, None, None)
    for B in (1, 16, 64):
        cp, bv = next_pow2(C), _logits_config(B, _R_FLASH)[1]
        pdl = _pdl_mode(True, B)        # what a launch on sm_90+ (SM12x included) compiles
        persist = _persistent(None, B)  # the gated launches' default build for B rows
        # (the default plan: the pick kernel, then the search and final gated to the rows it
        # leaves, mode "full" only)
        out.append(reduce_compile_config(TILE, CHUNK, C, bv, _V_FLASH, 2, pdl, gate=True,
                                         scaled=True, zin=True, rows=B, persist=persist))
        out.append(select_compile_config(TILE, CHUNK, C, bv, _V_FLASH, pdl=pdl, gate=True,
                                         scaled=True, rows=B, persist=persist))
        out.append(refine_compile_config(TILE, C, _V_FLASH, pdl=pdl, scaled=True, gate=True,
                                         rows=B, persist=persist))
        gumbel_sig = dict(
            **flags, seed_ptr="*i64", pos_ptr="*i64", z_ptr="*fp32", rowkey_ptr="*i64",
            floor_ptr="*fp32", rowf_ptr="*fp32", rowi_ptr="*i32", bmax_ptr="*fp32",
            best_v_ptr="*fp32", best_i_ptr="*i32", out_ptr="*i64", prev_ptr="*i64",
            done_ptr="*i32", need_ptr="*i32", step="i32", B="i32", V=_D16, C=_D16, CHUNK=_D16,
            NBLK="i32", stride_zb=_D16, stride_db="i32", z_off=_D16, done_off="i32")
        out.append(compile_config(_markov_gumbel_kernel, gumbel_sig, dict(
            TILE=TILE, MODE=2, C_P2=cp, BLOCK_V=bv, CAND=False, GATE=True,
            ROWS_P2=row_list_p2(B, persist), PERSIST=persist, PDL=pdl), 4))  # final
        nblk_p2 = next_pow2(triton.cdiv(_V_FLASH, bv))
        for mode in (1, 2):
            if mode == 2:               # (mode "plain" launches no rowstat)
                out.append(compile_config(_markov_rowstat_kernel, dict(
                    **flags, rowkey_ptr="*i64", bmax_ptr="*fp32", bsum_ptr="*fp32",
                    rowf_ptr="*fp32", floor_ptr="*fp32", step="i32", B="i32", V=_D16,
                    NBLK="i32"),
                    dict(MODE=mode, NBLK_P2=nblk_p2, PDL=pdl), 4))
            out.append(compile_config(_markov_gumbel_kernel, gumbel_sig, dict(      # cand
                TILE=TILE, MODE=mode, C_P2=cp, BLOCK_V=bv, CAND=True, GATE=False, ROWS_P2=1,
                PERSIST=False, PDL=pdl), 4))
            out.append(compile_config(_markov_pick_kernel, dict(
                **flags, z_ptr="*fp32", rowkey_ptr="*i64", cand_ptr="*i64",
                bmax_ptr="*fp32", rowf_ptr="*fp32", drafts_ptr="*i64", prev_ptr="*i64",
                need_ptr="*i32", part_ptr="*i64", done_ptr="*i32", step="i32", B="i32",
                V=_D16, C=_D16, CHUNK=_D16, NBLK="i32", stride_zb=_D16, stride_db="i32",
                z_off=_D16, done_off="i32"),
                dict(TILE=TILE, MODE=mode, C_P2=cp, BLOCK_V=bv,
                     SCALE=float(2 ** mass_scale_bits(_V_FLASH)), PDL=pdl), 4))
    return out


add_compile_configs("markov_sample", _markov_configs())
