"""`dspark::draft_attention`: the DSpark draft's attention over (context ring ∪ block) in one launch.

A draft pass runs N query tokens per row (docs/model.md, "Draft attention"); every query token t
and head h attends, non-causally, to

- the row's context ring `ring[rows[b]]` [W, d] (W = sliding_window): slot s holds position
  L − ((L − s) mod W) for the row's last committed position L, valid when that is ≥ 0;
- all N block KVs `kv[b]` [N, d],

with one softmax per (t, h) over both sets and the learned sink exp(sink_h) in the denominator
only: o = Σ_e exp(s_e − m) K_e / (Σ_e exp(s_e − m) + exp(sink_h − m)), s_e = (q · K_e) · scale.
Keys are values (MQA over one latent). Output in q's dtype (the reference computes in fp32, fp64
for fp64 inputs, and rounds once).

Bytes one call must move at Flash dims (H = 64, d = 512, W = 128, N = 5, bf16), per row:
q 327,680 + o 327,680 + context ring 131,072 + block KV 5,120 + ids 16 = 791,568 B (+ the sink,
256 B, once): 0.79 MB at B = 1 (0.18 µs at 4.3 TB/s copy bandwidth), 50.7 MB at B = 64
(11.8 µs). q and o are 83 % of it; the shared context, 17 %, is what a per-(token, head) kernel
rereads N·H = 320 times per row.

Kernel: grid (B, ceil(N·H / BLOCK_M)); program (b, i) takes BLOCK_M of the row's N·H query rows
(flattened token-major: m = t·H + h) and streams the row's context ring once, BLOCK_N slots at a
time, then the N block KVs as one more tile: S = Q Kᵀ · scale on the tensor cores (fp32
accumulation, d in chunks of DK so a warp never holds all of q), an online softmax per query row
in fp32, O += P K with P in the keys' dtype (bf16 on a GPU, as flash attention does; fp32 keys
keep an IEEE fp32 product). The sink opens the softmax as a candidate without a value (running
max = sink, denominator 1), so the max includes it as the reference's does. The tile (16 or 32
rows) is the plan's choice: `draft_attention_plan`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import upcast
from dspark_compile.kernels.invariance import batch_invariant
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.tl_helpers import (
    compile_config, interpreting, launch, multiprocessors, next_pow2, round_to)


def context_slot_positions(last_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B, W]: the position ring slot s holds for a row whose last committed position is L."""
    L = last_pos[:, None]
    return L - torch.remainder(L - torch.arange(window, device=last_pos.device), window)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def draft_attention_reference(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor,
                              rows: torch.Tensor, last_pos: torch.Tensor, sink: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """q [B, N, H, d], kv [B, N, d] (the block's RoPE'd KV), ring [rows, W, d], rows [B],
    last_pos [B], sink [H] -> o [B, N, H, d] in q's dtype.

    Two score sets (the context ring, masked where a slot holds no position yet, and the block),
    one softmax over them and the sink column, the two value sums added."""
    acc = upcast(q).dtype
    B, N, H, _ = q.shape
    W = ring.shape[1]
    ctx = ring[rows].to(acc)                                               # [B, W, d]
    blk = kv.to(acc)
    ctx_ok = (context_slot_positions(last_pos, W) >= 0)[:, None, None, :]  # [B, 1, 1, W]
    qf = q.to(acc)
    s_ctx = (torch.einsum("bthd,bnd->bthn", qf, ctx) * scale).masked_fill(~ctx_ok, float("-inf"))
    s_blk = torch.einsum("bthd,bnd->bthn", qf, blk) * scale
    sink_col = sink.to(acc).view(1, 1, H, 1).expand(B, N, H, 1)
    p = torch.softmax(torch.cat((s_ctx, s_blk, sink_col), dim=-1), dim=-1)
    o = torch.einsum("bthn,bnd->bthd", p[..., :W], ctx)
    o = o + torch.einsum("bthn,bnd->bthd", p[..., W:W + N], blk)
    return o.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Plan
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftAttentionPlan:
    """Launch choices: BLOCK_M query rows (of the row's N·H) per program, BLOCK_N context slots
    per step, warps and pipeline stages of the slot loop."""
    block_m: int
    block_n: int
    d_chunk: int
    num_warps: int
    num_stages: int


SM_COUNT_HINT = 132      # H200: the SM count a plan assumes when it is not given one
# Tiles (block_m, block_n, d_chunk, num_warps, num_stages), compiled at Flash dims (d = 512,
# bf16; benchmarks/kernel_resources.py): 16 query rows at 8 warps are 112 registers on sm_90
# (2 CTAs per SM) and 239 on sm_120, without stack, 49 KB shared memory; 32 rows are 194
# registers on sm_90 without stack, but spill on sm_120 (255 + 520 B stack), where every tile
# above 16 rows spills (mma v2 there, no wgmma).
TILE_16 = (16, 16, 128, 8, 2)
TILE_32 = (32, 16, 128, 8, 2)
CTAS_PER_SM_16 = 2


def draft_attention_plan(B: int, NH: int, capability: tuple = (9, 0), interpreted: bool = False,
                         sm_count: int = SM_COUNT_HINT,
                         invariant: bool = True) -> DraftAttentionPlan:
    """The plan for B rows of NH = N·H query rows on a GPU of `capability`: 16-row tiles while
    their programs fit one wave (the latency stays that of one program, flat in B), 32-row tiles
    beyond on sm_90 (half the programs, each key tile read for twice the rows); 16 rows on every
    other GPU. The interpreter pays per operation: one program per row there. `invariant`
    (kernels/invariance.py): 16 rows at every B, as the MMA shape, and with it the order of a
    query row's dot products, could follow the tile."""
    if interpreted:
        return DraftAttentionPlan(max(16, next_pow2(NH)), 16, 1 << 30, 4, 1)
    wide = not invariant and capability[0] == 9 and \
        B * triton.cdiv(NH, 16) > CTAS_PER_SM_16 * sm_count
    return DraftAttentionPlan(*(TILE_32 if wide else TILE_16))


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _scores(q_rows, mmask, k_rows, kmask, D, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, DK: tl.constexpr, SOFT: tl.constexpr):
    """Q Kᵀ [BLOCK_M, BLOCK_N] in fp32, the d axis in chunks of DK: a warp then holds a
    [16, DK] slice of q instead of all of d (at d = 512 the whole q operand alone was 128
    registers a thread); q is re-read per key tile, from L1."""
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    prec: tl.constexpr = "ieee" if SOFT or k_rows.dtype.element_ty == tl.float32 else "tf32"
    for c0 in tl.static_range(0, BLOCK_D, DK):
        dc = c0 + tl.arange(0, DK)
        dm = dc < D
        qc = tl.load(q_rows + dc[None, :], mask=mmask[:, None] & dm[None, :], other=0.0)
        kc = tl.load(k_rows + dc[None, :], mask=kmask[:, None] & dm[None, :], other=0.0)
        if SOFT:    # the interpreter's bf16 dot is wrong; bf16 -> fp32 is exact
            qc, kc = qc.to(tl.float32), kc.to(tl.float32)
        s += tl.dot(qc, tl.trans(kc), input_precision=prec)
    return s


@triton.jit
def _attend(q_rows, mmask, k_rows, kmask, ok, acc, m_i, l_i, scale, D, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DK: tl.constexpr, SOFT: tl.constexpr):
    """One tile of BLOCK_N keys (values = keys; k_rows [BLOCK_N, 1] pointers) into the online
    softmax of the query rows: slots not `ok` score -inf, but their values still enter P·K with
    P = 0, as the reference's einsum does, so a NaN there propagates as it does there."""
    s = _scores(q_rows, mmask, k_rows, kmask, D, BLOCK_M, BLOCK_N, BLOCK_D, DK, SOFT) * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_sub)
    p = tl.exp(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_rows + d[None, :], mask=kmask[:, None] & (d < D)[None, :], other=0.0)
    kdt = k.dtype
    if SOFT:    # keys decoded to fp32 (exact), P rounded to their dtype as the GPU's cast does
        pv = round_to(p, kdt, SOFT)
        k = k.to(tl.float32)
    else:
        pv = p.to(kdt)
    prec: tl.constexpr = "ieee" if k.dtype == tl.float32 else "tf32"
    acc = acc * alpha[:, None] + tl.dot(pv, k, input_precision=prec)
    return acc, m_new, l_i


@triton.jit
def _draft_attention_kernel(q_ptr, kv_ptr, ring_ptr, rows_ptr, last_ptr, sink_ptr, o_ptr, H, NH,
                            D, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_rr,
                            stride_rs, stride_ob, stride_ot, stride_oh, scale,
                            N: tl.constexpr, W: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_D: tl.constexpr,
                            DK: tl.constexpr, NUM_STAGES: tl.constexpr, SOFT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    mi = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)    # query row m = t·H + h
    mmask = mi < NH
    t, h = mi // H, mi % H
    q_rows = q_ptr + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh
    row = tl.load(rows_ptr + b).to(tl.int64)
    L = tl.load(last_ptr + b).to(tl.int64)
    # the sink opens the softmax: a candidate with exp(sink - m) in the denominator, no value
    sink = tl.load(sink_ptr + h, mask=mmask, other=0.0).to(tl.float32)
    m_i = sink
    l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    ring_row = ring_ptr + row * stride_rr
    for n0 in tl.range(0, W, BLOCK_N, num_stages=NUM_STAGES):
        s_idx = n0 + tl.arange(0, BLOCK_N)
        smask = s_idx < W
        r = (L - s_idx) % W
        held = L - tl.where(r < 0, r + W, r)                    # torch.remainder: r in [0, W)
        acc, m_i, l_i = _attend(q_rows, mmask, ring_row + s_idx[:, None] * stride_rs, smask,
                                smask & (held >= 0), acc, m_i, l_i, scale, D, BLOCK_M, BLOCK_N,
                                BLOCK_D, DK, SOFT)
    tb = tl.arange(0, BLOCK_NB)
    bmask = tb < N
    acc, m_i, l_i = _attend(q_rows, mmask, kv_ptr + b * stride_kb + tb[:, None] * stride_kt, bmask,
                            bmask, acc, m_i, l_i, scale, D, BLOCK_M, BLOCK_NB, BLOCK_D, DK, SOFT)
    o = tl.math.div_rn(acc, l_i[:, None])
    d = tl.arange(0, BLOCK_D)
    dt = o_ptr.dtype.element_ty
    tl.store(o_ptr + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
             round_to(o, dt, SOFT).to(dt), mask=mmask[:, None] & (d < D)[None, :])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(q, kv, ring, rows, last_pos, sink):
    """Shape / dtype errors name the argument; returns (B, N, H, D, W)."""
    if q.dim() != 4 or q.dtype not in _DTYPES:
        raise ValueError(f"q must be bf16/fp16/fp32 [B, N, H, d], got {q.dtype} {tuple(q.shape)}")
    B, N, H, D = q.shape
    if kv.shape != (B, N, D) or kv.dtype != q.dtype:
        raise ValueError(f"kv must be {q.dtype} [B, N, d] = [{B}, {N}, {D}], got {kv.dtype} "
                         f"{tuple(kv.shape)}")
    if ring.dim() != 3 or ring.shape[2] != D or ring.dtype != q.dtype:
        raise ValueError(f"ring must be {q.dtype} [rows, W, {D}], got {ring.dtype} "
                         f"{tuple(ring.shape)}")
    for name, t in (("rows", rows), ("last_pos", last_pos)):
        if t.shape != (B,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [{B}], got {t.dtype} {tuple(t.shape)}")
    if sink.shape != (H,):
        raise ValueError(f"sink must be [H = {H}], got {tuple(sink.shape)}")
    return B, N, H, D, ring.shape[1]


def draft_attention_launch(q, kv, ring, rows, last_pos, sink, scale,
                           plan: DraftAttentionPlan | None = None):
    """The Triton path; fp64 (exact mode) runs the reference. `plan` overrides
    draft_attention_plan (tests)."""
    if q.dtype == torch.float64:
        return draft_attention_reference(q, kv, ring, rows, last_pos, sink, scale)
    B, N, H, D, W = _check(q, kv, ring, rows, last_pos, sink)
    q, kv, ring = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, kv, ring))
    o = torch.empty((B, N, H, D), dtype=q.dtype, device=q.device)
    if B == 0 or N == 0 or H == 0:
        return o
    kernel = _draft_attention_kernel
    if plan is None:
        interp = interpreting(kernel)
        cap = (0, 0) if interp else torch.cuda.get_device_capability(q.device)
        sms = 1 if interp else multiprocessors(q.device)
        plan = draft_attention_plan(B, N * H, cap, interp, sms, batch_invariant())
    p = plan
    block_d = max(16, next_pow2(D))
    launch(kernel)[(B, triton.cdiv(N * H, p.block_m))](
        q, kv, ring, rows, last_pos, sink, o, H, N * H, D, q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1), ring.stride(0), ring.stride(1), o.stride(0), o.stride(1),
        o.stride(2), float(scale), N=N, W=W, BLOCK_M=p.block_m, BLOCK_N=p.block_n,
        BLOCK_NB=max(16, next_pow2(N)), BLOCK_D=block_d, DK=min(block_d, p.d_chunk),
        NUM_STAGES=p.num_stages,
        SOFT=interpreting(kernel), num_warps=p.num_warps)
    return o


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _draft_attention_fake(q, kv, ring, rows, last_pos, sink, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@dspark_op("draft_attention", reference=draft_attention_reference, fake=_draft_attention_fake)
def draft_attention(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, rows: torch.Tensor,
                    last_pos: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    return draft_attention_launch(q, kv, ring, rows, last_pos, sink, scale)


# SM12x readiness: both tiles at Flash dims (H = 64, d = 512, W = 128, N = 5), bf16 compute,
# fp32 sink, int64 ids (tests/kernels/test_sm12x_resources.py). TILE_32 runs on sm_90 only; on
# sm_120 it fits the shared memory and has no local memory, but a 520 B stack (see TILE_32).
_D16 = "i32:16"     # multiples of 16 at Flash dims: the JIT specialises them, the check must too
for _bm, _bn, _dk, _warps, _stages in (TILE_16, TILE_32):
    add_compile_configs("draft_attention", [compile_config(
        _draft_attention_kernel,
        dict(q_ptr="*bf16", kv_ptr="*bf16", ring_ptr="*bf16", rows_ptr="*i64", last_ptr="*i64",
             sink_ptr="*fp32", o_ptr="*bf16", H=_D16, NH=_D16, D=_D16, stride_qb=_D16,
             stride_qt=_D16, stride_qh=_D16, stride_kb=_D16, stride_kt=_D16, stride_rr=_D16,
             stride_rs=_D16, stride_ob=_D16, stride_ot=_D16, stride_oh=_D16, scale="fp32"),
        dict(N=5, W=128, BLOCK_M=_bm, BLOCK_N=_bn, BLOCK_NB=16, BLOCK_D=512, DK=_dk,
             NUM_STAGES=_stages, SOFT=False), _warps)])
