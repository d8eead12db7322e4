"""Host overhead of the streaming runtime: per bucket, the wall time of one GenerationStream
step() next to the bucket's graph replay alone.

    python benchmarks/host_overhead.py --preset tiny --buckets 1,64 --out DIR
    python benchmarks/host_overhead.py --engine ENGINE --buckets 1,16,64 --out DIR
    python benchmarks/host_overhead.py --dry-run --out DIR      # CPU: tiny, no timing claims

Per bucket B (all rows live, every request greedy unless --case mixed):
  - replay: B requests prefilled into rows 0..B-1, the state snapshotted; the bucket's graph
    (its greedy variant for an all-greedy batch) replayed --replays times, the state restored
    before each replay outside the timed region, CUDA events around the replay alone;
  - loop (--modes: overlap on, then off): B requests of --max-new-tokens through Engine.open_stream;
    wall time between consecutive step() returns over the steady steps (the call launched one
    program call of bucket B and no prefill, every request admitted), and the device time of
    each launch in the loop (CUDA events around the launch's copies and replay: a launch
    that waits on the host shows as wall above device time);
  - generate: Engine.generate of the same requests, wall time / scheduling iterations
    (prefill and the tail of finishing rows included).
  overhead = (loop wall per step - replay) / replay: the target is <= 5 % at B = 1 and B = 64.
-> JSON (host_overhead.json), CSV, a table.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402
from dspark_compile.engine_dir.format import STEP, ProgramKey  # noqa: E402
from bench_setup import begin, log, setup_engine  # noqa: E402

SCHEMA = "dspark-host-overhead/1"
TABLE = ["B", "mode", "replay_us", "wall_us", "device_us", "overhead_pct", "steady_steps",
         "generate_us_per_step"]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_args.add_preset(p)
    p.add_argument("--engine", default=None,
                   help="an engine directory to load (default: synth + build under --work)")
    bench_args.add_buckets(p, "1,64")
    p.add_argument("--case", default="greedy", choices=("greedy", "mixed"),
                   help="greedy: every request greedy (the greedy variants); mixed: alternate")
    p.add_argument("--prompt-len", type=int, default=8, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="per request (default: what max_seq_len leaves after the prompt)")
    p.add_argument("--modes", type=bench_args.names(("overlap", "serial")),
                   default="overlap,serial",
                   help="loops to time: overlap (step n + 1 launched before step n is read, the "
                        "CUDA default) and/or serial")
    p.add_argument("--replays", type=int, default=30)
    bench_args.add_max_seq_len(p)
    bench_args.add_dtype(p)
    bench_args.add_backend(p)
    bench_args.add_run_flags(p, "host_overhead", "CPU, tiny, no timing claims")
    a = p.parse_args(argv)
    if a.prompt_len < 1 or a.replays < 1 or (a.max_new_tokens is not None and a.max_new_tokens < 2):
        p.error("--prompt-len and --replays must be >= 1, --max-new-tokens >= 2")
    bench_args.dry_run_defaults(a, "dtype", "max_seq_len")
    a.variants = ["engine"]          # what setup_engine reads: capture the engine's graphs
    return a


def _requests(eng, B: int, args):
    from dspark_compile.models.config import step_lookahead
    from dspark_compile.models.request import SamplingParams
    rng = random.Random(args.seed + B)
    N = eng.cfg.dspark_block_size
    room = eng.cache.max_seq_len - args.prompt_len - step_lookahead(N)
    new = min(args.max_new_tokens or room, room)
    if new < 2:
        raise ValueError(f"--prompt-len {args.prompt_len} leaves no room for new tokens in the "
                         f"engine's max_seq_len={eng.cache.max_seq_len}")
    prompts = [[rng.randrange(eng.cfg.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(B)]
    params = [SamplingParams(max_new_tokens=new) if args.case == "greedy" or i % 2 == 0 else
              SamplingParams(max_new_tokens=new, temperature=1.0, top_p=0.95, seed=args.seed + i)
              for i in range(B)]
    return prompts, params


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_replay(eng, B: int, prompts, params, replays: int) -> dict:
    """The bucket's step alone, from the prefilled requests' state (restored before each)."""
    from dspark_compile.models.generate import set_row_sampling
    from dspark_compile.models.state import restore_state, snapshot_state
    rows = list(range(B))
    for r, p, sp in zip(rows, prompts, params):
        set_row_sampling(eng.state, r, sp)
        eng.prefill(r, p)
    greedy = eng.has(ProgramKey(STEP, B, "greedy")) and all(sp.temperature <= 0
                                                               for sp in params)
    key = ProgramKey(STEP, B, "greedy" if greedy else "full")
    g = eng.program(key).graph
    snap = snapshot_state(eng.state)
    times = []
    warm = 3 if g is not None else 0      # the program call has nothing to warm on the CPU
    for i in range(replays + warm):
        restore_state(eng.state, snap)
        if g is not None:
            g.rows.copy_(torch.tensor(rows, dtype=torch.int64))
            torch.cuda.synchronize(eng.device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.graph.replay()
            b.record()
            b.synchronize()
            us = a.elapsed_time(b) * 1e3
        else:                    # no graphs (CPU): the program call, waited for
            t = time.perf_counter()
            with torch.no_grad():
                eng.launch(rows, key).wait()
            us = (time.perf_counter() - t) * 1e6
        if i >= warm:
            times.append(us)
    restore_state(eng.state, snap)
    q = harness.quantiles(times)
    return {"replay_us": q["us_median"], "replay_p10_us": q["us_p10"],
            "replay_p90_us": q["us_p90"], "greedy_variant": greedy,
            "replay_method": "graph/cuda-events" if g is not None else "program/perf_counter"}


def time_loop(eng, B: int, prompts, params, overlap: bool) -> dict:
    """Wall per steady step() of an Engine.open_stream loop, and the device time of each launch
    in it (CUDA events around the launch)."""
    cuda = eng.device.type == "cuda"
    launch, marks = eng.launch, []

    def timed_launch(rows, key, use_graph=True):
        a = torch.cuda.Event(enable_timing=True) if cuda else None
        if a is not None:
            a.record()
        out = launch(rows, key, use_graph)
        e = None
        if a is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
        marks.append((key.size, a, e))
        return out
    eng.launch = timed_launch
    calls = []
    try:
        s = eng.open_stream(overlap=overlap)
        for p, sp in zip(prompts, params):
            s.add(p, sp)
        _sync(eng.device)
        last = time.perf_counter()
        while s.has_work:
            steps, prefill = eng.times.steps, len(s.waiting) + sum(
                1 for r in s.active.values() if r.status == "prefill")
            all_in = len(s.active) == B and not s.waiting
            s.step()
            now = time.perf_counter()
            calls.append({"wall_us": (now - last) * 1e6, "launches": eng.times.steps - steps,
                          "bucket": marks[-1][0] if marks else None, "steady": all_in
                          and not prefill and eng.times.steps - steps == 1})
            last = now
        s.close()
        _sync(eng.device)
    finally:
        del eng.launch               # the method again
    steady = [c for c in calls if c["steady"] and c["bucket"] == B]
    # the first steady call still reads the step launched with the prefills: skip it
    steady = steady[1:] if len(steady) > 2 else steady
    rec = {"steps": len(calls), "steady_steps": len(steady),
           "wall_us": statistics.median(c["wall_us"] for c in steady) if steady else None}
    dev = [a.elapsed_time(e) * 1e3 for b, a, e in marks if b == B and a is not None]
    rec["device_us"] = statistics.median(dev) if dev else None
    return rec


def time_generate(eng, prompts, params, overlap: bool) -> dict:
    _sync(eng.device)
    t = time.perf_counter()
    res = eng.generate(prompts, params, overlap=overlap)
    _sync(eng.device)
    wall = time.perf_counter() - t
    return {"generate_us_per_step": wall * 1e6 / max(res.steps, 1),
            "generate_steps": res.steps,
            "generate_tokens": sum(len(t) for t in res.tokens)}


def measure(eng, args, log) -> list[dict]:
    rows = []
    for B in args.buckets:
        if B not in eng.buckets or B > eng.cache.max_rows:
            raise ValueError(f"--buckets: {B} is not a bucket of the engine ({eng.buckets}, "
                             f"max_rows {eng.cache.max_rows})")
        prompts, params = _requests(eng, B, args)
        rep = time_replay(eng, B, prompts, params, args.replays)
        log(f"[replay] B={B}: {rep['replay_us']:.1f} us ({rep['replay_method']})")
        for overlap in [m == "overlap" for m in args.modes]:
            row = {"B": B, "mode": "overlap" if overlap else "serial", "case": args.case,
                   "prompt_len": args.prompt_len, "max_new_tokens": params[0].max_new_tokens,
                   **rep, **time_loop(eng, B, prompts, params, overlap),
                   **time_generate(eng, prompts, params, overlap)}
            if row["wall_us"] is not None:
                row["overhead_us"] = row["wall_us"] - row["replay_us"]
                row["overhead_pct"] = 100 * row["overhead_us"] / row["replay_us"]
            rows.append(row)
            log(f"[loop] B={B} {row['mode']}: wall {row['wall_us'] or float('nan'):.1f} us per "
                f"step over {row['steady_steps']} steady steps, "
                f"overhead {row.get('overhead_pct', float('nan')):.1f} %")
    return rows


def main(argv=None, engine=None) -> int:
    """`engine`: an Engine already loaded (in-process callers); else --engine or a build."""
    args = _args(argv)
    if (started := begin(args, "host_overhead")) is None:
        return 1
    env, out = started
    rec = {"schema": SCHEMA, "complete": False, "dry_run": args.dry_run, "environment": env,
           "buckets": args.buckets, "case": args.case, "replays": args.replays, "rows": []}
    with contextlib.ExitStack() as held, \
            bench_args.result_file(out / "host_overhead.json", rec):
        eng = _engine(args, engine, rec, held, log)
        rec.update(backend=eng.backend, engine_buckets=eng.buckets, max_rows=eng.cache.max_rows,
                   graphs=sorted({k.size for k in eng.captured()}),
                   prefill_programs=bool(eng.prefill_programs))
        rec["rows"] = measure(eng, args, log)
        rec["complete"] = True
    harness.write_csv(str(out / "host_overhead.csv"), rec["rows"])
    print(harness.format_table(rec["rows"], TABLE))
    print(f"written: {out / 'host_overhead.json'}")
    return 0


def _engine(args, engine, rec: dict, held: contextlib.ExitStack, log):
    """The engine measured: `engine`, --engine loaded, or synth + build under --work (a temporary
    directory `held` keeps until the run ends)."""
    if engine is not None:
        rec["setup"] = {"engine_dir": str(engine.dir)}
        return engine
    if args.engine:
        from dspark_compile.runtime.engine import Engine
        t = time.perf_counter()
        eng = Engine.load(args.engine, device=args.device, record_graph_memory=False,
                          trust_code=True)  # an engine of this checkout
        rec["setup"] = {"engine_dir": args.engine, "load_s": time.perf_counter() - t}
        return eng
    work = held.enter_context(bench_args.work_dir(args, "host_overhead_"))
    eng, rec["setup"] = setup_engine(args, work, log)
    return eng


if __name__ == "__main__":
    sys.exit(main())
