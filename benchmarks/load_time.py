"""Cold and warm start of an engine: `Engine.load` (validation, programs, weights, CUDA-graph
capture of every bucket and greedy variant, prefill graphs) in fresh processes, with and without
the engine's stored kernels (dspark_compile/engine_dir/kernel_store.py):

    python benchmarks/load_time.py --engine ENGINE [--build CKPT --buckets 1,2,4,...] --out DIR

Each case is one fresh Python process, so nothing compiled or loaded earlier is in memory:
- `cold-store`: an empty Triton cache, the engine's kernels required (what a fresh machine
  gets): the kernels come from the engine's store, and Triton's launcher module (host code,
  never stored in an engine) is built here with the C compiler into that cache;
- `cold-store-again`: the same, in the Triton cache the last `cold-store` case left (which then
  holds the launcher module and nothing else): `cold-store` minus this case is what building the
  launcher on the loading machine costs a cold load;
- `cold`: an empty Triton cache, the store ignored: every kernel compiles (minutes);
- `warm`: this machine's own Triton cache (filled by the build), the store ignored.
Per case: the process's wall time from start to a loaded engine (imports included), the load's
own phases (Engine.load_seconds, capture seconds per bucket), the Triton kernels compiled
(kernel_store.compiles(): zero is the target with a matching store), and the launcher modules
built with their C compiler seconds (kernel_store.launcher_builds(), `launcher_build_s`).
`--profile` writes the cumulative cProfile table of the first case. `--build CKPT` builds the
engine first (CUDA, aten backend, the given buckets and prefill chunks).

The launcher's cost on a GPU machine (an H100 or H200, the tiny model):

    dspark-compile synth --preset tiny --out /tmp/ck
    python benchmarks/load_time.py --engine /tmp/eng --build /tmp/ck --buckets 1,2,4 \
        --prefill-chunks 64 --cases cold-store,cold-store-again,warm --out /tmp/load_time
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
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)

# name -> (kernels policy, Triton cache: "fresh" (empty) or "user" (this machine's own))
# ("previous": the cache the last "fresh" case used)
CASES = {"cold-store": ("require", "fresh"), "cold-store-again": ("require", "previous"),
         "cold": ("ignore", "fresh"), "warm": ("ignore", "user")}

_CHILD = r"""
import cProfile, io, json, pstats, sys, time
t0 = time.perf_counter()
engine, cache, policy, profile = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
trust = sys.argv[5] == "trust"
from triton import knobs
if cache != "user":
    knobs.cache.dir = cache
import torch
import triton.runtime.build as triton_build
from dspark_compile.engine_dir import kernel_store
from dspark_compile.runtime.engine import Engine
kernel_store.activate()                  # count compiles also when the store is ignored
launcher_s = [0.0]
_build = triton_build._build     # the C compile of a launcher module (compile_module_from_src)
def _timed_build(*a, **k):
    t = time.perf_counter()
    try:
        return _build(*a, **k)
    finally:
        launcher_s[0] += time.perf_counter() - t
triton_build._build = _timed_build
t_import = time.perf_counter() - t0
prof = cProfile.Profile() if profile != "-" else None
if prof: prof.enable()
eng = Engine.load(engine, kernels=policy, trust_code=trust)
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
                  "launcher_builds": kernel_store.launcher_builds(),
                  "launcher_build_s": launcher_s[0],
                  "store_files_not_cubin_or_json": [n for n in kernel_store.store_files()
                                                    if not n.endswith((".cubin", ".json"))],
                  "buckets": eng.buckets, "greedy": sorted(k.size for k in eng.captured()
                                               if k.variant == "greedy")}))
"""


def run_case(engine: Path, cache: Path, policy: str, profile: str = "-",
             trust: bool = False) -> dict:
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _CHILD, str(engine), str(cache), policy, profile,
                          "trust" if trust else "-"], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"load ({policy}) failed: {res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t
    return out


def build(ckpt: str, engine: Path, buckets: list[int], chunks: list[int], dtype: str,
          max_seq_len: int) -> float:
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.build.pipeline import build_engine
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
    bench_args.add_buckets(p, "1,2,4,8,16,32,64")
    p.add_argument("--prefill-chunks", default="64,512")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--out", default=None, help="folder for load_time.json (and the profile)")
    p.add_argument("--profile", action="store_true", help="cProfile the first case")
    p.add_argument("--cases", default="cold-store,cold-store-again,warm",
                   help=f"comma-separated, from {list(CASES)} (default "
                        "cold-store,cold-store-again,warm)")
    p.add_argument("--trust-engine-code", action="store_true",
                   help="load an --backend inductor engine (its compiled/ Python runs)")
    args = p.parse_args(argv)
    import harness
    engine = Path(args.engine)
    result = {"environment": harness.environment(), "engine": str(engine)}
    if args.build:
        result["build_s"] = build(args.build, engine, args.buckets,
                                  [int(c) for c in args.prefill_chunks.split(",") if c],
                                  args.dtype, args.max_seq_len)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    if any(CASES[c][1] == "previous" and "fresh" not in [CASES[d][1] for d in names[:i]]
           for i, c in enumerate(names)):
        p.error("--cases: cold-store-again reuses the Triton cache of a cold-store or cold "
                "case before it")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        last_fresh = None
        for i, name in enumerate(names):
            policy, where = CASES[name]
            if where == "fresh":
                cache = last_fresh = Path(tmp) / f"cache{i}"
            else:
                cache = last_fresh if where == "previous" else "user"
            prof = str(out / "load_profile.txt") if (out and args.profile and i == 0) else "-"
            r = run_case(engine, cache, policy, prof, args.trust_engine_code)
            r["case"] = name
            rows.append(r)
            print(f"{name:<22} process {r['process_s']:6.1f}s  load {r['load_s']:6.1f}s  "
                  f"capture {sum(r['capture_s'].values()):6.1f}s  compiles {r['compiles']:4d}  "
                  f"store hits {r['store_hits']}  launchers built {r['launcher_builds']} "
                  f"({r['launcher_build_s']:.1f}s)", flush=True)
    result["cases"] = rows
    if out:
        (out / "load_time.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
