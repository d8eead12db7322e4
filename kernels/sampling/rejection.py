"""`dspark::rejection_sample`: rejection sampling of the DSpark drafts against the target
(reference.rejection_sample_reference is the contract), fused; with N = 0 and STREAM_TARGET
it is also plain target sampling (sample.py).

Dataflow (mode "full"): stats x 2 -> walk -> search x 2 (target rows and, on a side stream,
draft rows; only the rows the walk flags) -> sums (N >= 2) -> accept -> resample
(rejection_kernels.py). The statistics read all B (N + 1) target and B N draft rows once, 4 V
bytes each; each searched row is read ~3 times more (from L2 at small B). A block-verified
request (verify[b] != 0) has every row searched (its residual masses read whole
distributions) and its N - 1 middle target and draft rows read once more by sums (8 V bytes a
row: Flash, N = 5, 4.1 MB a request). Mode "greedy": each target row read once for its
argmax (Flash, B = 64: 199 MB, ~47 us at 4.2 TB/s), draft_logits never read, no scratch.
"""
from __future__ import annotations

import torch
import triton

from dspark_compile.kernels.philox import STREAM_RESAMPLE, STREAM_TARGET
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.sampling.plan import (HIST_BINS, MODES, PDL_BY_REQUESTS, PLAN,
                                                  REFINE_EDGES, REFINE_PASSES, SamplerPlan)
from dspark_compile.kernels.sampling.reference import (check_rejection_inputs,
                                                       rejection_sample_reference)
from dspark_compile.kernels.sampling.rejection_kernels import (
    _accept_kernel, _block_sums_kernel, _bound_walk_kernel, _greedy_accept_kernel,
    _resample_kernel, _rows_argmax_kernel, _rows_stats_kernel)
from dspark_compile.kernels.sampling.row_launch import (
    check_int32_index, gated_grid, gated_per_sm, hist_tile, launch_select_refine, mass_scale_bits,
    reduce_compile_config, refine_compile_config, row_list_p2, row_tiling, select_compile_config,
    threshold_scratch)
from dspark_compile.kernels.sampling.row_passes import row_reduce_kernel
from dspark_compile.kernels.tl_helpers import (
    PDL_MODES, compile_config, launch, next_pow2, pdl_available, pdl_launch, pdl_mode)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def rejection_sample_mode_reference(target_logits, draft_tokens, draft_logits, temperature,
                                    top_k, top_p, seed, start_pos, verify=None,
                                    mode: str = "full"):
    """The reference under the op's mode: "greedy" treats every row as greedy (and so ignores
    verify)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if mode == "greedy":
        temperature = torch.zeros_like(temperature)
    return rejection_sample_reference(target_logits, draft_tokens, draft_logits, temperature,
                                      top_k, top_p, seed, start_pos, verify)


# ----------------------------------------------------------------------------------------------
# Launcher (kernels: rejection_kernels.py)
# ----------------------------------------------------------------------------------------------

def rejection_sample_launch(target_logits, draft_tokens, draft_logits, temperature, top_k,
                            top_p, seed, start_pos, plan: SamplerPlan = PLAN, verify=None):
    """Run the fused rejection sampler under `plan` (CUDA, or CPU tensors under
    TRITON_INTERPRET=1): (tokens [B, N + 1], num_sampled [B]). verify: [B] int, nonzero for
    the requests block verification decides (None: none)."""
    return launch_rejection(plan, STREAM_RESAMPLE, target_logits, draft_tokens, draft_logits,
                            temperature, top_k, top_p, seed, start_pos, verify)


def launch_rejection(plan, stream, target_logits, draft_tokens, draft_logits, temperature,
                     top_k, top_p, seed, start_pos, verify=None):
    """rejection_sample_launch with the residual / bonus noise keyed by `stream`
    (STREAM_TARGET: plain target sampling, sample.py)."""
    plan.check_rejection()
    check_rejection_inputs(target_logits, draft_tokens, draft_logits, temperature, top_k, top_p,
                           seed, start_pos, verify)
    check_int32_index(target_logits=target_logits, draft_logits=draft_logits)
    B, N1, V = target_logits.shape
    N = N1 - 1
    dev = target_logits.device
    mode_pdl = _pdl_mode(plan.pdl, B)       # checked everywhere, used where available
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
    if plan.mode == "greedy":
        _greedy(target_logits, drafts, tokens, num, plan.test_hooks.tile, plan.chunk)
        return tokens, num
    if verify is None:      # every request token-wise
        verify = torch.zeros((B,), dtype=torch.int64, device=dev)
    meta = [t.contiguous() for t in (temperature, top_k, top_p, seed, start_pos, verify)]
    args = (target_logits, drafts, draft_logits, N, *meta, tokens, num)
    if not pdl_available(_accept_kernel, dev):
        mode_pdl = 0
    _parallel(plan, stream, mode_pdl, *args)
    return tokens, num



def _pdl_mode(pdl, B: int) -> int:
    """The kernels' PDL constexpr for plan.pdl (PDL_BY_REQUESTS' choice for B requests)."""
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


def _walk(logits, st, dlogits, dst, drafts, flags, seed, start_pos, verify, need, dneed, dec,
          pdl=0):
    """The bound walk (one program per request) over the target and draft logits (_rows_views)
    and their statistics, into need [rows], dneed [draft rows] and dec [rows] (int32)."""
    B, N1, V = logits.shape
    NBLK = st["bmax"].shape[1]
    launch(_bound_walk_kernel)[(B,)](
        drafts, logits, st["bmax"], st["bsum"], st["bnan"], dlogits, dst["bmax"], dst["bsum"],
        dst["bnan"], *flags, seed, start_pos, verify, need, dneed, dec, N1 - 1, V, NBLK,
        drafts.stride(0), logits.stride(1), dlogits.stride(1), N_P2=next_pow2(N1),
        NBLK_P2=next_pow2(NBLK), SCALE=float(2 ** mass_scale_bits(V)), PDL=pdl, num_warps=4,
        **pdl_launch(pdl))


def _search(plan, z, st, flags, rowf, rowi, rst, thr, counters, need, tiling, pdl):
    """Exact thresholds of the rows of z [B, n, V] (a _rows_view, n rows per request) that
    `need` flags (every row without it): reduce, select and the refinement passes, into rowf /
    rowi [B * n, 4]. counters: int32 [3 * rows + 2 * REFINE_PASSES * rows], zeroed; rst: the
    refine state [rows, 4], zeroed; thr: threshold_scratch for at least B * n rows;
    plan.rejection_persistent: the flagged rows in grids of about one wave (gated_grid)."""
    B, n, V = z.shape
    R, dev = B * n, z.device
    TILE, CHUNK, C = tiling
    NBLK = st["bmax"].shape[1]
    targ = torch.empty((R,), dtype=torch.int64, device=dev)     # greedy rows' argmax
    scratch = torch.empty((R,), dtype=torch.int64, device=dev)
    persist = plan.rejection_persistent and need is not None
    launch(row_reduce_kernel)[gated_grid(R, C, gated_per_sm("reduce", dev), dev, persist)](
        st["bmax"], st["barg"], st["bsum"], st["bnan"], *flags, z, targ, scratch, rowf, rowi,
        thr["hist"], rst, counters, thr["floor"], thr["live"], rowi if need is None else need, V,
        NBLK, C, CHUNK, z.stride(1), 1, 0, 0, 0, n, R, NBLK_P2=next_pow2(NBLK),
        TILE=hist_tile(TILE, HIST_BINS), NB=HIST_BINS, C_P2=next_pow2(C), BLOCK_V=TILE,
        NT_P2=thr["live"].shape[2], FLOOR=True, GATE=need is not None, SCALED=True,
        ROWS_P2=row_list_p2(R, persist), PERSIST=persist, PDL=pdl, num_warps=4,
        **pdl_launch(pdl))
    # exact thresholds; rows whose bracket overflowed CAP take the refinement passes
    launch_select_refine(
        plan, flags, z, 0, z.stride(1), rowf, rowi, rst, thr, counters, (R, 2 * R),
        [(3 * R + 2 * r * R, 3 * R + (2 * r + 1) * R) for r in range(REFINE_PASSES)],
        st["bmax"], V=V, C=C, CHUNK=CHUNK, RPR=n, TILE=TILE, BLOCK_V=TILE, need=need, pdl=pdl,
        scaled=True, persist=persist)
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


def _parallel(plan, stream, pdl, logits, drafts, dlogits, N, temperature, top_k, top_p, seed,
              start_pos, verify, tokens, num):
    """Mode "full": the module docstring's launches."""
    B, N1, V = logits.shape
    R, RD, dev = B * N1, B * N, logits.device
    logits = _rows_view(logits)
    # the row passes' tiling follows the rows they search: with the bound walk about two per
    # request (the resampled or bonus target row and its draft row; the undecided tests' few
    # more), so shorter chunks at small B (`ours-chunk*`: B = 1 -7 / -12 us, B = 4 -21 / -28 us
    # peaked / Gaussian; B = 16 and 64 keep 8192-token chunks, measured best there;
    # benchmarks/results/README.md, rejection tiling, 5af8e48)
    bounds = plan.bounds and N > 0
    TILE, CHUNK, C = tiling = row_tiling(2 * B if bounds else R, V, plan.test_hooks.tile,
                                         plan.chunk)
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
    side = _side_stream(dev) if plan.overlap and N > 0 and logits.is_cuda else None
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
    need = dneed = None
    thr = threshold_scratch(R, C, CHUNK, plan.cap, HIST_BINS, REFINE_EDGES, dev, TILE)
    dthr = thr if side is None else threshold_scratch(RD, C, CHUNK, plan.cap, HIST_BINS,
                                                      REFINE_EDGES, dev, TILE)
    if bounds:
        need = torch.empty((R,), dtype=i32, device=dev)
        dneed = torch.empty((RD,), dtype=i32, device=dev)
        _walk(logits, st, dlogits, dst, drafts, flags, seed, start_pos, verify, need, dneed, dec,
              pdl)
    # the draft rows' thresholds: only those the walk flags are searched
    targ, _ = _side_by_side(
        side, lambda: _search(plan, logits, st, flags, rowf, rowi, rst, thr, cnt_t, need, tiling,
                              pdl),
        lambda: _search(plan, dlogits, dst, flags, drowf, drowi, drst, dthr, cnt_d, dneed,
                        tiling, pdl) if N > 0 else None)
    accepted = torch.empty((B,), dtype=i32, device=dev)
    weight = torch.empty((B,), dtype=f32, device=dev)      # the residual's weight w_a
    part_f = torch.empty((B, C, 3), dtype=f32, device=dev)
    part_i = torch.empty((B, C, 3), dtype=i32, device=dev)
    sz, sd = logits.stride(1), dlogits.stride(1)
    NBLK = st["bmax"].shape[1]
    # block verification's residual masses S_1 .. S_{N-1} (chunk partials; only block requests'
    # programs work, the others exit: a step of token-wise rows pays one launch)
    sums = torch.empty((max(B * (N - 1), 1), C), dtype=f32, device=dev)
    if N > 1:
        launch(_block_sums_kernel)[(B * (N - 1), C)](
            drafts, logits, rowf, rowi, dlogits, drowf, drowi, st["bmax"], *flags, verify, sums,
            N, V, C, CHUNK, NBLK, drafts.stride(0), sz, sd, TILE=TILE, BLOCK=TILE, PDL=pdl,
            num_warps=4, **pdl_launch(pdl))
    launch(_accept_kernel)[(B,)](
        drafts, logits, rowf, rowi, dlogits, drowf, drowi, targ, *flags, seed, start_pos, verify,
        dec, sums, tokens, num, accepted, weight, N, V, C, drafts.stride(0), tokens.stride(0), sz,
        sd, C_P2=next_pow2(C), PDL=pdl, num_warps=1, **pdl_launch(pdl))
    launch(_resample_kernel)[(B, C)](
        logits, rowf, rowi, dlogits, drowf, drowi, st["bmax"], *flags, seed, start_pos, accepted,
        weight, tokens, part_f, part_i, cnt_r, N, V, C, CHUNK, NBLK, tokens.stride(0), sz,
        sd, 0, TILE=TILE, BLOCK=TILE, C_P2=next_pow2(C), STREAM=stream, PDL=pdl, num_warps=4,
        **pdl_launch(pdl))



# ----------------------------------------------------------------------------------------------
# Op registration
# ----------------------------------------------------------------------------------------------

def _rejection_fake(target_logits, draft_tokens, draft_logits, temperature, top_k, top_p, seed,
                    start_pos, verify=None, mode="full"):
    B, N1, _ = target_logits.shape
    return (target_logits.new_empty((B, N1), dtype=torch.int64),
            target_logits.new_empty((B,), dtype=torch.int64))


@dspark_op("rejection_sample", reference=rejection_sample_mode_reference, fake=_rejection_fake)
def rejection_sample(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, seed: torch.Tensor, start_pos: torch.Tensor,
                     verify: torch.Tensor | None = None, mode: str = "full"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused rejection sampling; mode "greedy" treats every row as greedy (the module
    docstring's greedy plan); verify [B] int: VERIFY_BLOCK rows take block verification
    (None: every row token-wise)."""
    plan = PLAN if mode == PLAN.mode else PLAN.replace(mode=mode)
    return rejection_sample_launch(target_logits, draft_tokens, draft_logits, temperature, top_k,
                                   top_p, seed, start_pos, plan, verify)


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
                dbnan_ptr="*i32", **flags, seed_ptr="*i64", pos_ptr="*i64", verify_ptr="*i64",
                need_ptr="*i32", dneed_ptr="*i32", dec_ptr="*i32", N="i32", V=d16, NBLK="i32",
                stride_db="i32", stride_zr=d16, stride_dr=d16),
                dict(N_P2=8, NBLK_P2=next_pow2(triton.cdiv(129280, 1024)),
                     SCALE=float(2 ** mass_scale_bits(129280)), PDL=pdl), 4))
            # block verification's residual masses (Flash's N = 5: rows 1 .. 4)
            out.append(compile_config(_block_sums_kernel, dict(
                drafts_ptr="*i64", z_ptr="*fp32", rowf_ptr="*fp32", rowi_ptr="*i32",
                dz_ptr="*fp32", drowf_ptr="*fp32", drowi_ptr="*i32", bmax_ptr="*fp32", **flags,
                verify_ptr="*i64", part_ptr="*fp32", N="i32", V=d16, C="i32", CHUNK=d16,
                NBLK="i32", stride_db="i32", stride_zr=d16, stride_dr=d16),
                dict(TILE=1024, BLOCK=1024, PDL=pdl), 4))
        # the acceptance chain reads C chunk partials (C_P2) for each tiling below
        for C in sorted({row_tiling(rows, 129280)[2] for rows in (1, 16, 48)}):
            out.append(compile_config(_accept_kernel, dict(
                drafts_ptr="*i64", z_ptr="*fp32", rowf_ptr="*fp32", rowi_ptr="*i32",
                dz_ptr="*fp32", drowf_ptr="*fp32", drowi_ptr="*i32", targ_ptr="*i64", **flags,
                seed_ptr="*i64", pos_ptr="*i64", verify_ptr="*i64", dec_ptr="*i32",
                part_ptr="*fp32", tokens_ptr="*i64", num_ptr="*i64", a_ptr="*i32",
                wa_ptr="*fp32", N="i32", V=d16, C="i32", stride_db="i32", stride_tb="i32",
                stride_zr=d16, stride_dr=d16), dict(C_P2=next_pow2(C), PDL=pdl), 1))
        # the tilings the launcher picks: plain sampling at B = 1 / 16 / 48 rows, rejection at
        # 2 B rows (the walk leaves about two a request to search) for B = 1 / 8 / 24; one
        # program per item (the default: plan.rejection_persistent off)
        for rows in (1, 16, 48):
            _, CHUNK, C = row_tiling(rows, 129280)
            # statistics blocks are the 1024-token tiles
            out.append(reduce_compile_config(1024, CHUNK, C, 1024, 129280, pdl, gate=drafts,
                                             scaled=True))
            out.append(select_compile_config(1024, CHUNK, C, 1024, 129280, pdl, gate=drafts,
                                             scaled=True))
            out.append(refine_compile_config(1024, C, 129280, pdl, scaled=True, gate=drafts))
            out.append(compile_config(_resample_kernel, dict(
                z_ptr="*fp32", rowf_ptr="*fp32", rowi_ptr="*i32", dz_ptr="*fp32",
                drowf_ptr="*fp32", drowi_ptr="*i32", bmax_ptr="*fp32", **flags,
                seed_ptr="*i64", pos_ptr="*i64", a_ptr="*i32", wa_ptr="*fp32", tokens_ptr="*i64",
                part_f_ptr="*fp32", part_i_ptr="*i32", done_ptr="*i32", N="i32", V=d16, C=d16,
                CHUNK=d16, NBLK="i32", stride_tb="i32", stride_zr=d16, stride_dr=d16,
                done_off="i32"),
                dict(TILE=1024, BLOCK=1024, C_P2=next_pow2(C), STREAM=stream, PDL=pdl), 4))
    return out



# fp32 logits (what the target head produces); a bf16 variant compiles alike
add_compile_configs("rejection_sample", _parallel_configs(STREAM_RESAMPLE))
