"""QKV post-processing kernels (qkv_postprocess, qkv_rope, context_kv_store) against the references.

Without CUDA the Triton launchers run in Triton's CPU interpreter (tests/conftest.py). What must
hold, on fresh random inputs at irregular shapes:
- cache bytes (FP8 nope, UE8M0 exponent bytes, bf16 rope part, context rows) equal the
  reference's exactly for every row with a slot; every other cache row -- including the scratch
  last slot the fixed-shape reference writes padded rows to -- is byte-identical to before;
- q equals the reference up to the norm's summation order: identical in bf16 except for rare
  one-ulp flips, within a few fp32 ulps of the head's magnitude in fp32;
- kv outputs (no norm) equal the reference exactly.
"""
import pytest
import torch

from dspark_compile.kernels import qkv_postprocess as qp
from dspark_compile.kernels.common import rmsnorm
from dspark_compile.kernels.registry import KERNELS

DTYPES = [torch.bfloat16, torch.float32]
TH = [(1, 1), (7, 3), (13, 5)]
DR = [(128, 64), (192, 64)]
EPS = 1e-6
MAX_POS = 97


def _u8(t):
    return t.contiguous().view(torch.uint8)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cos_sin(R, max_pos=MAX_POS, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


def _inputs(T, H, D, R, dtype, seed, n_pad=None):
    g = _gen(seed)
    q = (torch.randn(T, H, D, generator=g) * 3).to(dtype)
    kv = (torch.randn(T, D, generator=g) * 2).to(dtype)
    pos = torch.randint(0, MAX_POS, (T,), generator=g)
    S = 2 * T + 3                                        # ring larger than T, last slot = scratch
    slots = torch.randperm(S - 1, generator=g)[:T]
    n_pad = (T + 2) // 3 if n_pad is None else n_pad
    slots[torch.randperm(T, generator=g)[:n_pad]] = -1   # padded / rejected rows
    return q, kv, pos, _cos_sin(R), slots, S


def _garbage_caches(S, nope, R, seed):
    """Random bytes, never zeros: unwritten or wrongly written rows must show."""
    g = _gen(seed)
    rand = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return (rand(S, nope).view(torch.float8_e4m3fn), rand(S, nope // 64),
            rand(S, R * 2).view(torch.bfloat16))


def _written(S, slots):
    rows = torch.zeros(S, dtype=torch.bool)
    rows[slots[slots >= 0]] = True
    return rows


def _assert_cache(kernel_cache, ref_cache, before, slots):
    """Rows with a slot: the reference's bytes. All others (scratch included): untouched."""
    w = _written(before.shape[0], slots)
    kb, rb, bb = _u8(kernel_cache), _u8(ref_cache), _u8(before)
    assert torch.equal(kb[w], rb[w]), "written rows differ from the reference"
    assert torch.equal(kb[~w], bb[~w]), "a row without a slot (or the scratch slot) was touched"


def _assert_q(q, q_ref):
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and not q.isnan().any()
    if q.dtype == torch.float32:
        # rstd from a differently ordered sum may differ by an ulp; the rotation can cancel,
        # so bound by the head's magnitude rather than per element
        head_max = q_ref.abs().amax(-1, keepdim=True).double()
        err = (q.double() - q_ref.double()).abs() / (head_max * torch.finfo(torch.float32).eps)
        assert err.max().item() <= 4.0, f"q off by {err.max().item():.2f} eps of the head max"
    else:
        diff = q != q_ref
        assert diff.float().mean().item() <= 1e-3, f"{diff.sum().item()} q elements differ"
        ulp = torch.exp2(torch.floor(torch.log2(q_ref.float().abs().clamp_min(1e-30)))) / 128
        assert ((q.float() - q_ref.float()).abs() <= ulp)[diff].all(), "q off by more than an ulp"


# ------------------------------------------------------------------------------------------------
# qkv_postprocess
# ------------------------------------------------------------------------------------------------

def _run_postprocess(q, kv, pos, cs, slots, S, seed, block_h=None):
    D, R = kv.shape[1], cs.shape[1]
    before = _garbage_caches(S, D - R, R, seed)
    ker = [c.clone() for c in before]
    ref = [c.clone() for c in before]
    q_out = qp.qkv_postprocess_launch(q, kv, pos, cs, slots, *ker, EPS, block_h=block_h)
    q_ref = qp.qkv_postprocess_reference(q, kv, pos, cs, slots, *ref, EPS)
    for k, r, b in zip(ker, ref, before):
        _assert_cache(k, r, b, slots)
    _assert_q(q_out, q_ref)
    return q_out, ker


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,R", DR)
@pytest.mark.parametrize("T,H", TH)
def test_qkv_postprocess(T, H, D, R, dtype):
    q, kv, pos, cs, slots, S = _inputs(T, H, D, R, dtype, seed=T * 100 + H * 10 + D)
    _run_postprocess(q, kv, pos, cs, slots, S, seed=T + H)


@pytest.mark.parametrize("block_h", [1, 2])
def test_qkv_postprocess_gpu_head_blocks(block_h):
    """The head-block split a GPU launch uses (a partial last block too), run interpreted."""
    q, kv, pos, cs, slots, S = _inputs(4, 5, 192, 64, torch.bfloat16, seed=3)
    a, cache_a = _run_postprocess(q, kv, pos, cs, slots, S, seed=4, block_h=block_h)
    b, cache_b = _run_postprocess(q, kv, pos, cs, slots, S, seed=4)
    assert torch.equal(a, b) and all(torch.equal(_u8(x), _u8(y)) for x, y in zip(cache_a, cache_b))


def test_all_rows_padded_writes_nothing():
    q, kv, pos, cs, slots, S = _inputs(7, 3, 128, 64, torch.bfloat16, seed=5, n_pad=7)
    assert (slots == -1).all()
    _run_postprocess(q, kv, pos, cs, slots, S, seed=6)


def test_out_of_range_slot_writes_nothing():
    q, kv, pos, cs, slots, S = _inputs(3, 1, 128, 64, torch.bfloat16, seed=7, n_pad=0)
    before = _garbage_caches(S, 64, 64, 8)
    ker = [c.clone() for c in before]
    bad = slots.clone()
    bad[1] = S + 5                                           # the reference would raise here
    qp.qkv_postprocess_launch(q, kv, pos, cs, bad, *ker, EPS)
    ok = bad.clone()
    ok[1] = -1
    ref = [c.clone() for c in before]
    qp.qkv_postprocess_reference(q, kv, pos, cs, ok, *ref, EPS)
    for k, r, b in zip(ker, ref, before):
        _assert_cache(k, r, b, ok)


def _edge_kv_rows(dtype, R=64):
    """kv rows whose nope groups (64 wide) are the quant's edge cases; rope part random."""
    vals = [torch.zeros(64), torch.full((64,), -0.0)]
    g = _gen(9)

    def filled(amax):
        row = (torch.rand(64, generator=g) * 2 - 1) * abs(amax) * 0.9
        row[int(torch.randint(64, (1,), generator=g))] = amax
        return row

    vals += [filled(3e4), filled(-3e4), filled(1e-6), filled(1e-4)]
    vals += [filled(s * 448 * 2.0**k) for k in (-10, -7, 0, 5) for s in (1, -1)]
    ties = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, -(2.0**-10),
                         240.0, 232.0, -0.0, 2.0**-12, -248.0])
    vals.append(torch.cat([ties, torch.zeros(64 - len(ties))]))
    if dtype == torch.float32:       # amax/448 a few ulps above a power of two (fp32 log2 edge)
        for E in (118, 130, 160):
            for d in (1, 2, 3, 5, 9, 13, 26, 40):
                bits = torch.tensor([(E << 23) | (7 * 2**21 + d - 2**23)], dtype=torch.int32)
                vals.append(filled(bits.view(torch.float32).item()))
    nope = torch.stack(vals)                                 # [n, 64]
    n = nope.shape[0]
    T = 3
    rows = torch.cat([nope.reshape(1, -1).expand(T, -1).clone(),
                      torch.randn(T, R, generator=g)], dim=1)
    rows[1, : n * 64] = rows[1, : n * 64].flip(0)
    rows[2, : n * 64] *= -1
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_postprocess_edge_values(dtype):
    kv = _edge_kv_rows(dtype)
    T, D = kv.shape
    q = kv[:, None, :].clone()                               # q with the same extreme values
    pos = torch.tensor([0, 5, MAX_POS - 1])
    slots = torch.tensor([2, -1, 0])
    _, ker = _run_postprocess(q, kv, pos, _cos_sin(64), slots, 5, seed=10)
    assert (_u8(ker[0])[0] == 0x80).any()                    # -0 stored as -0


def test_qkv_postprocess_strided_q_and_int32_indices():
    q, kv, pos, cs, slots, S = _inputs(5, 3, 128, 64, torch.bfloat16, seed=11)
    wide = torch.randn(5, 3, 2 * 128).bfloat16()
    wide[..., :128] = q
    _run_postprocess(wide[..., :128], kv, pos.int(), cs, slots.int(), S, seed=12)


def test_negative_positions_index_from_the_end():
    q, kv, pos, cs, slots, S = _inputs(3, 2, 128, 64, torch.bfloat16, seed=13)
    _run_postprocess(q, kv, torch.tensor([-1, -MAX_POS, 4]), cs, slots, S, seed=14)


# ------------------------------------------------------------------------------------------------
# qkv_rope (draft layers)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,R", DR)
@pytest.mark.parametrize("T,H", TH)
def test_qkv_rope(T, H, D, R, dtype):
    q, kv, pos, cs, _, _ = _inputs(T, H, D, R, dtype, seed=T * 7 + H + D)
    q_out, kv_out = qp.qkv_rope_launch(q, kv, pos, cs, EPS)
    q_ref, kv_ref = qp.qkv_rope_reference(q, kv, pos, cs, EPS)
    _assert_q(q_out, q_ref)
    assert kv_out.dtype == kv.dtype and torch.equal(_u8(kv_out), _u8(kv_ref))


def test_qkv_rope_edges_and_head_blocks():
    kv = _edge_kv_rows(torch.float32)
    q = torch.stack([kv, kv.flip(1), -kv], dim=1)
    pos = torch.tensor([1, 2, 3])
    for block_h in (None, 1, 2):
        q_out, kv_out = qp.qkv_rope_launch(q, kv, pos, _cos_sin(64), EPS, block_h=block_h)
        q_ref, kv_ref = qp.qkv_rope_reference(q, kv, pos, _cos_sin(64), EPS)
        _assert_q(q_out, q_ref)
        assert torch.equal(_u8(kv_out), _u8(kv_ref))


# ------------------------------------------------------------------------------------------------
# context_kv_store (draft context ring)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.float32),
                                                  (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("D,R", DR)
@pytest.mark.parametrize("T", [1, 7, 13])
def test_context_kv_store(T, D, R, kv_dtype, cache_dtype):
    _, kv, pos, cs, slots, S = _inputs(T, 1, D, R, kv_dtype, seed=T + D)
    before = torch.randint(0, 256, (S, D * cache_dtype.itemsize), dtype=torch.uint8,
                           generator=_gen(T)).view(cache_dtype)
    ker, ref = before.clone(), before.clone()
    qp.context_kv_store_launch(kv, pos, cs, slots, ker)
    qp.context_kv_store_reference(kv, pos, cs, slots, ref)
    _assert_cache(ker, ref, before, slots)


def test_context_kv_store_edges():
    kv = _edge_kv_rows(torch.float32)
    before = torch.randn(6, kv.shape[1]).bfloat16()
    ker, ref = before.clone(), before.clone()
    slots = torch.tensor([4, -1, 1])
    qp.context_kv_store_launch(kv, torch.tensor([0, 1, 2]), _cos_sin(64), slots, ker)
    qp.context_kv_store_reference(kv, torch.tensor([0, 1, 2]), _cos_sin(64), slots, ref)
    _assert_cache(ker, ref, before, slots)


# ------------------------------------------------------------------------------------------------
# registered ops: CPU = reference, export keeps the (mutating) node, bad input named
# ------------------------------------------------------------------------------------------------

def _op_args(name, seed=20):
    q, kv, pos, cs, slots, S = _inputs(5, 2, 128, 64, torch.bfloat16, seed=seed)
    if name == "qkv_postprocess":
        return (q, kv, pos, cs, slots, *_garbage_caches(S, 64, 64, seed)), (EPS,)
    if name == "qkv_rope":
        return (q, kv, pos, cs), (EPS,)
    return (kv, pos, cs, slots, torch.randn(S, 128).bfloat16()), ()


def _clone_all(ts):
    return tuple(t.clone() for t in ts)


@pytest.mark.parametrize("name", ["qkv_postprocess", "qkv_rope", "context_kv_store"])
def test_registered_op_on_cpu_is_reference(name):
    tensors, consts = _op_args(name)
    a, b = _clone_all(tensors), _clone_all(tensors)
    out = getattr(torch.ops.dspark, name)(*a, *consts)
    ref = KERNELS[name].reference(*b, *consts)
    flat = lambda o: [] if o is None else list(o) if isinstance(o, tuple) else [o]
    for x, y in zip(flat(out) + list(a), flat(ref) + list(b)):   # outputs and mutated caches
        assert torch.equal(_u8(x), _u8(y))


@pytest.mark.parametrize("name", ["qkv_postprocess", "qkv_rope", "context_kv_store"])
def test_export_keeps_op(name):
    op = getattr(torch.ops.dspark, name)
    tensors, consts = _op_args(name)

    class M(torch.nn.Module):
        def forward(self, *ts):
            out = op(*ts, *consts)
            if out is None:
                return ts[-1].float().sum()
            outs = out if isinstance(out, tuple) else (out,)
            return tuple(o.float() + 1 for o in outs)

    ep = torch.export.export(M(), _clone_all(tensors), strict=False)
    nodes = [n for n in ep.graph.nodes if n.op == "call_function" and n.target == op.default]
    assert len(nodes) == 1
    # the exported program updates the caches in place, like eager
    a, b = _clone_all(tensors), _clone_all(tensors)
    out_ep, out_eager = ep.module()(*a), M()(*b)
    for x, y in zip(list(a), list(b)):
        assert torch.equal(_u8(x), _u8(y))
    for x, y in zip(out_ep if isinstance(out_ep, tuple) else (out_ep,),
                    out_eager if isinstance(out_eager, tuple) else (out_eager,)):
        assert torch.equal(x, y)


def test_bad_inputs_name_the_argument():
    q, kv, pos, cs, slots, S = _inputs(3, 2, 128, 64, torch.bfloat16, seed=30)
    caches = _garbage_caches(S, 64, 64, 31)
    with pytest.raises(ValueError, match="q must be"):
        qp.qkv_postprocess_launch(q[:, :, :64], kv, pos, cs, slots, *caches, EPS)
    with pytest.raises(ValueError, match="positions"):
        qp.qkv_rope_launch(q, kv, pos[:2], cs, EPS)
    with pytest.raises(ValueError, match="cache_scale"):
        qp.qkv_postprocess_launch(q, kv, pos, cs, slots, caches[0], caches[1][:, :0], caches[2],
                                  EPS)
    with pytest.raises(ValueError, match="cache_nope"):
        qp.qkv_postprocess_launch(q, kv, pos, cs, slots, caches[0].view(torch.uint8), *caches[1:],
                                  EPS)
    with pytest.raises(ValueError, match="slots"):
        qp.context_kv_store_launch(kv, pos, cs, slots[:1], torch.zeros(S, 128))
    with pytest.raises(ValueError, match="cache must"):
        qp.context_kv_store_launch(kv, pos, cs, slots, torch.zeros(S, 64))


# ------------------------------------------------------------------------------------------------
# GPU (H200): hardware conversions, FMA contraction, Flash dims (H=64, D=512, rope 64)
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64])
def test_gpu_flash_dims(B):
    T, H, D, R = 6 * B, 64, 512, 64
    q, kv, pos, cs, slots, S = _inputs(T, H, D, R, torch.bfloat16, seed=B)
    before = _garbage_caches(S, D - R, R, B)
    ker = [c.cuda() for c in before]
    ref = [c.clone() for c in before]
    q_out = torch.ops.dspark.qkv_postprocess(q.cuda(), kv.cuda(), pos.cuda(), cs.cuda(),
                                             slots.cuda(), *ker, EPS)
    torch.cuda.synchronize()
    q_ref = qp.qkv_postprocess_reference(q, kv, pos, cs, slots, *ref, EPS)
    # nope bytes and scales: no arithmetic before the quant, exact on any hardware
    for k, r, b in zip(ker[:2], ref[:2], before[:2]):
        _assert_cache(k.cpu(), r, b, slots)
    # rope part: the GPU may contract the rotation into FMAs -> one bf16 ulp, rarely
    w = _written(S, slots)
    kr, rr = ker[2].cpu().float()[w], ref[2].float()[w]
    assert ((kr - rr).abs() <= rr.abs() / 128 + 1e-30).all()
    assert torch.equal(_u8(ker[2].cpu())[~w], _u8(before[2])[~w])
    diff = q_out.cpu() != q_ref
    assert diff.float().mean().item() <= 1e-2
    # One bf16 ulp of what was rounded: the output itself for nope dims; for rotated dims the
    # pair that went in (e cos - o sin can cancel to ~0 while its rounding error is an ulp of
    # |e| + |o|, so a bound relative to the output alone would be wrong there).
    qn = rmsnorm(q, None, EPS).float()
    pair = (qn[..., D - R::2].abs() + qn[..., D - R + 1::2].abs()).repeat_interleave(2, -1)
    mag = q_ref.float().abs()
    mag[..., D - R:] = torch.maximum(mag[..., D - R:], pair)
    assert ((q_out.cpu().float() - q_ref.float()).abs()[diff] <= mag[diff] / 128 + 1e-30).all()
    q2, kv2 = torch.ops.dspark.qkv_rope(q.cuda(), kv.cuda(), pos.cuda(), cs.cuda(), EPS)
    q2r, kv2r = qp.qkv_rope_reference(q, kv, pos, cs, EPS)
    assert torch.equal(q2.cpu(), q_out.cpu())
    assert ((kv2.cpu().float() - kv2r.float()).abs() <= kv2r.float().abs() / 128 + 1e-30).all()
    ring = torch.randn(S, D).bfloat16()
    ring_gpu = ring.cuda()
    torch.ops.dspark.context_kv_store(kv.cuda(), pos.cuda(), cs.cuda(), slots.cuda(), ring_gpu)
    assert torch.equal(_u8(ring_gpu.cpu())[~w], _u8(ring)[~w])
    for t in range(T):                                  # nope part is a plain copy
        if slots[t] >= 0:
            assert torch.equal(ring_gpu.cpu()[slots[t], : D - R], kv[t, : D - R])


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_skips_padding():
    T, H, D, R = 12, 64, 512, 64
    q, kv, pos, cs, slots, S = _inputs(T, H, D, R, torch.bfloat16, seed=40)
    dev = [x.cuda() for x in (q, kv, pos, cs, slots)]
    caches = [c.cuda() for c in _garbage_caches(S, D - R, R, 41)]
    out = torch.ops.dspark.qkv_postprocess(*dev, *caches, EPS)       # warm-up / compile
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.dspark.qkv_postprocess(*dev, *caches, EPS)
    q2, kv2, pos2, _, slots2, _ = _inputs(T, H, D, R, torch.bfloat16, seed=42)
    for d, s in zip(dev, (q2, kv2, pos2, cs, slots2)):
        d.copy_(s)
    before = [c.cpu() for c in caches]
    g.replay()
    torch.cuda.synchronize()
    ref = [c.clone() for c in before]
    q_ref = qp.qkv_postprocess_reference(q2, kv2, pos2, cs, slots2, *ref, EPS)
    for k, r, b in zip(caches[:2], ref[:2], before[:2]):
        _assert_cache(k.cpu(), r, b, slots2)
    assert (out.cpu() != q_ref).float().mean().item() <= 1e-2
