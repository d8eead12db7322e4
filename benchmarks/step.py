"""The whole draft-plus-verify step, every way we can run it, side by side in one run:

    python benchmarks/step.py --preset tiny --buckets 1,4,16,64 --out DIR
    python benchmarks/step.py --dry-run --out DIR        # CPU: tiny, one bucket, no timing

synth checkpoint (or reuse --work) -> build_engine for the buckets -> Engine.load (its CUDA
graphs) -> per case ("mixed": random greedy and sampled rows; "greedy": every row greedy), every
state row prefilled with a random request, the state snapshotted -> per bucket B (rows 0..B-1,
all live):
  - the router's top-k ids of one eager reference step -> the byte floor (step_floor.py);
  - variants: `eager` (models/step.py DraftVerifyStep called eagerly), `eager-graph` (the same
    captured in one CUDA graph), `compile-graph` (torch.compile of it, captured in one graph;
    compile seconds recorded, skipped past --compile-budget-s), `engine` (the bucket's captured
    program), `engine-greedy` (its greedy variant; "greedy" case only), `engine-batch-dependent`
    (the same program captured with kernels/invariance.py batch_dependent_plans(): the price of
    batch invariance, against `engine` in the same run);
  - per variant: median / p10 / p90 µs over --replays replays, the state restored (and L2
    flushed) before each one outside the timed region; kernel launches of one replay from
    torch.profiler (CUPTI), split into dspark:: / Inductor / library / aten kernels, plus the
    graph's kernel-node count from the driver where the graph is ours; ratio to the floor;
  - per layer (layers.N, mtp.N, head, sampler, ...): the engine's program and the exported
    reference step run uncaptured through an fx Interpreter that wraps each node in
    record_function(<its layer>), each kernel attributed to its range.
-> JSON (rewritten after every row, "complete": false until the end), CSV, plot, a table.

`--dry-run` runs the same code on the CPU without timing: every variant once, launches
replaced by the aten / dspark ops the profiler sees, the floor, the JSON.

The parts: bench_setup.py (device, checkpoint and engine under --work, output directory),
step_floor.py (the byte floor), step_variants.py (how each variant runs one step, the compile
budget, replay timing), step_launches.py (what a step launches, per layer); this file is the
run that ties them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import step_floor  # noqa: E402
# the parts of the benchmark, in the order a run uses them; names re-exported for the other
# benchmarks (prefill.py, host_overhead.py) that import them from here
from bench_setup import _default_out, bench_device, setup_engine  # noqa: E402,F401
from step_launches import (LABEL, _counts, _sync, dspark_kernel_names,  # noqa: E402,F401
                           graph_kernel_nodes, per_layer, profile_launches)
from step_variants import (Runner, Skipped, _cpu_copy_bandwidth,  # noqa: E402,F401
                           _l2_flusher, make_runner, time_runner)

VARIANTS = ("eager", "eager-graph", "compile-graph", "engine", "engine-greedy",
            "engine-batch-dependent")
CASES = {"mixed": "random", "greedy": "greedy"}   # case -> prefill_random_requests mix
SCHEMA = "dspark-step-benchmark/1"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=("tiny", "flash-slice"))
    p.add_argument("--buckets", default="1,4,16,64",
                   help="batch buckets (all rows live); --dry-run uses the first")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--cases", default="mixed,greedy", help="comma-separated subset of mixed,greedy")
    p.add_argument("--replays", type=int, default=30, help="timed replays per variant and bucket")
    p.add_argument("--warmup", type=int, default=3, help="untimed replays before them")
    p.add_argument("--compile-budget-s", type=float, default=900.0,
                   help="seconds one bucket's torch.compile may take (enforced with SIGALRM in "
                        "the main thread); over it the variant is skipped with the reason")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="positions per request (default 256; --dry-run 64)")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="random prompt lengths 1..this (default 64; --dry-run 12)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float64"),
                   help="compute dtype (default bfloat16; --dry-run float32)")
    p.add_argument("--per-layer", default="all", choices=("all", "smallest", "none"),
                   help="buckets that get the per-layer attribution (an export of the reference "
                        "step each: ~10-30 s)")
    p.add_argument("--backend", default=None, choices=("inductor", "aten"),
                   help="the engine's --backend (default: the build's, inductor on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None,
                   help="directory for the checkpoint and engine, reused when they match "
                        "(default: a temporary directory, deleted at the end)")
    p.add_argument("--out", default=None,
                   help="output directory (default benchmarks/results/<device>_step_<date>/)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny, one bucket, no timing")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--git-commit", default=None, help="when the machine has no .git")
    a = p.parse_args(argv)
    a.buckets = sorted({int(b) for b in a.buckets.split(",") if b.strip()})
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    a.cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [v for v in a.variants if v not in VARIANTS] + [c for c in a.cases if c not in CASES]
    if bad or not a.buckets or a.buckets[0] < 1:
        p.error(f"unknown variants/cases {bad} or bad buckets {a.buckets}")
    if a.dry_run:
        a.preset, a.buckets = "tiny", a.buckets[:1]
    a.dtype = a.dtype or ("float32" if a.dry_run else "bfloat16")
    a.max_seq_len = a.max_seq_len or (64 if a.dry_run else 256)
    # prompts up to 64 tokens put the SWA rings (window 128 at Flash dims, 8 tiny) and the C4 /
    # C128 compressed caches part-way full; the dry run keeps its prefill short
    a.max_prompt_len = a.max_prompt_len or (12 if a.dry_run else 64)
    return a


def prefill_case(eng, case: str, args) -> dict:
    """Every state row holds a fresh random request of the case's mix; returns the snapshot."""
    from dspark_compile.models.random_requests import prefill_random_requests
    from dspark_compile.models.state import snapshot_state
    for t in eng.state.values():      # as allocated: no entry left from the other case
        t.zero_()
    with torch.no_grad():
        prefill_random_requests(eng.model, eng.state, range(eng.cache.max_rows), args.seed,
                                eng.cache.max_step_tokens, max_prompt_len=args.max_prompt_len,
                                mix=CASES[case])
    _sync(eng.device)
    return snapshot_state(eng.state)


TABLE = ["case", "B", "variant", "status", "us_median", "us_p10", "us_p90", "launches_total",
         "launches_dspark", "launches_inductor", "launches_library", "launches_aten",
         "floor_us", "ratio_to_floor", "compile_s"]


def main(argv=None) -> int:
    args = _args(argv)
    args.device = bench_device(args)
    if args.device is None:
        return 1
    log = lambda s: print(s, flush=True)  # noqa: E731
    from dspark_compile.models.state import restore_state
    from dspark_compile.models.step import DraftVerifyStep
    from dspark_compile.build.pipeline import export_step

    env = harness.environment(args.git_commit)
    out = Path(args.out) if args.out else _default_out(env.get("device") or "cpu")
    out.mkdir(parents=True, exist_ok=True)
    rec = {"schema": SCHEMA, "complete": False, "dry_run": args.dry_run, "environment": env,
           "preset": args.preset, "dtype": args.dtype, "buckets": args.buckets,
           "max_seq_len": args.max_seq_len, "max_prompt_len": args.max_prompt_len,
           "variants": args.variants, "cases": args.cases, "replays": args.replays,
           "warmup": args.warmup, "compile_budget_s": args.compile_budget_s,
           "launch_counting": ("ops: top-level aten/dspark ops in torch.profiler (CPU)"
                               if args.dry_run else
                               "kernels: CUDA events torch.profiler (CUPTI) records over one call"),
           "rows": [], "floors": {}, "per_layer": {}, "kernel_names": {},
           "kernel_us": {}}

    def write():
        (out / "step.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")

    tmp = None
    work = Path(args.work) if args.work else Path(tmp := tempfile.mkdtemp(prefix="step_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        dspark = set(dspark_kernel_names())
        rec["dspark_kernel_names"] = sorted(dspark)
        eng, rec["setup"] = setup_engine(args, work, log)
        dev = eng.device
        rec["max_rows"] = eng.cache.max_rows
        rec["backend"] = eng.backend
        rec["compile_seconds"] = eng.manifest.get("compiled", {}).get("compile_seconds")
        rec["copy_bandwidth"] = (harness.measure_copy_bandwidth() if dev.type == "cuda"
                                 else _cpu_copy_bandwidth())
        bw = rec["copy_bandwidth"]["bytes_per_s"]
        step = DraftVerifyStep(eng.model).eval()
        ctx = {"engine": eng, "step": step, "state": eng.state, "device": dev,
               "compile_budget_s": args.compile_budget_s, "flush": _l2_flusher(dev),
               "rows": {B: torch.arange(B, device=dev) for B in args.buckets}}
        runners: dict = {}
        ref_programs: dict = {}   # bucket -> the exported reference step's module (per layer)
        layer_buckets = {"all": args.buckets, "smallest": args.buckets[:1], "none": []}[args.per_layer]
        compile_over = None     # once one bucket's compile is skipped, larger ones are too
        write()
        for case in args.cases:
            t = time.perf_counter()
            snap = prefill_case(eng, case, args)
            log(f"[prefill] case {case}: {eng.cache.max_rows} rows in {time.perf_counter() - t:.1f}s")
            ctx["restore"] = restore = lambda snap=snap: restore_state(eng.state, snap)
            for B in args.buckets:
                key = f"{case}/B{B}"
                rows_list = list(range(B))
                restore()
                with torch.no_grad(), step_floor.record_routing(eng.model) as routing:
                    _, num = step(ctx["rows"][B], eng.state)
                tokens_per_row = float(num.double().mean())
                restore()
                log(f"[eager] {key}: routing recorded")
                floor = step_floor.byte_floor(eng.model, eng.state, rows_list, routing)
                floor["us"] = floor["bytes"] / bw * 1e6
                rec["floors"][key] = floor
                log(f"[floor] {key}: {floor['bytes'] / 1e6:.2f} MB -> {floor['us']:.2f} us")
                for v in args.variants:
                    if v == "engine-greedy" and case != "greedy":
                        continue
                    row = {"name": f"{args.preset} {case}", "case": case, "B": B, "variant": v,
                           "tokens_per_row_step": tokens_per_row, "floor_bytes": floor["bytes"],
                           "floor_us": floor["us"]}
                    try:
                        if v == "compile-graph" and compile_over:
                            raise Skipped(compile_over)
                        if (v, B) not in runners:
                            t = time.perf_counter()
                            runners[(v, B)] = make_runner(v, B, ctx)
                            row["setup_s"] = round(time.perf_counter() - t, 2)
                        r = runners[(v, B)]
                        row.update(r.info)
                        restore()
                        times: dict = {}
                        with torch.no_grad():
                            names = profile_launches(r.call, dev, times)
                        restore()
                        row.update({f"launches_{k}": n for k, n in _counts(names, dspark).items()})
                        rec["kernel_names"][f"{key}/{v}"] = dict(sorted(
                            {n: names.count(n) for n in set(names)}.items()))
                        if times:
                            rec["kernel_us"][f"{key}/{v}"] = dict(sorted(
                                ((n, round(t, 2)) for n, t in times.items()),
                                key=lambda kv: -kv[1]))
                        if r.graph is not None:
                            row["graph_nodes"] = graph_kernel_nodes(r.graph)
                        if dev.type == "cuda":
                            row.update(time_runner(r, ctx, args.replays, args.warmup))
                            row["ratio_to_floor"] = row["us_median"] / floor["us"]
                        else:
                            row["us_median"] = None     # dry run: no timing
                        row["status"] = "ok"
                    except Skipped as e:
                        row.update(status="skipped", reason=str(e))
                        if v == "compile-graph":
                            compile_over = f"bucket {B}: {e}"
                    except Exception as e:  # noqa: BLE001 -- one variant's failure is a result
                        traceback.print_exc()
                        row.update(status="skipped", reason=f"{type(e).__name__}: {str(e)[:300]}")
                        _sync(dev)
                    restore()
                    rec["rows"].append(row)
                    write()
                    log(f"[{key}] {v}: {row['status']} "
                        + (f"{row['us_median']:.1f} us " if row.get("us_median") else "")
                        + (f"launches {row.get('launches_total')}" if row["status"] == "ok"
                           else row.get("reason", "")))
                if B in layer_buckets:
                    layers = {}
                    t = time.perf_counter()
                    if B not in ref_programs:   # the same program for both cases
                        ep = export_step(eng.model, eng.state, B)
                        ep.example_inputs = None
                        ref_programs[B] = ep.module()
                        del ep
                    progs = {"reference": ref_programs[B]}
                    if any(v.startswith("engine") for v in args.variants):
                        progs["engine"] = eng.modules[B]
                        if case == "greedy" and B in eng.greedy_modules:
                            progs["engine-greedy"] = eng.greedy_modules[B]
                    for name, gm in progs.items():
                        restore()
                        try:
                            layers[name] = per_layer(gm, ctx["rows"][B], eng.state, dev, dspark)
                        except Exception as e:  # noqa: BLE001
                            traceback.print_exc()
                            layers[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    restore()
                    del progs
                    rec["per_layer"][key] = layers
                    log(f"[per-layer] {key} in {time.perf_counter() - t:.1f}s: "
                        + ", ".join(f"{n} {sum(c.get('total', 0) for c in d.values() if isinstance(c, dict))}"
                                    for n, d in layers.items()))
                    write()
            # graphs of the last case are kept (they are valid for the next case: same state
            # tensors, restored in place)
        rec["complete"] = True
    finally:
        write()
        if tmp:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)

    harness.write_csv(str(out / "step.csv"), rec["rows"])
    msg = harness.write_plot(str(out / "step.png"), [r for r in rec["rows"] if r.get("us_median")],
                             x="B", y="us_median") if not args.dry_run else "dry run: no plot"
    print(f"\n{env.get('device')}  torch {env['torch']}  triton {env['triton']}  "
          f"commit {env['git_commit'][:12]}  {env['date_utc']}  copy "
          f"{rec['copy_bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s")
    print(harness.format_table(rec["rows"], TABLE))
    print(msg)
    print(f"written: {out / 'step.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
