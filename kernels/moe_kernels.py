"""Triton kernels of `dspark::moe_experts` (kernels/moe.py holds the math, plan and launcher).

Four launches, every grid static (sized from the shapes), nothing read back by the host:

1. `_moe_route_kernel` (E + 1 programs, one an expert): the step's (token, slot) pairs sorted
   by expert into blocks of BLOCK_M rows. Writes `pair_of_row[row]` (pair = token * k + slot), and per block
   its expert, its live row count and, at `count_ptr`, how many blocks are live. Pairs keep
   their pair order within an expert (stable), so the layout is a pure function of topk_ids.
   A slot whose id is outside [0, E), or whose token is not `valid`, is no pair.
2. `_moe_gate_up_kernel`, grid (max blocks, I / BN): h = swiglu(x W1^T, x W3^T) of one
   block's rows, both GEMMs in one K loop over the same activation tile, written at the
   block's rows of `h` (sorted layout).
3. `_moe_down_kernel`, grid (max blocks, D / BN): o = h W2^T, times the pair's routing
   weight, written at the pair's row of `y_pair` [T * k, D] (fp32).
4. `_moe_combine_kernel`, grid (T, D / BLOCK_D): y[t] = sum over slots j = 0..k-1 of
   y_pair[t * k + j], in slot order. No float atomics: every output element is one program's
   fixed-order sum, so a replay is bit-equal to any other run.

Batch invariance: BLOCK_M is 16 at every token count and the weight tile (BN, BK) is a function
of the matrix's shape (kernels/moe_layout.py `tile_for`), so every output element is the same
sequence of MMAs over the same K steps whichever tokens share its block, whichever row it sits
in, however many blocks the launch has. No split-K.

The MMAs put the weight rows on the M side (acc [BN, BLOCK_M]): decode blocks hold 1-2 live rows
of 16, so the 16-wide side then wastes activation rows, not weight rows.

Weights come in one of two layouts (`TILED`):
- the kernel's (kernels/moe_layout.py): a tile's values and scales are two contiguous runs;
  8 e2m1 values per 32-bit word bit-permuted so that two values decode to a bf16 pair with
  one or two shifts and masks, and one bf16x2 multiply by 2^(s - 1) applies the E8M0 scale;
- the checkpoint's (the eager model): row-contiguous packed bytes, each nibble decoded on its
  own (`_e2m1`), the scale per byte in fp32: 11.4 instructions a value in the K loop's SASS
  against the tiled 3.5-3.8 (sm_90), 1.7x the time on the H200
  (benchmarks/results/h200_moe_2026-12-02/NOTES.md).
Programs of grid blocks at or past the live block count return at once (the padding of the
worst-case grid).
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark_compile.kernels.tl_helpers import round_to

# moe_layout.PAIR_SHIFTS and the masks of its bit order (int32 bit patterns)
_MAG = tl.constexpr(0x01C001C0)            # bf16 bits 6..8 of both lanes
_SGN = tl.constexpr(-2147450880)           # 0x80008000: bf16 sign bit of both lanes
_HI16 = tl.constexpr(-65536)               # 0xFFFF0000
_PAIR_A = tl.constexpr((-3, 0, 3, 6))
_PAIR_B = tl.constexpr((1, 0, 3, 2))


# ------------------------------------------------------------------------------------------------
# routing
# ------------------------------------------------------------------------------------------------

@triton.jit
def _moe_route_kernel(ids_ptr, valid_ptr, pair_ptr, blk_expert_ptr, blk_rows_ptr, count_ptr, P,
                      E, K_TOP, MAX_BLOCKS, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                      E_P2: tl.constexpr, HAS_VALID: tl.constexpr):
    """Program e < E: expert e's blocks and rows; program E: the live count and the unused tail
    of the block table. Every program counts all pairs per expert itself (a histogram of the
    step's T * k ids, read from L2), so no program waits for another."""
    me = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        e, ok = _pair_expert(ids_ptr, valid_ptr, offs, offs < P, E, K_TOP, HAS_VALID)
        # no pair counts in bin 0 and is taken out again (the histogram has no mask argument
        # in every Triton this runs on)
        counts += tl.histogram(tl.where(ok, e, 0), E_P2)
        counts -= tl.where(experts == 0, tl.sum((~ok).to(tl.int32), axis=0), 0)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, axis=0)
    if me == E:
        n_blocks = tl.sum(nblk, axis=0)
        tl.store(count_ptr, n_blocks)
        for b0 in range(n_blocks, MAX_BLOCKS, BLOCK_P):
            b = b0 + tl.arange(0, BLOCK_P)
            tl.store(blk_expert_ptr + b, tl.full([BLOCK_P], -1, tl.int32), mask=b < MAX_BLOCKS)
            tl.store(blk_rows_ptr + b, tl.zeros([BLOCK_P], tl.int32), mask=b < MAX_BLOCKS)
    else:
        mine = experts == me
        count = tl.sum(tl.where(mine, counts, 0), axis=0)
        n_mine = tl.sum(tl.where(mine, nblk, 0), axis=0)
        start = tl.sum(tl.where(mine, blk_end, 0), axis=0) - n_mine
        for b0 in range(0, n_mine, BLOCK_P):
            j = b0 + tl.arange(0, BLOCK_P)
            live = j < n_mine
            tl.store(blk_expert_ptr + start + j, tl.full([BLOCK_P], 0, tl.int32) + me, mask=live)
            tl.store(blk_rows_ptr + start + j, tl.minimum(count - j * BLOCK_M, BLOCK_M),
                     mask=live)
        # row of each of my pairs = my first row + my pairs before it (stable: pair order)
        seen = start * BLOCK_M
        if count > 0:
            for p0 in range(0, P, BLOCK_P):
                offs = p0 + tl.arange(0, BLOCK_P)
                e, ok = _pair_expert(ids_ptr, valid_ptr, offs, offs < P, E, K_TOP, HAS_VALID)
                hit = (ok & (e == me)).to(tl.int32)
                row = seen + tl.cumsum(hit, axis=0) - hit
                tl.store(pair_ptr + row, offs, mask=hit != 0)
                seen += tl.sum(hit, axis=0)


@triton.jit
def _pair_expert(ids_ptr, valid_ptr, offs, inb, E, K_TOP, HAS_VALID: tl.constexpr):
    """Expert of pairs `offs` (int32), -1 for none: out of range, or its token not valid."""
    e = tl.load(ids_ptr + offs, mask=inb, other=-1).to(tl.int32)
    ok = inb & (e >= 0) & (e < E)
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + offs // K_TOP, mask=inb, other=0) != 0)
    return tl.where(ok, e, -1), ok


@triton.jit
def _block_rows(pair_ptr, blk_expert_ptr, blk_rows_ptr, b, BLOCK_M: tl.constexpr):
    """(expert, in-block row index, live-row mask, pair per row) of block b."""
    e = tl.load(blk_expert_ptr + b).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    live = r < tl.load(blk_rows_ptr + b)
    pair = tl.load(pair_ptr + b * BLOCK_M + r, mask=live, other=0).to(tl.int64)
    return e, r, live, pair


# ------------------------------------------------------------------------------------------------
# weight tiles: [BN, BK] of expert e's rows nt * BN.., K columns kt * BK.., natural K order
# ------------------------------------------------------------------------------------------------

@triton.jit
def _e2m1(c):
    """4-bit e2m1 code (int32 0..15) -> fp32 value from its bits: with t = the low 3 bits
    (exponent e, mantissa m), t >= 2 is 2^(e-1) (1 + m/2), i.e. fp32 bits (t << 22) + (126 << 23);
    t = 1 is 0.5 and t = 0 is 0; bit 3 is the sign (8 integer ops, no float compare)."""
    t = c & 7
    mag = tl.where(t < 2, t * 0x3F000000, (t << 22) + 0x3F000000)
    return (mag | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _checkpoint_tile(w_ptr, s_ptr, e, nt, kt, N, K, BN: tl.constexpr, BK: tl.constexpr,
                     WDT: tl.constexpr):
    """The checkpoint layout: rows of K / 2 packed bytes (low nibble = even element), one E8M0
    byte per 32 elements; e2m1(code) * 2^(byte - 127) per nibble in fp32 (byte 0 is 2^-127,
    an fp32 subnormal; 255 gives inf, as the reference)."""
    BKH: tl.constexpr = BK // 2
    rows = (e * N + nt * BN + tl.arange(0, BN)).to(tl.int64)
    kb = kt * BKH + tl.arange(0, BKH)
    byte = tl.load(w_ptr + rows[:, None] * (K // 2) + kb[None, :]).to(tl.int32)
    ks = kt * (BK // 32) + tl.arange(0, BK // 32)
    sb = tl.load(s_ptr + rows[:, None] * (K // 32) + ks[None, :]).to(tl.int32)
    scale = tl.where(sb == 0, 0x00400000, sb << 23).to(tl.float32, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BN, BK // 32, 16]), [BN, BKH])
    lo = _e2m1(byte & 15) * scale
    hi = _e2m1(byte >> 4) * scale
    return tl.reshape(tl.join(lo, hi), [BN, BK]).to(WDT)


@triton.jit
def _shift(u, A: tl.constexpr):
    if A > 0:
        return u << A
    elif A < 0:
        return u >> (-A)           # arithmetic: the filled top bits are masked off
    else:
        return u


@triton.jit
def _pair_bits(u, J: tl.constexpr):
    """Pair J of every word as two bf16 lanes of e2m1 * 2^-126 (kernels/moe_layout.py)."""
    A: tl.constexpr = _PAIR_A[J]
    B: tl.constexpr = _PAIR_B[J]
    if A == B:
        return _shift(u, A) & (_MAG | _SGN)
    else:
        return (_shift(u, A) & _MAG) | (_shift(u, B) & _SGN)


@triton.jit
def _tile_words(w_ptr, s_ptr, e, nt, kt, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """The kernel layout (kernels/moe_layout.py): tile kt of expert e's rows nt * BN.. as its
    [BN, BK / 8] words and, per row, its BK / 32 scale bytes as one 64- or 32-bit word."""
    W: tl.constexpr = BK // 8
    G: tl.constexpr = BK // 32
    tile = (e * (N // BN) + nt) * (K // BK) + kt
    r = tl.arange(0, BN)
    u = tl.load(w_ptr + tile * (BN * W) + r[:, None] * W + tl.arange(0, W)[None, :])
    SW: tl.constexpr = tl.int64 if G == 8 else tl.int32
    sw = tl.load(s_ptr.to(tl.pointer_type(SW)) + tile * BN + r)
    return u, sw


@triton.jit
def _scale_byte(sw, g: tl.constexpr):
    return ((sw >> (8 * g)) & 255).to(tl.int32)


@triton.jit
def _slab_pair(u, sw, J: tl.constexpr, BK: tl.constexpr, WDT: tl.constexpr,
               WIDE: tl.constexpr, SOFT: tl.constexpr):
    """Slabs 2J and 2J + 1 of a tile ([BN, BK / 8] each, WDT): lane 0 and lane 1 of pair J of
    every word, times their rows' scales. Slab s holds the tile's K offsets s * BK / 8 ..; it
    lies in one 32-element scale group (BK <= 256). Exact: e2m1 * 2^k has <= 2 significant
    bits."""
    W: tl.constexpr = BK // 8
    s0 = _scale_byte(sw, (2 * J * W) // 32)[:, None]
    s1 = _scale_byte(sw, ((2 * J + 1) * W) // 32)[:, None]
    r = _pair_bits(u, J)
    if SOFT:          # the interpreter: no inline PTX; fp32 lanes, the same products
        lo = (r << 16).to(tl.float32, bitcast=True)
        hi = (r & _HI16).to(tl.float32, bitcast=True)
        if WIDE:      # 2^126 first, then 2^(s - 127); byte 0 is the subnormal 2^-127
            c0 = tl.where(s0 == 0, 0x00400000, s0 << 23).to(tl.float32, bitcast=True)
            c1 = tl.where(s1 == 0, 0x00400000, s1 << 23).to(tl.float32, bitcast=True)
            lo = lo * 8.507059173023462e37
            hi = hi * 8.507059173023462e37
        else:         # 2^(s - 1), normal for s <= 128
            c0 = ((s0 + 126) << 23).to(tl.float32, bitcast=True)
            c1 = ((s1 + 126) << 23).to(tl.float32, bitcast=True)
        return (lo * c0).to(WDT), (hi * c1).to(WDT)
    else:             # one bf16x2 multiply a pair (two for WIDE), each lane its own scale
        if WIDE:
            cw = tl.where(s0 == 0, 0x40, s0 << 7) | (tl.where(s1 == 0, 0x40, s1 << 7) << 16)
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; mov.b32 t, 0x7E807E80; mul.rn.bf16x2 t, $1, t; "
                "mul.rn.bf16x2 $0, t, $2; }", "=r,r,r", [r, cw], dtype=tl.int32, is_pure=True,
                pack=1)
        else:
            cw = ((s0 + 126) << 7) | ((s1 + 126) << 23)
            r = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [r, cw],
                                          dtype=tl.int32, is_pure=True, pack=1)
        lo = r.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return lo.to(WDT), hi.to(WDT)


@triton.jit
def _act_slab(x_ptr, x_off, live, kt, s: tl.constexpr, BK: tl.constexpr):
    """[BM, BK / 8] activations of slab s of K tile kt (rows not live read 0)."""
    W: tl.constexpr = BK // 8
    kk = kt * BK + s * W + tl.arange(0, W)
    return tl.load(x_ptr + x_off[:, None] + kk[None, :], mask=live[:, None], other=0.0)


@triton.jit
def _dot(w, a, acc, IEEE: tl.constexpr):
    """acc [BN, BM] += w [BN, BK] . a [BM, BK]^T. IEEE: fp32 products as the reference (fp32 /
    fp16 activations, and the interpreter, whose dot multiplies bf16's raw uint16 bits); bf16
    products are exact in fp32, so either path is the tensor cores' math."""
    if IEEE:
        return tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc=acc,
                      input_precision="ieee")
    else:
        return tl.dot(w, tl.trans(a), acc=acc)


# ------------------------------------------------------------------------------------------------
# the GEMMs
# ------------------------------------------------------------------------------------------------

@triton.jit
def _moe_gate_up_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, pair_ptr, blk_expert_ptr,
                        blk_rows_ptr, count_ptr, D, I, K_TOP, stride_xt, limit,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        TILED: tl.constexpr, WIDE: tl.constexpr, IEEE: tl.constexpr,
                        SOFT: tl.constexpr):
    b = tl.program_id(0)
    if b >= tl.load(count_ptr):
        return                                  # padding block of the worst-case grid
    e, r, live, pair = _block_rows(pair_ptr, blk_expert_ptr, blk_rows_ptr, b, BLOCK_M)
    x_off = (pair // K_TOP) * stride_xt
    nt = tl.program_id(1)
    DT = x_ptr.dtype.element_ty
    WDT = tl.bfloat16 if DT == tl.bfloat16 else tl.float32
    g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    nk = D // BLOCK_K
    if TILED:
        for kt in range(0, nk):
            # the words go through Triton's cp.async pipeline (num_stages); loading the next
            # tile into registers by hand ran 40 % slower (H200,
            # benchmarks/results/h200_moe_slab_2026-12-04)
            wg, sg = _tile_words(w1_ptr, s1_ptr, e, nt, kt, I, D, BLOCK_N, BLOCK_K)
            wu, su = _tile_words(w3_ptr, s3_ptr, e, nt, kt, I, D, BLOCK_N, BLOCK_K)
            for j in tl.static_range(4):
                a0 = _act_slab(x_ptr, x_off, live, kt, 2 * j, BLOCK_K)
                a1 = _act_slab(x_ptr, x_off, live, kt, 2 * j + 1, BLOCK_K)
                lo, hi = _slab_pair(wg, sg, j, BLOCK_K, WDT, WIDE, SOFT)
                g = _dot(hi, a1, _dot(lo, a0, g, IEEE), IEEE)
                lo, hi = _slab_pair(wu, su, j, BLOCK_K, WDT, WIDE, SOFT)
                u = _dot(hi, a1, _dot(lo, a0, u, IEEE), IEEE)
    else:
        for kt in range(0, nk):
            kk = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + x_off[:, None] + kk[None, :], mask=live[:, None], other=0.0)
            w = _checkpoint_tile(w1_ptr, s1_ptr, e, nt, kt, I, D, BLOCK_N, BLOCK_K, WDT)
            g = _dot(w, a, g, IEEE)
            w = _checkpoint_tile(w3_ptr, s3_ptr, e, nt, kt, I, D, BLOCK_N, BLOCK_K, WDT)
            u = _dot(w, a, u, IEEE)
    # the reference rounds both GEMMs to x's dtype, clamps (NaN stays NaN), silu in fp32
    g = round_to(tl.trans(g), DT, SOFT)
    u = round_to(tl.trans(u), DT, SOFT)
    if limit > 0:
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    h = round_to(silu * u, DT, SOFT)
    n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (b * BLOCK_M + r).to(tl.int64)
    tl.store(h_ptr + rows[:, None] * I + n[None, :], h.to(DT), mask=live[:, None])


@triton.jit
def _moe_down_kernel(h_ptr, w2_ptr, s2_ptr, wt_ptr, y_ptr, pair_ptr, blk_expert_ptr,
                     blk_rows_ptr, count_ptr, D, I, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILED: tl.constexpr,
                     WIDE: tl.constexpr, IEEE: tl.constexpr, SOFT: tl.constexpr):
    b = tl.program_id(0)
    if b >= tl.load(count_ptr):
        return
    e, r, live, pair = _block_rows(pair_ptr, blk_expert_ptr, blk_rows_ptr, b, BLOCK_M)
    h_off = (b * BLOCK_M + r).to(tl.int64) * I
    nt = tl.program_id(1)
    DT = h_ptr.dtype.element_ty
    WDT = tl.bfloat16 if DT == tl.bfloat16 else tl.float32
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    nk = I // BLOCK_K
    if TILED:
        for kt in range(0, nk):
            w, sw = _tile_words(w2_ptr, s2_ptr, e, nt, kt, D, I, BLOCK_N, BLOCK_K)
            for j in tl.static_range(4):
                lo, hi = _slab_pair(w, sw, j, BLOCK_K, WDT, WIDE, SOFT)
                acc = _dot(lo, _act_slab(h_ptr, h_off, live, kt, 2 * j, BLOCK_K), acc, IEEE)
                acc = _dot(hi, _act_slab(h_ptr, h_off, live, kt, 2 * j + 1, BLOCK_K), acc, IEEE)
    else:
        for kt in range(0, nk):
            kk = kt * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(h_ptr + h_off[:, None] + kk[None, :], mask=live[:, None], other=0.0)
            w = _checkpoint_tile(w2_ptr, s2_ptr, e, nt, kt, D, I, BLOCK_N, BLOCK_K, WDT)
            acc = _dot(w, a, acc, IEEE)
    # epilogue: the expert's output rounded to the activation dtype, times the routing weight
    wt = tl.load(wt_ptr + pair, mask=live, other=0.0)
    o = round_to(tl.trans(acc), DT, SOFT) * wt[:, None]
    n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + pair[:, None] * D + n[None, :], o, mask=live[:, None])


@triton.jit
def _moe_combine_kernel(y_pair_ptr, ids_ptr, valid_ptr, y_ptr, D, E, K_TOP,
                        BLOCK_D: tl.constexpr, HAS_VALID: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    y = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, K_TOP):
        p = t * K_TOP + j
        _, ok = _pair_expert(ids_ptr, valid_ptr, p, p >= 0, E, K_TOP, HAS_VALID)
        y += tl.load(y_pair_ptr + p * D + d, mask=dmask & ok, other=0.0)  # no expert: adds 0
    tl.store(y_ptr + t * D + d, y, mask=dmask)
