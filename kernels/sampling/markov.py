"""`dspark::markov_sample`: the DSpark Markov draft sampler (reference.markov_sample_reference
is the contract: N drafts and their draft logits), fused.

Dataflow per step of the full plan (fixed launches: one CUDA graph): logits -> rowstat -> cand
-> pick -> [rows pick flags: reduce -> select -> refine x REFINE_PASSES -> final]; the greedy
plan (mode "greedy") is one step kernel per step and one launch writing the drafts. The op
returns the draft logits, not q: rejection processes them like the target's and computes q
where it reads it (mode "greedy" leaves them unwritten: rejection never reads a greedy row's q).

Bytes a call moves (Flash: V = 129280, r = 256, N = 5, bf16 W1/W2, fp32 base logits): W2 once
a step, 5 x 66.2 MB = 331 MB (the floor, ~78 us on an H200), + base logits B N V 4 (2.6 MB a
request) + W1 rows B N r 2, + draft_logits B N V 4 written (mode "full").
"""
from __future__ import annotations

import torch
import triton

from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.sampling.markov_kernels import (
    _markov_gumbel_kernel, _markov_greedy_step_kernel, _markov_greedy_tokens_kernel,
    _markov_logits_kernel, _markov_pick_kernel, _markov_rowstat_kernel)
from dspark_compile.kernels.sampling.plan import (
    FINAL_PER_SM, GREEDY_CONFIGS, GREEDY_CONFIGS_FP32, LOGITS_CONFIGS, MODES, PDL_BY_TILE, PLAN,
    SamplerPlan)
from dspark_compile.kernels.sampling.reference import (check_markov_inputs,
                                                       markov_sample_reference)
from dspark_compile.kernels.sampling.row_launch import (
    check_int32_index, gated_grid, gated_per_sm, hist_tile, launch_select_refine, mass_scale_bits,
    reduce_compile_config, refine_compile_config, row_list_p2, row_tiling, select_compile_config,
    threshold_scratch)
from dspark_compile.kernels.sampling.row_passes import row_reduce_kernel
from dspark_compile.kernels.tl_helpers import (
    compile_config, interpreting, launch, next_pow2, pdl_available, pdl_launch, pdl_mode)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def markov_sample_mode_reference(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed,
                                 start_pos, mode: str = "full"):
    """The reference under the op's mode: "greedy" treats every row as greedy."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    if mode == "greedy":
        temperature = torch.zeros_like(temperature)
    return markov_sample_reference(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed,
                                   start_pos)


# ----------------------------------------------------------------------------------------------
# Launcher (kernels: markov_kernels.py)
# ----------------------------------------------------------------------------------------------

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



def _pdl_mode(pdl, B: int = 1) -> int:
    """The kernels' PDL constexpr for plan.pdl (full plan: PDL_BY_TILE's choice for B rows)."""
    return pdl_mode(pdl, PDL_BY_TILE[_batch_tile(B)])


def markov_sample_launch(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos,
                         plan: SamplerPlan = PLAN):
    """Run the fused sampler under `plan` (CUDA, or CPU tensors under TRITON_INTERPRET=1):
    (drafts [B, N] int64, draft_logits [B, N, V] fp32; unspecified in mode "greedy")."""
    check_markov_inputs(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos)
    check_int32_index(base_logits=base_logits, w2=w2)   # draft_logits has base_logits' shape
    B, N, V = base_logits.shape
    dev = base_logits.device
    # every token is written (by pick, reduce, final or the packed maxima), and every
    # draft_logits row by the logits kernel (mode "full"), so no fill
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
    if plan.mode == "greedy":
        # one launch per step, its row reduction an atomic max of packed keys (zero-filled: zero
        # is below every key), then one launch writing the tokens
        packed = torch.zeros((N, B), dtype=torch.int64, device=dev)
        _greedy_steps(base_logits, w1, w2, anchor, packed, plan.greedy_config,
                      _pdl_mode(plan.pdl) > 0, plan.reverse_odd_steps)
        launch(_markov_greedy_tokens_kernel)[(N,)](packed, drafts, B, drafts.stride(0),
                                                   BLOCK=min(1024, next_pow2(B)), num_warps=4)
        return drafts, out
    meta = [t.contiguous() for t in (temperature, top_k, top_p, seed, start_pos)]
    _full_plan(plan, base_logits, anchor, w1, w2, *meta, drafts, out)
    return drafts, out


def _full_buffers(plan, B, N, V, NBLK, C, CHUNK, TILE, dev):
    """The full plan's buffers: block statistics, row parameters, the one zeroed tensor of every
    ticket / slot counter of the call ([step, counter, row], then the refine state per row, then
    with plan.candidate the packed row maxima [step, row] as int64), and the search's scratch."""
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    bufs = {n: torch.empty((B, NBLK), dtype=t, device=dev)
            for n, t in (("bmax", f32), ("bsum", f32), ("barg", i32), ("bnan", i32))}
    bufs.update(rowf=torch.empty((B, 4), dtype=f32, device=dev),
                rowi=torch.empty((B, 4), dtype=i32, device=dev),
                prev=torch.empty((B,), dtype=i64, device=dev),   # step 0 folds the anchor itself
                best_v=torch.empty((B, C), dtype=f32, device=dev),
                best_i=torch.empty((B, C), dtype=i32, device=dev))
    ncnt = N * (6 + 2 * plan.refine_passes) * B + 4 * B
    nkey = N * B if plan.candidate else 0
    zeroed = torch.zeros((ncnt + ncnt % 2 + 2 * nkey,), dtype=i32, device=dev)
    bufs["counters"] = zeroed[:ncnt - 4 * B].view(N, -1, B)
    bufs["rst"] = zeroed[ncnt - 4 * B:ncnt].view(B, 4)
    bufs["rowkey"] = zeroed[ncnt + ncnt % 2:].view(i64) if plan.candidate else bufs["prev"]
    bufs["thr"] = threshold_scratch(B, C, CHUNK, plan.cap, plan.hist_bins, plan.refine_edges,
                                    dev, TILE)
    if plan.candidate:
        bufs.update(need=torch.empty((B,), dtype=i32, device=dev),
                    part=torch.empty((B, C), dtype=i64, device=dev),
                    cand=torch.empty((B,), dtype=i64, device=dev),
                    rowfl=torch.empty((B,), dtype=f32, device=dev))
    return bufs


def _full_plan(plan, base_logits, anchor, w1, w2, temperature, top_k, top_p, seed, start_pos,
               drafts, out):
    """Mode "full": the launches of every step (the module docstring's dataflow)."""
    B, N, V = base_logits.shape
    dev = base_logits.device
    # programmatic dependent launch for every launch after the first (the first waits for the
    # op's inputs the plain way): each kernel enters with pdl_enter, so only the launch latency
    # between the launches of a step overlaps
    pdl = _pdl_mode(plan.pdl, B)        # checked everywhere, used where available
    if not pdl_available(_markov_logits_kernel, dev):
        pdl = 0
    lcfg = _logits_config(B, w1.shape[1], plan.logits_config)
    NBLK = triton.cdiv(V, lcfg[1])
    # the candidate plan's row passes search only the few rows its pick leaves, so they take the
    # one-row tiling (short chunks, many programs per row: a search is its slowest program)
    TILE, CHUNK, C = row_tiling(1 if plan.candidate else B, V, plan.test_hooks.tile, plan.chunk)
    bufs = _full_buffers(plan, B, N, V, NBLK, C, CHUNK, TILE, dev)
    flags = (temperature, top_k, top_p)
    for k in range(N):
        _logits_step(k, plan, lcfg, base_logits, w1, w2, anchor, temperature, out, bufs, pdl)
        if plan.candidate:
            _pick_step(k, plan, TILE, CHUNK, C, lcfg[1], flags, seed, start_pos, out, drafts, bufs,
                       pdl)
        _search_step(k, plan, TILE, CHUNK, C, lcfg[1], flags, out, drafts, bufs, pdl)
        _final_step(k, plan, TILE, CHUNK, C, lcfg[1], flags, seed, start_pos, out, drafts, bufs,
                    pdl)
        if plan.test_hooks.thresholds is not None:
            plan.test_hooks.thresholds.append((bufs["rowf"].clone(), bufs["rowi"].clone()))
        if plan.test_hooks.needs is not None and plan.candidate:
            plan.test_hooks.needs.append(bufs["need"].clone())


def _logits_step(k, plan, lcfg, base_logits, w1, w2, anchor, temperature, out, bufs, pdl):
    """Step k's logits kernel: draft_logits, block statistics, packed row maxima (candidate)."""
    B, N, V = base_logits.shape
    BLOCK_B, BLOCK_V, BLOCK_R, warps, stages = lcfg
    NBLK = bufs["bmax"].shape[1]
    # step k's slices are passed as offsets rather than views (plainer for export)
    launch(_markov_logits_kernel)[(NBLK,)](
        base_logits, w1, w2, anchor, bufs["prev"], temperature, out, bufs["bmax"], bufs["barg"],
        bufs["bsum"], bufs["bnan"], bufs["rowkey"], B, V, NBLK, base_logits.stride(0),
        out.stride(0), k * base_logits.stride(1), k * out.stride(1), k,
        R=w1.shape[1], BLOCK_B=BLOCK_B, BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R, STAGES=stages,
        EVEN_V=V % BLOCK_V == 0,
        DOT_F32=interpreting(_markov_logits_kernel) or w1.dtype == torch.float32,
        REVERSE_ODD=plan.reverse_odd_steps, CAND=plan.candidate, PDL=pdl, num_warps=warps,
        **pdl_launch(pdl > 0 and k > 0))


def _counter(plan, k, j, B):
    """Offset of step k's counter j (NCNT = 6 + 2 refine_passes of B rows a step)."""
    return (k * (6 + 2 * plan.refine_passes) + j) * B


def _pick_step(k, plan, TILE, CHUNK, C, BLOCK_V, flags, seed, start_pos, out, drafts, bufs,
               pdl):
    """rowstat, cand and pick: the step's token where no threshold is needed, else need[b]."""
    B, _, V = out.shape
    NBLK = bufs["bmax"].shape[1]
    sz, zo, C_P2 = out.stride(0), k * out.stride(1), next_pow2(C)
    rp = plan.refine_passes
    launch(_markov_rowstat_kernel)[(B,)](
        *flags, bufs["rowkey"], bufs["bmax"], bufs["bsum"], bufs["rowf"], bufs["rowfl"], k, B, V,
        NBLK, NBLK_P2=next_pow2(NBLK), PDL=pdl, num_warps=4, **pdl_launch(pdl > 0))
    launch(_markov_gumbel_kernel)[(B, C)](       # cand
        *flags, seed, start_pos, out, bufs["rowkey"], bufs["rowfl"], bufs["rowf"], bufs["rowi"],
        bufs["bmax"], bufs["best_v"], bufs["best_i"], bufs["cand"], bufs["prev"],
        bufs["counters"], bufs["rowi"], k, B, V, C, CHUNK, NBLK, sz, drafts.stride(0), zo,
        _counter(plan, k, 5 + 2 * rp, B), TILE=TILE, C_P2=C_P2, BLOCK_V=BLOCK_V, CAND=True,
        PDL=pdl, num_warps=4, **pdl_launch(pdl > 0))
    launch(_markov_pick_kernel)[(B, C)](
        *flags, out, bufs["rowkey"], bufs["cand"], bufs["bmax"], bufs["rowf"], drafts,
        bufs["prev"], bufs["need"], bufs["part"], bufs["counters"], k, B, V, C, CHUNK, NBLK, sz,
        drafts.stride(0), zo, _counter(plan, k, 4 + 2 * rp, B), TILE=TILE, C_P2=C_P2,
        BLOCK_V=BLOCK_V, SCALE=float(2 ** mass_scale_bits(V)), PDL=pdl, num_warps=4,
        **pdl_launch(pdl > 0))


def _search_step(k, plan, TILE, CHUNK, C, BLOCK_V, flags, out, drafts, bufs, pdl):
    """Exact thresholds of the rows pick flagged (every non-greedy row without the candidate
    plan): reduce, then select and the refinement passes (rows whose bracket overflowed CAP)."""
    B, _, V = out.shape
    dev = out.device
    NBLK = bufs["bmax"].shape[1]
    need = bufs.get("need")
    persist = need is not None and plan.markov_persist(B)
    flagged = bufs["rowi"] if need is None else need
    sz, zo, thr = out.stride(0), k * out.stride(1), bufs["thr"]
    cnt = [_counter(plan, k, j, B) for j in range(6 + 2 * plan.refine_passes)]
    launch(row_reduce_kernel)[gated_grid(B, C, gated_per_sm("reduce", dev), dev, persist)](
        bufs["bmax"], bufs["barg"], bufs["bsum"], bufs["bnan"], *flags, out, drafts, bufs["prev"],
        bufs["rowf"], bufs["rowi"], thr["hist"], bufs["rst"], bufs["counters"], thr["floor"],
        thr["live"], flagged, V, NBLK, C, CHUNK, sz, drafts.stride(0), zo, k, cnt[0], 1, B,
        NBLK_P2=next_pow2(NBLK), TILE=hist_tile(TILE, plan.hist_bins), NB=plan.hist_bins,
        C_P2=next_pow2(C), BLOCK_V=BLOCK_V, NT_P2=thr["live"].shape[2], FLOOR=plan.block_floor,
        GATE=need is not None, SCALED=True, ZIN=plan.candidate, ROWS_P2=row_list_p2(B, persist),
        PERSIST=persist, PDL=pdl, num_warps=4, **pdl_launch(pdl > 0))
    launch_select_refine(
        plan, flags, out, zo, sz, bufs["rowf"], bufs["rowi"], bufs["rst"], thr, bufs["counters"],
        (cnt[1], cnt[2]), [(cnt[4 + 2 * r], cnt[5 + 2 * r]) for r in range(plan.refine_passes)],
        bufs["bmax"], V=V, C=C, CHUNK=CHUNK, RPR=1, TILE=TILE, BLOCK_V=BLOCK_V, pdl=pdl,
        need=need, scaled=True, persist=persist)


def _final_step(k, plan, TILE, CHUNK, C, BLOCK_V, flags, seed, start_pos, out, drafts, bufs,
                pdl):
    """final: the Gumbel-max above each searched row's exact threshold -> the draft, `prev`."""
    B, _, V = out.shape
    dev = out.device
    NBLK = bufs["bmax"].shape[1]
    need = bufs.get("need")
    persist = need is not None and plan.markov_persist(B)
    launch(_markov_gumbel_kernel)[gated_grid(B, C, FINAL_PER_SM, dev, persist)](
        *flags, seed, start_pos, out, bufs["rowkey"], bufs["bmax"], bufs["rowf"], bufs["rowi"],
        bufs["bmax"], bufs["best_v"], bufs["best_i"], drafts, bufs["prev"], bufs["counters"],
        bufs["rowi"] if need is None else need, k, B, V, C, CHUNK, NBLK, out.stride(0),
        drafts.stride(0), k * out.stride(1), _counter(plan, k, 3, B), TILE=TILE,
        C_P2=next_pow2(C), BLOCK_V=BLOCK_V, GATE=need is not None,
        ROWS_P2=row_list_p2(B, persist), PERSIST=persist, PDL=pdl, num_warps=4,
        **pdl_launch(pdl > 0))


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
# Op registration
# ----------------------------------------------------------------------------------------------

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
    plan = PLAN if mode == PLAN.mode else PLAN.replace(mode=mode)
    return markov_sample_launch(base_logits, anchor, w1, w2, temperature, top_k, top_p, seed,
                                start_pos, plan)


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
    TILE, CHUNK, C = row_tiling(1, _V_FLASH)
    for B in (1, 16, 64):
        cp, bv = next_pow2(C), _logits_config(B, _R_FLASH)[1]
        pdl = _pdl_mode(True, B)        # what a launch on sm_90+ (SM12x included) compiles
        persist = PLAN.markov_persist(B)    # the gated launches' default build for B rows
        # (the default plan: the pick kernel, then the search and final gated to the rows it
        # leaves, mode "full" only)
        out.append(reduce_compile_config(TILE, CHUNK, C, bv, _V_FLASH, pdl, gate=True,
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
            TILE=TILE, C_P2=cp, BLOCK_V=bv, CAND=False, GATE=True,
            ROWS_P2=row_list_p2(B, persist), PERSIST=persist, PDL=pdl), 4))  # final
        nblk_p2 = next_pow2(triton.cdiv(_V_FLASH, bv))
        out.append(compile_config(_markov_rowstat_kernel, dict(
            **flags, rowkey_ptr="*i64", bmax_ptr="*fp32", bsum_ptr="*fp32", rowf_ptr="*fp32",
            floor_ptr="*fp32", step="i32", B="i32", V=_D16, NBLK="i32"),
            dict(NBLK_P2=nblk_p2, PDL=pdl), 4))
        out.append(compile_config(_markov_gumbel_kernel, gumbel_sig, dict(      # cand
            TILE=TILE, C_P2=cp, BLOCK_V=bv, CAND=True, GATE=False, ROWS_P2=1, PERSIST=False,
            PDL=pdl), 4))
        out.append(compile_config(_markov_pick_kernel, dict(
            **flags, z_ptr="*fp32", rowkey_ptr="*i64", cand_ptr="*i64", bmax_ptr="*fp32",
            rowf_ptr="*fp32", drafts_ptr="*i64", prev_ptr="*i64", need_ptr="*i32",
            part_ptr="*i64", done_ptr="*i32", step="i32", B="i32", V=_D16, C=_D16, CHUNK=_D16,
            NBLK="i32", stride_zb=_D16, stride_db="i32", z_off=_D16, done_off="i32"),
            dict(TILE=TILE, C_P2=cp, BLOCK_V=bv, SCALE=float(2 ** mass_scale_bits(_V_FLASH)),
                 PDL=pdl), 4))
    return out


add_compile_configs("markov_sample", _markov_configs())
