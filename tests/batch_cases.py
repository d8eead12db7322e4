"""One batch-invariance case per `dspark::` op (tests/kernels/test_batch_invariance.py).

A case builds the inputs of a pool of `rows` independent rows (a row: one token for the
per-token ops, one request's tokens for the attention, compressor and sampler ops) and knows
how to take a sub-batch of them and where a row's results are, in the op's outputs and in the
state it writes. Shared state (weights, caches indexed through `rows` / `slots`) stays whole in
every sub-batch, so a row sees the same inputs alone as in any batch.

Shapes are small for the CPU interpreter (`big=False`); `big=True` gives the GPU enough
heads, candidates and K blocks that the plans' batch-dependent choices (split-K, attention
splits, tile sizes) would change between one row and 64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dspark_compile.kernels import compress as ck
from dspark_compile.kernels.act_quant import act_quant_reference
from dspark_compile.kernels.mhc import hc_pre_reference
from dspark_compile.kernels.qkv_postprocess import kv_quant_reference
from dspark_compile.models.quant_formats import fp8_block_quant, mxfp4_quant
from dspark_compile.models.batch import Batch


@dataclass
class Case:
    """`build(g, rows, big)` -> kwargs for `rows` rows; `row_keys`: kwargs sliced along dim 0
    by a sub-batch; `results(kwargs, out, j)` -> the tensors that belong to row j of a call
    (from its outputs and from the mutated kwargs, read after the call)."""
    build: Callable[[torch.Generator, int, bool], dict]
    row_keys: tuple
    results: Callable[[dict, object, int], list]
    mutated: tuple = ()
    # the pool's rows, and whether only its last row is checked, when the Triton interpreter
    # runs the kernel. The samplers' kernels hold a row per program whatever the batch, and
    # interpreted they were most of this test's CI time (rejection_sample ~2 min: about 14 s a
    # call, a dozen launches each, almost independent of the rows), so there: 8 rows, one row
    interpreted_pool: int = 24
    interpreted_last_only: bool = False
    # the pool on a GPU: the GEMMs' 400 rows reach their widest token tile (128, the last one
    # padded) and verify rows at B = 64 (384 tokens)
    gpu_pool: int = 64


def _outs(out):
    return list(out) if isinstance(out, (tuple, list)) else ([] if out is None else [out])


def _row_of_outputs(kw, out, j):
    return [o[j] for o in _outs(out)]


def cos_sin(R, max_pos=512):
    inv = 1.0 / 10000.0 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


def _randn(g, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# --- per-token ops --------------------------------------------------------------------------

def _act_quant(g, n, big):
    return dict(x=_randn(g, n, 512 if big else 256, scale=3, dtype=torch.bfloat16))


def _swiglu_quant(g, n, big):
    K = 512 if big else 256
    return dict(g=_randn(g, n, K, scale=3, dtype=torch.bfloat16),
                u=_randn(g, n, K, scale=3, dtype=torch.bfloat16), limit=7.0)


def _rmsnorm_quant(g, n, big):
    K = 4096 if big else 384
    return dict(x=_randn(g, n, K, scale=2, dtype=torch.bfloat16),
                weight=(1 + 0.2 * torch.randn(K, generator=g)).bfloat16(), eps=1e-6)


def _rmsnorm(g, n, big):
    K = 512 if big else 200
    return dict(x=_randn(g, n, K, scale=2, dtype=torch.bfloat16),
                weight=(1 + 0.2 * torch.randn(K, generator=g)).bfloat16(), eps=1e-6)


def _fp8_linear(g, n, big):
    N, K = (1024, 4096) if big else (200, 512)
    w = torch.randn(N, K, generator=g) * 0.05
    w[:, :128] *= 64
    wq, ws = fp8_block_quant(w)
    x, xs = act_quant_reference(torch.randn(n, K, generator=g) * 3)
    return dict(x=x, x_s=xs, w=wq, w_s=ws.view(torch.uint8), groups=1,
                out_dtype=torch.bfloat16)


def _fp8_linear_multi(g, n, big):
    """wq_a + wkv on the GPU (1024 and 512 rows, K = 4096); two weights of their own split."""
    K, Ns = (4096, (1024, 512)) if big else (512, (200, 128))
    kw = dict(x=None, x_s=None, w2=None, w_s2=None, w3=None, w_s3=None, out_dtype=torch.bfloat16)
    for j, N in enumerate(Ns):
        w = torch.randn(N, K, generator=g) * 0.05
        w[:, :128] *= 64
        wq, ws = fp8_block_quant(w)
        kw[f"w{j}"], kw[f"w_s{j}"] = wq, ws.view(torch.uint8)
    kw["x"], kw["x_s"] = act_quant_reference(torch.randn(n, K, generator=g) * 3)
    return kw


def _linear(g, n, big):
    N, K = (2048, 4096) if big else (200, 384)
    return dict(x=_randn(g, n, K, dtype=torch.bfloat16), w=_randn(g, N, K, dtype=torch.bfloat16),
                dtype=torch.bfloat16, out_dtype=torch.float32)


def _moe_experts(g, n, big):
    E, I, D, k = 8, 64, (256 if big else 128), 3
    ws = []
    for rows, cols in ((I, D), (I, D), (D, I)):
        q, s = zip(*(mxfp4_quant(torch.randn(rows, cols, generator=g) * 0.2) for _ in range(E)))
        ws += [torch.stack(q), torch.stack([t.view(torch.uint8) for t in s])]
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    return dict(x=_randn(g, n, D, dtype=torch.bfloat16), topk_ids=ids,
                topk_weights=torch.rand(n, k, generator=g) + 0.25,
                w1=ws[0], s1=ws[1], w3=ws[2], s3=ws[3], w2=ws[4], s2=ws[5], swiglu_limit=10.0)


HC = dict(eps=1e-6, norm_eps=1e-6)


def _hc_weights(g, m, D, head):
    mix = m if head else (2 + m) * m
    return dict(fn=torch.randn(mix, m * D, generator=g) * (0.5 / (m * D) ** 0.5),
                scale=1 + 0.1 * torch.randn(1 if head else 3, generator=g),
                base=torch.randn(mix, generator=g))


def _hc_stream(g, n, big):
    m, D = 4, (4096 if big else 128)
    X = _randn(g, n, m, D, dtype=torch.bfloat16)
    y = _randn(g, n, D, dtype=torch.bfloat16)
    _, post, comb = hc_pre_reference(X, **_hc_weights(g, m, D, False), eps=HC["eps"],
                                     norm_eps=HC["norm_eps"], iters=3)
    return m, D, dict(y=y, X=X, post=post, comb=comb)


def _hc_pre(g, n, big):
    m, D, s = _hc_stream(g, n, big)
    return dict(X=s["X"], **_hc_weights(g, m, D, False), **HC, iters=3)


def _hc_head(g, n, big):
    m, D, s = _hc_stream(g, n, big)
    return dict(X=s["X"], **_hc_weights(g, m, D, True), **HC)


def _hc_post(g, n, big):
    return _hc_stream(g, n, big)[2]


def _hc_post_pre(g, n, big):
    m, D, s = _hc_stream(g, n, big)
    return dict(**s, **_hc_weights(g, m, D, False), **HC, iters=3)


def _hc_post_head(g, n, big):
    m, D, s = _hc_stream(g, n, big)
    return dict(**s, **_hc_weights(g, m, D, True), **HC)


# --- per-request ops with state ----------------------------------------------------------------

def _qkv(g, n, big, store):
    H, D, R = (16, 512, 64) if big else (3, 192, 64)
    S = n + 3                                  # one cache row per token, the last one scratch
    d = dict(q=_randn(g, n, H, D, scale=3, dtype=torch.bfloat16),
             kv=_randn(g, n, D, scale=2, dtype=torch.bfloat16),
             positions=torch.randint(0, 500, (n,), generator=g), cos_sin=cos_sin(R), eps=1e-6)
    if store == "fp8":
        rand = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        d.update(slots=torch.randperm(S - 1, generator=g)[:n],
                 cache_nope=rand(S, D - R).view(torch.float8_e4m3fn),
                 cache_scale=rand(S, (D - R) // 64), cache_rope=rand(S, 2 * R).view(torch.bfloat16))
    if store == "ring":
        d.update(slots=torch.randperm(S - 1, generator=g)[:n],
                 cache=_randn(g, S, D, dtype=torch.bfloat16))
        del d["q"], d["eps"]
    return d


def _slot_rows(*names):
    def results(kw, out, j):
        s = int(kw["slots"][j])
        return [o[j] for o in _outs(out)] + [kw[k][s] for k in names]
    return results


def _sparse_attention(g, n, big):
    T, H, nope, rope = (6, 64, 448, 64) if big else (2, 3, 128, 16)
    ring, window, ratio, NE, K = (160, 128, 4, 600, 512) if big else (10, 7, 4, 9, 5)
    R = n + 1
    swa = kv_quant_reference(torch.randn(R, ring, nope + rope, generator=g) * 2, nope)
    cmp = kv_quant_reference(torch.randn(R, NE, nope + rope, generator=g) * 2, nope)
    start = torch.randint(0, NE * ratio - T, (n, 1), generator=g)
    return dict(q=_randn(g, n, T, H, nope + rope, dtype=torch.bfloat16), swa_kv=swa[0],
                swa_scale=swa[1], swa_rope=swa[2], cmp_kv=cmp[0], cmp_scale=cmp[1],
                cmp_rope=cmp[2], cmp_idx=torch.randint(-1, NE, (n, T, K), generator=g),
                rows=torch.randperm(R, generator=g)[:n], pos=start + torch.arange(T),
                sink=torch.randn(H, generator=g), scale=(nope + rope) ** -0.5, window=window,
                ratio=ratio)


def _draft_attention(g, n, big):
    N, H, D, W = (5, 64, 512, 128) if big else (5, 3, 64, 9)
    R = n + 2
    return dict(q=_randn(g, n, N, H, D, scale=2, dtype=torch.bfloat16),
                kv=_randn(g, n, N, D, dtype=torch.bfloat16),
                ring=_randn(g, R, W, D, dtype=torch.bfloat16),
                rows=torch.randperm(R, generator=g)[:n],
                last_pos=torch.randint(-1, 3 * W, (n,), generator=g),
                sink=torch.randn(H, generator=g) * 2, scale=D ** -0.5)


def _indexer_topk(g, n, big):
    T, HI, DI, NE, topk, ratio = (6, 64, 128, 2048, 512, 4) if big else (2, 3, 24, 40, 7, 4)
    R = n + 1
    return dict(q=_randn(g, n, T, HI, DI, dtype=torch.bfloat16),
                weights=torch.randn(n, T, HI, generator=g),
                k_cache=_randn(g, R, NE, DI, dtype=torch.bfloat16),
                rows=torch.randperm(R, generator=g)[:n],
                pos=torch.randint(0, NE * ratio - T, (n, 1), generator=g) + torch.arange(T),
                topk=topk, ratio=ratio)


def _compress_args(g, n, big, ratio=4):
    d_c, T, R = (512, 6, 64) if big else (128, 6, 64)
    coff = ck.coff_of(ratio)
    W, ring, rows_n = coff * d_c, coff * ratio + T + 1, n + 1
    rows = torch.randperm(rows_n, generator=g)[:n]
    pos = torch.randint(0, 200, (n, 1), generator=g) + torch.arange(T)
    batch = Batch(rows=rows, pos=pos, tokens=torch.zeros_like(pos), valid=torch.ones(n, dtype=torch.bool))
    return d_c, rows_n, dict(
        kv=torch.randn(n * T, W, generator=g) * 2, score=torch.randn(n * T, W, generator=g) * 3,
        ape=torch.randn(ratio, W, generator=g), positions=pos, rows=rows, valid=batch.valid,
        ring_slots=batch.ring_slots(ring), ring_kv=torch.randn(rows_n, ring, W, generator=g),
        ring_score=torch.randn(rows_n, ring, W, generator=g),
        norm_weight=(1 + 0.2 * torch.randn(d_c, generator=g)).bfloat16(), cos_sin=cos_sin(R))


def _compress(g, n, big):
    return dict(**_compress_args(g, n, big)[2], eps=1e-6, out_dtype=torch.bfloat16)


def _compress_store(g, n, big):
    d_c, rows_n, d = _compress_args(g, n, big)
    return dict(**d, cache=torch.randn(rows_n, 64, d_c, generator=g).bfloat16(), eps=1e-6,
                out_dtype=torch.bfloat16)


def _compress_store_fp8(g, n, big):
    d_c, rows_n, d = _compress_args(g, n, big)
    R = d["cos_sin"].shape[1]
    rand = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return dict(**d, cache_nope=rand(rows_n, 64, d_c - R).view(torch.float8_e4m3fn),
                cache_scale=rand(rows_n, 64, (d_c - R) // 64),
                cache_rope=rand(rows_n, 64, 2 * R).view(torch.bfloat16), eps=1e-6,
                out_dtype=torch.bfloat16)


def _compress_rows(*names):
    """Row j's tokens' outputs, and its rows of the rings and caches."""
    def results(kw, out, j):
        T = kw["positions"].shape[1]
        r = int(kw["rows"][j])
        res = [o.view(kw["rows"].shape[0], -1, *o.shape[1:])[j] for o in _outs(out)]
        return res + [kw[k][r] for k in ("ring_kv", "ring_score") + names] + \
            [torch.tensor(T)]
    return results


COMPRESS_KEYS = ("kv", "score", "positions", "rows", "valid", "ring_slots")


# --- samplers -------------------------------------------------------------------------------------

V = 137


def _params(g, n):
    T = torch.rand(n, generator=g) * 1.5
    T[::3] = 0.0                                  # greedy rows among the sampled ones
    return dict(temperature=T, top_k=torch.randint(0, 20, (n,), generator=g),
                top_p=0.5 + 0.5 * torch.rand(n, generator=g),
                seed=torch.randint(0, 2 ** 31, (n,), generator=g))


def _sample(g, n, big):
    p = _params(g, n)
    return dict(logits=torch.randn(n, V, generator=g) * 3, **p,
                position=torch.randint(0, 1000, (n,), generator=g))


def _rejection_sample(g, n, big):
    N = 5
    p = _params(g, n)
    return dict(target_logits=torch.randn(n, N + 1, V, generator=g) * 3,
                draft_tokens=torch.randint(0, V, (n, N), generator=g),
                draft_logits=torch.randn(n, N, V, generator=g) * 3, **p,
                start_pos=torch.randint(0, 1000, (n,), generator=g))


def _markov_sample(g, n, big):
    N, R = 5, 16
    p = _params(g, n)
    return dict(base_logits=torch.randn(n, N, V, generator=g) * 2,
                anchor=torch.randint(0, V, (n,), generator=g),
                w1=torch.randn(V, R, generator=g).bfloat16(),
                w2=(torch.randn(V, R, generator=g) * 0.3).bfloat16(), **p,
                start_pos=torch.randint(0, 1000, (n,), generator=g))


def _rope(g, n, big):
    H, D, R = (64, 512, 64) if big else (3, 192, 64)
    return dict(x=_randn(g, n, H, D, scale=3, dtype=torch.bfloat16), cos_sin=cos_sin(R),
                positions=torch.randint(0, 500, (n,), generator=g), rope_dim=R, inverse=True)


def _moe_gate(g, n, big):
    E, k = (256, 6) if big else (72, 6)
    return dict(logits=_randn(g, n, E, scale=3), bias=_randn(g, E, scale=0.2), tid2eid=None,
                tokens=torch.randint(0, 100, (n,), generator=g), k=k, norm_topk=True, scale=2.5)


def _ring_slots(g, n, big):
    T = 6
    return dict(rows=torch.randperm(n + 5, generator=g)[:n],
                pos=torch.randint(0, 300, (n, 1), generator=g) + torch.arange(T)[None, :],
                valid=torch.rand(n, generator=g) > 0.2, write=torch.rand(n, T, generator=g) > 0.3,
                ring=8)


SAMPLER_KEYS = ("temperature", "top_k", "top_p", "seed")

CASES: dict[str, Case] = {
    "act_quant": Case(_act_quant, ("x",), _row_of_outputs),
    "swiglu_quant": Case(_swiglu_quant, ("g", "u"), _row_of_outputs),
    "rmsnorm_quant": Case(_rmsnorm_quant, ("x",), _row_of_outputs),
    "rmsnorm": Case(_rmsnorm, ("x",), _row_of_outputs),
    "fp8_linear": Case(_fp8_linear, ("x", "x_s"), _row_of_outputs, gpu_pool=400),
    "fp8_linear_multi": Case(_fp8_linear_multi, ("x", "x_s"), _row_of_outputs, gpu_pool=400),
    "linear": Case(_linear, ("x",), _row_of_outputs, gpu_pool=400),
    "moe_experts": Case(_moe_experts, ("x", "topk_ids", "topk_weights"), _row_of_outputs),
    "hc_pre": Case(_hc_pre, ("X",), _row_of_outputs),
    "hc_head": Case(_hc_head, ("X",), _row_of_outputs),
    "hc_post": Case(_hc_post, ("y", "X", "post", "comb"), _row_of_outputs),
    "hc_post_pre": Case(_hc_post_pre, ("y", "X", "post", "comb"), _row_of_outputs),
    "hc_post_head": Case(_hc_post_head, ("y", "X", "post", "comb"), _row_of_outputs),
    "ring_slots": Case(_ring_slots, ("rows", "pos", "valid", "write"),
                       lambda kw, out, j: [out.view(kw["pos"].shape)[j]]),
    "rope": Case(_rope, ("x", "positions"), _row_of_outputs),
    "moe_gate": Case(_moe_gate, ("logits", "tokens"), _row_of_outputs),
    "qkv_rope": Case(lambda g, n, big: _qkv(g, n, big, None), ("q", "kv", "positions"),
                     _row_of_outputs),
    "qkv_postprocess": Case(lambda g, n, big: _qkv(g, n, big, "fp8"),
                            ("q", "kv", "positions", "slots"),
                            _slot_rows("cache_nope", "cache_scale", "cache_rope"),
                            ("cache_nope", "cache_scale", "cache_rope")),
    "context_kv_store": Case(lambda g, n, big: _qkv(g, n, big, "ring"),
                             ("kv", "positions", "slots"), _slot_rows("cache"), ("cache",)),
    "sparse_attention": Case(_sparse_attention, ("q", "cmp_idx", "rows", "pos"),
                             _row_of_outputs),
    "draft_attention": Case(_draft_attention, ("q", "kv", "rows", "last_pos"), _row_of_outputs),
    "indexer_topk": Case(_indexer_topk, ("q", "weights", "rows", "pos"), _row_of_outputs),
    "compress": Case(_compress, COMPRESS_KEYS, _compress_rows(), ("ring_kv", "ring_score")),
    "compress_store": Case(_compress_store, COMPRESS_KEYS, _compress_rows("cache"),
                           ("ring_kv", "ring_score", "cache")),
    "compress_store_fp8": Case(_compress_store_fp8, COMPRESS_KEYS,
                               _compress_rows("cache_nope", "cache_scale", "cache_rope"),
                               ("ring_kv", "ring_score", "cache_nope", "cache_scale",
                                "cache_rope")),
    "sample": Case(_sample, ("logits", "position") + SAMPLER_KEYS, _row_of_outputs,
                   interpreted_pool=8, interpreted_last_only=True),
    "rejection_sample": Case(_rejection_sample,
                             ("target_logits", "draft_tokens", "draft_logits", "start_pos")
                             + SAMPLER_KEYS, _row_of_outputs, interpreted_pool=8,
                             interpreted_last_only=True),
    "markov_sample": Case(_markov_sample, ("base_logits", "anchor", "start_pos") + SAMPLER_KEYS,
                          _row_of_outputs, interpreted_pool=8, interpreted_last_only=True),
}

# kwargs whose dim 0 holds `T` tokens per row (flattened [B*T, ...]): sliced as row blocks
TOKEN_MAJOR = {"kv": "positions", "score": "positions", "ring_slots": "positions"}


def take(case: Case, kw: dict, idx: list[int]) -> dict:
    """The kwargs of the sub-batch of rows `idx` (in that order); shared state stays whole."""
    out = dict(kw)
    ix = torch.tensor(idx, dtype=torch.long)
    for k in case.row_keys:
        t = kw[k]
        if k in TOKEN_MAJOR and TOKEN_MAJOR[k] in kw and kw[TOKEN_MAJOR[k]].dim() == 2 and \
                t.shape[0] != kw[TOKEN_MAJOR[k]].shape[0]:
            T = kw[TOKEN_MAJOR[k]].shape[1]
            t = t.view(-1, T, *t.shape[1:])[ix.to(t.device)].flatten(0, 1)
        else:
            t = t[ix.to(t.device)]
        out[k] = t
    for k in case.mutated:
        out[k] = kw[k].clone()
    return out
