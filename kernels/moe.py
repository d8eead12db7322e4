"""Routed experts of one MoE layer as a single `dspark::moe_experts` op: reference, plan, launcher.

    y[t] = sum_j w[t, j] * o_j[t],   o_j = W2_e (swiglu(W1_e x[t], W3_e x[t])),   e = topk_ids[t, j]

Weights are MXFP4: e2m1 values with one E8M0 scale per 32 consecutive K elements, in one of two
layouts named by the op's `layout` argument: "checkpoint" (packed e2m1 pairs, int8 bytes, low
nibble = even element, as stored: docs/model.md, "MXFP4 experts"; the eager model) or the
kernel's tiled layout, applied once at build time (kernels/moe_layout.py; models/moe.py
`use_kernel_layouts`). The reference is defined on the checkpoint layout; a tiled call is the
reference of its weights laid back.

W4A16, not W4A8: activations stay in the compute dtype (bf16 in deployment), weights are
dequantized to it inside the GEMMs' K loops. The step's MoE reads 6-384 tokens, so the op is
bound by weight bytes (below), which W4A8 does not reduce; it would add an FP8 rounding of x and
of h between the GEMMs that the model's reference and the HF model (tests/models/
test_hf_reference.py) do not have, and e2m1 x 2^k is exact in bf16 (<= 2 significant bits), so
W4A16 loses nothing on the weight side. W4A8's one possible gain, a cheaper decode (four e4m3
bytes a register instead of two bf16), needs the E8M0 scale applied per 32-element group in the
accumulator. Measured on the H200 (benchmarks/results/h200_moe_slab_2026-12-04): the slab-layout W4A16
kernels reach 52-62 % of the copy bandwidth (1.6-1.9x the touched-expert floor at 6-384 tokens),
with the K loop's issue time near the byte time; a W4A8 build was not measured, so the decision
stands on the numerics above.

Numerics (the reference below is the definition; the kernels match it up to fp32 summation
order): both GEMMs accumulate in fp32 (fp64 for fp64 x) and round to x's dtype; the SwiGLU clamp
(kernels/act_quant.py `swiglu`: gate min(g, limit), up clamp(u, -limit, limit), NaN kept) in
fp32, h rounded to x's dtype; o_j times the fp32 routing weight; the k slots summed in slot
order in fp32. A slot whose id is outside [0, E) (slot -1), or of a token whose `valid` is
False (a padded row), adds nothing; a token contributes only through the experts it is routed
to (a NaN row stays in its row). Batch invariant: a token's output bits do not depend on the
other tokens of the call (kernels/moe_kernels.py says why).

Bytes moved at Flash dims (E = 256, D = 4096, I = 2048, k = 6): per touched expert w1, w3
2048 x 2048 B + 2048 x 128 B scales each, w2 4096 x 1024 B + 4096 x 64 B: 13.37 MB; 6 tokens
touch ~36 experts (0.48 GB, ~100 us at 4.8 TB/s), 384 tokens all 256 (3.42 GB, ~710 us).
Activations at 384 tokens: h (2304 x 2048 bf16) written and read 19 MB, y_pair (2304 x 4096
fp32) 75 MB, 3 % of the weights. The kernels are in kernels/moe_kernels.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton

from dspark_compile.kernels import moe_kernels as mk
from dspark_compile.kernels import moe_layout as ml
from dspark_compile.kernels.act_quant import swiglu
from dspark_compile.kernels.common import cached_decode, row_matmul
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.tl_helpers import compile_config, interpreting, launch, next_pow2

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = ml.MXFP4_BLOCK
CHECKPOINT = ml.CHECKPOINT


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit) -> fp32 E2M1_VALUES, by arithmetic.

    No lookup table: a table built with torch.tensor(...) would be a host-to-device copy, which is
    illegal inside CUDA-graph capture.
    """
    e = (codes >> 1) & 3
    m = (codes & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2((e - 1).to(torch.float32)))
    return torch.where((codes & 8) != 0, -mag, mag)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """packed [..., K/2] int8/uint8, scale [..., K/32] e8m0 -> [..., K] in `dtype`."""
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)        # even element = low nibble
    vals = e2m1_decode(codes)
    exp = scale.view(torch.uint8).to(torch.float32) - 127.0           # never a numeric cast
    vals = vals.unflatten(-1, (-1, MXFP4_BLOCK)) * torch.exp2(exp).unsqueeze(-1)
    return vals.flatten(-2).to(dtype)


def _expert_weights(weights: tuple, layout: str, dtype: torch.dtype):
    """((E, D), e -> expert e's (w1, w3, w2) decoded to `dtype`) from the six weight tensors in
    `layout`: all experts decoded once and kept between eager CPU calls (kernels/common.py
    `cached_decode`), else one expert at a time."""
    size = torch.empty((), dtype=dtype).element_size()
    # two e2m1 values a byte, whether the layout holds them as int8 or as int32 words
    nbytes = sum(w.numel() * w.element_size() * 2 * size for w in weights[0::2])

    def checkpoint_layout():
        if ml.parse_layout(layout) is None:
            return weights
        return ml.experts_to_checkpoint(*weights)

    def decode_all():
        w1, s1, w3, s3, w2, s2 = checkpoint_layout()
        return tuple(mxfp4_dequant(w, sc, dtype) for w, sc in ((w1, s1), (w3, s3), (w2, s2)))

    decoded = cached_decode(weights, ("mxfp4 experts", layout, dtype), nbytes, decode_all)
    if decoded is not None:
        return decoded[2].shape[:2], lambda e: tuple(d[e] for d in decoded)
    w1, s1, w3, s3, w2, s2 = checkpoint_layout()
    return w2.shape[:2], lambda e: tuple(mxfp4_dequant(w[e], sc[e], dtype)
                                         for w, sc in ((w1, s1), (w3, s3), (w2, s2)))


def moe_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                          w2: torch.Tensor, s2: torch.Tensor, swiglu_limit: float,
                          layout: str = CHECKPOINT,
                          valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [T, D] fp32 (fp64 for fp64 x); the module docstring gives the math.

    x [T, D]; topk_ids [T, k] int64 (outside [0, E): no expert); topk_weights [T, k];
    checkpoint layout: w1/w3 [E, I, D/2], s1/s3 [E, I, D/32]; w2 [E, D, I/2], s2 [E, D, I/32]
    (a tiled layout is laid back first); valid [T] bool or None (all valid).
    Fixed shapes (every expert runs on every token, its result kept only where routed): no
    nonzero, no data-dependent shapes.
    """
    acc = _out_dtype(x)
    (E, D), expert = _expert_weights((w1, s1, w3, s3, w2, s2), layout, acc)
    if valid is not None:
        topk_ids = torch.where(valid[:, None], topk_ids, torch.full_like(topk_ids, -1))
    T, k = topk_ids.shape
    xa, wt = x.to(acc), topk_weights.to(acc)
    ys = torch.zeros(T, k, D, dtype=acc, device=x.device)             # slot j's w * o_j
    for e in range(E):
        we1, we3, we2 = expert(e)
        g = row_matmul(xa, we1.T).to(x.dtype)
        u = row_matmul(xa, we3.T).to(x.dtype)
        h = swiglu(g, u, swiglu_limit)
        o = row_matmul(h.to(acc), we2.T).to(x.dtype).to(acc)
        ys = torch.where((topk_ids == e)[..., None], wt[..., None] * o[:, None, :], ys)
    y = ys[:, 0] if k else ys.sum(1)
    for j in range(1, k):                                             # slot order, as the kernel
        y = y + ys[:, j]
    return y


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# Plan and launcher
# ----------------------------------------------------------------------------------------------

RESULTS = "benchmarks/results/h200_moe_2026-12-02/NOTES.md"
# Rows of an expert block, at every token count: tl.dot's smallest N side (the weight rows are
# its M side). Decode blocks hold ~1-9 pairs; a block size chosen by token count would change a
# token's K-sum tiles with the batch (issue 30 item 5: batch invariance).
BLOCK_M = 16
# Pairs per routing scan step: the histogram and the prefix sum of 256 ids (B = 64's 2,304 pairs
# in 9 steps), in every one of the E + 1 programs.
BLOCK_P = 256
# Output columns per combine program.
BLOCK_D = 1024
# Checkpoint-layout tiles: BK 128 (64-row blocks at BK 128 took 113 KB of shared memory on
# sm_120 for fp32 activations, over SM12x's 99 KB: 64 there).
CHECKPOINT_MAX_BK = {torch.float32: 64}
CHECKPOINT_BKS = (128, 64, 32)
TILED_MAX_BK = {torch.float32: 128, torch.float16: 128}


@dataclass(frozen=True)
class MoePlan:
    """Launch choices of one call: every field a function of the weights' shapes and layout,
    none of the token count (batch invariance). `moe_plan` says where each number comes from."""
    gate_up_tile: tuple = (64, 128)    # (BN, BK) of w1 / w3: the layout's, or tile_for's
    down_tile: tuple = (64, 128)       # (BN, BK) of w2
    tiled: bool = False                # weights in the kernel's layout (kernels/moe_layout.py)
    wide: bool = False                 # a scale byte > 128: two bf16 multiplies a pair
    block_d: int = BLOCK_D
    # one warpgroup, the 64-row tile's wgmma M: 8 warps 2x slower (H200, RESULTS run 2)
    num_warps: int = 4
    # K steps in flight (3 x 25 KB at 64 x 256, bf16): 4 within 1 % (RESULTS run 2)
    num_stages: int = 3


def max_bk(dtype, tiled: bool) -> int:
    return (TILED_MAX_BK if tiled else CHECKPOINT_MAX_BK).get(dtype, 256 if tiled else 128)


def moe_plan(E: int, D: int, I: int, layout: str = CHECKPOINT, dtype=torch.bfloat16) -> MoePlan:
    """The plan of weights [E] x (I x D, D x I) in `layout`: the tiled layout carries its tiles
    (chosen at build time by moe_layout.tile_for from the shapes); the checkpoint layout takes
    checkpoint_tile's at BK <= 128 (its per-nibble decode holds twice the registers a value)."""
    lay = ml.parse_layout(layout)
    if lay is not None:
        return MoePlan(lay.gate_up_tile, lay.down_tile, True, lay.wide)
    bk = max_bk(dtype, False)
    return MoePlan(checkpoint_tile(I, D, bk), checkpoint_tile(D, I, bk), False, False,
                   block_d=min(BLOCK_D, next_pow2(D)))


def checkpoint_tile(N: int, K: int, max_bk: int) -> tuple:
    """(BN, BK) of an [N, K] matrix in the checkpoint layout: BK any of 128 / 64 / 32 (its
    loader reads whole 32-element scale groups; no slabs), from the shape only."""
    return ml.tile_for(N, K, max_bk, CHECKPOINT_BKS)


def max_blocks(P: int, E: int, block_m: int = BLOCK_M) -> int:
    """Worst-case live blocks: sum_e ceil(c_e / bm) <= (P + n (bm - 1)) / bm, n <= min(E, P)
    experts hit."""
    return (P + min(E, P) * (block_m - 1)) // block_m


def _valid_bytes(valid: Optional[torch.Tensor], T: int, device):
    if valid is None:
        return torch.empty(1, dtype=torch.uint8, device=device), False
    if valid.shape != (T,) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool [{T}] tensor, got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    return valid.contiguous().view(torch.uint8), True


def moe_route_launch(topk_ids: torch.Tensor, E: int, block_m: int = BLOCK_M,
                     block_p: int = BLOCK_P, valid: Optional[torch.Tensor] = None):
    """(pair_of_row [max_blocks * bm] int32, block expert [max_blocks] int32 (-1 unused),
    block live rows [max_blocks] int32, live block count [1] int32); rows past a block's live
    rows are never written. A pair of a token whose `valid` is False is no pair."""
    T, k = topk_ids.shape
    ids = topk_ids.reshape(-1).contiguous()
    P = ids.numel()
    nb = max_blocks(P, E, block_m)
    dev = ids.device
    vb, has_valid = _valid_bytes(valid, T, dev)
    pair = torch.empty(nb * block_m, dtype=torch.int32, device=dev)
    blk_e = torch.empty(nb, dtype=torch.int32, device=dev)
    blk_rows = torch.empty(nb, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    launch(mk._moe_route_kernel)[(E + 1,)](
        ids, vb, pair, blk_e, blk_rows, count, P, E, max(k, 1), nb, BLOCK_M=block_m,
        BLOCK_P=block_p, E_P2=next_pow2(E), HAS_VALID=has_valid, num_warps=4)
    return pair, blk_e, blk_rows, count


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _shapes(lay, w1, w2):
    """(E, I, D) from the weights of `lay` (None: the checkpoint layout)."""
    if lay is None:
        return w1.shape[0], w1.shape[1], 2 * w1.shape[2]
    if w1.dim() != 5 or w2.dim() != 5:
        raise ValueError(f"layout {lay.name}: w1 and w2 must be 5-d tiled tensors, got "
                         f"{tuple(w1.shape)} and {tuple(w2.shape)}")
    return w1.shape[0], w1.shape[1] * w1.shape[3], w1.shape[2] * w1.shape[4] * 8


def _want(lay, E, I, D):
    """name -> (shape, dtypes) of the six weight tensors in `lay`."""
    if lay is None:
        b = (torch.int8, torch.uint8)
        return {"w1": ((E, I, D // 2), b), "w3": ((E, I, D // 2), b), "w2": ((E, D, I // 2), b),
                "s1": ((E, I, D // 32), b), "s3": ((E, I, D // 32), b),
                "s2": ((E, D, I // 32), b)}
    out = {}
    for w, s, (N, K), (bn, bk) in (("w1", "s1", (I, D), lay.gate_up_tile),
                                   ("w3", "s3", (I, D), lay.gate_up_tile),
                                   ("w2", "s2", (D, I), lay.down_tile)):
        out[w] = ((E, N // bn, K // bk, bn, bk // 8), (torch.int32,))
        out[s] = ((E, N // bn, K // bk, bn, bk // 32), (torch.uint8,))
    return out


def _check(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, layout):
    if x.dim() != 2 or x.dtype not in _KERNEL_DTYPES + (torch.float64,):
        raise ValueError(f"x must be a float [T, D] tensor, got {x.dtype} {tuple(x.shape)}")
    T, D = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids and topk_weights must both be [{T}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    lay = ml.parse_layout(layout)
    E, I, Dw = _shapes(lay, w1, w2)
    if Dw != D:
        raise ValueError(f"w1 {tuple(w1.shape)} ({layout}) is for hidden {Dw}, x has {D}")
    tensors = {"w1": w1, "s1": s1, "w3": w3, "s3": s3, "w2": w2, "s2": s2}
    for name, (shape, dtypes) in _want(lay, E, I, D).items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.element_size() != dtypes[0].itemsize or \
                (lay is not None and t.dtype not in dtypes):
            raise ValueError(f"{name} must be {dtypes[0]} {list(shape)} in layout {layout}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if lay is not None:     # the kernels read a row's scale bytes as one 64-bit word
        for name in ("s1", "s3", "s2"):
            if tensors[name].data_ptr() % 8:
                raise ValueError(f"{name} (layout {layout}) must start on an 8-byte boundary")
    if D % MXFP4_BLOCK or I % MXFP4_BLOCK:
        raise ValueError(f"hidden {D} and intermediate {I} must be multiples of {MXFP4_BLOCK}")
    return T, D, E, I


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Checkpoint bytes as uint8 (E8M0 / int8 views); tiled int32 words as they are."""
    t = t.contiguous()
    return t if t.dtype == torch.int32 else t.view(torch.uint8)


def moe_experts_launch(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, swiglu_limit,
                       layout: str = CHECKPOINT, valid=None, plan: MoePlan | None = None):
    T, D, E, I = _check(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, layout)
    if x.dtype == torch.float64:  # exact-precision model runs: no kernel, the reference
        return moe_experts_reference(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2,
                                     swiglu_limit, layout, valid)
    k = topk_ids.shape[1]
    P = T * k
    y = torch.empty(T, D, dtype=torch.float32, device=x.device)
    if P == 0:
        return y.zero_()
    plan = plan or moe_plan(E, D, I, layout, x.dtype)
    (gbn, gbk), (dbn, dbk) = plan.gate_up_tile, plan.down_tile
    if I % gbn or D % gbk or D % dbn or I % dbk:
        raise ValueError(f"plan tiles {plan.gate_up_tile} / {plan.down_tile} must divide "
                         f"intermediate {I} and hidden {D}")
    ids = topk_ids.reshape(-1).contiguous()
    wt = topk_weights.reshape(-1).to(torch.float32).contiguous()
    x2 = x if x.stride(1) == 1 else x.contiguous()
    pair, blk_e, blk_rows, count = moe_route_launch(topk_ids, E, BLOCK_M, BLOCK_P, valid)
    vb, has_valid = _valid_bytes(valid, T, x.device)
    nb = blk_e.shape[0]
    h = torch.empty(nb * BLOCK_M, I, dtype=x.dtype, device=x.device)       # sorted rows
    y_pair = torch.empty(P, D, dtype=torch.float32, device=x.device)
    soft = interpreting(mk._moe_gate_up_kernel)
    ieee = soft or x.dtype != torch.bfloat16      # moe_kernels._dot says why
    route = (pair, blk_e, blk_rows, count)
    knobs = dict(TILED=plan.tiled, WIDE=plan.wide, IEEE=ieee, SOFT=soft,
                 num_warps=plan.num_warps, num_stages=plan.num_stages)
    launch(mk._moe_gate_up_kernel)[(nb, I // gbn)](
        x2, _raw(w1), _raw(s1), _raw(w3), _raw(s3), h, *route, D, I, k, x2.stride(0),
        float(swiglu_limit), BLOCK_M=BLOCK_M, BLOCK_N=gbn, BLOCK_K=gbk, **knobs)
    launch(mk._moe_down_kernel)[(nb, D // dbn)](
        h, _raw(w2), _raw(s2), wt, y_pair, *route, D, I, BLOCK_M=BLOCK_M, BLOCK_N=dbn,
        BLOCK_K=dbk, **knobs)
    launch(mk._moe_combine_kernel)[(T, triton.cdiv(D, plan.block_d))](
        y_pair, ids, vb, y, D, E, k, BLOCK_D=plan.block_d, HAS_VALID=has_valid,
        num_warps=plan.num_warps)
    return y


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _moe_fake(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, swiglu_limit,
              layout=CHECKPOINT, valid=None):
    lay = ml.parse_layout(layout)
    D = x.shape[1] if lay is not None else w2.shape[1]
    return x.new_empty(x.shape[0], D, dtype=_out_dtype(x))


@dspark_op("moe_experts", reference=moe_experts_reference, fake=_moe_fake)
def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                w2: torch.Tensor, s2: torch.Tensor, swiglu_limit: float,
                layout: str = CHECKPOINT, valid: torch.Tensor | None = None) -> torch.Tensor:
    return moe_experts_launch(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, swiglu_limit,
                              layout, valid)


def _compile_configs():
    """Every kernel configuration `moe_plan` picks at Flash dims (E = 256, D 4096, I 2048):
    both layouts, bf16 (tiled 64 x 256, checkpoint 64 x 128) and fp32 (64 x 64) activations,
    the tiled layout's wide-scale variant for bf16."""
    D16, ptr8, ptr32 = "i32:16", "*u8", "*i32"
    route = dict(pair_ptr=ptr32, blk_expert_ptr=ptr32, blk_rows_ptr=ptr32, count_ptr=ptr32)
    out = [compile_config(mk._moe_route_kernel, dict(
        ids_ptr="*i64", valid_ptr=ptr8, P="i32", E=D16, K_TOP="i32", MAX_BLOCKS="i32", **route),
        dict(BLOCK_M=BLOCK_M, BLOCK_P=BLOCK_P, E_P2=256, HAS_VALID=hv), 4) for hv in (False, True)]
    for dt, tiled, wide in (("*bf16", True, False), ("*bf16", True, True),
                            ("*bf16", False, False), ("*fp32", True, False),
                            ("*fp32", False, False)):
        tdt = torch.bfloat16 if dt == "*bf16" else torch.float32
        bk = max_bk(tdt, tiled)
        wptr = ptr32 if tiled else ptr8
        knobs = dict(BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=bk, TILED=tiled, WIDE=wide,
                     IEEE=dt != "*bf16", SOFT=False)
        out.append(compile_config(mk._moe_gate_up_kernel, dict(
            x_ptr=dt, w1_ptr=wptr, s1_ptr=ptr8, w3_ptr=wptr, s3_ptr=ptr8, h_ptr=dt, D=D16,
            I=D16, K_TOP="i32", stride_xt=D16, limit="fp32", **route), knobs, 4))
        out.append(compile_config(mk._moe_down_kernel, dict(
            h_ptr=dt, w2_ptr=wptr, s2_ptr=ptr8, wt_ptr="*fp32", y_ptr="*fp32", D=D16, I=D16,
            **route), knobs, 4))
    out += [compile_config(mk._moe_combine_kernel, dict(
        y_pair_ptr="*fp32", ids_ptr="*i64", valid_ptr=ptr8, y_ptr="*fp32", D=D16, E=D16,
        K_TOP="i32"), dict(BLOCK_D=BLOCK_D, HAS_VALID=hv), 4) for hv in (False, True)]
    return out


add_compile_configs("moe_experts", _compile_configs())
