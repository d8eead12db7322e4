"""Cold and warm start of an engine: `Engine.load` (validation, programs, weights, CUDA-graph
capture of every bucket and greedy variant, prefill graphs) in fresh processes, with and without
the engine's stored kernels (dspark_compile/kernel_store.py):

    python benchmarks/load_time.py --engine ENGINE [--build CKPT --buckets 1,2,4,...] --out DIR

Each case is one fresh Python process, so nothing compiled or loaded earlier is in memory:
- `cold-store`: an empty Triton cache, the engine's kernels required (what a fresh machine
  gets);
- `cold`: an empty Triton cache, the store ignored: every kernel compiles (minutes);
- `warm`: this machine's own Triton cache (filled by the build), the store ignored.
Per case: the process's wall time from start to a loaded engine (imports included), the load's
own phases (Engine.load_seconds, capture seconds per bucket), and the Triton kernels compiled
(kernel_store.compiles(): zero is the target with a matching store). `--profile` writes the
cumulative cProfile table of the first case. `--build CKPT` builds the engine first (CUDA,
aten backend, the given buckets and prefill chunks).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# name -> (kernels policy, Triton cache: "fresh" (empty) or "user" (this machine's own))
CASES = {"cold-store": ("require", "fresh"), "cold": ("ignore", "fresh"), "warm": ("ignore", "user")}

_CHILD = r"""
import cProfile, io, json, pstats, sys, time
t0 = time.perf_counter()
engine, cache, policy, profile = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
from triton import knobs
if cache != "user":
    knobs.cache.dir = cache
import torch
from dspark_compile import kernel_store
from dspark_compile.runtime import Engine
kernel_store.activate()                  # count compiles also when the store is ignored
t_import = time.perf_counter() - t0
prof = cProfile.Profile() if profile != "-" else None
if prof: prof.enable()
eng = Engine.load(engine, kernels=policy)
torch.cuda.synchronize()
if prof:
    prof.disable()
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
    open(profile, "w").write(s.getvalue())
print(json.dumps({"wall_s": time.perf_counter() - t0, "import_s": t_import,
                  "load_s": eng.load_seconds,
                  "capture_s": {str(b): s for b, s in eng.capture_seconds.items()},
                  "prefill_capture_s": ({str(c): s for c, s in
                                         eng.prefill_programs.capture_seconds.items()}
                                        if eng.prefill_programs is not None else {}),
                  "compiles": kernel_store.compiles(), "store_hits": kernel_store.store_hits(),
                  "buckets": eng.buckets, "greedy": sorted(eng.greedy_graphs)}))
"""


def run_case(engine: Path, cache: Path, policy: str, profile: str = "-") -> dict:
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _CHILD, str(engine), str(cache), policy, profile],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"load ({policy}) failed: {res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t
    return out


def build(ckpt: str, engine: Path, buckets: list[int], chunks: list[int], dtype: str,
          max_seq_len: int) -> float:
    from dspark_compile.build_config import BuildConfig
    from dspark_compile.trace import build_engine
    t = time.perf_counter()
    build_engine(ckpt, engine, BuildConfig(buckets=tuple(buckets), max_seq_len=max_seq_len,
                                           dtype=dtype, device="cuda", backend="aten",
                                           prefill_chunks=tuple(chunks)),
                 log=lambda m: print(m, flush=True))
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory (built by --build if given)")
    p.add_argument("--build", metavar="CKPT", help="build the engine from this checkpoint first")
    p.add_argument("--buckets", default="1,2,4,8,16,32,64")
    p.add_argument("--prefill-chunks", default="64,512")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--out", default=None, help="folder for load_time.json (and the profile)")
    p.add_argument("--profile", action="store_true", help="cProfile the first case")
    p.add_argument("--cases", default="cold-store,warm",
                   help=f"comma-separated, from {list(CASES)} (default cold-store,warm)")
    args = p.parse_args(argv)
    import harness
    engine = Path(args.engine)
    result = {"environment": harness.environment(), "engine": str(engine)}
    if args.build:
        result["build_s"] = build(args.build, engine, [int(b) for b in args.buckets.split(",")],
                                  [int(c) for c in args.prefill_chunks.split(",") if c],
                                  args.dtype, args.max_seq_len)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            policy, where = CASES[name]
            cache = Path(tmp) / f"cache{i}" if where == "fresh" else "user"
            prof = str(out / "load_profile.txt") if (out and args.profile and i == 0) else "-"
            r = run_case(engine, cache, policy, prof)
            r["case"] = name
            rows.append(r)
            print(f"{name:<22} process {r['process_s']:6.1f}s  load {r['load_s']:6.1f}s  "
                  f"capture {sum(r['capture_s'].values()):6.1f}s  compiles {r['compiles']:4d}  "
                  f"store hits {r['store_hits']}", flush=True)
    result["cases"] = rows
    if out:
        (out / "load_time.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
