"""mHC benchmark cases (group "mhc"): `dspark::hc_post_pre` (one layer's post then the next
site's pre, the op the step calls most: 14 calls a flash-slice step) and `dspark::hc_pre`, at
Flash dims (D = 4096, m = 4, 24 mix rows, 20 Sinkhorn passes, bf16 stream).

    python benchmarks/kernel_bench.py --only mhc --batches 1,16,64 --variants 'ours*'

Variants: `eager` / `compile` (the reference), `ours` (the op's plan), and the mix kernel's
tiling varied as (BLOCK_T rows, BLOCK_D columns) a program: `ours-tXdY`. Every tiling gives the
same bits (kernels/mhc.py: one tree over D), so the plan may take the fastest at each T
(`GPU_TILES`); these variants say which that is.

bytes_moved: post_pre reads y (T·D·2) and X (T·m·D·2) and fn (24·m·D·4), writes X' (T·m·D·2),
a (T·D·2), post and comb (T·(m + m²)·4); pre reads X and fn and writes a, post, comb.
"""
from __future__ import annotations

import torch
from harness import Case, compare

from dspark_compile.kernels import mhc

M, MIX, ITERS = 4, 24, 20
TOKENS_PER_REQUEST = 6
# (BLOCK_T, BLOCK_D) timed beside the plan: [rows, 32, BLOCK_D] accumulators near 8192
TILINGS = ((1, 256), (2, 128), (4, 64), (8, 32), (16, 16), (4, 32), (8, 16))


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def _make(T, D, post: bool):
    def make(device, seed):
        g = _gen(device, seed)
        X = torch.randn(T, M, D, generator=g, device=device).to(torch.bfloat16)
        d = dict(X=X, fn=torch.randn(MIX, M * D, generator=g, device=device) * 0.02,
                 scale=torch.rand(3, generator=g, device=device) + 0.5,
                 base=torch.randn(MIX, generator=g, device=device) * 0.1, eps=1e-6,
                 norm_eps=1e-6, iters=ITERS)
        if post:
            d.update(y=torch.randn(T, D, generator=g, device=device).to(torch.bfloat16),
                     post=torch.rand(T, M, generator=g, device=device) * 2,
                     comb=torch.softmax(torch.randn(T, M, M, generator=g, device=device), -1))
        return d
    return make


def _ref(post: bool):
    if post:
        return lambda d: mhc.hc_post_pre_reference(d["y"], d["X"], d["post"], d["comb"], d["fn"],
                                                   d["scale"], d["base"], d["eps"],
                                                   d["norm_eps"], d["iters"])
    return lambda d: mhc.hc_pre_reference(d["X"], d["fn"], d["scale"], d["base"], d["eps"],
                                          d["norm_eps"], d["iters"])


def _ours(post: bool, tiles=None):
    if post:
        return lambda d: mhc.hc_post_pre_launch(d["y"], d["X"], d["post"], d["comb"], d["fn"],
                                                d["scale"], d["base"], d["eps"], d["norm_eps"],
                                                d["iters"], tiles=tiles)
    return lambda d: mhc.hc_pre_launch(d["X"], d["fn"], d["scale"], d["base"], d["eps"],
                                       d["norm_eps"], d["iters"], tiles=tiles)


def floor_bytes(T, D, post: bool) -> int:
    stream = T * M * D * 2
    return (stream * (2 if post else 1) + T * D * 2 * (2 if post else 1) + MIX * M * D * 4
            + T * (M + M * M) * 4)


def _check(make, post):
    def check(device):
        d = make(device, 123)
        got, want = _ours(post)(d), _ref(post)(d)
        return "; ".join(m for m in (compare(f"out{i}", g, w) for i, (g, w) in
                                     enumerate(zip(got, want))) if m)
    return check


def cases(batches):
    D = 4096 if torch.cuda.is_available() else 256
    out = []
    for B in batches:
        T = TOKENS_PER_REQUEST * B
        for post in (True, False):
            make = _make(T, D, post)
            extra = {f"ours-t{bt}d{bd}": _ours(post, dict(block_t=bt, block_d=bd))
                     for bt, bd in TILINGS}
            out.append(Case("mhc", "hc_post_pre" if post else "hc_pre",
                            {"B": B, "T": T, "D": D}, make, _ref(post), _ours(post),
                            floor_bytes(T, D, post), check=_check(make, post), extra=extra,
                            compile=False))
    return out
