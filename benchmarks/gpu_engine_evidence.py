"""GPU engine evidence on the tiny model, in one run (no network access needed):

    python benchmarks/gpu_engine_evidence.py --out benchmarks/results/gpu_engine_<date>.json

synth tiny checkpoint -> build for every default bucket on the GPU -> Engine.load (CUDA-graph
capture, largest bucket first, one pool) -> per bucket:
  - capture seconds and graph-pool bytes (what the capture added to the shared pool),
  - replay == uncaptured program on the same state copy, with a padded batch (bucket - 1 live
    rows scattered over the state, the trash row among them): tokens, counts, whole state,
  - median / p10 / p90 step time over `--replays` graph replays with every row live (CUDA
    events around the replay alone; the state is restored before each replay, outside the
    timed region, so every replay decodes from the same positions),
-> greedy generation through the graphs checked lossless against target-only greedy decoding
(a divergence is reported with its logit margin; one whose relative margin is below 1e-3 is a
near-tie) -> JSON (device, driver, torch/triton/CUDA versions, git commit, date, build/load
times, per-bucket rows) and a printed table.

`--device cpu` runs the same flow without graphs (timing with perf_counter), as a smoke test
of this script; `--engine DIR` reuses an engine built earlier on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402

from dspark_compile.models.state import restore_state as _restore  # noqa: E402
from dspark_compile.models.state import snapshot_state as _snapshot  # noqa: E402
from dspark_compile.engine_dir.build_config import DEFAULT_BUCKETS  # noqa: E402
from dspark_compile.engine_dir.format import STEP, ProgramKey  # noqa: E402

NEAR_TIE = 1e-3
MAX_ROWS = 64
SEQ = 256


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--device", default="cuda")
    bench_args.add_buckets(p, ",".join(map(str, DEFAULT_BUCKETS)))
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32", "float64"))
    p.add_argument("--replays", type=int, default=50, help="timed replays per bucket")
    p.add_argument("--work", default=None, help="directory for the checkpoint and engine "
                   "(default: a temporary directory, deleted at the end)")
    p.add_argument("--engine", default=None, help="use this engine instead of building one")
    bench_args.add_git_commit(p)
    return p.parse_args(argv)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_rows(eng, seed: int = 0) -> None:
    """Every state row holds a live request: mixed prompt lengths and sampling settings."""
    from dspark_compile.models.random_requests import prefill_random_requests
    prefill_random_requests(eng.model, eng.state, range(eng.cache.max_rows), seed,
                            eng.cache.max_step_tokens, max_prompt_len=30)


def _all_greedy(eng) -> None:
    eng.state["row.temperature"].zero_()


def replay_vs_program(eng, bucket: int, seed: int, variant: str = "full") -> dict:
    """The same state copy run by the uncaptured program and by the graph replay (a padded
    batch); leaves the state as it was. variant "greedy": every row made greedy first, both
    runs use the bucket's greedy variant."""
    rng = random.Random(seed)
    n_live = max(1, bucket - 1)
    rows = rng.sample(range(eng.cache.max_rows), n_live)
    if bucket > 1:
        rows.insert(rng.randrange(n_live + 1), eng.trash)
    snap = _snapshot(eng.state)
    if variant == "greedy":
        _all_greedy(eng)
    before = _snapshot(eng.state)
    t_p, n_p = eng.run_step(rows, use_graph=False, bucket=bucket, variant=variant)
    after = _snapshot(eng.state)
    _restore(eng.state, before)
    t_g, n_g = eng.run_step(rows, use_graph=True, bucket=bucket, variant=variant)
    # every row but the trash row (garbage by design); float tensors may differ in reduction
    # order (the sampler compacts candidates with atomics): recorded, and checked close.
    differ, close = [], []
    for k, v in eng.state.items():
        x, y = v[:eng.trash], after[k][:eng.trash]
        if not torch.equal(x, y):
            differ.append(k)
            if x.is_floating_point() and x.element_size() > 1 and torch.allclose(
                    x, y, rtol=1e-5, atol=1e-6):
                close.append(k)
    pad = [i for i, r in enumerate(rows) if r == eng.trash]
    outputs_equal = bool(torch.equal(t_p, t_g) and torch.equal(n_p, n_g))
    rec = {"live_rows": n_live, "padded_rows": len(pad),
           "replay_equal": outputs_equal and set(differ) <= set(close),
           "outputs_bit_equal": outputs_equal,
           "state_bit_equal": not differ,
           "state_tensors_differing": differ,
           "padding_inert": bool((n_g[pad] == 0).all() and (t_g[pad] == -1).all())}
    _restore(eng.state, snap)
    return rec


def time_bucket(eng, bucket: int, replays: int, variant: str = "full",
                all_greedy: bool = False) -> dict:
    """Step time with every row of the bucket live; state restored before each replay.
    all_greedy: every row made greedy first; variant "greedy" (implies it): the bucket's
    greedy variant replayed."""
    rows = list(range(bucket))
    snap = _snapshot(eng.state)
    key = ProgramKey(STEP, bucket, "greedy" if variant == "greedy" else "full")
    g = eng.program(key).graph if eng.has(key) else None
    if all_greedy or variant == "greedy":
        _all_greedy(eng)
    work = _snapshot(eng.state)
    use_graph = g is not None
    times = []
    if use_graph:
        g.rows.copy_(torch.tensor(rows, dtype=torch.int64))
        for i in range(replays + 3):
            _restore(eng.state, work)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.graph.replay()
            b.record()
            b.synchronize()
            if i >= 3:                       # first replays: warm-up
                times.append(a.elapsed_time(b) * 1e3)
        accepted = g.out_num[:bucket].float().mean().item()
    else:
        for i in range(replays + 1):
            _restore(eng.state, work)
            t = time.perf_counter()
            _, num = eng.run_step(rows, use_graph=False, bucket=bucket, variant=variant)
            _sync(eng.device)
            if i >= 1:
                times.append((time.perf_counter() - t) * 1e6)
        accepted = num.float().mean().item()
    _restore(eng.state, snap)
    q = harness.quantiles(times)
    return {"method": "graph-replay/cuda-events" if use_graph else "program/perf_counter",
            "replays": len(times), **q, "us_per_row": q["us_median"] / bucket,
            "tokens_per_row_step": accepted}


def lossless(eng, seed: int = 7) -> dict:
    from dspark_compile.runtime.lossless import check_lossless
    from dspark_compile.models.request import SamplingParams

    rng = random.Random(seed)
    V = eng.cfg.vocab_size
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (1, 4, 9, 17, 30, 45, 60, 12, 3)]
    params = [SamplingParams(max_new_tokens=n) for n in (40, 32, 24, 48, 16, 40, 30, 8, 1)]
    t = time.perf_counter()
    res = eng.generate(prompts, params)
    seconds = time.perf_counter() - t
    reports = []
    for i, (p, sp, out) in enumerate(zip(prompts, params, res.tokens)):
        r = check_lossless(eng.model, [p], [sp], [out], device=eng.device)
        reports.append({"request": i, "ok": r.ok, "line": r.line(),
                        "relative_margin": None if r.ok else r.relative_margin})
    exact = sum(r["ok"] for r in reports)
    near = all(r["ok"] or r["relative_margin"] < NEAR_TIE for r in reports)
    return {"requests": len(prompts), "exact": exact, "all_exact_or_near_tie": near,
            "steps": res.steps, "generate_seconds": seconds,
            "mean_accepted_length": res.mean_accepted_length,
            "acceptance_per_position": res.acceptance_per_position, "reports": reports}


def main(argv=None) -> int:
    args = _args(argv)
    from dspark_compile.factory.synth import synth_checkpoint
    from dspark_compile.runtime.engine import Engine
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.build.pipeline import build_engine

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (use --device cpu for a smoke run)",
              file=sys.stderr)
        return 1
    buckets = tuple(args.buckets)
    rec = {"environment": harness.environment(args.git_commit), "device_arg": str(device),
           "dtype": args.dtype, "buckets": list(buckets), "max_rows": MAX_ROWS, "max_seq_len": SEQ}
    with bench_args.work_dir(args, "gpu_engine_") as work:
        if args.engine:
            engine_dir = Path(args.engine)
        else:
            t = time.perf_counter()
            ckpt = synth_checkpoint("tiny", work / "ckpt", seed=0, overwrite=True)
            rec["synth_seconds"] = time.perf_counter() - t
            engine_dir = work / "engine"
            t = time.perf_counter()
            manifest = build_engine(ckpt, engine_dir, BuildConfig(
                buckets=buckets, max_rows=MAX_ROWS, max_seq_len=SEQ, dtype=args.dtype,
                device=str(device)), log=lambda s: print(s, flush=True))
            rec["build_seconds"] = time.perf_counter() - t
            rec["pass_stats_largest_bucket"] = manifest["pass_stats"][str(max(buckets))]
        t = time.perf_counter()
        eng = Engine.load(engine_dir, device=device, trust_code=True)  # an engine of this checkout
        rec["load_seconds"] = time.perf_counter() - t
        print(f"[load] {engine_dir} on {eng.device} in {rec['load_seconds']:.1f}s; graphs "
              f"{[str(k) for k in eng.captured()]}", flush=True)
        rec["graph_pool_total_bytes"] = sum(eng.graph_pool_bytes.values())
        if device.type == "cuda":
            rec["cuda_memory_reserved_bytes"] = torch.cuda.memory_reserved(eng.device)
        prefill_rows(eng)
        rows = []
        for b in eng.buckets:
            row = {"bucket": b, "capture_s": eng.capture_seconds.get(b),
                   "pool_bytes": eng.graph_pool_bytes.get(b)}
            row.update(replay_vs_program(eng, b, seed=b))
            row.update(time_bucket(eng, b, args.replays))
            if eng.has(ProgramKey(STEP, b, "greedy")):
                g = replay_vs_program(eng, b, seed=b, variant="greedy")
                row["greedy_variant_replay_equal"] = g["replay_equal"]
                row["greedy_variant_padding_inert"] = g["padding_inert"]
                # an all-greedy batch: the full program vs the greedy variant
                row["us_median_all_greedy_full"] = time_bucket(
                    eng, b, args.replays, "full", all_greedy=True)["us_median"]
                row["us_median_greedy_variant"] = time_bucket(
                    eng, b, args.replays, "greedy")["us_median"]
            rows.append(row)
            print(f"[bucket {b}] replay_equal={row['replay_equal']} median "
                  f"{row['us_median']:.1f} us", flush=True)
        rec["buckets_detail"] = rows
        rec["lossless"] = lossless(eng)
        rec["manifest_runtime_load"] = json.loads(
            (engine_dir / "manifest.json").read_text()).get("runtime_load")

    out = Path(args.out)
    bench_args.write_record(out, rec)
    env = rec["environment"]
    print(f"\n{env.get('device')}  torch {env['torch']}  triton {env['triton']}  "
          f"commit {env['git_commit'][:12]}  {env['date_utc']}")
    print(f"build {rec.get('build_seconds', float('nan')):.1f}s  load+capture "
          f"{rec['load_seconds']:.1f}s  pool {rec['graph_pool_total_bytes'] / 2**20:.1f} MiB")
    print(harness.format_table(rows, ["bucket", "capture_s", "pool_bytes", "replay_equal",
                                      "state_bit_equal", "padding_inert", "us_median", "us_p10",
                                      "us_p90", "us_per_row", "tokens_per_row_step",
                                      "greedy_variant_replay_equal", "us_median_all_greedy_full",
                                      "us_median_greedy_variant"]))
    ll = rec["lossless"]
    print(f"lossless: {ll['exact']}/{ll['requests']} exact, all exact or near-tie: "
          f"{ll['all_exact_or_near_tie']}; mean accepted length {ll['mean_accepted_length']:.2f}")
    for r in ll["reports"]:
        if not r["ok"]:
            print(f"  request {r['request']}: {r['line']}")
    print(f"written: {out}")
    ok = all(r["replay_equal"] and r["padding_inert"]
             and r.get("greedy_variant_replay_equal", True)
             and r.get("greedy_variant_padding_inert", True) for r in rows) \
        and ll["all_exact_or_near_tie"]
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
