"""Activation-quant kernels (act_quant, swiglu_quant, rmsnorm_quant) and rmsnorm against their
references.

On a machine without CUDA the Triton launchers run in Triton's CPU interpreter (tests/conftest.py
sets TRITON_INTERPRET=1). FP8 bytes and scales must equal the reference's exactly whenever the
kernel quantizes the same activations; where the activation itself comes from math whose last
ulp may differ (swiglu's exp, rmsnorm's summation order), every FP8/scale difference must be
explained by a one-ulp activation difference at that element or in that group, and such
differences must be rare.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

from dspark_compile.kernels import act_quant as aq
from dspark_compile.kernels.common import FP8_MAX, ue8m0_scale
from dspark_compile.kernels.registry import KERNELS
from dspark_compile.kernels.tl_helpers import fp8e4m3_bits, round_to, ue8m0_exponent

G = aq.ACT_QUANT_GROUP
DTYPES = [torch.bfloat16, torch.float32]
SHAPES = [(1, 128), (7, 384), (13, 640)]


def _u8(t):
    return t.contiguous().view(torch.uint8)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of x's dtype at |x| (at least the smallest normal's spacing)."""
    fi = torch.finfo(x.dtype)
    xf = x.abs().double().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(xf))) * fi.eps


def _randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# ------------------------------------------------------------------------------------------------
# edge values: one group per case, each `group` long
# ------------------------------------------------------------------------------------------------

def _f32_from_bits(E: int, M: int) -> float:
    """fp32 value with biased exponent E and 24-bit significand M (implicit bit included)."""
    return torch.tensor([(E << 23) | (M - 2**23)], dtype=torch.int32).view(torch.float32).item()


def edge_groups(group: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[n, group] rows that stress the quant: zeros, -0, huge, exact power-of-two amax, ties."""
    gen = torch.Generator().manual_seed(seed)

    def filled(amax, sign=1.0):
        row = (torch.rand(group, generator=gen) * 2 - 1) * abs(amax) * 0.9
        row[int(torch.randint(group, (1,), generator=gen))] = sign * abs(amax)
        return row

    rows = [torch.zeros(group), torch.full((group,), -0.0)]
    r = torch.zeros(group)
    r[::2] = -0.0
    r[5] = 1e-3
    rows.append(r)
    rows += [filled(3e4), filled(3e4, -1.0)]
    for k in (-10, -7, 0, 5, 20):                      # amax exactly 448 * 2^k: scale 2^k, no clamp
        rows += [filled(448 * 2.0**k), filled(448 * 2.0**k, -1.0)]
    rows += [filled(1e-6), filled(1e-4), torch.full((group,), 1e-4)]   # at / under the amax floor
    # e4m3 rounding ties at scale 1 (amax 448): normal ties and subnormal ties, both signs
    ties = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, -(2.0**-10),
                         -(5 * 2.0**-10), 2.0**-12, 0.0, -0.0, 240.0, 232.0, 248.0, -440.0, 1e-30])
    rows.append(torch.cat([ties, torch.zeros(group - len(ties))]))
    if dtype == torch.float32:
        # amax / 448 a few fp32 ulps above a power of two, where the reference's fp32 log2 rounds
        # down onto the integer: the kernel must reproduce that decision exactly.
        for E in (117, 125, 140, 170, 240):
            for d in (1, 2, 3, 5, 6, 9, 13, 26, 40, 80, 160):
                rows.append(filled(_f32_from_bits(E, 7 * 2**21 + d)))
        rows.append(filled(3e38))
    return torch.stack(rows).to(dtype)


# ------------------------------------------------------------------------------------------------
# the exact device helpers themselves
# ------------------------------------------------------------------------------------------------

@triton.jit
def _helpers_probe(x_ptr, e_ptr, b_ptr, r_ptr, N, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(e_ptr + offs, ue8m0_exponent(tl.abs(x)), mask=m)
    tl.store(b_ptr + offs, fp8e4m3_bits(tl.minimum(tl.maximum(x, -448.0), 448.0), SOFT), mask=m)
    tl.store(r_ptr + offs, round_to(x, tl.bfloat16, SOFT), mask=m)


def _probe(x):
    e = torch.empty(x.shape, dtype=torch.int32)
    b = torch.empty(x.shape, dtype=torch.uint8)
    r = torch.empty(x.shape, dtype=torch.float32)
    _helpers_probe[(triton.cdiv(x.numel(), 4096),)](x, e, b, r, x.numel(), BLOCK=4096, SOFT=True)
    return e, b, r


def test_ue8m0_exponent_matches_reference_at_every_boundary():
    vals = []
    for E in range(100, 255):                 # amax from below the 1e-4 floor up to fp32 max
        for d in list(range(-3, 48)) + [100, 1000, 2**21 - 1]:
            vals.append(_f32_from_bits(E, 7 * 2**21 + d))
        vals += [_f32_from_bits(E, 2**23), _f32_from_bits(E, 2**24 - 1)]
    g = torch.Generator().manual_seed(1)
    rnd = torch.exp2(torch.rand(20000, generator=g, dtype=torch.float64) * 140 - 20).float()
    x = torch.cat([torch.tensor(vals, dtype=torch.float32), rnd, torch.tensor([0.0, 1e-4, 448.0])])
    e, _, _ = _probe(x)
    assert torch.equal(torch.exp2(e.double()).float(), ue8m0_scale(x))


def test_fp8_and_bf16_rounding_match_torch():
    # every e4m3 code, its neighbours' midpoints (ties), one fp32 ulp either side, and randoms
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[codes.isfinite() & (codes.abs() <= FP8_MAX)].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(math.inf)),
                      torch.nextafter(mids, torch.tensor(-math.inf))])
    g = torch.Generator().manual_seed(2)
    rnd = (torch.rand(20000, generator=g) * 2 - 1) * torch.exp2(torch.randint(-20, 9, (20000,),
                                                                               generator=g).float())
    x = torch.cat([codes, near, rnd, torch.tensor([-0.0, 1e-40, -1e-40])]).clamp(-FP8_MAX, FP8_MAX)
    _, b, r = _probe(x)
    assert torch.equal(b, _u8(x.to(torch.float8_e4m3fn)))
    xb = torch.cat([x, _randn(5000, torch.float32, 3, 1e3), torch.tensor([-0.0])])
    _, _, r = _probe(xb)
    assert torch.equal(r, xb.to(torch.bfloat16).float())


# ------------------------------------------------------------------------------------------------
# act_quant: exact
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K", SHAPES)
def test_act_quant_exact(T, K, dtype):
    x = _randn((T, K), dtype, seed=T * K, scale=4.0)
    q, s = aq.act_quant_launch(x)
    qr, sr = aq.act_quant_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(_u8(q), _u8(qr)) and torch.equal(s, sr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_act_quant_edge_values_exact(dtype):
    rows = edge_groups(G, dtype)
    n = rows.shape[0]
    x = rows.reshape(1, n * G)                      # one token, every edge case a group
    x2 = torch.cat([x, rows[torch.randperm(n)].reshape(1, n * G)])
    q, s = aq.act_quant_launch(x2)
    qr, sr = aq.act_quant_reference(x2)
    assert torch.equal(_u8(q), _u8(qr)) and torch.equal(s, sr)
    assert (_u8(q) == 0x80).any()                   # negative zero survived as -0


@pytest.mark.parametrize("block_g", [1, 4])
def test_gpu_block_configs(block_g):
    """The (BLOCK_G, partial last block) configurations a GPU launch uses, run interpreted."""
    x = _randn((3, 640), torch.bfloat16, seed=11, scale=4.0)     # 5 groups: 4 + 1 masked
    q, s = aq.act_quant_launch(x, block_g=block_g)
    qr, sr = aq.act_quant_reference(x)
    assert torch.equal(_u8(q), _u8(qr)) and torch.equal(s, sr)
    u = _randn((3, 640), torch.bfloat16, seed=12, scale=4.0)
    q, s = aq.swiglu_quant_launch(x, u, 10.0, block_g=block_g)
    q2, s2 = aq.swiglu_quant_launch(x, u, 10.0)
    assert torch.equal(_u8(q), _u8(q2)) and torch.equal(s, s2)


def test_act_quant_leading_dims_and_strides():
    base = _randn((2, 3, 2 * 256), torch.bfloat16, seed=5)
    x = base[..., :256]                             # non-contiguous rows
    q, s = aq.act_quant_launch(x)
    qr, sr = aq.act_quant_reference(x)
    assert q.shape == (2, 3, 256) and s.shape == (2, 3, 2)
    assert torch.equal(_u8(q), _u8(qr)) and torch.equal(s, sr)


# ------------------------------------------------------------------------------------------------
# swiglu_quant / rmsnorm_quant: exact quant of the kernel's activation, activation within 1 ulp
# ------------------------------------------------------------------------------------------------

def _assert_explained(h, h_ref, q, s, q_ref, s_ref, max_frac):
    """h within one ulp of h_ref for 16-bit dtypes (a flipped rounding), a few ulps for fp32 (exp
    or rstd off by an ulp, then a multiply); every FP8/scale difference sits on an element (or in
    a group) where h differs; and (q, s) is exactly the quant of h."""
    qh, sh = aq.act_quant_reference(h)
    assert torch.equal(_u8(q), _u8(qh)) and torch.equal(s, sh), "quant of the kernel's h not exact"
    assert not h.isnan().any()
    diff = h != h_ref
    assert diff.float().mean().item() <= max_frac, f"{diff.float().mean().item():.4f} of h differ"
    d = (h.double() - h_ref.double()).abs()
    ulps = 1 if h.dtype.itemsize == 2 else 4
    worst = (d / _ulp(h_ref)).max().item()
    assert worst <= ulps, f"h off by {worst} ulp (allowed {ulps})"
    grp_diff = diff.unflatten(-1, (-1, G)).any(-1)
    assert not (s != s_ref)[~grp_diff].any(), "scale differs in a group whose h is identical"
    q_diff = (_u8(q) != _u8(q_ref)).unflatten(-1, (-1, G))
    explained = diff.unflatten(-1, (-1, G)) | (s != s_ref)[..., None]
    assert not (q_diff & ~explained).any(), "FP8 byte differs where h and the scale agree"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K", SHAPES)
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_quant(T, K, dtype, limit):
    g = _randn((T, K), dtype, seed=K + T, scale=6.0)     # beyond the clamp at 10 too
    u = _randn((T, K), dtype, seed=K + T + 1, scale=6.0)
    h = torch.empty_like(g)
    q, s = aq.swiglu_quant_launch(g, u, limit, h_out=h)
    qr, sr = aq.swiglu_quant_reference(g, u, limit)
    # bf16 h: exp's last fp32 ulp flips a bf16 rounding almost never; fp32 h shows it often.
    _assert_explained(h, aq.swiglu(g, u, limit), q, s, qr, sr,
                      max_frac=0.01 if dtype == torch.bfloat16 else 0.5)
    q2, s2 = aq.swiglu_quant_launch(g, u, limit)         # the launch the op uses (no hook)
    assert torch.equal(_u8(q2), _u8(q)) and torch.equal(s2, s)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # silu(-huge)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_quant_edges(dtype):
    rows = edge_groups(G, dtype)
    rows = rows[rows.float().abs().amax(-1) < 1e5]      # keep silu(g) * u finite
    n = rows.shape[0]
    g = torch.cat([rows.reshape(1, -1), torch.full((1, n * G), 30.0, dtype=dtype),
                   torch.full((1, n * G), -0.0, dtype=dtype)])
    u = torch.cat([torch.ones(1, n * G, dtype=dtype), rows.reshape(1, -1),
                   rows.reshape(1, -1)])
    for limit in (10.0, 0.0):
        h = torch.empty_like(g)
        q, s = aq.swiglu_quant_launch(g, u, limit, h_out=h)
        qr, sr = aq.swiglu_quant_reference(g, u, limit)
        _assert_explained(h, aq.swiglu(g, u, limit), q, s, qr, sr, max_frac=0.5)
        assert not s.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K", SHAPES)
def test_rmsnorm_quant(T, K, dtype):
    x = _randn((T, K), dtype, seed=3 * K + T, scale=3.0)
    w = (1 + _randn((K,), torch.float32, seed=K, scale=0.3)).to(dtype)
    y, q, s = aq.rmsnorm_quant_launch(x, w, 1e-6)
    yr, qr, sr = aq.rmsnorm_quant_reference(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    # the kernel's row sum is ordered differently: rstd may move by an fp32 ulp, which shifts a
    # bf16 rounding rarely and every fp32 element of that row by at most an ulp
    _assert_explained(y, yr, q, s, qr, sr, max_frac=0.01 if dtype == torch.bfloat16 else 1.0)


def test_rmsnorm_quant_edges():
    x = edge_groups(G, torch.float32)[:16].reshape(8, 2 * G)
    x[0] = 0.0                                             # all-zero row: y = 0 (eps), scale 2^-22
    w = torch.ones(2 * G)
    y, q, s = aq.rmsnorm_quant_launch(x, w, 1e-6)
    yr, qr, sr = aq.rmsnorm_quant_reference(x, w, 1e-6)
    _assert_explained(y, yr, q, s, qr, sr, max_frac=1.0)
    assert torch.equal(y[0], yr[0]) and torch.equal(s[0], sr[0])


def _assert_ulp_close(y, yr):
    """The kernel sums a row in another order: rstd may move by an fp32 ulp, so a bf16 element
    rounds the other way rarely (one ulp), an fp32 element moves by a few ulps."""
    assert y.dtype == yr.dtype and y.shape == yr.shape and not y.isnan().any()
    diff = y != yr
    assert diff.float().mean().item() <= (0.01 if y.dtype == torch.bfloat16 else 1.0)
    ulps = 1 if y.dtype.itemsize == 2 else 4
    assert ((y.double() - yr.double()).abs() / _ulp(yr)).max().item() <= ulps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K", SHAPES + [(5, 200), (2, 7)])   # K not a multiple of 128 too
def test_rmsnorm(T, K, dtype):
    x = _randn((T, K), dtype, seed=5 * K + T, scale=3.0)
    w = (1 + _randn((K,), torch.float32, seed=K + 1, scale=0.3)).to(dtype)
    _assert_ulp_close(aq.rmsnorm_launch(x, w, 1e-6), aq.rmsnorm_reference(x, w, 1e-6))


def test_rmsnorm_edges():
    """An all-zero row (eps only: exact zeros), huge and tiny rows, a NaN row (NaN everywhere in
    it) and an inf row (rstd 0: NaN at the inf, zeros elsewhere), as in the reference and in no
    other row; leading dims; a strided view."""
    x = torch.randn(6, 3, 160)
    x[0, 0] = 0.0
    x[1, 1] *= 1e18
    x[2, 2] *= 1e-18
    x[3, 0, 5] = float("nan")
    x[4, 1, 7] = float("inf")
    w = 1 + 0.3 * torch.randn(160)
    y, yr = aq.rmsnorm_launch(x, w, 1e-6), aq.rmsnorm_reference(x, w, 1e-6)
    bad = torch.zeros(6, 3, dtype=torch.bool)
    bad[3, 0] = bad[4, 1] = True
    assert torch.equal(y.isnan(), yr.isnan()) and yr[3, 0].isnan().all()
    assert yr[4, 1].isnan().sum() == 1 and not y[~bad].isnan().any()
    _assert_ulp_close(y[~bad], yr[~bad])
    assert torch.equal(y[0, 0], torch.zeros(160))
    xs = torch.randn(4, 320)[:, ::2]                      # a non-contiguous last dim
    _assert_ulp_close(aq.rmsnorm_launch(xs, w, 1e-6), aq.rmsnorm_reference(xs, w, 1e-6))


# ------------------------------------------------------------------------------------------------
# registered ops: CPU = reference, export keeps the node, bad input named
# ------------------------------------------------------------------------------------------------

def _args():
    x = _randn((5, 256), torch.bfloat16, 7)
    return {
        "act_quant": (x,),
        "swiglu_quant": (x, _randn((5, 256), torch.bfloat16, 8), 10.0),
        "rmsnorm_quant": (x, _randn((256,), torch.bfloat16, 9), 1e-6),
        "rmsnorm": (x, _randn((256,), torch.bfloat16, 9), 1e-6),
    }


@pytest.mark.parametrize("name", ["act_quant", "swiglu_quant", "rmsnorm_quant", "rmsnorm"])
def test_registered_op_on_cpu_is_reference(name):
    args = _args()[name]
    out = getattr(torch.ops.dspark, name)(*args)
    ref = KERNELS[name].reference(*args)
    out, ref = ((out,), (ref,)) if isinstance(out, torch.Tensor) else (out, ref)
    assert len(out) == len(ref)
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_u8(a), _u8(b))


@pytest.mark.parametrize("name", ["act_quant", "swiglu_quant", "rmsnorm_quant", "rmsnorm"])
def test_export_keeps_op(name):
    op = getattr(torch.ops.dspark, name)
    args = _args()[name]
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    consts = [a for a in args if not isinstance(a, torch.Tensor)]

    class M(torch.nn.Module):
        def forward(self, *ts):
            out = op(*ts, *consts)
            return tuple(o.float() * 2 for o in ((out,) if isinstance(out, torch.Tensor) else out))

    ep = torch.export.export(M(), tensors, strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(op.default) == 1
    for a, b in zip(ep.module()(*tensors), M()(*tensors)):
        assert torch.equal(a, b)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="x.shape"):
        aq.act_quant_launch(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="g and u"):
        aq.swiglu_quant_launch(torch.zeros(2, 128), torch.zeros(2, 256), 1.0)
    with pytest.raises(ValueError, match="weight"):
        aq.rmsnorm_quant_launch(torch.zeros(2, 128), torch.zeros(64), 1e-6)
    with pytest.raises(ValueError, match=r"weight must be a float \[100\] vector"):
        aq.rmsnorm_launch(torch.zeros(2, 100), torch.zeros(64), 1e-6)
    with pytest.raises(ValueError, match="x must be a bf16/fp16/fp32"):
        aq.rmsnorm_launch(torch.zeros(2, 100, dtype=torch.int32), torch.zeros(100), 1e-6)


# ------------------------------------------------------------------------------------------------
# GPU (H200): the hardware-conversion path at Flash shapes
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T", [6, 384])
def test_gpu_flash_shapes(T):
    dev = "cuda"
    for K in (2048, 4096, 640):
        x = _randn((T, K), torch.bfloat16, seed=T + K, scale=3.0)
        q, s = torch.ops.dspark.act_quant(x.to(dev))
        qr, sr = aq.act_quant_reference(x)
        assert torch.equal(_u8(q.cpu()), _u8(qr)) and torch.equal(s.cpu(), sr)
        rows = edge_groups(G, torch.bfloat16).reshape(1, -1)
        q, s = torch.ops.dspark.act_quant(rows.to(dev))
        qr, sr = aq.act_quant_reference(rows)
        assert torch.equal(_u8(q.cpu()), _u8(qr)) and torch.equal(s.cpu(), sr)
    I = 2048
    g = _randn((T, I), torch.bfloat16, seed=1, scale=6.0)
    u = _randn((T, I), torch.bfloat16, seed=2, scale=6.0)
    h = torch.empty(T, I, dtype=torch.bfloat16, device=dev)
    q, s = aq.swiglu_quant_launch(g.to(dev), u.to(dev), 10.0, h_out=h)
    qr, sr = aq.swiglu_quant_reference(g, u, 10.0)
    _assert_explained(h.cpu(), aq.swiglu(g, u, 10.0), q.cpu(), s.cpu(), qr, sr, max_frac=0.02)
    x = _randn((T, 4096), torch.bfloat16, seed=3, scale=3.0)
    w = (1 + _randn((4096,), torch.float32, seed=4, scale=0.3)).bfloat16()
    y, q, s = torch.ops.dspark.rmsnorm_quant(x.to(dev), w.to(dev), 1e-6)
    yr, qr, sr = aq.rmsnorm_quant_reference(x, w, 1e-6)
    _assert_explained(y.cpu(), yr, q.cpu(), s.cpu(), qr, sr, max_frac=0.02)
    for K in (512, 4096):
        _assert_ulp_close(torch.ops.dspark.rmsnorm(x[:, :K].to(dev), w[:K].to(dev), 1e-6).cpu(),
                          aq.rmsnorm_reference(x[:, :K], w[:K], 1e-6))
