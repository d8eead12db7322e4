"""GEMM tile sweep (group "gemm_tiles"): the LM head's `dspark::linear` and the large FP8
linears at the decode token counts, with the tiles and pipeline depths a Hopper-class GPU allows.

    python benchmarks/kernel_bench.py --only gemm_tiles --batches 16,64 --variants 'ours*,t*' \
        --calls-per-graph 8 --replays 20 --out DIR

Why (issue 55): the plans size their pipelines for SMEM_BUDGET = 96 KB (SM12x's 99 KB a block),
so the 128-token tile of the LM head (128 tokens + 64 weight rows of 128 K in bf16: 48 KB a
stage) runs with ONE stage on every GPU, the H100's 227 KB included; at B = 64 the LM heads
take 2.6 ms for ~745 GFLOP (30 % of the bf16 MMA peak) and the FP8 linears 2.5 ms. Every
variant keeps the batch-invariant form (W x^T: 64-row weight blocks on the MMA's M side, the
tokens on its N side, K in blocks of 128 in order, the plan's split of K), so a variant must
equal `ours` bit for bit; `check` says where one does not.

Variants: `ours` (the plan), `t{tokens}x{rows}w{warps}s{stages}` (the same kernel with that
tile, warps and stages; only those whose stages fit 220 KB of shared memory).
"""
from __future__ import annotations

import dataclasses

import torch
from harness import Case, compare

from dspark_compile.kernels import fp8_linear as fl
from dspark_compile.kernels import linear as ln

HEAD = (129280, 4096)       # Flash's LM head [V, hidden], bf16
# (N, K, groups) of the FP8 linears with the most bytes a layer (fp8_linear_cases.SHAPES)
FP8_SHAPES = {(32768, 1024, 1): "wq_b", (8192, 4096, 8): "wo_a", (4096, 8192, 1): "wo_b"}
SMEM_LIMIT = 220 * 1024     # H100 / H200: 227 KB a block, less the epilogue's scratch
# (weight rows, warps, stages) per token tile: the plan's tile deeper, wider weight tiles with
# one or two warpgroups. The FP8 plans already run 3 stages (24 KB a stage at 128 tokens).
HEAD_TILES = ((64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2),
              (128, 8, 3), (256, 8, 2))
FP8_TILES = ((64, 4, 4), (128, 8, 3), (256, 8, 3))


def _variants(M: int, bytes_per: int, tiles) -> list[tuple]:
    """(tokens, rows, warps, stages) candidates for M tokens: the plan's token tile and, from
    M >= 256, 256 tokens (the widest wgmma N); those whose stages fit SMEM_LIMIT."""
    tokens = {fl.invariant_tile(M)[0]} | ({256} if M >= 256 else set())
    return [(bm, bn, warps, st) for bm in sorted(tokens) for bn, warps, st in tiles
            if st * 128 * (bm + bn) * bytes_per <= SMEM_LIMIT]


def _label(v) -> str:
    return "t{}x{}w{}s{}".format(*v)


# --- linear (the LM head) -------------------------------------------------------------------

def _make_head(M):
    def make(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(M, HEAD[1], generator=g, device=device).to(torch.bfloat16)
        w = (torch.randn(*HEAD, generator=g, device=device) * 0.02).to(torch.bfloat16)
        return {"x": x, "w": w}
    return make


def _head_ref(d):
    return ln.linear_reference(d["x"], d["w"], torch.bfloat16, torch.float32)


def _head_ours(d):
    return torch.ops.dspark.linear(d["x"], d["w"], torch.bfloat16, torch.float32)


def _head_variant(v):
    bm, bn, warps, st = v

    def fn(d):
        M, (N, K) = d["x"].shape[0], d["w"].shape
        _, _, swap, split, per, _, _ = ln.linear_plan(M, N, K, 2)
        return ln.linear_launch(d["x"], d["w"], torch.bfloat16, torch.float32,
                                plan=(bm, bn, swap, split, per, warps, st))
    return fn


def _bit_check(make, reference, ours, variants):
    """ours against the reference (harness.compare's tolerance), then every variant against ours
    bit for bit: a tile that changes a single bit is not batch invariant and is named."""
    def check(device):
        d = make(device, 123)
        y = ours(d)
        bad = [compare("ours", y, reference(d))]
        bad += [compare(name, fn(d), y, exact=True) for name, fn in variants.items()]
        return "; ".join(b for b in bad if b)
    return check


# --- fp8_linear -----------------------------------------------------------------------------

def _fp8_variant(v):
    bm, bn, warps, st = v

    def fn(d):
        M, N, K = d["x"].shape[0], d["w"].shape[0], d["w"].shape[1]
        p = fl.fp8_linear_plan(M, N, K, d["groups"])
        p = dataclasses.replace(p, block_m=bm, block_n=bn, num_warps=warps, num_stages=st)
        return fl.fp8_linear_launch(d["x"], d["x_s"], d["w"], d["w_s"], d["groups"],
                                    torch.bfloat16, plan=p)
    return fn


def cases(batches):
    from fp8_linear_cases import TOKENS_PER_REQUEST, _make, _ours, _reference, floor_bytes
    out = []
    for M in sorted({TOKENS_PER_REQUEST * B for B in batches}):
        make = _make_head(M)
        extra = {_label(v): _head_variant(v) for v in _variants(M, 2, HEAD_TILES)}
        N, K = HEAD
        out.append(Case("gemm_tiles", "linear.lm_head", {"B": M / TOKENS_PER_REQUEST, "T": M,
                                                         "N": N, "K": K},
                        make, _head_ref, _head_ours, N * K * 2 + M * K * 2 + M * N * 4,
                        check=_bit_check(make, _head_ref, _head_ours, extra), extra=extra,
                        compile=False))
        for (N, K, G), use in FP8_SHAPES.items():
            make = _make(M, N, K, G)
            extra = {}
            for v in _variants(M, 1, FP8_TILES):
                if G == 1 or (N // G) % v[1] == 0:
                    extra[_label(v)] = _fp8_variant(v)
            out.append(Case("gemm_tiles", f"fp8_linear.{use}",
                            {"B": M / TOKENS_PER_REQUEST, "T": M, "N": N, "K": K, "groups": G},
                            make, _reference, _ours, int(floor_bytes(M, N, K, G)),
                            check=_bit_check(make, _reference, _ours, extra), extra=extra,
                            compile=False))
    return out
