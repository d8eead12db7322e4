"""dspark::compress / compress_store / compress_store_fp8 (kernels/compress.py) against the reference.

Without CUDA the launcher runs the Triton kernel in Triton's CPU interpreter (tests/conftest.py).
What must hold, on fresh random inputs at irregular shapes:
- the rings equal the reference's exactly, except the scratch last slot the fixed-shape
  reference redirects unwritten rows to, which the kernel leaves as it was;
- entries of blocks that close in a valid row: bf16 identical except rare one-ulp flips (the
  pooling's summation order differs; at most 2 % of the elements, each within one ulp of the
  entry's largest magnitude); fp32 within 64 ulps of the entry's largest magnitude (the
  rounding of a per-channel softmax sum over up to 128 rows);
- the caches hold exactly what the kernel's own entries quantize / cast to (the kernel's FP8
  bytes equal kv_quant_reference of its entries), at exactly the reference's slots; every other
  row, the scratch slot included, is untouched;
- NaN in a pooled row gives a NaN entry as in the reference; NaN in a masked row (position < 0)
  or in a row no block pools changes nothing.
"""
import math
import types

import pytest
import torch

from dspark_compile.kernels import compress as ck
from dspark_compile.kernels.qkv_postprocess import kv_quant_reference
from dspark_compile.kernels.registry import KERNELS
from dspark_compile.models.batch import Batch

EPS = 1e-6
MAX_POS = 700


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cos_sin(R, max_pos=MAX_POS, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


def _u8(t):
    return t.contiguous().view(torch.uint8)


def _inputs(ratio, d_c, R, starts, T, seed, padded=(), ring_extra=1):
    """Rows starting at `starts` (one batch row each), T tokens, the rows in `padded` pointing at
    the trash row; random rings (never zeros) with room for T tokens."""
    g = _gen(seed)
    B = len(starts)
    coff = ck.coff_of(ratio)
    W = coff * d_c
    n_rows = B + 2                                      # last = trash
    ring = coff * ratio + T + ring_extra
    rows = torch.randperm(n_rows - 1, generator=g)[:B]
    for b in padded:
        rows[b] = n_rows - 1
    pos = torch.tensor(starts)[:, None] + torch.arange(T)
    batch = Batch(rows=rows, pos=pos, tokens=torch.zeros_like(pos), valid=rows < n_rows - 1)
    d = dict(kv=torch.randn(B * T, W, generator=g) * 2, score=torch.randn(B * T, W, generator=g) * 3,
             ape=torch.randn(ratio, W, generator=g), positions=pos, rows=rows, valid=batch.valid,
             ring_slots=batch.ring_slots(ring),
             ring_kv=torch.randn(n_rows, ring, W, generator=g) * 2,
             ring_score=torch.randn(n_rows, ring, W, generator=g) * 3,
             norm_weight=(1 + 0.2 * torch.randn(d_c, generator=g)).bfloat16(),
             cos_sin=_cos_sin(R))
    return d


def _clone(d):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _closing(d, n_entries=None):
    blk, closes = ck.block_ends(d["positions"], d["ape"].shape[0])
    ok = closes & d["valid"][:, None]
    return ok if n_entries is None else ok & (blk < n_entries)


def _assert_rings(ker, ref, before):
    """Equal to the reference's but for the scratch slot, which the kernel leaves untouched."""
    for name in ("ring_kv", "ring_score"):
        k, r, b = (x[name].flatten(0, 1) for x in (ker, ref, before))
        assert _same(k[:-1], r[:-1]), f"{name} differs"
        assert _same(k[-1], b[-1]), f"{name}: the scratch slot was written"


def _same(a, b):
    """Equal values and NaN in the same places (NaN payloads may differ)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _assert_entries(e, r, mask, dtype):
    """Entries where `mask` (closing blocks of valid rows): the stated tolerance."""
    e, r = e[mask].double(), r[mask].double()
    assert not e.isnan().any() and e.shape == r.shape
    mag = r.abs().amax(-1, keepdim=True)
    if dtype == torch.float32:
        err = (e - r).abs() / (mag * torch.finfo(torch.float32).eps)
        assert err.max().item() <= 64, f"fp32 entries off by {err.max().item():.1f} eps of the max"
    else:
        diff = e != r
        assert diff.double().mean().item() <= 0.02, f"{int(diff.sum())} bf16 elements differ"
        assert ((e - r).abs() <= mag / 128).all(), "bf16 entries off by more than an ulp"


def _run(d, dtype, mode, n_entries=5, plan=None):
    """(kernel state, reference state, entries of both) for one op mode on the same inputs."""
    d_c = d["norm_weight"].shape[0]
    R = d["cos_sin"].shape[1]
    n_rows = d["ring_kv"].shape[0]
    g = _gen(99)
    if mode == "fp8":
        cache = {"cache_nope": torch.randint(0, 256, (n_rows, n_entries, d_c - R), dtype=torch.uint8,
                                             generator=g).view(torch.float8_e4m3fn),
                 "cache_scale": torch.randint(0, 256, (n_rows, n_entries, (d_c - R) // 64),
                                              dtype=torch.uint8, generator=g),
                 "cache_rope": torch.randn(n_rows, n_entries, R, generator=g).bfloat16()}
    elif mode == "float":
        cache = {"cache": torch.randn(n_rows, n_entries, d_c, generator=g).to(dtype)}
    else:
        cache = {}
    before = _clone({**d, **cache})
    ker, ref = _clone(before), _clone(before)
    kw = dict(eps=EPS, out_dtype=dtype)
    base = [k for k in d]
    if mode == "fp8":
        ck.compress_launch(**{k: ker[k] for k in base}, **kw, plan=plan,
                           fp8_cache=(ker["cache_nope"], ker["cache_scale"], ker["cache_rope"]))
        ck.compress_store_fp8_reference(**ref, **kw)
    elif mode == "float":
        ck.compress_launch(**{k: ker[k] for k in base}, **kw, cache=ker["cache"], plan=plan)
        ck.compress_store_reference(**ref, **kw)
    # entries of both sides from a MODE-0 run on fresh copies (the stores return nothing)
    e_k = ck.compress_launch(**_clone(d), **kw, plan=plan)
    e_r = ck.compress_reference(**_clone(d), **kw)
    if mode == "entries":
        ck.compress_launch(**{k: ker[k] for k in base}, **kw, plan=plan)
        ck.compress_reference(**{k: ref[k] for k in base}, **kw)
    _assert_rings(ker, ref, before)
    return ker, ref, before, e_k, e_r


def _assert_caches(ker, before, e_k, d, mode, n_entries):
    """The cache rows the reference writes hold the kernel's entries, quantized / cast; all other
    rows (the scratch slot too) as before."""
    slots = ck.entry_slots(d["rows"], d["valid"], *ck.block_ends(d["positions"], d["ape"].shape[0]),
                           n_entries)
    w = slots >= 0
    e = e_k.reshape(-1, e_k.shape[-1])[w]
    if mode == "float":
        want = [e.to(ker["cache"].dtype)]
        names = ["cache"]
    else:
        want = list(kv_quant_reference(e, ker["cache_nope"].shape[-1]))
        names = ["cache_nope", "cache_scale", "cache_rope"]
    for name, x in zip(names, want):
        k, b = ker[name].flatten(0, 1), before[name].flatten(0, 1)
        assert torch.equal(_u8(k[slots[w]]), _u8(x)), f"{name}: stored rows differ from the entries"
        untouched = torch.ones(k.shape[0], dtype=torch.bool)
        untouched[slots[w]] = False
        assert torch.equal(_u8(k[untouched]), _u8(b[untouched])), f"{name}: another row was written"


# rows starting before, on and after block ends; C4 at 0 masks the previous block (b = 0)
# (the last C4 row's blocks are past a 70-entry cache); T = 1 decodes that close a block
CASES = [(4, 128, 64, [0, 5, 10, 281], 6), (4, 64, 64, [1, 30], 9),
         (128, 128, 64, [0, 250, 123], 6), (128, 128, 64, [127], 1), (4, 128, 64, [3], 1)]


@pytest.mark.parametrize("mode", ["entries", "float", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ratio,d_c,R,starts,T", CASES)
def test_compress_matches_reference(ratio, d_c, R, starts, T, dtype, mode):
    if mode == "fp8" and d_c == R:
        pytest.skip("no nope part: the FP8 cache is only the main compressor's (d = 512)")
    d = _inputs(ratio, d_c, R, starts, T, seed=ratio + d_c + T + len(starts), padded=(1,) if len(
        starts) > 2 else ())
    n_entries = 70 if ratio == 4 else 2                    # some blocks past the cache's capacity
    ker, ref, before, e_k, e_r = _run(d, dtype, mode, n_entries)
    _assert_entries(e_k, e_r, _closing(d), dtype)
    if mode != "entries":
        _assert_caches(ker, before, e_k, d, mode, n_entries)
    else:   # candidates that do not close (or padded rows) are zeros from the kernel
        assert (e_k[~_closing(d)] == 0).all()


def test_several_entries_close_in_one_chunk_and_gpu_plans():
    """A prefill chunk closing 4 C4 blocks per row, with the GPU's row tiling (2 rows a step)
    and with the channels split over programs (norm, RoPE and store in the second launch)."""
    d = _inputs(4, 128, 64, [0, 7], 16, seed=5)
    assert _closing(d).sum() == 8
    for plan in (None, ck.CompressPlan(rows=2, split=1, num_warps=4),
                 ck.CompressPlan(rows=4, split=4, num_warps=4)):
        ker, ref, before, e_k, e_r = _run(d, torch.bfloat16, "fp8", 8, plan=plan)
        _assert_entries(e_k, e_r, _closing(d), torch.bfloat16)
        _assert_caches(ker, before, e_k, d, "fp8", 8)


def test_a_plan_whose_rows_do_not_divide_the_pooled_rows_is_refused():
    # C4 pools coff 2 x 4 = 8 rows; a 16-row step would read past them (no row mask)
    d = _inputs(4, 128, 64, [0, 7], 16, seed=5)
    with pytest.raises(ValueError, match=r"plan.rows = 16 must divide the 8 pooled rows"):
        _run(d, torch.bfloat16, "fp8", 8, plan=ck.CompressPlan(rows=16, split=1, num_warps=4))


@pytest.mark.parametrize("mode", ["entries", "fp8"])
def test_c128_channel_split_equals_one_program(mode):
    """The GPU plan of C128 (8 programs of d_c / 8 channels, then the finishing launch) gives
    the single program's bytes exactly: the pooling is per channel either way."""
    d = _inputs(128, 128, 64, [125, 3, 250], 6, seed=13)
    assert _closing(d).sum() == 2
    one = _run(d, torch.bfloat16, mode, 2, plan=ck.CompressPlan(128, 1, 4))
    split = _run(d, torch.bfloat16, mode, 2, plan=ck.CompressPlan(32, 8, 4))
    for a, b in zip(one[:1] + one[3:4], split[:1] + split[3:4]):   # final state, entries
        for x, y in (zip(a.values(), b.values()) if isinstance(a, dict) else [(a, b)]):
            assert torch.equal(_u8(x), _u8(y))
    _assert_entries(split[3], split[4], _closing(d), torch.bfloat16)


def test_no_entry_closes_and_all_rows_padded_write_nothing():
    d = _inputs(128, 128, 64, [3, 200], 6, seed=6)          # no block end in either chunk
    assert not _closing(d).any()
    ker, _, before, e_k, _ = _run(d, torch.bfloat16, "fp8", 4)
    _assert_caches(ker, before, e_k, d, "fp8", 4)
    d = _inputs(4, 128, 64, [0, 4], 6, seed=7, padded=(0, 1))
    assert (d["ring_slots"] == -1).all()
    ker, _, before, e_k, _ = _run(d, torch.bfloat16, "float", 4)
    for name in ("ring_kv", "ring_score", "cache"):
        assert torch.equal(ker[name], before[name]), f"{name} written for padded rows"


@pytest.mark.filterwarnings("ignore:All-NaN slice")     # the interpreter's max over a NaN column
def test_nan_propagates_as_in_the_reference():
    d = _inputs(4, 128, 64, [0, 9], 6, seed=8)
    # row 0 starts at 0: block 0 pools positions -4..3, -4..-1 masked; NaN in ring slots that
    # no block of row 0 reads (they would hold positions -4..-1)
    ring = d["ring_kv"].shape[1]
    d["ring_kv"][d["rows"][0], (ring - 4):] = float("nan")
    # row 1 (9..14) closes block 2: positions 8..11's second halves + the first halves of 4..7,
    # 4..8 read from the ring: NaN in position 5's ring row, a first-half channel
    d["ring_kv"][d["rows"][1], 5 % ring, 3] = float("nan")
    e_k = ck.compress_launch(**_clone(d), eps=EPS, out_dtype=torch.float32)
    e_r = ck.compress_reference(**_clone(d), eps=EPS, out_dtype=torch.float32)
    ok = _closing(d)
    assert not e_r[0][ok[0]].isnan().any() and not e_k[0][ok[0]].isnan().any()
    assert e_r[1][ok[1]].isnan().all() and e_k[1][ok[1]].isnan().all()
    _assert_entries(e_k[:1], e_r[:1], ok[:1], torch.float32)
    nope = torch.zeros(4, 8, 64, dtype=torch.float8_e4m3fn)
    scale, rope = torch.zeros(4, 8, 1, dtype=torch.uint8), torch.zeros(4, 8, 64).bfloat16()
    ck.compress_launch(**_clone(d), eps=EPS, out_dtype=torch.bfloat16,
                       fp8_cache=(nope, scale, rope))
    blk = ck.block_ends(d["positions"], 4)[0][1][ok[1]]
    assert (_u8(nope[d["rows"][1], blk]) & 0x7F == 0x7F).all(), "NaN entry not stored as NaN"


def test_registered_ops_on_cpu_are_the_reference_and_export_as_one_node():
    d = _inputs(4, 128, 64, [0, 5], 6, seed=9)
    a, b = _clone(d), _clone(d)
    out = torch.ops.dspark.compress(*a.values(), EPS, torch.bfloat16)
    ref = ck.compress_reference(*b.values(), EPS, torch.bfloat16)
    assert torch.equal(out, ref) and torch.equal(a["ring_kv"], b["ring_kv"])
    cache = torch.zeros(4, 6, 128).bfloat16()

    class M(torch.nn.Module):
        def forward(self, *ts):
            torch.ops.dspark.compress_store(*ts, EPS, torch.bfloat16)
            return ts[-1].float().sum()

    args = (*_clone(d).values(), cache)
    ep = torch.export.export(M(), args, strict=False)
    ops = [n for n in ep.graph.nodes if n.op == "call_function"
           and n.target == torch.ops.dspark.compress_store.default]
    assert len(ops) == 1
    x, y = (*_clone(d).values(), cache.clone()), (*_clone(d).values(), cache.clone())
    ep.module()(*x)
    ck.compress_store_reference(*y[:-1], y[-1], EPS, torch.bfloat16)
    assert all(torch.equal(u, v) for u, v in zip(x, y))
    assert set(KERNELS) >= {"compress", "compress_store", "compress_store_fp8"}


def test_compressor_store_equals_forward_then_insert():
    """models/compressor.py: `store` (one op, insert included) leaves the state `forward` + the
    caller's insert would leave (the entries quantized and written with masked row writes)."""
    from dspark_compile.kernels.common import masked_row_write
    from dspark_compile.models.compressor import Compressor
    from dspark_compile.models.config import Precision
    cfg = types.SimpleNamespace(rms_norm_eps=EPS, hidden_size=64)
    prec = Precision(dtype=torch.bfloat16)
    comp = Compressor(cfg, 4, 128, prec)
    g = _gen(10)
    for buf in (comp.ape, comp.wkv.weight, comp.wgate.weight):
        buf.copy_(torch.randn(buf.shape, generator=g) * 0.3)
    d = _inputs(4, 128, 64, [0, 5, 10], 6, seed=11, padded=(2,))
    batch = Batch(rows=d["rows"], pos=d["positions"], tokens=torch.zeros_like(d["positions"]),
                  valid=d["valid"])
    x = torch.randn(18, 64, generator=g).bfloat16()
    caches = (torch.zeros(5, 6, 64, dtype=torch.float8_e4m3fn), torch.zeros(5, 6, 1, dtype=torch.uint8),
              torch.zeros(5, 6, 64).bfloat16())
    a = [t.clone() for t in (d["ring_kv"], d["ring_score"], *caches)]
    comp.store(x, batch, a[0], a[1], d["cos_sin"], tuple(a[2:]))
    b = [t.clone() for t in (d["ring_kv"], d["ring_score"], *caches)]
    entries, blk, closes = comp(x, batch, b[0], b[1], d["cos_sin"])
    slots = Compressor.entry_slots(batch, blk, closes, 6)
    for dst, rows in zip(b[2:], kv_quant_reference(entries.reshape(-1, 128), 64)):
        masked_row_write(dst.flatten(0, 1), slots, rows)
    assert all(torch.equal(_u8(u), _u8(v)) for u, v in zip(a, b))


def test_bad_inputs_name_the_argument():
    d = _inputs(4, 128, 64, [0, 5], 6, seed=12)
    kw = dict(eps=EPS, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv must be float32"):
        ck.compress_launch(**{**_clone(d), "kv": d["kv"][:, :128]}, **kw)
    with pytest.raises(ValueError, match="ring_score"):
        ck.compress_launch(**{**_clone(d), "ring_score": d["ring_score"][:, :, :128]}, **kw)
    with pytest.raises(ValueError, match="holds .* slots"):
        ck.compress_launch(**{**_clone(d), "ring_kv": d["ring_kv"][:, :9].contiguous(),
                              "ring_score": d["ring_score"][:, :9].contiguous()}, **kw)
    with pytest.raises(ValueError, match="valid"):
        ck.compress_launch(**{**_clone(d), "valid": d["valid"].long()}, **kw)
    with pytest.raises(ValueError, match="cache_scale"):
        ck.compress_launch(**_clone(d), **kw, fp8_cache=(
            torch.zeros(4, 6, 64, dtype=torch.float8_e4m3fn), torch.zeros(4, 6, 2, dtype=torch.uint8),
            torch.zeros(4, 6, 64).bfloat16()))
    with pytest.raises(ValueError, match="cache must"):
        ck.compress_launch(**_clone(d), **kw, cache=torch.zeros(4, 6, 64))


# ------------------------------------------------------------------------------------------------
# GPU (H200): Flash dims (d = 512 main compressors, d_i = 128 indexer), hardware conversions
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("ratio,d_c", [(4, 512), (128, 512), (4, 128)])
@pytest.mark.parametrize("B", [1, 64])
def test_gpu_flash_dims(ratio, d_c, B):
    g = _gen(B + ratio)
    # B rows of 6 verify tokens, spread over positions so that some rows close blocks
    starts = (torch.randint(0, 4000, (B,), generator=g) // ratio * ratio
              + torch.randint(ratio - 6, ratio, (B,), generator=g)).clamp_min(0).tolist()
    d = _inputs(ratio, d_c, 64, starts, 6, seed=B, padded=(B - 1,) if B > 1 else ())
    d["cos_sin"] = _cos_sin(64, max_pos=4200)
    dev = {k: v.cuda() for k, v in d.items()}
    for mode, dtype in (("entries", torch.bfloat16), ("fp8", torch.bfloat16)):
        if mode == "fp8" and d_c == 128:
            continue
        e_k = ck.compress_launch(**_clone(dev), eps=EPS, out_dtype=dtype).cpu()
        e_r = ck.compress_reference(**_clone(d), eps=EPS, out_dtype=dtype)
        ok = _closing(d)
        # hardware exp / FMA contraction: one bf16 ulp of the entry's max, at most 5 % of elements
        diff = e_k[ok] != e_r[ok]
        assert diff.float().mean().item() <= 0.05
        mag = e_r[ok].float().abs().amax(-1, keepdim=True)
        assert ((e_k[ok].float() - e_r[ok].float()).abs() <= mag / 128).all()
        a, b = _clone(dev), _clone(d)
        ck.compress_launch(**a, eps=EPS, out_dtype=dtype)
        ck.compress_reference(**b, eps=EPS, out_dtype=dtype)
        _assert_rings({k: v.cpu() for k, v in a.items()}, b, d)
        if mode == "fp8":
            NE = math.ceil(4200 / ratio)
            dv = dev["kv"].device
            caches = [torch.zeros(B + 2, NE, 448, dtype=torch.float8_e4m3fn, device=dv),
                      torch.zeros(B + 2, NE, 7, dtype=torch.uint8, device=dv),
                      torch.zeros(B + 2, NE, 64, dtype=torch.bfloat16, device=dv)]
            torch.ops.dspark.compress_store_fp8(*_clone(dev).values(), *caches, EPS, dtype)
            e_g = torch.ops.dspark.compress(*_clone(dev).values(), EPS, dtype)
            slots = ck.entry_slots(dev["rows"], dev["valid"],
                                   *ck.block_ends(dev["positions"], ratio), NE)
            w = slots >= 0
            want = kv_quant_reference(e_g.reshape(-1, d_c)[w], 448)
            for c, x in zip(caches, want):
                assert torch.equal(_u8(c.flatten(0, 1)[slots[w]]), _u8(x))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    d = _inputs(4, 512, 64, [3, 7, 11, 0], 6, seed=40, padded=(3,))
    dev = {k: v.cuda() for k, v in d.items()}
    out = torch.ops.dspark.compress(*dev.values(), EPS, torch.bfloat16)     # compile
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.dspark.compress(*dev.values(), EPS, torch.bfloat16)
    d2 = _inputs(4, 512, 64, [3, 7, 11, 0], 6, seed=41, padded=(3,))
    for k in dev:
        dev[k].copy_(d2[k])
    g.replay()
    torch.cuda.synchronize()
    ref = ck.compress_reference(**_clone(d2), eps=EPS, out_dtype=torch.bfloat16)
    ok = _closing(d2)
    mag = ref[ok].float().abs().amax(-1, keepdim=True)
    assert ((out.cpu()[ok].float() - ref[ok].float()).abs() <= mag / 128).all()
