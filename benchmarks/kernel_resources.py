"""Registers, shared memory and instruction counts of the declared kernel configurations, compiled
for any NVIDIA capability on a machine without a GPU: check what a kernel change costs before
spending device time timing it.

Why: on 2026-11-30 a change to the Markov logits kernel's epilogue measured +50 us at B = 64 on
the H200. The change fused the reductions and skipped a division. Compiled for sm_90 afterwards,
that configuration had gone from 146 to 198 registers per thread, which at 4 warps is 3 -> 2
CTAs per SM, so fewer W2 tiles were in flight. This tool would have shown that in a minute on the
CPU.

Every configuration that kernel files declare through `registry.add_compile_configs` (the same
list kernels/sm12x.py checks for SM12x) is compiled for `--capability` with Triton's
GPUTarget, then read with the cuobjdump bundled with Triton. The output is one line per
configuration:
- registers per thread;
- static + dynamic shared memory;
- local memory (spills);
- SASS instructions, and the barriers, shuffles and MUFU among them;
- the CTAs per SM that the registers allow (65536 registers per SM, allocated per warp in
  units of 8 per thread; 32 CTAs at most).

Run it on two trees and diff the JSON.

    python benchmarks/kernel_resources.py --capability 90 --ops markov_sample --out r.json

Tuning data only: nothing here is imported by the product.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

from dspark_compile.kernels import sm12x  # noqa: E402
from dspark_compile.kernels.registry import KERNELS  # noqa: E402

_OP_RE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
COUNTED = ("BAR", "SHFL", "MUFU")


def sass_counts(cubin: bytes) -> collections.Counter:
    """Opcode counts (without modifiers) of a cubin's SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([sm12x.cuobjdump_path(), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = _OP_RE.match(line)
        if m:
            ops[m.group(1)] += 1
    return ops


def report(capability: int, ops: set[str] | None = None) -> list[dict]:
    sm12x.import_all_kernel_modules()
    unknown = (ops or set()) - set(KERNELS)
    if unknown:
        raise SystemExit(f"--ops: no registered op {sorted(unknown)}; known: {sorted(KERNELS)}")
    out = []
    for rec, compiled in sm12x.config_resources(capability, ops):
        counts = sass_counts(compiled.asm["cubin"])
        out.append(dict(rec, capability=capability, instructions=sum(counts.values()),
                        **{c.lower(): counts[c] for c in COUNTED},
                        ctas_by_registers=sm12x.ctas_by_registers(rec["registers"],
                                                            rec["num_warps"])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--capability", type=int, default=90, help="e.g. 90 (H100/H200), 120")
    ap.add_argument("--ops", default="", help="comma-separated registered op names (all if "
                    "empty)")
    ap.add_argument("--out", default=None, help="write the records as JSON here")
    args = ap.parse_args()
    rows = report(args.capability, set(filter(None, args.ops.split(","))) or None)
    for r in rows:
        cx = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
        print(f"{r['op']:16s} {r['kernel']:28s} w{r['num_warps']} regs {r['registers']:3d} "
              f"ctas/SM {r['ctas_by_registers']:2d} smem {r['shared_bytes']:6d} "
              f"local {r['local_bytes']:4d} instr {r['instructions']:5d} bar {r['bar']:3d} "
              f"shfl {r['shfl']:3d} mufu {r['mufu']:3d}  {cx}")
    if args.out:
        bench_args.write_record(Path(args.out), rows)


if __name__ == "__main__":
    main()
