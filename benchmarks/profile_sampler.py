"""Where the sampler's time goes: per-kernel CUDA time of the fused Markov sampler and the
rejection sampler at Flash dims (benchmarks/sampler_cases.py inputs), one line per kernel.

    python benchmarks/profile_sampler.py --out benchmarks/results/<dir>/profile.json

Complements benchmarks/kernel_bench.py (which times whole ops by CUDA-graph replay against eager and
torch.compile): this one answers "which launch is over its share" with torch.profiler, after a
warm-up, averaging `--calls` eager calls. Kernel times here exclude launch gaps, so their sum
is a lower bound of the graph-replay time; the difference is what launches cost.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402
import sampler_cases as sc  # noqa: E402


def _ops(kw=None):
    """op name -> (inputs maker per B, call). `kw`: SamplerPlan fields (an A/B's variant): the
    calls then go to the launchers, under PLAN with those fields, instead of the registered ops."""
    from dspark_compile.kernels.sampling import markov as ms
    from dspark_compile.kernels.sampling import rejection as rj
    from dspark_compile.kernels.sampling.plan import PLAN
    kw = kw or {}

    def markov(mode="full"):
        if kw:
            return lambda d: ms.markov_sample_launch(**d, plan=PLAN.replace(mode=mode, **kw))
        return lambda d: torch.ops.dspark.markov_sample(**d, mode=mode)

    def rejection(mode="full"):
        if kw:
            return lambda d: rj.rejection_sample_launch(**d, plan=PLAN.replace(mode=mode, **kw))
        return lambda d: torch.ops.dspark.rejection_sample(**d, mode=mode)

    mk = sc._markov_inputs
    return {
        "markov_greedy/mode=greedy": (lambda B: mk(B, 0.0, 1.0), markov("greedy")),
        "markov_greedy/full": (lambda B: mk(B, 0.0, 1.0), markov()),
        "markov_topp": (lambda B: mk(B, 1.0, sc.TOP_P), markov()),
        "markov_topp_peaked": (lambda B: mk(B, 1.0, sc.TOP_P, peaked=True), markov()),
        "rejection_topp": (lambda B: sc._rejection_inputs(B, 1.0, sc.TOP_P, False), rejection()),
        "rejection_topp_peaked": (lambda B: sc._rejection_inputs(B, 1.0, sc.TOP_P, False,
                                                                 peaked=True), rejection()),
        "rejection_greedy": (lambda B: sc._rejection_inputs(B, 0.0, 1.0, True), rejection()),
        "rejection_greedy/mode=greedy": (lambda B: sc._rejection_inputs(B, 0.0, 1.0, True),
                                         rejection("greedy")),
    }


def _launch_kw(text: str) -> dict:
    """--launch-kw JSON object -> launcher keyword arguments (JSON lists become tuples, as the
    launchers' config knobs take them)."""
    try:
        kw = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"--launch-kw must be a JSON object: {e}")
    if not isinstance(kw, dict):
        raise SystemExit(f"--launch-kw must be a JSON object, got {text!r}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}


def profile(fn, d, calls):
    from torch.profiler import ProfilerActivity, profile as tprof
    for _ in range(3):
        fn(d)
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(d)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    seq = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("(")[0][:60]
            t = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            per[name][0] += t
            per[name][1] += 1
            seq.append((e.time_range.start, name, t))
    rows = [{"kernel": k, "us_per_call": t / calls, "launches_per_call": n / calls}
            for k, (t, n) in per.items()]
    rows.sort(key=lambda r: -r["us_per_call"])
    # the last call's launches in issue order: which refinement pass, which step, costs what
    seq.sort()
    n = round(sum(r["launches_per_call"] for r in rows))
    last = [{"kernel": k, "us": t} for _, k, t in seq[-n:]]
    return rows, last


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=bench_args.ordered_ints, default="1,64")
    p.add_argument("--ops", default=",".join(_ops()))
    p.add_argument("--calls", type=int, default=5)
    bench_args.add_git_commit(p)
    p.add_argument("--sequence", action="store_true", help="also print the last call's launches "
                   "in order (always in the json)")
    p.add_argument("--launch-kw", default="", help='SamplerPlan fields as JSON, e.g. '
                   '\'{"greedy_config": [64, 4, 3, 2], "pdl": false}\' (an A/B variant)')
    a = p.parse_args(argv)
    kw = _launch_kw(a.launch_kw)
    ops = _ops(kw)
    unknown = sorted(set(a.ops.split(",")) - set(ops))
    if unknown:
        raise SystemExit(f"--ops: unknown {unknown}; known: {sorted(ops)}")
    import dspark_compile.kernels.sampling  # noqa: F401  (registers the ops)
    res = {"environment": harness.environment(a.git_commit), "calls": a.calls,
           "launch_kw": {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()},
           "cases": []}
    dev = torch.device("cuda")
    for name in a.ops.split(","):
        make, fn = ops[name]
        for B in a.batches:
            rows, last = profile(fn, make(B)(dev, 0), a.calls)
            total = sum(r["us_per_call"] for r in rows)
            res["cases"].append({"op": name, "B": B, "kernel_us_total": total, "kernels": rows,
                                 "last_call": last})
            print(f"\n== {name} B={B}: kernel time {total:.1f} us/call, "
                  f"{sum(r['launches_per_call'] for r in rows):.0f} launches/call", flush=True)
            for r in rows[:12]:
                print(f"  {r['us_per_call']:9.1f} us  x{r['launches_per_call']:5.1f}  {r['kernel']}")
            if a.sequence:
                print("  last call, in order: " + ", ".join(
                    f"{r['kernel'].replace('_kernel', '')} {r['us']:.1f}" for r in last))
            with open(a.out, "w") as f:          # after every case: a timeout keeps what ran
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
