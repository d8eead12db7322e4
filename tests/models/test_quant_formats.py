"""FP8 block-scaled and MXFP4 weight formats: hand-checked dequant values, quantize -> dequantize
error bounds, rounding and packing conventions."""
import pytest
import torch

from dspark_compile.kernels import moe
from dspark_compile.models.quant_formats import (
    e8m0_from_exponent, e8m0_to_float, fp8_block_dequant, fp8_block_quant, mxfp4_dequant,
    mxfp4_quant)


def bytes_(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).flatten().tolist()


def e8m0(byte_values) -> torch.Tensor:
    return torch.tensor(byte_values, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# ---- MXFP4 -----------------------------------------------------------------------------------

def test_mxfp4_dequant_is_the_moe_op_reference():
    assert mxfp4_dequant is moe.mxfp4_dequant


def test_mxfp4_dequant_hand_bytes():
    # One row of 64 elements (32 bytes, two scale blocks).
    packed = torch.zeros(1, 32, dtype=torch.uint8)
    packed[0, 0] = 0x21   # low nibble 1 -> +0.5 (element 0), high nibble 2 -> +1.0 (element 1)
    packed[0, 1] = 0xF9   # low 9 -> -0.5 (element 2), high 15 -> -6.0 (element 3)
    packed[0, 2] = 0x7B   # low 11 (0b1011) -> -1.5 (element 4), high 7 -> +6.0 (element 5)
    packed[0, 16] = 0x36  # block 2: low 6 -> 4.0 (element 32), high 3 -> 1.5 (element 33)
    scale = e8m0([[128, 125]])  # block 0: x2; block 1: x2^-2
    out = mxfp4_dequant(packed.view(torch.int8), scale)
    assert out.dtype == torch.float32 and out.shape == (1, 64)
    want = torch.zeros(1, 64)
    want[0, :6] = torch.tensor([0.5, 1.0, -0.5, -6.0, -1.5, 6.0]) * 2
    want[0, 32:34] = torch.tensor([4.0, 1.5]) / 4
    assert torch.equal(out, want)


def test_mxfp4_dequant_every_code():
    # byte k*16 + k puts code k in both nibbles: element pair (v_k, v_k)
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | (codes << 4)).repeat(2).view(1, 32)
    out = mxfp4_dequant(packed.view(torch.int8), e8m0([[127, 127]]))
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    want = torch.tensor(lut + [-v for v in lut]).repeat_interleave(2).repeat(2).view(1, 64)
    assert torch.equal(out, want)


def test_mxfp4_quant_hand_values_and_packing():
    row = torch.zeros(1, 32)
    row[0, :4] = torch.tensor([0.5, 1.0, -0.5, -6.0])  # amax 6 -> scale 2^0, byte 127
    packed, scale = mxfp4_quant(row)
    assert packed.dtype == torch.int8 and packed.shape == (1, 16)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (1, 1)
    assert bytes_(scale) == [127]
    assert bytes_(packed)[:3] == [0x21, 0xF9, 0x00]
    # amax 12 -> scale 2^1 (byte 128): 12 -> 6 (code 7), 1 -> 0.5 (code 1)
    row2 = torch.zeros(1, 32)
    row2[0, :2] = torch.tensor([1.0, 12.0])
    p2, s2 = mxfp4_quant(row2)
    assert bytes_(s2) == [128] and bytes_(p2)[0] == 0x71


def test_mxfp4_quant_rounds_ties_to_even():
    # Midpoints of the e2m1 grid with scale 1 (6 sets amax): ties go to the even code.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    row = torch.zeros(1, 32)
    row[0, :7] = torch.tensor(mids)
    row[0, 7] = 6.0
    row[0, 8:15] = -torch.tensor(mids)
    p, s = mxfp4_quant(row)
    out = mxfp4_dequant(p, s)[0]
    assert out[:7].tolist() == want and out[7] == 6.0
    assert out[8:15].tolist() == [-w for w in want]
    # no negative zero code (8) is ever produced: -0.25 rounds to +0 (code 0)
    codes = torch.stack((p.view(torch.uint8) & 0xF, p.view(torch.uint8) >> 4), -1).flatten()
    assert not (codes == 8).any()


def test_mxfp4_round_trip_bound():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)
    w[3, 32:64] = 0.0  # an all-zero block
    p, s = mxfp4_quant(w)
    d = mxfp4_dequant(p, s)
    assert d.shape == w.shape and torch.isfinite(d).all()
    assert torch.equal(d[3, 32:64], torch.zeros(32))
    scale = e8m0_to_float(s).repeat_interleave(32, 1)
    amax = w.abs().view(64, 8, 32).amax(-1).repeat_interleave(32, 1)
    nz = amax > 0
    # scale is the smallest power of two with amax / scale <= 6
    assert ((amax / scale)[nz] <= 6).all() and ((amax / scale)[nz] > 3).all()
    # nearest-grid rounding: half a step, steps 0.5 / 1 / 2 in [0,2) / [2,4) / [4,6]
    x = (w / scale).abs()
    half_step = torch.where(x < 2, 0.25, torch.where(x < 4, 0.5, 1.0))
    assert ((d - w).abs() <= half_step * scale + 1e-12).all()
    # values on the grid survive a second quantization exactly (the bytes may differ: a block
    # whose amax rounded down to 3 * scale re-quantizes with half the scale)
    assert torch.equal(mxfp4_dequant(*mxfp4_quant(d)), d)


def test_mxfp4_quant_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quant(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="2-D"):
        mxfp4_quant(torch.zeros(64))


# ---- FP8 block scaled ------------------------------------------------------------------------

def test_fp8_block_dequant_hand_checked():
    # 256 x 130: blocks rows {0..127, 128..255} x cols {0..127, 128..129} (a partial block).
    q = torch.zeros(256, 130)
    q[0, 0], q[127, 127], q[5, 129] = 1.5, -448.0, 0.875
    q[128, 0], q[200, 128], q[255, 129] = 3.0, -0.015625, 240.0
    q = q.to(torch.float8_e4m3fn)
    assert torch.equal(q.float()[0, 0], torch.tensor(1.5))  # all values above are exact e4m3
    scale = e8m0([[120, 127], [130, 135]])  # 2^-7, 2^0, 2^3, 2^8
    d = fp8_block_dequant(q, scale)
    assert d.shape == (256, 130) and d.dtype == torch.float32
    assert d[0, 0] == 1.5 * 2.0 ** -7
    assert d[127, 127] == -448.0 * 2.0 ** -7
    assert d[5, 129] == 0.875
    assert d[128, 0] == 3.0 * 8
    assert d[200, 128] == -0.015625 * 256
    assert d[255, 129] == 240.0 * 256
    assert d[1, 1] == 0 and int((d != 0).sum()) == 6
    assert fp8_block_dequant(q, scale, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_fp8_block_dequant_non_square_block():
    q = torch.ones(4, 6).to(torch.float8_e4m3fn)
    d = fp8_block_dequant(q, e8m0([[127, 128, 129], [126, 127, 128]]), block=(2, 2))
    assert d.tolist() == [[1, 1, 2, 2, 4, 4]] * 2 + [[0.5, 0.5, 1, 1, 2, 2]] * 2


def test_fp8_block_dequant_rejects_wrong_scale_shape():
    q = torch.zeros(256, 130).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        fp8_block_dequant(q, e8m0([[127]]))


def test_fp8_block_quant_round_trip_bound():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 260, generator=g)  # partial blocks on both edges
    w[:128, :128] *= 1e-3
    w[128:256, 256:] *= 100.0
    q, s = fp8_block_quant(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 260)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (3, 3)
    d = fp8_block_dequant(q, s)
    scale = e8m0_to_float(s).repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    # e4m3: half an ulp is 2^-4 relative for normals; subnormal step is 2^-9 (times the scale)
    bound = torch.maximum(w.abs() * 2.0 ** -4, scale * 2.0 ** -10)
    assert ((d - w).abs() <= bound).all()
    # the scale is the smallest power of two with amax / scale <= 448
    amax = torch.nn.functional.pad(w.abs(), (0, 124, 0, 84)).view(3, 128, 3, 128).amax((1, 3))
    ratio = amax / e8m0_to_float(s)
    assert (ratio <= 448).all() and (ratio > 224).all()


def test_fp8_block_quant_custom_block_and_zero_matrix():
    q, s = fp8_block_quant(torch.zeros(64, 128), block=(64, 128))
    assert s.shape == (1, 1) and torch.equal(fp8_block_dequant(q, s, (64, 128)), torch.zeros(64, 128))


def test_e8m0_helpers():
    s = e8m0_from_exponent(torch.tensor([-127, -1, 0, 1, 127]))
    assert bytes_(s) == [0, 126, 127, 128, 254]
    assert e8m0_to_float(s).tolist() == [2.0 ** -127, 0.5, 1.0, 2.0, 2.0 ** 127]
    with pytest.raises(ValueError, match="outside"):
        e8m0_from_exponent(torch.tensor([128]))
