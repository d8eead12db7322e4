"""The two weight formats of a DeepSeek-V4 checkpoint: quantize (synthetic writer) and dequantize.

- FP8 block-scaled linears (docs/model.md, "FP8 block-scaled weights"): `float8_e4m3fn [out, in]`
  plus one UE8M0 scale (`float8_e8m0fnu`) per 128x128 block, `W = Wq * 2^(byte - 127)`.
- MXFP4 routed experts (docs/model.md, "MXFP4 experts"): int8 bytes `[out, in/2]`, two e2m1
  codes per byte (low nibble = even element), one E8M0 scale per 32 consecutive input elements.
  Dequant is the MoE op's own
  :func:`dspark_compile.kernels.moe.mxfp4_dequant`, re-exported here.

E8M0 scales are always read through their byte (`.view(torch.uint8)`), never numerically cast:
a numeric cast to uint8 destroys them, and byte access works the same on every torch we target.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_compile.kernels.common import FP8_MAX, ue8m0_scale
from dspark_compile.kernels.moe import E2M1_VALUES, MXFP4_BLOCK, mxfp4_dequant

__all__ = ["fp8_block_quant", "fp8_block_dequant", "mxfp4_quant", "mxfp4_dequant",
           "e8m0_from_exponent", "e8m0_to_float", "FP4_MAX"]

FP4_MAX = 6.0  # largest e2m1 magnitude
# E8M0 encodes 2^(byte-127) for bytes 0..254 (255 is NaN).
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


def e8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents -> float8_e8m0fnu tensor holding 2^exp (byte = exp + 127)."""
    if exp.is_floating_point() and not torch.equal(exp, exp.round()):
        raise ValueError("e8m0_from_exponent: exponents must be integers")
    e = exp.to(torch.int32)
    if e.numel() and (int(e.min()) < _E8M0_MIN_EXP or int(e.max()) > _E8M0_MAX_EXP):
        raise ValueError(f"e8m0_from_exponent: exponent outside [{_E8M0_MIN_EXP}, {_E8M0_MAX_EXP}]")
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu (or its uint8 bytes) -> fp32 2^(byte - 127)."""
    return torch.exp2(scale.view(torch.uint8).to(torch.float32) - 127.0)


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")


# ---- FP8 block scaled ---------------------------------------------------------------------

def fp8_block_quant(w: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """Float matrix [R, C] -> (float8_e4m3fn [R, C], float8_e8m0fnu [ceil(R/br), ceil(C/bc)]).

    Scale per block is 2^ceil(log2(amax / 448)) (amax floored at 1e-4, as DeepSeek's UE8M0
    quant does), so every block fits e4m3 without saturation. Edge blocks may be partial.
    """
    _check_2d("fp8_block_quant weight", w)
    br, bc = block
    R, C = w.shape
    nr, nc = -(-R // br), -(-C // bc)
    wf = F.pad(w.float(), (0, nc * bc - C, 0, nr * br - R))          # zeros never raise amax
    blocks = wf.view(nr, br, nc, bc)
    scale = ue8m0_scale(blocks.abs().amax(dim=(1, 3)))               # [nr, nc] powers of two
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(nr * br, nc * bc)[:R, :C].contiguous()
    return q, e8m0_from_exponent(torch.log2(scale).round())


def fp8_block_dequant(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight float8_e4m3fn [R, C], scale e8m0 [ceil(R/br), ceil(C/bc)] -> [R, C] in `dtype`."""
    _check_2d("fp8_block_dequant weight", weight)
    br, bc = block
    R, C = weight.shape
    want = (-(-R // br), -(-C // bc))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8_block_dequant: scale shape {tuple(scale.shape)} does not match "
                         f"weight {tuple(weight.shape)} with block {block} (expected {want})")
    s = e8m0_to_float(scale)
    s = s.repeat_interleave(br, 0)[:R].repeat_interleave(bc, 1)[:, :C]
    return (weight.float() * s).to(dtype)


# ---- MXFP4 -----------------------------------------------------------------------------------

def _e2m1_boundaries(device) -> torch.Tensor:
    """Midpoints between consecutive e2m1 magnitudes, nudged so bucketize rounds ties to even.

    bucketize(right=False) puts a value equal to a boundary in the *lower* bucket. Round-to-
    nearest-even wants the lower code at 0.25, 1.25, 2.5, 5 (lower code even) and the upper one
    at 0.75, 1.75, 3.5 (upper code even): those three boundaries move one ulp down.
    """
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    mids = (vals[:-1] + vals[1:]) / 2
    lower_code_even = torch.arange(len(mids)) % 2 == 0
    mids = torch.where(lower_code_even, mids, torch.nextafter(mids, torch.tensor(-1.0)))
    return mids.to(device)


def mxfp4_quant(w: torch.Tensor):
    """Float matrix [R, C] (C % 32 == 0) -> (int8 [R, C/2] packed e2m1, float8_e8m0fnu [R, C/32]).

    Per 32-block scale 2^ceil(log2(amax / 6)) (no element saturates); codes are the nearest e2m1
    value, ties to even; sign in bit 3; element 2k in the low nibble of byte k.
    """
    _check_2d("mxfp4_quant weight", w)
    R, C = w.shape
    if C % MXFP4_BLOCK:
        raise ValueError(f"mxfp4_quant: {C} columns is not a multiple of {MXFP4_BLOCK}")
    blocks = w.float().view(R, C // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(-1)
    exp = torch.ceil(torch.log2(amax / FP4_MAX)).clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, _E8M0_MIN_EXP))  # all-zero block
    x = blocks / torch.exp2(exp)[..., None]
    mag = torch.bucketize(x.abs().clamp_(max=FP4_MAX), _e2m1_boundaries(w.device),
                          out_int32=True).to(torch.uint8)
    neg = ((x < 0) & (mag > 0)).to(torch.uint8)  # no negative zero (code 8)
    del x
    codes = mag.bitwise_or_(neg.bitwise_left_shift_(3)).view(R, C)
    packed = codes[:, 0::2].bitwise_or(codes[:, 1::2].bitwise_left_shift(4))
    return packed.view(torch.int8), e8m0_from_exponent(exp)
