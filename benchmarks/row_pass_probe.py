"""Why are the sampler's row passes ~10x their bytes? A probe of the loop structure alone.

The threshold search's row passes (kernels/sampling/row_passes.py and refine.py: reduce,
select, refine; the samplers' final passes) each read a [rows, V] fp32 buffer once, yet at B = 64 they took 40-100 us per pass
on the H200 against ~8 us for their bytes. Hypothesis: latency, not arithmetic. Each program
iteration loads one small tile (the histogram passes: 256 tokens = 1 KB per CTA, because their
per-lane [TILE, NB] histograms live in registers) and, in select/refine/final, first loads the
tile's block maxima to decide whether to read it at all -- two dependent round trips per tile.

This probe times the same work with different loop skeletons, on inputs like the benchmark's
(randn * 3 rows at the Flash vocabulary, several buffers rotated so L2 does not hold them):
- `hist`: per-lane NB-bin mass histograms (the reduce/refine work) with U tiles loaded per
  iteration before any is used (U = 1 is today's loop), optional software prefetch of the next
  iteration's tiles, or Triton's own pipelining (`tl.range(num_stages=S)`);
- `scan`: per-lane exact fixed-point sums (the select/final work) at larger tiles, with and
  without the block-maximum check before each tile's load.

    python benchmarks/row_pass_probe.py --rows 64 --out /tmp/probe.json

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

from dspark_compile.kernels.sampling.device import hist_add_z  # noqa: E402

V = 129280


@triton.jit
def _ld(zrow, offs, hi):
    return tl.load(zrow + offs, mask=offs < hi, other=float("-inf"))


@triton.jit
def _chunk(z_ptr, V, CHUNK):
    """(row, chunk, chunks, row pointer, chunk start, chunk end) of this program."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    lo = c * CHUNK
    return b, c, tl.num_programs(1), z_ptr + b.to(tl.int64) * V, lo, tl.minimum(lo + CHUNK, V)


@triton.jit
def hist_probe(z_ptr, out_ptr, V, CHUNK, m, TILE: tl.constexpr, NB: tl.constexpr,
               U: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr):
    b, c, C, zrow, lo, hi = _chunk(z_ptr, V, CHUNK)
    ar = tl.arange(0, TILE)
    cnt2 = tl.zeros((TILE, NB), tl.int32)
    ms2 = tl.zeros((TILE, NB), tl.float32)
    if PREFETCH:
        n0 = _ld(zrow, lo + ar, hi)
        if U >= 2:
            n1 = _ld(zrow, lo + TILE + ar, hi)
        for v0 in range(lo, hi, U * TILE):
            z0 = n0
            n0 = _ld(zrow, v0 + U * TILE + ar, hi)
            if U >= 2:
                z1 = n1
                n1 = _ld(zrow, v0 + (U + 1) * TILE + ar, hi)
            cnt2, ms2 = hist_add_z(cnt2, ms2, z0, m, NB)
            if U >= 2:
                cnt2, ms2 = hist_add_z(cnt2, ms2, z1, m, NB)
    else:
        for v0 in tl.range(lo, hi, U * TILE, num_stages=STAGES):
            z0 = _ld(zrow, v0 + ar, hi)
            if U >= 2:
                z1 = _ld(zrow, v0 + TILE + ar, hi)
            if U >= 4:
                z2 = _ld(zrow, v0 + 2 * TILE + ar, hi)
                z3 = _ld(zrow, v0 + 3 * TILE + ar, hi)
            cnt2, ms2 = hist_add_z(cnt2, ms2, z0, m, NB)
            if U >= 2:
                cnt2, ms2 = hist_add_z(cnt2, ms2, z1, m, NB)
            if U >= 4:
                cnt2, ms2 = hist_add_z(cnt2, ms2, z2, m, NB)
                cnt2, ms2 = hist_add_z(cnt2, ms2, z3, m, NB)
    o = (b * C + c) * 2 * NB + tl.arange(0, NB)
    tl.store(out_ptr + o, tl.sum(cnt2, axis=0).to(tl.float32))
    tl.store(out_ptr + o + NB, tl.sum(ms2, axis=0))


@triton.jit
def scan_probe(z_ptr, bmax_ptr, out_ptr, V, CHUNK, NBLK, m, tau, TILE: tl.constexpr,
               CHECK: tl.constexpr, BLOCK_V: tl.constexpr):
    b, c, C, zrow, lo, hi = _chunk(z_ptr, V, CHUNK)
    ar = tl.arange(0, TILE)
    am = tl.zeros((TILE,), tl.int64)
    ac = tl.zeros((TILE,), tl.int32)
    for v0 in range(lo, hi, TILE):
        go = True
        if CHECK:
            NBT: tl.constexpr = 2 * max(TILE // BLOCK_V, 1)
            blk = v0 // BLOCK_V + tl.arange(0, NBT)
            ok = (blk <= (v0 + TILE - 1) // BLOCK_V) & (blk < NBLK)
            go = tl.max(tl.load(bmax_ptr + b * NBLK + blk, mask=ok, other=float("-inf")),
                        axis=0) >= tau
        if go:
            z = _ld(zrow, v0 + ar, hi)
            keep = (z >= tau) & (z > float("-inf"))
            w = (tl.exp(z - m) * 1e15).to(tl.int64)
            am += tl.where(keep, w, 0)
            ac += keep.to(tl.int32)
    tl.store(out_ptr + b * C + c, (tl.sum(am, axis=0) + tl.sum(ac, axis=0)).to(tl.float32))


def bench(fn, reps=50):
    """Median of CUDA-graph replays (us); fn rotates its own inputs."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(a.elapsed_time(e) * 1000 / 4)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=bench_args.ordered_ints, default="64,1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = "cuda"
    results = []
    for rows in args.rows:
        nbuf = max(2, (256 << 20) // (rows * V * 4))
        bufs = [torch.randn(rows, V, device=dev) * 3.0 for _ in range(min(nbuf, 8))]
        m = float(max(float(b.max()) for b in bufs))
        tau = 4.0
        BLOCK_V = 64
        NBLK = triton.cdiv(V, BLOCK_V)
        bmaxs = [b[:, :NBLK * BLOCK_V].reshape(rows, -1, BLOCK_V).amax(-1).contiguous()
                 if V % BLOCK_V == 0 else
                 torch.nn.functional.pad(b, (0, NBLK * BLOCK_V - V), value=float("-inf"))
                 .reshape(rows, NBLK, BLOCK_V).amax(-1).contiguous() for b in bufs]
        chunk = 2048 if rows <= 4 else 4096 if rows <= 16 else 8192
        C = triton.cdiv(V, chunk)
        out = torch.empty(rows * C * 64, device=dev)
        floor_us = rows * V * 4 / 4.2e12 * 1e6
        it = [0]

        def nxt():
            it[0] = (it[0] + 1) % len(bufs)
            return it[0]

        hist_cfgs = []
        for nb in (16, 8):
            base = max(16, min(1024, 4096 // nb))
            for (tile, warps, U, pf, st) in ((base, 4, 1, 0, 1), (base, 8, 1, 0, 1),
                                             (base, 4, 2, 0, 1), (base, 4, 4, 0, 1),
                                             (base, 4, 1, 1, 1), (base, 4, 2, 1, 1),
                                             (base // 2, 4, 4, 0, 1), (base // 2, 4, 2, 1, 1),
                                             (base, 8, 2, 0, 1), (base, 8, 4, 0, 1),
                                             (base, 4, 1, 0, 3), (base // 4, 2, 4, 0, 1)):
                hist_cfgs.append((nb, tile, warps, U, pf, st))
        for (nb, tile, warps, U, pf, st) in hist_cfgs:
            def run(nb=nb, tile=tile, warps=warps, U=U, pf=pf, st=st):
                i = nxt()
                hist_probe[(rows, C)](bufs[i], out, V, chunk, m, TILE=tile, NB=nb, U=U,
                                      PREFETCH=pf, STAGES=st, num_warps=warps)
            try:
                us = bench(run)
            except Exception as e:  # noqa: BLE001 -- a config that does not compile is data too
                us = float("nan")
                print("hist", nb, tile, warps, U, pf, st, "failed:", str(e)[:200])
            results.append(dict(kind="hist", rows=rows, NB=nb, TILE=tile, warps=warps, U=U,
                                prefetch=pf, stages=st, us=us, floor_us=floor_us))
        for tile in (1024, 2048, 4096):
            for warps in (4, 8):
                for check in (1, 0):
                    def run(tile=tile, warps=warps, check=check):
                        i = nxt()
                        scan_probe[(rows, C)](bufs[i], bmaxs[i], out, V, chunk, NBLK, m, tau,
                                              TILE=tile, CHECK=check, BLOCK_V=BLOCK_V,
                                              num_warps=warps)
                    try:
                        us = bench(run)
                    except Exception as e:  # noqa: BLE001
                        us = float("nan")
                        print("scan", tile, warps, check, "failed:", str(e)[:200])
                    results.append(dict(kind="scan", rows=rows, TILE=tile, warps=warps,
                                        check=check, us=us, floor_us=floor_us))
    for r in results:
        keys = [k for k in r if k not in ("us", "floor_us")]
        print(" ".join(f"{k}={r[k]}" for k in keys), f"us={r['us']:.1f}",
              f"floor={r['floor_us']:.1f}")
    if args.out:
        bench_args.write_record(Path(args.out), dict(
            device=torch.cuda.get_device_name(), torch=torch.__version__,
            triton=triton.__version__, results=results))


if __name__ == "__main__":
    main()
