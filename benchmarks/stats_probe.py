"""Why does rejection's statistics pass run at ~2x its bytes? A probe of its per-token work.

kernels/sampling/rejection_kernels.py's _rows_stats_kernel reads each row once and writes four
numbers per 1024-token block (max, lowest argmax, sum exp(z - max), NaN flag). At B = 64 (384 target rows,
199 MB) it took 103 us on the H200 against ~47 us for its bytes (profile at 5b45da0), the draft rows'
pass 87 us for 165 MB. Hypothesis: the instructions per token, not the loads -- a correctly
rounded division (a multi-instruction sequence) even at T = 1, then four block reductions (max,
argmax, sum, NaN), each a CTA barrier. This probe times, on the same rows:
- `read`: the loads and a sum only (the pass's floor at this grid);
- `base`: the kernel before 73155ea (four blocks a program, the next one's load in flight);
- `nodiv`: no division where T = 1 (bit-identical there: x / 1 = x);
- `fused`: nodiv, and the max and its lowest index from one reduction (tl.max return_indices);
- `greedyarg`: fused, the argmax only for greedy rows (reduce reads it only for those);
- `sumany`: greedyarg, and the sum and the NaN flag from one reduction (a tuple tl.reduce);
- `2d-gG-wW`: G blocks loaded as one [G, 1024] tile, each reduction once for all G, W warps;
- `shipped`: kernels/sampling/rejection_kernels.py's kernel now (2d-g1-w2's work).
The first two runs (2026-11-30; benchmarks/results/README.md, "Sampler", "History") timed the
shipped kernel of then as `base`.

    python benchmarks/stats_probe.py --out /tmp/stats_probe.json

Tuning data only: nothing here is imported by the product.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402
from dspark_compile.kernels.sampling.rejection_kernels import _rows_stats_kernel  # noqa: E402

V = 129280


@triton.jit
def stats_probe(logits_ptr, temp_ptr, bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, V, NBLK, RPR,
                stride_lr, BLOCK: tl.constexpr, BPP: tl.constexpr, WORK: tl.constexpr,
                DIV: tl.constexpr):
    # BPP blocks a program, the next one's load in flight (the loop before 73155ea). WORK 0: read +
    # sum; 1: max, argmax, sum, NaN flag as four reductions (with DIV: divided at T = 1 too,
    # the kernel before 73155ea); 2: max and argmax as one; 3: and the argmax for greedy rows only;
    # 4: and the sum and NaN flag as one
    r = tl.program_id(0)
    b0 = tl.program_id(1) * BPP
    temp = tl.load(temp_ptr + r // RPR).to(tl.float32)
    greedy = temp <= 0.0
    t = tl.where(greedy, 1.0, temp)
    row = logits_ptr + r.to(tl.int64) * stride_lr
    ar = tl.arange(0, BLOCK)
    xn = tl.load(row + b0 * BLOCK + ar, mask=b0 * BLOCK + ar < V, other=0.0)
    for j in range(0, BPP):
        blk = b0 + j
        x = xn
        nx = (blk + 1) * BLOCK + ar
        xn = tl.load(row + nx, mask=(nx < V) & (j + 1 < BPP), other=0.0)
        if blk < NBLK:
            offs = blk * BLOCK + ar
            vm = offs < V
            so = r * NBLK + blk
            if WORK == 0:
                tl.store(bsum_ptr + so, tl.sum(tl.where(vm, x, 0.0), axis=0))
            else:
                z = x.to(tl.float32)
                if DIV or t != 1.0:
                    z = tl.math.div_rn(z, t)
                isnan = (z != z) & vm
                zn = tl.where(isnan | ~vm, float("-inf"), z)
                if WORK == 1:
                    bmax = tl.max(zn, axis=0)
                    tl.store(barg_ptr + so, tl.argmax(zn, axis=0, tie_break_left=True)
                             + blk * BLOCK)
                else:
                    bmax, barg = tl.max(zn, axis=0, return_indices=True,
                                        return_indices_tie_break_left=True)
                    if WORK == 2:
                        tl.store(barg_ptr + so, barg + blk * BLOCK)
                    elif greedy:
                        tl.store(barg_ptr + so, barg + blk * BLOCK)
                tl.store(bmax_ptr + so, bmax)
                e = tl.where(zn > float("-inf"), tl.exp(zn - bmax), 0.0)
                if WORK == 4:
                    bsum, bnan = tl.reduce((e, isnan.to(tl.int32)), 0, _sum_any)
                    tl.store(bsum_ptr + so, bsum)
                    tl.store(bnan_ptr + so, bnan)
                else:
                    tl.store(bsum_ptr + so, tl.sum(e, axis=0))
                    tl.store(bnan_ptr + so, tl.max(isnan.to(tl.int32), axis=0))


@triton.jit
def _sum_any(s0, n0, s1, n1):
    return s0 + s1, tl.maximum(n0, n1)


@triton.jit
def stats_probe_2d(logits_ptr, temp_ptr, bmax_ptr, barg_ptr, bsum_ptr, bnan_ptr, V, NBLK, RPR,
                   stride_lr, BLOCK: tl.constexpr, G: tl.constexpr):
    # G blocks as one [G, BLOCK] tile: every reduction runs once for the G blocks
    r = tl.program_id(0)
    blk = tl.program_id(1) * G + tl.arange(0, G)
    temp = tl.load(temp_ptr + r // RPR).to(tl.float32)
    greedy = temp <= 0.0
    t = tl.where(greedy, 1.0, temp)
    offs = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    vm = offs < V
    x = tl.load(logits_ptr + r.to(tl.int64) * stride_lr + offs, mask=vm, other=0.0)
    z = x.to(tl.float32)
    if t != 1.0:
        z = tl.math.div_rn(z, t)
    isnan = (z != z) & vm
    zn = tl.where(isnan | ~vm, float("-inf"), z)
    bmax, barg = tl.max(zn, axis=1, return_indices=True, return_indices_tie_break_left=True)
    e = tl.where(zn > float("-inf"), tl.exp(zn - bmax[:, None]), 0.0)
    bsum, bnan = tl.reduce((e, isnan.to(tl.int32)), 1, _sum_any)
    so = r * NBLK + blk
    bm = blk < NBLK
    tl.store(bmax_ptr + so, bmax, mask=bm)
    tl.store(barg_ptr + so, barg + blk * BLOCK, mask=bm)
    tl.store(bsum_ptr + so, bsum, mask=bm)
    tl.store(bnan_ptr + so, bnan, mask=bm)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=bench_args.ordered_ints, default="1,16,64")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cuda"
    cfg = harness.TimingConfig(calls_per_graph=20, replays=40)
    BLOCK = 1024
    NBLK = triton.cdiv(V, BLOCK)
    out = {"environment": harness.environment(), "cases": []}
    for B in args.requests:
        R = B * 6
        nsets = harness.num_input_sets(R * V * 4, cfg)
        sets = []
        for _ in range(nsets):
            st = dict(bmax=torch.empty((R, NBLK), device=dev),
                      barg=torch.empty((R, NBLK), dtype=torch.int32, device=dev),
                      bsum=torch.empty((R, NBLK), device=dev),
                      bnan=torch.empty((R, NBLK), dtype=torch.int32, device=dev))
            sets.append(dict(x=torch.randn((R, V), device=dev) * 3,
                             t=torch.ones((B,), device=dev), **st))

        def run(kernel, grid, **kw):
            def fn(s):
                kernel[grid](s["x"], s["t"], s["bmax"], s["barg"], s["bsum"], s["bnan"], V, NBLK,
                             6, V, BLOCK=BLOCK, **kw)
            return fn

        def probe(work, bpp, warps, div=False):
            return run(stats_probe, (R, triton.cdiv(NBLK, bpp)), BPP=bpp, WORK=work, DIV=div,
                       num_warps=warps)

        bpp0 = 4 if R * NBLK >= 4096 else 1     # blocks per program before 73155ea
        variants = {"base": probe(1, bpp0, 4, div=True), "read": probe(0, bpp0, 4),
                    "nodiv": probe(1, bpp0, 4), "fused": probe(2, bpp0, 4),
                    "greedyarg": probe(3, bpp0, 4), "sumany": probe(4, bpp0, 4),
                    "sumany-w2": probe(4, bpp0, 2), "sumany-w1": probe(4, bpp0, 1),
                    "shipped": run(_rows_stats_kernel, (R, NBLK), num_warps=2)}
        for g in (1, 2, 4, 8):
            for w in (2, 4, 8):
                variants[f"2d-g{g}-w{w}"] = run(stats_probe_2d, (R, triton.cdiv(NBLK, g)), G=g,
                                                num_warps=w)
        floor_us = R * V * 4 / 4.2e6
        for name, fn in variants.items():
            rec = harness.time_variant(fn, sets, cfg)
            rec.update(B=B, rows=R, variant=name, floor_us=floor_us)
            out["cases"].append(rec)
            print(f"B={B:3d} {name:18s} {rec['us_median']:8.1f} us  (bytes {floor_us:.1f} us)",
                  flush=True)
    bench_args.write_record(Path(args.out), out)


if __name__ == "__main__":
    main()
