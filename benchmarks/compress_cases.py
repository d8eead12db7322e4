"""Compressor and draft-attention benchmark cases (groups "compress" and "draft_attention"), Flash
shapes, at context lengths CONTEXTS = 64, 1k, 8k and 32k positions and the B of --batches.

    python benchmarks/kernel_bench.py --only compress,draft_attention --batches 1,16,64 \
        --out benchmarks/results/h200_compress
    python benchmarks/kernel_bench.py --only compress --ops compress.c128 --batches 1,16,64 --variants 'ours*'
    python benchmarks/kernel_bench.py --dry-run --only compress,draft_attention      # CPU smoke test

Every case is one verify forward of T = 6 tokens per row (N + 1, dspark_block_size 5) for B live
rows; row b's last position is about the context length (ctx + (37 b mod 128) - 6 .. + 5, so the
rows' phases modulo 4 and 128 differ and a C128 case closes the blocks of the rows whose chunk
crosses a multiple of 128, as a step does). Variants: `eager` (the reference: the plain
PyTorch the model ran before these ops), `compile` (torch.compile of it), `ours` (the op);
C128 also `ours-split1` (one program per entry instead of the plan's 8-way channel split).

compress (kernels/compress.py; the ops the layers call once attention.py hands the insert to
them: compress_store_fp8 for the main compressors, compress_store for the indexer's bf16 K):

    name                 W = coff·d_c   d_c   cache
    compress.c4          1024           512   FP8 (fp8_ds_mla: 448 e4m3 + 7 UE8M0 + 64 bf16)
    compress.c4_index    256            128   bf16 indexer K
    compress.c128        512            512   FP8
    compress.c128_close  512            512   FP8, every row closes a block (the worst step)

bytes_moved (the floor, counted from the case's positions): kv + score read (fp32, B·T·W each),
both rings written (the same bytes), the distinct ape rows read (fp32, W each), per closing
entry the ring rows it pools from before the chunk (fp32 kv + score, d_c each: at most
coff·CR rows; 8 rows = 32 KB for C4, 128 rows = 512 KB for C128) and the entry written (583 B
FP8, 2·d_c bf16), the norm weight (2·d_c) and a cos/sin row (4·R) per entry, and the ids
(positions, ring slots: 8 B per token; rows + valid: 9 B per row).

draft_attention (kernels/draft_attention.py; H = 64, d = 512, W = 128 context slots, N = 5):
bytes_moved = B · (q + o: 2·N·H·d·2 = 655,360, context ring W·d·2 = 131,072, block KV N·d·2 =
5,120, ids 16) + the sink (4·H): 791,568 B per row (0.79 MB at B = 1, 50.7 MB at B = 64). At
ctx = 64 the ring is only part valid (the window edge: positions < W). Extra variants
`ours-tile16` / `ours-tile32` time each tile of the plan (kernels/draft_attention.py TILE_16 /
TILE_32; tuning data).
"""
from __future__ import annotations

import torch
from harness import Case, compare

from dspark_compile.kernels import compress as ck
from dspark_compile.kernels import draft_attention as da
from dspark_compile.models.batch import Batch

CONTEXTS = (64, 1024, 8192, 32768)
T = 6                       # verify tokens per row (N + 1)
MAX_STEP_TOKENS = 64        # CacheConfig.max_step_tokens: ring length coff·CR + 64
H, D, R, W_CTX, N = 64, 512, 64, 128, 5
EPS = 1e-6
FP8_ROW = 448 + 7 + 2 * 64  # nope bytes + exponent bytes + bf16 rope part

# name -> (ratio, d_c, FP8 cache, every row closes)
COMPRESSORS = {"compress.c4": (4, 512, True, False), "compress.c4_index": (4, 128, False, False),
               "compress.c128": (128, 512, True, False),
               "compress.c128_close": (128, 512, True, True)}


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def _starts(B, ctx, ratio, close_all):
    """First positions of the rows' chunks (deterministic: bytes_moved is counted from them)."""
    if close_all:    # each chunk ends 0..5 tokens past a block end: every row closes one
        return [max(ratio, ctx) // ratio * ratio - 1 - (b % T) for b in range(B)]
    return [max(0, ctx + (37 * b) % 128 - T) for b in range(B)]


_TABLES: dict = {}


def _cos_sin(device, max_pos):
    """One table per (device, length), shared by every input set (the step shares it too)."""
    key = (str(device), max_pos)
    if key not in _TABLES:
        _TABLES[key] = _table(device, max_pos)
    return _TABLES[key]


def _table(device, max_pos):
    inv = 1.0 / 160000.0 ** (torch.arange(0, R, 2, dtype=torch.float64, device=device) / R)
    ang = torch.arange(max_pos, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


def _compress_inputs(B, ctx, ratio, d_c, fp8, close_all):
    coff = ck.coff_of(ratio)
    W = coff * d_c
    starts = _starts(B, ctx, ratio, close_all)
    n_entries = -(-(max(starts) + T + 1) // ratio)

    def make(device, seed):
        g = _gen(device, seed)
        rows = torch.arange(B, device=device)
        pos = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)
        batch = Batch(rows=rows, pos=pos, tokens=torch.zeros_like(pos),
                      valid=torch.ones(B, dtype=torch.bool, device=device))
        ring = coff * ratio + MAX_STEP_TOKENS
        rn = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=device) * scale
        d = dict(kv=rn(B * T, W, scale=2.0), score=rn(B * T, W, scale=3.0), ape=rn(ratio, W),
                 positions=pos, rows=rows, valid=batch.valid, ring_slots=batch.ring_slots(ring),
                 ring_kv=rn(B + 1, ring, W, scale=2.0), ring_score=rn(B + 1, ring, W, scale=3.0),
                 norm_weight=(1 + 0.2 * rn(d_c)).bfloat16(), cos_sin=_cos_sin(device, ctx + 256))
        if fp8:
            d["cache_nope"] = torch.randint(0, 127, (B + 1, n_entries, d_c - R), dtype=torch.uint8,
                                            generator=g, device=device).view(torch.float8_e4m3fn)
            d["cache_scale"] = torch.randint(110, 130, (B + 1, n_entries, (d_c - R) // 64),
                                             dtype=torch.uint8, generator=g, device=device)
            d["cache_rope"] = rn(B + 1, n_entries, R).bfloat16()
        else:
            d["cache"] = rn(B + 1, n_entries, d_c).bfloat16()
        return d
    return make, starts


def compress_floor(starts, ratio, d_c, fp8) -> int:
    """The byte floor of one call (module docstring), counted from the rows' first positions."""
    coff = ck.coff_of(ratio)
    W = coff * d_c
    B = len(starts)
    nbytes = B * T * W * 4 * 4 + B * T * 16 + B * 9
    nbytes += len({(s + t) % ratio for s in starts for t in range(T)}) * W * 4
    for s in starts:
        for e in range((ratio - 1 - s % ratio) % ratio, T, ratio):      # closing block ends
            first = ((s + e) // ratio - (coff - 1)) * ratio
            before = sum(1 for p in range(first, first + coff * ratio) if 0 <= p < s)
            nbytes += before * d_c * 4 * 2 + (FP8_ROW if fp8 else 2 * d_c) + 2 * d_c + 4 * R
    return nbytes


def _compress_fns(fp8):
    kw = dict(eps=EPS, out_dtype=torch.bfloat16)
    if fp8:
        return (lambda d: ck.compress_store_fp8_reference(**d, **kw),
                lambda d: torch.ops.dspark.compress_store_fp8(**d, **kw))
    return (lambda d: ck.compress_store_reference(**d, **kw),
            lambda d: torch.ops.dspark.compress_store(**d, **kw))


def _dequant(d):
    """The compressed cache as floats (FP8 nope x 2^(byte - 127) per 64, then the rope part)."""
    if "cache" in d:
        return d["cache"].float()
    nope = d["cache_nope"].float().unflatten(-1, (-1, 64))
    scale = torch.exp2(d["cache_scale"].float() - 127.0)[..., None]
    return torch.cat(((nope * scale).flatten(-2), d["cache_rope"].float()), -1)


def _compress_check(make, fp8):
    """ours vs the reference on one input set: rings exactly, the cache dequantized (rel. err.);
    both without the scratch last slot, which only the fixed-shape reference writes."""
    ref, ours = _compress_fns(fp8)

    def check(device):
        a, b = make(device, 123), make(device, 123)
        ours(a)
        ref(b)
        msgs = [compare(k, a[k].flatten(0, 1)[:-1], b[k].flatten(0, 1)[:-1], as_bytes=True)
                for k in ("ring_kv", "ring_score")]
        msgs.append(compare("cache", _dequant(a).flatten(0, 1)[:-1],
                            _dequant(b).flatten(0, 1)[:-1]))
        return "; ".join(m for m in msgs if m)
    return check


def _ours_plan(fp8, plan):
    """ours with an explicit plan (tuning variants)."""
    def fn(d):
        base = {k: v for k, v in d.items() if not k.startswith("cache")}
        if fp8:
            return ck.compress_launch(**base, eps=EPS, out_dtype=torch.bfloat16, plan=plan,
                                      fp8_cache=(d["cache_nope"], d["cache_scale"],
                                                 d["cache_rope"]))
        return ck.compress_launch(**base, eps=EPS, out_dtype=torch.bfloat16, plan=plan,
                                  cache=d["cache"])
    return fn


def compress_cases(batches):
    out = []
    for name, (ratio, d_c, fp8, close_all) in COMPRESSORS.items():
        ref, ours = _compress_fns(fp8)
        extra = {}
        if ratio == 128:    # tuning data: C128 in one program per entry (no channel split)
            extra["ours-split1"] = _ours_plan(fp8, ck.CompressPlan(8, 1, ck.NUM_WARPS))
        for ctx in CONTEXTS:
            for B in batches:
                make, starts = _compress_inputs(B, ctx, ratio, d_c, fp8, close_all)
                closing = sum(len(range((ratio - 1 - s % ratio) % ratio, T, ratio)) for s in starts)
                out.append(Case("compress", name, {"B": B, "T": B * T, "ctx": ctx,
                                                   "closing": closing},
                                make, ref, ours, compress_floor(starts, ratio, d_c, fp8),
                                check=_compress_check(make, fp8), extra=extra))
    return out


# ------------------------------------------------------------------------------------------------
# draft_attention
# ------------------------------------------------------------------------------------------------

def _draft_inputs(B, ctx):
    def make(device, seed):
        g = _gen(device, seed)
        rn = lambda *s, scale=1.0: torch.randn(*s, generator=g, device=device) * scale
        last = torch.tensor([max(0, ctx - 1 - (b % 7)) for b in range(B)], device=device)
        return dict(q=rn(B, N, H, D, scale=2.0).bfloat16(), kv=rn(B, N, D).bfloat16(),
                    ring=rn(B + 1, W_CTX, D).bfloat16(), rows=torch.arange(B, device=device),
                    last_pos=last, sink=rn(H, scale=2.0), scale=D ** -0.5)
    return make


def draft_floor(B: int) -> int:
    return B * (2 * N * H * D * 2 + W_CTX * D * 2 + N * D * 2 + 16) + 4 * H


def _draft_check(make):
    def check(device):
        a, b = make(device, 123), make(device, 123)
        return compare("o", torch.ops.dspark.draft_attention(**a), da.draft_attention_reference(**b))
    return check


def draft_attention_cases(batches):
    out = []
    ours = lambda d: torch.ops.dspark.draft_attention(**d)
    extra = {f"ours-tile{t[0]}": (lambda d, t=t: da.draft_attention_launch(
        **d, plan=da.DraftAttentionPlan(*t))) for t in (da.TILE_16, da.TILE_32)}
    for ctx in CONTEXTS:
        for B in batches:
            make = _draft_inputs(B, ctx)
            out.append(Case("draft_attention", "draft_attention", {"B": B, "T": B * N, "ctx": ctx},
                            make, lambda d: da.draft_attention_reference(**d), ours, draft_floor(B),
                            check=_draft_check(make), extra=extra))
    return out


def cases(batches):
    return compress_cases(batches) + draft_attention_cases(batches)
