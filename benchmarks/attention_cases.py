"""Attention benchmark cases (group "attention"): dspark::sparse_attention and dspark::indexer_topk
at Flash shapes, context lengths 64, 1k, 8k and 32k positions.

    python benchmarks/kernel_bench.py --only attention --batches 1,16,64 --out benchmarks/results/h200_attention
    python benchmarks/kernel_bench.py --only attention --ops sparse_attention.c4@8k --variants 'ours*' --batches 1

Each case is one layer's call for B requests of T = 6 verify tokens at positions ctx-6 .. ctx-1
(so ctx positions of context): 64 heads x 512 (448 FP8 nope + 64 bf16 rope; 583 B per cached
entry: 448 + 7 scale bytes + 128), window 128; C128 caches of ctx/128 entries, C4 caches of
ctx/4 entries with top-512 lists of distinct visible entries (ascending, -1 after the visible
ones, as indexer_topk writes them); indexer 64 heads x 128 over bf16 keys, top 512.

Variants: `eager` and `compile` (the reference: the candidates gathered and dequantized to fp32,
einsum scores, softmax with the sink column; the indexer's einsum + relu + head sum + stable
sort), `ours` (the op); sparse_attention's plan varied (tuning, not declared configurations):
`ours-split1` (no split), `ours-h64` (64 heads a program), `ours-n16` / `ours-n64` (candidates a
block), `ours-s3` (3 pipeline stages), `ours-c1` / `ours-c2` / `ours-n16c1` (chunks of 1 or 2
blocks, split over programs), `ours-previous` (the plan before CHUNK_BLOCKS = 2: chunks of >= 4 blocks).

bytes_moved (the floors the targets compare with; "KV entries actually visited", each once):

    sparse_attention   q + o (B*T*64*512*2 B each) + per row the union of its tokens' candidates:
                       min(window + T - 1, ctx) SWA entries, ctx // 128 C128 entries, or the
                       union of the 6 top-512 lists (C4; random lists: vis * (1 - (1 - 512 /
                       vis)^6) in expectation, vis = ctx // 4) x 583 B, + the C4 lists (8 B
                       per slot)
    indexer_topk       per row the visible keys (ctx // 4 x 128 x 2 B) + q (B*T*64*128*2) +
                       weights (B*T*64*4) + the lists written (B*T*512*8)

e.g. sparse_attention C4 at B = 64, 8k: 64 x 6 x 128 KB (q + o) + 64 x (133 + 1685) x 583 B +
64 x 6 x 4 KB = 119 MB, 25 us at 4.8 TB/s; indexer_topk at B = 64, 32k: 134 MB of keys, 28 us.

Without CUDA (`--dry-run` on the CPU) the cases shrink to 8 heads and contexts up to 1k so the
reference runs in seconds; their numbers mean nothing.
"""
import dataclasses

import torch
from harness import Case, compare

from dspark_compile.kernels import indexer_topk as it
from dspark_compile.kernels import sparse_attention as sa
from dspark_compile.kernels.qkv_postprocess import kv_quant_reference

T = 6
ENTRY_BYTES = 448 + 7 + 128


@dataclasses.dataclass(frozen=True)
class Dims:
    H: int = 64
    nope: int = 448
    rope: int = 64
    window: int = 128
    HI: int = 64
    DI: int = 128
    topk: int = 512
    contexts: tuple = (64, 1024, 8192, 32768)


CPU_DIMS = Dims(H=8, nope=64, rope=64, window=16, HI=8, DI=64, topk=32, contexts=(64, 1024))


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def _fp8_cache(R, n, D, nope, g, device):
    return kv_quant_reference(torch.randn(R, n, D, generator=g, device=device) * 2, nope)


def _c4_lists(B, ctx, K, g, device):
    """Distinct visible entries per token, ascending, -1 after them."""
    vis = max(1, (ctx - T + 1) // 4)
    keys = torch.rand(B * T, vis, generator=g, device=device)
    pick = keys.topk(min(K, vis), -1).indices.sort(-1).values
    idx = torch.full((B * T, K), -1, dtype=torch.int64, device=device)
    idx[:, :pick.shape[1]] = pick
    return idx.view(B, T, K)


def _attention_inputs(dims, B, ctx, ratio):
    D = dims.nope + dims.rope

    def make(device, seed):
        g = _gen(device, seed)
        R = B + 1
        d = dict(q=torch.randn(B, T, dims.H, D, generator=g, device=device).to(torch.bfloat16))
        d["swa_kv"], d["swa_scale"], d["swa_rope"] = _fp8_cache(R, dims.window + T, D,
                                                                dims.nope, g, device)
        if ratio:
            ne = max(1, ctx // ratio)
            d["cmp_kv"], d["cmp_scale"], d["cmp_rope"] = _fp8_cache(R, ne, D, dims.nope, g,
                                                                    device)
        else:
            d["cmp_kv"] = d["cmp_scale"] = d["cmp_rope"] = None
        d["cmp_idx"] = _c4_lists(B, ctx, dims.topk, g, device) if ratio == 4 else None
        d.update(rows=torch.randperm(B, generator=g, device=device),
                 pos=torch.arange(ctx - T, ctx, device=device).expand(B, T).contiguous(),
                 sink=torch.randn(dims.H, generator=g, device=device), scale=D ** -0.5,
                 window=dims.window, ratio=ratio)
        return d
    return make


def attention_floor(dims, B, ctx, ratio) -> int:
    D = dims.nope + dims.rope
    per_row = min(dims.window + T - 1, ctx)
    lists = 0
    if ratio == 128:
        per_row += ctx // 128
    elif ratio == 4:
        # the union of a row's T lists: random K-subsets of the visible entries, so in
        # expectation vis * (1 - (1 - K / vis)^T) distinct entries
        vis = max(1, (ctx - T + 1) // 4)
        per_row += round(vis * (1 - (1 - min(dims.topk, vis) / vis) ** T))
        lists = B * T * dims.topk * 8
    return B * T * dims.H * D * 2 * 2 + B * per_row * ENTRY_BYTES + lists


def _attention_ref(d):
    return sa.sparse_attention_reference(**d)


def _attention_ours(d):
    return torch.ops.dspark.sparse_attention(**d)


def _attention_plan(d, **changes):
    """The op's plan for these inputs with `changes` (tuning variants: not declared configs)."""
    B, T_, H, _ = d["q"].shape
    n = d["window"] + (d["cmp_idx"].shape[-1] if d["cmp_idx"] is not None
                       else d["cmp_kv"].shape[1] if d["ratio"] else 0)
    return dataclasses.replace(sa.sparse_attention_plan(B * T_, H, n), **changes)


def _previous_plan(d):
    """The invariant plan before CHUNK_BLOCKS: chunks of >= 4 blocks, as many as fill 2 waves
    for one token's head blocks (kernels/sparse_attention.py at 6dbd08a)."""
    p = _attention_plan(d)
    B, T_, H, _ = d["q"].shape
    n = d["window"] + (d["cmp_idx"].shape[-1] if d["cmp_idx"] is not None
                       else d["cmp_kv"].shape[1] if d["ratio"] else 0)
    blocks, n_hb = -(-n // p.block_n), -(-H // p.block_h)
    n_chunks = max(1, min(blocks // 4, -(-2 * sa.SM_COUNT_HINT // n_hb)))
    split = n_chunks > 1 and B * T_ * n_hb < 2 * sa.SM_COUNT_HINT
    return dataclasses.replace(p, chunk=-(-blocks // n_chunks), split=split)


def _variant(**changes):
    return lambda d: sa.sparse_attention_launch(**d, plan=_attention_plan(d, **changes))


# tuning variants: no split; 64 heads a program (the H200's 227 KB of shared memory take it,
# SM12x's 99 KB do not); 16 or 64 candidates a block; 3 stages; chunks of 1 or 2 candidate
# blocks, split over programs (B = 1 fills the GPU: 6 tokens x 2 head blocks x the chunks)
ATTENTION_VARIANTS = {"ours-split1": _variant(split=False), "ours-h64": _variant(block_h=64),
                      "ours-n16": _variant(block_n=16), "ours-n64": _variant(block_n=64),
                      "ours-s3": _variant(num_stages=3),
                      "ours-previous": lambda d: sa.sparse_attention_launch(
                          **d, plan=_previous_plan(d)),
                      "ours-c1": _variant(chunk=1, split=True),
                      "ours-c2": _variant(chunk=2, split=True),
                      "ours-n16c1": _variant(block_n=16, chunk=1, split=True)}


def _attention_check(make):
    def check(device):
        d = make(device, 123)
        return compare("o", _attention_ours(d), _attention_ref(d))
    return check


def _indexer_inputs(dims, B, ctx, integer=False):
    def make(device, seed):
        g = _gen(device, seed)
        shape_q, shape_k = (B, T, dims.HI, dims.DI), (B + 1, max(1, ctx // 4), dims.DI)
        if integer:   # exact scores: the kernel must pick exactly the reference's entries
            q = torch.randint(-2, 3, shape_q, generator=g, device=device).to(torch.bfloat16)
            k = torch.randint(-2, 3, shape_k, generator=g, device=device).to(torch.bfloat16)
            w = torch.randint(-2, 3, (B, T, dims.HI), generator=g, device=device).float() / 2
        else:
            q = torch.randn(shape_q, generator=g, device=device).to(torch.bfloat16)
            k = torch.randn(shape_k, generator=g, device=device).to(torch.bfloat16)
            w = torch.randn(B, T, dims.HI, generator=g, device=device)
        return dict(q=q, weights=w, k_cache=k, rows=torch.randperm(B, generator=g, device=device),
                    pos=torch.arange(ctx - T, ctx, device=device).expand(B, T).contiguous(),
                    topk=dims.topk, ratio=4)
    return make


def indexer_floor(dims, B, ctx) -> int:
    keys = B * (ctx // 4) * dims.DI * 2
    return keys + B * T * dims.HI * (dims.DI * 2 + 4) + B * T * dims.topk * 8


def _indexer_ref(d):
    return it.indexer_topk_reference(**d)


def _indexer_ours(d):
    return torch.ops.dspark.indexer_topk(**d)


def _indexer_check(make_exact):
    def check(device):
        d = make_exact(device, 123)
        return compare("idx", _indexer_ours(d), _indexer_ref(d), exact=True)
    return check


def cases(batches):
    dims = Dims() if torch.cuda.is_available() else CPU_DIMS
    if not torch.cuda.is_available():
        batches = [b for b in batches if b <= 4] or batches[:1]
    out = []
    for ctx in dims.contexts:
        at = f"@{ctx // 1024}k" if ctx >= 1024 else f"@{ctx}"   # one plot panel per context
        for B in batches:
            params = {"B": B, "T": T, "ctx": ctx}
            for kind, ratio in (("swa", 0), ("c128", 128), ("c4", 4)):
                make = _attention_inputs(dims, B, ctx, ratio)
                n = dims.window + (dims.topk if ratio == 4 else max(1, ctx // ratio) if ratio
                                   else 0)
                p = sa.sparse_attention_plan(B * T, dims.H, n)
                plan = f"h{p.block_h}n{p.block_n}/chunk{p.chunk}{'-split' if p.split else ''}"
                out.append(Case("attention", f"sparse_attention.{kind}{at}",
                                dict(params, plan=plan),
                                make, _attention_ref, _attention_ours,
                                attention_floor(dims, B, ctx, ratio), check=_attention_check(make),
                                extra=dict(ATTENTION_VARIANTS)))
            p = it.indexer_topk_plan(B * T, max(1, ctx // 4))
            out.append(Case("attention", f"indexer_topk{at}",
                            dict(params, plan=f"e{p.block_e}x{p.e_blocks}"),
                            _indexer_inputs(dims, B, ctx), _indexer_ref, _indexer_ours,
                            indexer_floor(dims, B, ctx),
                            check=_indexer_check(_indexer_inputs(dims, B, ctx, integer=True))))
    return out
