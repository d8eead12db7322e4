"""Triton kernels of `dspark::moe_experts` (kernels/moe.py holds the math, plan and launcher).

Four launches, every grid static (sized from the shapes), nothing read back by the host:

1. `_moe_route_kernel` (one program): the step's (token, slot) pairs sorted by expert into
   blocks of BLOCK_M rows. Writes `pair_of_row[row]` (pair = token * k + slot), and per block
   its expert, its live row count and, at `count_ptr`, how many blocks are live. Pairs keep
   their pair order within an expert (stable), so the layout is a pure function of topk_ids.
2. `_moe_gate_up_kernel`, grid (max blocks, I / BLOCK_N): h = swiglu(x W1^T, x W3^T) of one
   block's rows, written at the block's rows of `h` (sorted layout).
3. `_moe_down_kernel`, grid (max blocks, D / BLOCK_N): o = h W2^T, times the pair's routing
   weight, written at the pair's row of `y_pair` [T * k, D] (fp32).
4. `_moe_combine_kernel`, grid (T, D / BLOCK_D): y[t] = sum over slots j = 0..k-1 of
   y_pair[t * k + j], in slot order. No float atomics: every output element is one program's
   fixed-order sum, so a replay is bit-equal to any other run.

Programs of grid blocks at or past the live block count return at once (the padding of the
worst-case grid). MXFP4 weights are dequantized inside the K loop from their bytes: the even and
odd K elements of a byte pair multiply the even and odd columns of the activation tile (two dots
of BLOCK_K / 2), so no interleave is needed; each element's E8M0 scale is loaded per packed byte
(16 bytes share one).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_compile.kernels.tl_helpers import round_to


@triton.jit
def _moe_route_kernel(ids_ptr, pair_ptr, blk_expert_ptr, blk_rows_ptr, count_ptr, P, E,
                      MAX_BLOCKS, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                      E_P2: tl.constexpr):
    experts = tl.arange(0, E_P2)
    # pass 1: pairs per expert (an id outside [0, E) is no pair: slot -1 convention)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        onehot, _, _ = _onehot(ids_ptr, p0, P, E, experts, BLOCK_P)
        counts += tl.sum(onehot, axis=0)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, axis=0)
    blk_start = blk_end - nblk
    n_blocks = tl.sum(nblk, axis=0)
    tl.store(count_ptr, n_blocks)
    # block table: block b belongs to the expert whose block range holds it
    for b0 in range(0, MAX_BLOCKS, BLOCK_P):
        b = b0 + tl.arange(0, BLOCK_P)
        eb = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        sel = experts[None, :] == eb[:, None]
        cnt = tl.sum(tl.where(sel, counts[None, :], 0), axis=1)
        start = tl.sum(tl.where(sel, blk_start[None, :], 0), axis=1)
        live = b < n_blocks
        rows = tl.minimum(cnt - (b - start) * BLOCK_M, BLOCK_M)
        tl.store(blk_expert_ptr + b, tl.where(live, eb, -1), mask=b < MAX_BLOCKS)
        tl.store(blk_rows_ptr + b, tl.where(live, rows, 0), mask=b < MAX_BLOCKS)
    # pass 2: row of each pair = its expert's first row + pairs of that expert before it
    seen = blk_start * BLOCK_M
    for p0 in range(0, P, BLOCK_P):
        onehot, offs, valid = _onehot(ids_ptr, p0, P, E, experts, BLOCK_P)
        before = tl.cumsum(onehot, axis=0) - onehot
        row = tl.sum(onehot * (before + seen[None, :]), axis=1)
        tl.store(pair_ptr + row, offs, mask=valid)
        seen += tl.sum(onehot, axis=0)


@triton.jit
def _onehot(ids_ptr, p0, P, E, experts, BLOCK_P: tl.constexpr):
    """[BLOCK_P, E_P2] int32 one-hot of the experts of pairs p0.., their indices, validity."""
    offs = p0 + tl.arange(0, BLOCK_P)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
    valid = (offs < P) & (e >= 0) & (e < E)
    e = tl.where(valid, e, -1)
    return (e[:, None] == experts[None, :]).to(tl.int32), offs, valid


@triton.jit
def _block_rows(pair_ptr, blk_expert_ptr, blk_rows_ptr, b, BLOCK_M: tl.constexpr):
    """(expert, in-block row index, live-row mask, pair per row) of block b."""
    e = tl.load(blk_expert_ptr + b).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    live = r < tl.load(blk_rows_ptr + b)
    pair = tl.load(pair_ptr + b * BLOCK_M + r, mask=live, other=0).to(tl.int64)
    return e, r, live, pair


@triton.jit
def _e2m1(c):
    """4-bit e2m1 code (int32 0..15) -> fp32 value from its bits: with t = the low 3 bits
    (exponent e, mantissa m), t >= 2 is 2^(e-1) (1 + m/2), i.e. fp32 bits (t << 22) + (126 << 23);
    t = 1 is 0.5 and t = 0 is 0; bit 3 is the sign (8 integer ops, no float compare)."""
    t = c & 7
    mag = tl.where(t < 2, t * 0x3F000000, (t << 22) + 0x3F000000)
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_tile(w_ptr, s_ptr, rows, rmask, kb0, KB, BN: tl.constexpr, BKH: tl.constexpr,
                DT: tl.constexpr):
    """Weight rows `rows` [BN] at packed bytes kb0..kb0+BKH of rows of KB bytes -> (even, odd)
    elements [BN, BKH] in DT: e2m1(code) * 2^(scale byte - 127), exact in DT (<= 2 significant
    bits). Scale byte 0 is 2^-127 (an fp32 subnormal), 255 gives inf, as the reference.

    Each row's bytes are contiguous (64-byte runs at BLOCK_K 128; a [BKH, BN] load would walk
    rows KB bytes apart, one byte per transaction), and its BKH / 16 scale bytes are loaded once
    and broadcast."""
    kb = kb0 + tl.arange(0, BKH)
    byte = tl.load(w_ptr + rows[:, None] * KB + kb[None, :], mask=rmask[:, None], other=0)
    ks = kb0 // 16 + tl.arange(0, BKH // 16)
    sb = tl.load(s_ptr + rows[:, None] * (KB // 16) + ks[None, :], mask=rmask[:, None],
                 other=127).to(tl.int32)
    scale = tl.where(sb == 0, 0x00400000, sb << 23).to(tl.float32, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BN, BKH // 16, 16]), [BN, BKH])
    b = byte.to(tl.int32)
    lo = (_e2m1(b & 15) * scale).to(DT)
    hi = (_e2m1(b >> 4) * scale).to(DT)
    return lo, hi


@triton.jit
def _act_tile(a_ptr, row_off, rmask, k0, BLOCK_K: tl.constexpr):
    """Even and odd columns k0.. of the activation rows at `row_off` -> two [BM, BLOCK_K / 2]."""
    kk = k0 + 2 * tl.arange(0, BLOCK_K // 2)
    ptr = a_ptr + row_off[:, None] + kk[None, :]
    return (tl.load(ptr, mask=rmask[:, None], other=0.0),
            tl.load(ptr + 1, mask=rmask[:, None], other=0.0))


@triton.jit
def _mac(x_ptr, x_off, live, k0, w_ptr, s_ptr, w_rows, nmask, KB, acc, BLOCK_K: tl.constexpr,
         BLOCK_N: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr):
    """acc += x[rows, k0:k0+BLOCK_K] . W[w_rows, same K]^T, acc [BM, BN], or its transpose
    [BN, BM] with SWAP (the weight rows on the MMA's M side: decode blocks hold 1-2 live rows
    of 16, so the 16-row side then wastes the activations' rows, not the weights')."""
    lo, hi = _mxfp4_tile(w_ptr, s_ptr, w_rows, nmask, k0 // 2, KB, BLOCK_N, BLOCK_K // 2, DT)
    xe, xo = _act_tile(x_ptr, x_off, live, k0, BLOCK_K)
    if SWAP:
        return _dot(hi, tl.trans(xo), _dot(lo, tl.trans(xe), acc, IEEE), IEEE)
    else:
        return _dot(xo, tl.trans(hi), _dot(xe, tl.trans(lo), acc, IEEE), IEEE)


@triton.jit
def _acc_init(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        return tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def _acc_rows_first(acc, SWAP: tl.constexpr):
    if SWAP:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr):
    # fp32 activations: fp32 products as the reference, no TF32. The interpreter also takes
    # this path for bf16 (its dot multiplies bf16's raw uint16 bits); bf16 products are exact
    # in fp32, so it is the tensor cores' math.
    if IEEE:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc=acc, input_precision="ieee")
    else:
        return tl.dot(a, w, acc=acc)


@triton.jit
def _moe_gate_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, pair_ptr, blk_expert_ptr,
                        blk_rows_ptr, count_ptr, D, I, K_TOP, stride_xt, limit,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        IEEE: tl.constexpr, SOFT: tl.constexpr, SWAP: tl.constexpr):
    b = tl.program_id(0)
    if b >= tl.load(count_ptr):
        return                                  # padding block of the worst-case grid
    e, r, live, pair = _block_rows(pair_ptr, blk_expert_ptr, blk_rows_ptr, b, BLOCK_M)
    x_off = (pair // K_TOP) * stride_xt
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    w_rows = e * I + n
    DT = x_ptr.dtype.element_ty
    g = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    u = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, D, BLOCK_K):
        g = _mac(x_ptr, x_off, live, k0, w1_ptr, s1_ptr, w_rows, nmask, D // 2, g, BLOCK_K,
                 BLOCK_N, DT, IEEE, SWAP)
        u = _mac(x_ptr, x_off, live, k0, w3_ptr, s3_ptr, w_rows, nmask, D // 2, u, BLOCK_K,
                 BLOCK_N, DT, IEEE, SWAP)
    # the reference rounds both GEMMs to x's dtype, clamps (NaN stays NaN), silu in fp32
    g = round_to(_acc_rows_first(g, SWAP), DT, SOFT)
    u = round_to(_acc_rows_first(u, SWAP), DT, SOFT)
    if limit > 0:
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    h = round_to(silu * u, DT, SOFT)
    rows = (b * BLOCK_M + r).to(tl.int64)
    tl.store(h_ptr + rows[:, None] * I + n[None, :], h.to(DT), mask=live[:, None] & nmask[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w2_ptr, s2_ptr, wt_ptr, y_ptr, pair_ptr, blk_expert_ptr,
                     blk_rows_ptr, count_ptr, D, I, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                     SOFT: tl.constexpr, SWAP: tl.constexpr):
    b = tl.program_id(0)
    if b >= tl.load(count_ptr):
        return
    e, r, live, pair = _block_rows(pair_ptr, blk_expert_ptr, blk_rows_ptr, b, BLOCK_M)
    h_off = (b * BLOCK_M + r).to(tl.int64) * I
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < D
    w_rows = e * D + n
    DT = h_ptr.dtype.element_ty
    acc = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, I, BLOCK_K):
        acc = _mac(h_ptr, h_off, live, k0, w2_ptr, s2_ptr, w_rows, nmask, I // 2, acc, BLOCK_K,
                   BLOCK_N, DT, IEEE, SWAP)
    # epilogue: the expert's output rounded to the activation dtype, times the routing weight
    wt = tl.load(wt_ptr + pair, mask=live, other=0.0)
    o = round_to(_acc_rows_first(acc, SWAP), DT, SOFT) * wt[:, None]
    tl.store(y_ptr + pair[:, None] * D + n[None, :], o, mask=live[:, None] & nmask[None, :])


@triton.jit
def _moe_combine_kernel(y_pair_ptr, ids_ptr, y_ptr, D, E, K_TOP, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    y = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, K_TOP):
        p = t * K_TOP + j
        e = tl.load(ids_ptr + p)
        ok = (e >= 0) & (e < E)               # a slot without an expert adds nothing
        y += tl.load(y_pair_ptr + p * D + d, mask=dmask & ok, other=0.0)
    tl.store(y_ptr + t * D + d, y, mask=dmask)
