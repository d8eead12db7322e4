"""Launching the row passes: tiling, grids, scratch, compile configurations, and
launch_select_refine (select, then the refinement passes), shared by both fused samplers."""
from __future__ import annotations

import torch
import triton

from dspark_compile.kernels.sampling.plan import (CAND_CAP, FEW_CANDIDATES, GATED_PER_SM, HIST_BINS,
                                                  REFINE_EDGES)
from dspark_compile.kernels.sampling.refine import row_refine_kernel
from dspark_compile.kernels.sampling.row_passes import row_reduce_kernel, row_select_kernel
from dspark_compile.kernels.tl_helpers import (
    compile_config, launch, multiprocessors, next_pow2, pdl_launch)

SELECT_WARPS = 8          # row_select / row_refine: their last program resolves CAP candidates


def select_tile(tile: int) -> int:
    """Tokens per load of row_select_kernel: 512 at 8 warps keeps it at 64 registers on sm_90
    (4 programs per SM; 1024 tokens took 128, and the pass waited on memory)."""
    return min(tile, 512)


def row_tiling(rows: int, V: int, tile: int | None = None, chunk: int | None = None):
    """(TILE, CHUNK, C): TILE tokens per vector op, CHUNK tokens per program of the row passes.

    Few rows get more, shorter chunks so the row passes still fill the GPU.
    """
    TILE = tile or min(1024, max(16, next_pow2(V)))   # >= 16: whole Philox blocks per tile
    if TILE < 16 or TILE & (TILE - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {TILE}")
    if chunk is None:
        chunk = 2048 if rows <= 4 else 4096 if rows <= 16 else 8192
    CHUNK = max(TILE, chunk // TILE * TILE)
    return TILE, CHUNK, triton.cdiv(V, CHUNK)


def hist_tile(tile: int, nb: int) -> int:
    """Tokens per load of the histogram passes (reduce, refine): they keep per-lane [tile, nb]
    histograms in registers, so 2048 cells (16 per thread at 4 warps), which leaves room for
    the next tiles' loads in flight (H200: 256 x 8 with two tiles prefetched ran the reduce
    loop in half the time of 256 x 16 without, benchmarks/row_pass_probe.py)."""
    return max(16, min(tile, 2048 // nb))


def refine_tile(tile: int, edges: int) -> int:
    """hist_tile for row_refine_kernel, which runs SELECT_WARPS warps."""
    return hist_tile(tile, edges) * SELECT_WARPS // 4


def mass_scale_bits(V: int) -> int:
    """Fixed-point fraction bits: V masses <= 1 sum below 2^62."""
    return 61 - max(int(V - 1).bit_length(), 1)


def gated_per_sm(kind: str, device) -> int:
    """GATED_PER_SM's programs per SM for pass `kind` (reduce / select / refine) on `device`."""
    device = torch.device(device)
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 12
    return GATED_PER_SM.get(major, GATED_PER_SM[12])[kind]


def gated_grid(rows: int, C: int, per_sm: int, device, persist: bool) -> tuple:
    """Grid of a row pass over `rows` rows of C chunk programs: one program per (row, chunk)
    item, (rows, C); persistent (PERSIST, a gated pass whose flagged rows are usually few) at
    most per_sm programs per SM, which take the flagged rows' items in turn (row_list)."""
    if not persist:
        return (rows, C)
    return (max(1, min(rows * C, per_sm * multiprocessors(device))),)


def row_list_p2(rows: int, persist: bool) -> int:
    """ROWS_P2 of a row pass over `rows` rows: the need flags' vector of a persistent gated
    pass (row_list), 1 otherwise."""
    return next_pow2(rows) if persist else 1


def check_int32_index(**tensors) -> None:
    """The fused kernels index rows and vocabulary with int32 arithmetic: a tensor spanning 2^31
    or more elements (its element count, or its largest offset for a strided view) would wrap
    silently, so the launchers refuse it, naming the tensor."""
    for name, t in tensors.items():
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        if max(t.numel(), span) >= 2 ** 31:
            raise ValueError(f"{name} spans {max(t.numel(), span)} elements ({tuple(t.shape)}, "
                             f"strides {t.stride()}); the fused kernels index at most 2^31 - 1 "
                             f"(split the batch)")


def live_slots(CHUNK: int, TILE: int, nb: int = HIST_BINS) -> int:
    """Span flags per row-pass program (a power of two >= select's tiles and reduce's spans of
    2 hist_tile tokens)."""
    return next_pow2(max(CHUNK // select_tile(TILE), triton.cdiv(CHUNK, 2 * hist_tile(TILE, nb))))


def threshold_scratch(rows: int, C: int, CHUNK: int, cap: int, nb: int, edges: int, dev,
                      TILE: int):
    """Scratch of the select/refine passes for `rows` rows in C chunk programs (uninitialised:
    every slot is written before it is read)."""
    i32, i64 = torch.int32, torch.int64
    return dict(
        live=torch.empty((rows, C, live_slots(CHUNK, TILE, nb)), dtype=i32, device=dev),
        floor=torch.empty((rows,), dtype=torch.float32, device=dev),
        hist=torch.empty((rows, C, 2 * max(nb, edges)), dtype=i32, device=dev),
        kext=torch.empty((rows, C, 2), dtype=i32, device=dev),
        above_m=torch.empty((rows, C), dtype=i64, device=dev),
        above_c=torch.empty((rows, C), dtype=i64, device=dev),
        rowa=torch.empty((rows, 2), dtype=i64, device=dev),
        ckey=torch.empty((rows, cap), dtype=i32, device=dev),
        cmass=torch.empty((rows, cap), dtype=i64, device=dev),
        # the overflowing brackets' tokens, per chunk program (rows x V fp32 at most)
        spill=torch.empty((rows, C, CHUNK), dtype=torch.float32, device=dev),
        spn=torch.empty((rows, C), dtype=i32, device=dev))


def reduce_compile_config(TILE: int, CHUNK: int, C: int, BLOCK_V: int, V: int, pdl: int = 0,
                          gate: bool = False, scaled: bool = False, zin: bool = False,
                          rows: int = 1, persist: bool = False):
    """row_reduce_kernel's compile entry for a launch at row tile TILE, C chunk programs of CHUNK
    tokens, statistics blocks of BLOCK_V, vocabulary V (with the top-p floor); `gate`, `scaled`,
    `zin`: only rows need flags mark (of `rows`), unscaled logits read, Z given (the rejection
    plan and the Markov candidate plan); `persist` (with `gate`): the persistent build
    (PERSIST), whose need-flag vector `rows` sizes."""
    d16 = "i32:16"
    return compile_config(row_reduce_kernel, dict(
        bmax_ptr="*fp32", barg_ptr="*i32", bsum_ptr="*fp32", bnan_ptr="*i32", temp_ptr="*fp32",
        topk_ptr="*i64", topp_ptr="*fp32", z_ptr="*fp32", drafts_ptr="*i64", prev_ptr="*i64",
        rowf_ptr="*fp32", rowi_ptr="*i32", hist_ptr="*i32", rst_ptr="*i32", done_ptr="*i32",
        floor_ptr="*fp32", live_ptr="*i32", need_ptr="*i32", V=d16, NBLK="i32", C=d16,
        CHUNK=d16, stride_zb=d16, stride_db="i32", z_off=d16, step="i32", done_off="i32",
        RPR="i32", ROWS="i32"),
        dict(NBLK_P2=next_pow2(triton.cdiv(V, BLOCK_V)), TILE=hist_tile(TILE, HIST_BINS),
             NB=HIST_BINS, C_P2=next_pow2(C), BLOCK_V=BLOCK_V,
             NT_P2=live_slots(CHUNK, TILE), FLOOR=True, GATE=gate, SCALED=scaled, ZIN=zin,
             ROWS_P2=row_list_p2(rows, persist and gate), PERSIST=persist and gate,
             PDL=pdl), 4)


def select_compile_config(TILE: int, CHUNK: int, C: int, BLOCK_V: int, V: int, pdl: int = 0,
                          gate: bool = False, scaled: bool = False, rows: int = 1,
                          persist: bool = False):
    """row_select_kernel's compile entry (kernels/sm12x.py readiness) for a launch at row tile
    TILE, C chunk programs of CHUNK tokens, logits blocks of BLOCK_V, vocabulary V; `gate`,
    `scaled`, `rows`, `persist` as in reduce_compile_config."""
    d16 = "i32:16"
    return compile_config(row_select_kernel, dict(
        temp_ptr="*fp32", topk_ptr="*i64", topp_ptr="*fp32", z_ptr="*fp32", rowf_ptr="*fp32",
        rowi_ptr="*i32", above_m_ptr="*i64", above_c_ptr="*i64", rowa_ptr="*i64",
        ckey_ptr="*i32", cmass_ptr="*i64", ccount_ptr="*i32", done_ptr="*i32", kext_ptr="*i32",
        rst_ptr="*i32", spill_ptr="*fp32", spn_ptr="*i32", bmax_ptr="*fp32", live_ptr="*i32",
        floor_ptr="*fp32", need_ptr="*i32", V=d16, C=d16, CHUNK=d16, NBLK="i32",
        stride_zb=d16, z_off=d16, ccount_off="i32", done_off="i32", RPR="i32", ROWS="i32"),
        dict(TILE=select_tile(TILE), NB=HIST_BINS, CAP=CAND_CAP,
             SCALE=float(2 ** mass_scale_bits(V)), C_P2=next_pow2(C), BLOCK_V=BLOCK_V,
             NT_P2=live_slots(CHUNK, TILE), SKIP=True, FEW=FEW_CANDIDATES, SCAN=True,
             GATE=gate, SCALED=scaled, ROWS_P2=row_list_p2(rows, persist and gate),
             PERSIST=persist and gate, PDL=pdl),
        SELECT_WARPS)


def refine_compile_config(TILE: int, C: int, V: int, pdl: int = 0, scaled: bool = False,
                          gate: bool = False, rows: int = 1, persist: bool = False):
    """row_refine_kernel's compile entry for a launch at row tile TILE, C chunk programs,
    vocabulary V (no logits-block dependence: it reads only the spill regions); `gate`, `rows`,
    `persist` as in reduce_compile_config."""
    d16 = "i32:16"
    return compile_config(row_refine_kernel, dict(
        temp_ptr="*fp32", topk_ptr="*i64", topp_ptr="*fp32", z_ptr="*fp32", rowf_ptr="*fp32",
        rowi_ptr="*i32", rst_ptr="*i32", above_m_ptr="*i64", above_c_ptr="*i64",
        rowa_ptr="*i64", hist_ptr="*i32", kext_ptr="*i32", spill_ptr="*fp32", spn_ptr="*i32",
        ckey_ptr="*i32", cmass_ptr="*i64", ccount_ptr="*i32", done_ptr="*i32",
        need_ptr="*i32", V=d16, C=d16, CHUNK=d16, stride_zb=d16, z_off=d16, ccount_off="i32",
        done_off="i32", RPR="i32", ROWS="i32", LAST="i32"),
        dict(TILE=refine_tile(TILE, REFINE_EDGES), NB=REFINE_EDGES, CAP=CAND_CAP,
             SCALE=float(2 ** mass_scale_bits(V)), C_P2=next_pow2(C), FEW=FEW_CANDIDATES,
             SCAN=True, GATE=gate, SCALED=scaled, ROWS_P2=row_list_p2(rows, persist and gate),
             PERSIST=persist and gate, PDL=pdl),
        SELECT_WARPS)


def launch_select_refine(plan, flags, z, z_off: int, stride_zb: int, rowf, rowi, rst, scratch,
                         counters, select_offs, refine_offs, bmax, *, V: int, C: int, CHUNK: int,
                         RPR: int, TILE: int, BLOCK_V: int, pdl: int = 0, need=None,
                         scaled: bool = False, persist: bool = False) -> None:
    """row_select_kernel, then one row_refine_kernel per entry of refine_offs (rows already resolved
    exit at once), with the search choices of `plan` (hist_bins, refine_edges, cap,
    few_candidates, skip_below_bracket, the scan_fallback hook). select_offs / refine_offs:
    (candidate counter, ticket counter) offsets into `counters` for each launch (zeroed by the
    caller). bmax [rows, NBLK]: the block maxima of z over blocks of BLOCK_V tokens, from which
    select skips the tiles below the bracket. V, C, CHUNK, RPR (rows per request), TILE: the
    row tiling (row_tiling). `pdl`: the kernels' PDL mode
    (tl_helpers.PDL_MODES; > 0: programmatic dependent launch, the caller checked
    pdl_available). `need` (int32 [rows] or None): select searches only the rows flagged
    nonzero; the refine passes take the same rows (a row select skips keeps state 0). `persist`
    (with `need`): the passes run as grids of about one wave whose programs take the flagged
    rows' (row, chunk) items in turn (gated_grid, row_list), not one program per item. `scaled`:
    z holds unscaled logits, each row's divided by its temperature (scale_z)."""
    NB, edges, cap = plan.hist_bins, plan.refine_edges, plan.cap
    scan = plan.test_hooks.scan_fallback
    skip, few = plan.skip_below_bracket, min(plan.few_candidates, plan.cap)
    s = scratch
    scale = float(2 ** mass_scale_bits(V))
    C_P2 = next_pow2(C)
    rows, gate = rowf.shape[0], need is not None
    persist = persist and gate
    flagged = rowi if need is None else need
    launch(row_select_kernel)[gated_grid(rows, C, gated_per_sm("select", z.device), z.device,
                                         persist)](
        *flags, z, rowf, rowi, s["above_m"], s["above_c"], s["rowa"], s["ckey"], s["cmass"],
        counters, counters, s["kext"], rst, s["spill"], s["spn"], bmax, s["live"], s["floor"],
        flagged, V, C, CHUNK, bmax.shape[1], stride_zb, z_off, select_offs[0], select_offs[1],
        RPR, rows, TILE=select_tile(TILE), NB=NB, CAP=cap, SCALE=scale, C_P2=C_P2,
        BLOCK_V=BLOCK_V, NT_P2=s["live"].shape[2], SKIP=skip, FEW=few, SCAN=scan, GATE=gate,
        SCALED=scaled, ROWS_P2=row_list_p2(rows, persist), PERSIST=persist, PDL=pdl,
        num_warps=SELECT_WARPS, **pdl_launch(pdl))
    for r, (co, do) in enumerate(refine_offs):
        launch(row_refine_kernel)[gated_grid(rows, C, gated_per_sm("refine", z.device),
                                             z.device, persist)](
            *flags, z, rowf, rowi, rst, s["above_m"], s["above_c"], s["rowa"], s["hist"],
            s["kext"], s["spill"], s["spn"], s["ckey"], s["cmass"], counters, counters, flagged,
            V, C, CHUNK, stride_zb, z_off, co, do, RPR, rows, int(r == len(refine_offs) - 1),
            TILE=refine_tile(TILE, edges), NB=edges, CAP=cap, SCALE=scale, C_P2=C_P2, FEW=few,
            SCAN=scan, GATE=gate, SCALED=scaled, ROWS_P2=row_list_p2(rows, persist),
            PERSIST=persist, PDL=pdl, num_warps=SELECT_WARPS, **pdl_launch(pdl))
