"""The draft-plus-verify step at TP = 1 and TP = 2, per rank, with the collectives' share, so the
two-GPU step can be predicted before it is measured (issue 53 item 5):

    python benchmarks/tp_step.py --cpu --out DIR                  # CPU: gloo, 2 processes
    python benchmarks/tp_step.py --out DIR                        # one GPU: the engines' programs
    python benchmarks/tp_step.py --eager --out DIR                # one GPU: the eager step
    python benchmarks/tp_step.py --dry-run --out DIR              # CPU, untimed (CI)

One GPU (default): the ENGINES' step programs, benchmarks/tp_program.py: the TP = 1 engine's
and rank 0's of the TP = 2 engine (one build config, built under --work), each bucket's step
captured in one CUDA graph and timed in the same run, rank 0's program with its COLLECTIVES
REPLACED BY LOCAL COPIES (benchmarks/tp_standin.py: each all-gather node -> rank 0's tensor then
zeros, the same shape and bytes; each wait -> identity; no process group). --dry-run runs that
path on the CPU untimed (one step each, outputs checked) on the tp checkpoint.

--eager (one GPU): the EAGER step (models/step.py DraftVerifyStep) of the unsharded model (TP = 1,
models/loading.py load_model) and of each rank's sharded model (TP = 2, models/sharding.py
build_rank_model), both with the build's kernel weight layouts (use_kernel_layouts), every state
row holding a random live request (models/random_requests.py, the same prompts on every rank).
Its unfused aten glue, which sharding does not shrink, dominates it (flash-slice B = 1 on an
H100: TP = 1 17,162 us, rank 0 16,543 us, while the engine's step is ~3,200 us): it says
nothing about the engine. (That run's local gather copied x tp times, so every all-reduce
doubled and ids went out of range at B = 16; it now writes x then zeros, as the programs'.) --cpu also runs the eager step (the ranks' real gloo collectives).

--cpu: TP = 1 in one spawned process, then TP = 2 in two spawned gloo processes on loopback,
torch.set_num_threads(1) each, on the tp checkpoint (dspark_compile/factory/tp_checkpoint.py: the
tiny preset widened so tp = 2 splits whole 128 x 128 scale blocks; flash-slice widths hold 24 GB of
weights, out of reach of this CPU run). Per bucket B: --warmup untimed then --steps timed steps,
the state restored and the ranks at a barrier before each (outside the timed region); per step the
host clock around the step and, inside it, around every collective: the benchmark wraps
models/parallel.py's ParallelConfig._gather0 (the all_gather_single and its wait, which both
all_reduce and all_gather_last call) with a timing shim, here only; the model's code path is
unchanged. Collective time includes waiting for the slower rank. compute = step - collectives,
per step, then the median.

--eager on one GPU: the preset's (flash-slice) TP = 1 step and rank 0's TP = 2 step on the one
device, each captured in one CUDA graph and timed over --steps replays (CUDA events, state
restored and L2 flushed outside the timed region: benchmarks/step_variants.py), in the same run.
Rank 0 runs in this single process as ParallelConfig(rank=0, tp=2) with no process group: the
benchmark monkeypatches ParallelConfig._gather0 so the "gather" returns a [tp, ...] tensor built
from the rank's own data (its tensor, then zeros: the same bytes an all-gather writes), i.e.
COLLECTIVES REPLACED BY LOCAL COPIES; the result is rank 0's step before communication (the
numbers differ from a real rank's, so routing differs too). The issue's target: rank-0 step
<= 0.55 x the TP = 1 step at B = 1 and 16. The predicted two-GPU step adds calls x
--collective-us (the collective calls of one step, counted on an uncaptured step).

-> DIR/tp_step.json (rewritten as it goes, "complete": false until the end) and DIR/tp_step.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402
import tp_program  # noqa: E402
from dspark_compile.models.parallel import ParallelConfig, ParallelError  # noqa: E402

SCHEMA = "dspark-tp-step-benchmark/1"
TABLE = ["TP", "rank", "B", "step_ms", "collectives_ms", "compute_ms", "ratio_to_tp1",
         "collective_calls", "collective_kb"]
GPU_TABLE = ["TP", "rank", "B", "step_us", "step_us_p10", "step_us_p90", "step_us_again",
             "drift", "ratio_to_tp1",
             "collective_calls", "collective_kb", "predicted_2gpu_us"]
DRY_TABLE = ["TP", "rank", "B", "collective_calls", "collective_kb", "collective_kb_written"]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true",
                   help="CPU mode: TP = 1 and TP = 2 as spawned gloo processes on the tp "
                        "checkpoint (default: one-GPU mode, rank 0 with local-copy collectives)")
    p.add_argument("--eager", action="store_true",
                   help="one-GPU mode: time the EAGER reference step (models/step.py "
                        "DraftVerifyStep) instead of the engines' programs (the default)")
    p.add_argument("--dry-run", action="store_true",
                   help="the engines' programs on the CPU, untimed: one step each on the tp "
                        "checkpoint (tiny widened, 3 target layers), outputs checked (CI)")
    p.add_argument("--build-only", action="store_true",
                   help="the engines' programs mode: synthesise and build under --work, then "
                        "stop (a later call with the same --work and flags reuses them: one "
                        "command per part on a machine with a per-command time limit)")
    p.add_argument("--preset", default="flash-slice", choices=bench_args.PRESETS,
                   help="one-GPU mode's checkpoint preset (--cpu: the tp checkpoint, always)")
    p.add_argument("--buckets", type=bench_args.ints, default=None,
                   help="batch sizes, all rows live (default 1,16; --cpu 1,4)")
    p.add_argument("--steps", type=bench_args.at_least(3), default=None,
                   help="timed steps / graph replays per TP and bucket (default 30; --cpu 10)")
    p.add_argument("--warmup", type=bench_args.at_least(0), default=2,
                   help="untimed steps before them")
    p.add_argument("--dtype", default=None, choices=bench_args.DTYPES,
                   help="compute dtype (default bfloat16; --cpu float32)")
    p.add_argument("--max-seq-len", type=bench_args.at_least(16), default=None,
                   help="positions per request (default 256; --cpu 64)")
    p.add_argument("--max-prompt-len", type=bench_args.at_least(1), default=None,
                   help="random prompt lengths 1..this (default 64; --cpu 12)")
    p.add_argument("--collective-us", type=float, default=10.0,
                   help="one-GPU mode: assumed µs per collective call of the two-GPU step, for "
                        "the prediction column (a few-KB 2-GPU all-gather over NVLink: ~4-9 µs "
                        "with custom kernels, more through NCCL or PCIe)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None,
                   help="directory for the checkpoints, reused when present (default: a "
                        "temporary directory, deleted at the end)")
    bench_args.add_out(p, "tp_step")
    bench_args.add_git_commit(p)
    a = p.parse_args(argv)
    if a.dry_run and (a.cpu or a.eager):
        p.error("argument --dry-run: the programs' dry run; not with --cpu or --eager")
    if a.build_only and (a.cpu or a.eager or not a.work):
        p.error("argument --build-only: builds the programs mode's engines under --work "
                "(needs --work; not with --cpu or --eager)")
    cpu = a.cpu
    if a.dry_run:
        a.buckets = a.buckets or [1, 2]
        a.steps = a.steps or 3
        a.dtype = a.dtype or "float32"
        a.max_seq_len = a.max_seq_len or 64
        a.max_prompt_len = a.max_prompt_len or 12
    a.buckets = a.buckets or ([1, 4] if cpu else [1, 16])
    a.steps = a.steps or (10 if cpu else 30)
    a.dtype = a.dtype or ("float32" if cpu else "bfloat16")
    a.max_seq_len = a.max_seq_len or (64 if cpu else 256)
    a.max_prompt_len = a.max_prompt_len or (12 if cpu else 64)
    if a.max_prompt_len + 16 > a.max_seq_len:
        p.error(f"argument --max-prompt-len: {a.max_prompt_len} leaves no room for a step in "
                f"--max-seq-len {a.max_seq_len} (needs max-prompt-len + 16 <= max-seq-len)")
    return a


# ------------------------------------------------------------------------------------------------
# the seam: ParallelConfig._gather0, wrapped (CPU: timed) or replaced (one GPU: local copies)
# ------------------------------------------------------------------------------------------------

class CollectiveShim:
    """Installs a wrapper of ParallelConfig._gather0 for this process: counts each call and the
    bytes the rank contributes; `time_it` adds the host time inside the real gather (CPU);
    `local` replaces the gather by a local copy: the rank's tensor then zeros, the bytes of
    a gather of tp ranks (one GPU, no process group). `uninstall` puts the original back."""

    def __init__(self, time_it: bool = False, local: bool = False):
        self.time_it, self.local = time_it, local
        self.orig = ParallelConfig._gather0
        self.reset()

    def reset(self) -> None:
        self.seconds, self.calls, self.nbytes = 0.0, 0, 0

    def install(self) -> "CollectiveShim":
        shim, orig = self, self.orig

        def gather(pc, x):
            shim.calls += 1
            shim.nbytes += x.numel() * x.element_size()
            if shim.local:
                # rank 0's tensor then zeros (tp_standin.py's stand-in): every all-reduce is
                # the rank's own partial sum; x copied tp times doubled each one, and the
                # residual stream's growth drove ids out of range at B = 16
                x = x.contiguous()
                g = x.new_zeros((pc.tp, *x.shape))
                g[0].copy_(x)
                return g
            if not shim.time_it:
                return orig(pc, x)
            t = time.perf_counter()
            g = orig(pc, x)
            shim.seconds += time.perf_counter() - t
            return g

        ParallelConfig._gather0 = gather
        return self

    def uninstall(self) -> None:
        ParallelConfig._gather0 = self.orig


# ------------------------------------------------------------------------------------------------
# models and states
# ------------------------------------------------------------------------------------------------

def _precision(dtype: str):
    from dspark_compile.models.config import Precision
    return Precision(dtype=getattr(torch, dtype))


def load_tp_model(ckpt, tp: int, pc: ParallelConfig | None, dtype: str, device="cpu"):
    """TP = 1: the unsharded model; else this rank's sharded model (`pc`). Both with the build's
    kernel weight layouts, as the engine's programs run them."""
    from dspark_compile.models.loading import load_model
    from dspark_compile.models.moe import use_kernel_layouts
    from dspark_compile.models.sharding import build_rank_model
    prec = _precision(dtype)
    if tp == 1:
        model = load_model(ckpt, prec, device=device)
    else:
        model, _ = build_rank_model(ckpt, pc, prec, device=device)
    use_kernel_layouts(model, prec.dtype)
    return model


def live_state(model, B: int, args, device):
    """(rows 0..B-1, the state with a random live request in each, its snapshot): the same
    prompts and sampling on every rank and at every TP (one seed)."""
    from dspark_compile.models.config import CacheConfig
    from dspark_compile.models.random_requests import prefill_random_requests
    from dspark_compile.models.state import allocate_state, snapshot_state
    cache = CacheConfig(max_rows=B, max_seq_len=args.max_seq_len, max_step_tokens=16)
    state = allocate_state(model.cfg, cache, model.prec, device)
    with torch.no_grad():
        prefill_random_requests(model, state, range(B), args.seed, cache.max_step_tokens,
                                max_prompt_len=args.max_prompt_len)
    return torch.arange(B, device=device), state, snapshot_state(state)


# ------------------------------------------------------------------------------------------------
# CPU mode
# ------------------------------------------------------------------------------------------------

def _cpu_rank(rank: int, tp: int, port: int, ckpt: str, out_dir: str, args) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)                 # the ranks share the host's cores
    if tp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=tp)
    try:
        pc = ParallelConfig.from_group() if tp > 1 else None
        model = load_tp_model(ckpt, tp, pc, args.dtype)
        rows = _cpu_measure(model, tp, args, dist.barrier if tp > 1 else (lambda: None))
        bench_args.write_record(Path(out_dir) / f"tp{tp}_rank{rank}.json", rows)
    finally:
        if tp > 1:
            dist.destroy_process_group()


def _cpu_measure(model, tp: int, args, barrier) -> list[dict]:
    from dspark_compile.models.state import restore_state
    from dspark_compile.models.step import DraftVerifyStep
    shim = CollectiveShim(time_it=True).install()
    step = DraftVerifyStep(model).eval()
    out = []
    for B in args.buckets:
        rows, state, snap = live_state(model, B, args, "cpu")
        per = []
        for i in range(args.warmup + args.steps):
            restore_state(state, snap)
            barrier()
            shim.reset()
            t = time.perf_counter()
            with torch.no_grad():
                step(rows, state)
            dt = time.perf_counter() - t
            if i >= args.warmup:
                per.append((dt, shim.seconds, shim.calls, shim.nbytes))
        out.append({"B": B, "steps": len(per),
                    "step_ms": statistics.median(p[0] for p in per) * 1e3,
                    "step_ms_min": min(p[0] for p in per) * 1e3,
                    "collectives_ms": statistics.median(p[1] for p in per) * 1e3,
                    "compute_ms": statistics.median(p[0] - p[1] for p in per) * 1e3,
                    "collective_calls": per[0][2], "collective_bytes": per[0][3]})
    shim.uninstall()
    return out


def run_cpu(args, work: Path, rec: dict, write) -> None:
    import torch.multiprocessing as mp
    from dspark_compile.factory.synth import synth_checkpoint
    from dspark_compile.factory.tp_checkpoint import tp_checkpoint
    from dspark_compile.models.parallel_check import free_port
    tiny, wide = work / "ckpt_tiny", work / "ckpt_tp_wide"
    if not (wide / "config.json").exists():
        t = time.perf_counter()
        if not (tiny / "config.json").exists():
            synth_checkpoint("tiny", tiny, seed=0, overwrite=True)
        tp_checkpoint(tiny, wide)
        rec["setup"]["checkpoint_s"] = round(time.perf_counter() - t, 1)
        _log(f"[ckpt] tp checkpoint in {rec['setup']['checkpoint_s']} s -> {wide}")
    rec["checkpoint"] = "tiny widened for tp = 2 (dspark_compile/factory/tp_checkpoint.py)"
    with tempfile.TemporaryDirectory(prefix="tp_step_ranks_") as out_dir:
        for tp in (1, 2):
            t = time.perf_counter()
            mp.spawn(_cpu_rank, args=(tp, free_port(), str(wide), out_dir, args), nprocs=tp)
            _log(f"[tp={tp}] {tp} process(es) in {time.perf_counter() - t:.1f} s")
            for r in range(tp):
                for row in json.loads((Path(out_dir) / f"tp{tp}_rank{r}.json").read_text()):
                    rec["rows"].append({"TP": tp, "rank": r, **row})
            write()
    base = {row["B"]: row["step_ms"] for row in rec["rows"] if row["TP"] == 1}
    for row in rec["rows"]:
        row["collective_kb"] = row["collective_bytes"] / 1e3
        row["ratio_to_tp1"] = row["compute_ms"] / base[row["B"]]


# ------------------------------------------------------------------------------------------------
# one-GPU mode
# ------------------------------------------------------------------------------------------------

def run_gpu(args, work: Path, rec: dict, write) -> None:
    from dspark_compile.models.state import restore_state
    from dspark_compile.models.step import DraftVerifyStep
    from step_variants import _l2_flusher, capture, time_runner
    dev = cuda_device()
    ckpt = tp_program.checkpoint(args, work, rec, _log, dev)     # the program mode's, shared
    rec["collectives"] = ("TP = 2 rank 0: collectives replaced by local copies (the benchmark "
                          "monkeypatches ParallelConfig._gather0: the rank's tensor then zeros, "
                          "no process group)")
    shim = CollectiveShim(local=True).install()
    flush = _l2_flusher(dev)
    try:
        models = {}
        for tp in (1, 2):
            t = time.perf_counter()
            pc = ParallelConfig(rank=0, tp=2) if tp == 2 else None
            models[tp] = load_tp_model(ckpt, tp, pc, args.dtype, device=dev)
            torch.cuda.synchronize(dev)
            rec["setup"][f"load_tp{tp}_s"] = round(time.perf_counter() - t, 1)
            _log(f"[load] TP = {tp}{' rank 0' if tp == 2 else ''} in "
                 f"{rec['setup'][f'load_tp{tp}_s']} s, "
                 f"{torch.cuda.memory_allocated(dev) / 2**30:.1f} GiB allocated")
        for B in args.buckets:
            kept = {}
            for tp in (1, 2):
                model = models[tp]
                rows, state, snap = live_state(model, B, args, dev)
                step = DraftVerifyStep(model).eval()
                ctx = {"device": dev, "flush": flush,
                       "restore": lambda s=state, n=snap: restore_state(s, n)}
                ctx["restore"]()
                shim.reset()
                with torch.no_grad():
                    step(rows, state)            # uncaptured: counts the step's collectives
                calls, nbytes = shim.calls, shim.nbytes
                r = capture(lambda s=step, x=rows, st=state: s(x, st), dev, ctx["restore"])
                t = time_runner(r, ctx, args.steps, args.warmup)
                kept[tp] = (r, ctx, state, snap)
                row = {"TP": tp, "rank": 0, "B": B, "step_us": t["us_median"],
                       "step_us_p10": t["us_p10"], "step_us_p90": t["us_p90"],
                       "replays": t["replays"], "collective_calls": calls,
                       "collective_bytes": nbytes, "collective_kb": nbytes / 1e3}
                if tp == 2:
                    row["predicted_2gpu_us"] = t["us_median"] + calls * args.collective_us
                rec["rows"].append(row)
                write()
                _log(f"[B={B}] TP = {tp}: {t['us_median']:.1f} us, {calls} collectives "
                     f"({nbytes / 1e3:.1f} KB)")
            # TP = 1 replayed again after TP = 2: the drift between the two TP = 1 medians
            # bounds what the ratio can tell (clocks, thermals)
            r, ctx = kept[1][:2]
            again = time_runner(r, ctx, args.steps, args.warmup)["us_median"]
            first = next(x for x in rec["rows"] if x["TP"] == 1 and x["B"] == B)
            first.update(step_us_again=again, drift=again / first["step_us"] - 1)
            _log(f"[B={B}] TP = 1 again: {again:.1f} us")
            del kept, r, ctx
            torch.cuda.empty_cache()
    finally:
        shim.uninstall()
    base = {row["B"]: row["step_us"] for row in rec["rows"] if row["TP"] == 1}
    for row in rec["rows"]:
        row["ratio_to_tp1"] = row["step_us"] / base[row["B"]]


def cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


# ------------------------------------------------------------------------------------------------

def _log(line: str) -> None:
    print(line, flush=True)


def main(argv=None) -> int:
    args = _args(argv)
    program = not args.cpu and not args.eager
    if not args.cpu and not args.dry_run and not torch.cuda.is_available():
        print("tp_step: no CUDA device; the one-GPU mode needs one (use --cpu for the CPU run, "
              "--dry-run for the programs' untimed CPU run)", file=sys.stderr)
        return 1
    env = harness.environment(args.git_commit)
    out = bench_args.out_dir(args, env, "tp_step")
    mode = "cpu" if args.cpu else "dry-run" if args.dry_run else "one-gpu"
    rec = {"schema": SCHEMA, "complete": False, "mode": mode,
           "environment": env, "dtype": args.dtype, "buckets": args.buckets,
           "steps": args.steps, "warmup": args.warmup, "max_seq_len": args.max_seq_len,
           "max_prompt_len": args.max_prompt_len, "seed": args.seed,
           "step": "eager DraftVerifyStep (unsharded at TP = 1, the rank's sharded model at "
                   "TP = 2), kernel weight layouts",
           "setup": {}, "rows": []}
    if args.cpu:
        rec.update(threads_per_rank=1, backend="gloo (loopback)", timing=(
            "host clock; collectives = time inside ParallelConfig._gather0 (all_gather_single + "
            "wait, incl. waiting for the other rank); compute = step - collectives, per step; "
            "medians"))
    elif args.dry_run:
        rec.update(timing="none (dry run: one uncaptured step per TP and bucket, outputs "
                          "checked)")
    else:
        rec.update(preset=args.preset, collective_us=args.collective_us, timing=(
            "CUDA graph replays, CUDA events, state restored and L2 flushed outside the timed "
            "region; medians"))
    if program:
        tp_program.describe(rec)
    with bench_args.work_dir(args, "tp_step_") as work, \
            bench_args.result_file(out / "tp_step.json", rec) as write:
        try:
            if args.cpu:
                run_cpu(args, work, rec, write)
            elif program:
                dev = cuda_device() if not args.dry_run else torch.device("cpu")
                tp_program.run_program(args, work, rec, write, _log, dev)
            else:
                run_gpu(args, work, rec, write)
        except ParallelError as e:      # a preset whose splits tp = 2 does not allow (tiny)
            print(f"tp_step: {e}", file=sys.stderr)
            return 2
        rec["complete"] = True
    table = harness.format_table(_display(rec["rows"]), TABLE if args.cpu else
                                 DRY_TABLE if args.dry_run else GPU_TABLE)
    _write_md(out / "tp_step.md", rec, table)
    print(f"\n{env.get('device')}  torch {env['torch']}  triton {env['triton']}  "
          f"commit {env['git_commit'][:12]}  {env['date_utc']}")
    print(table)
    print(f"written: {out / 'tp_step.json'}, {out / 'tp_step.md'}")
    return 0


def _display(rows: list[dict]) -> list[dict]:
    """The table's cells: µs and KB of 1000 or more as integers (harness's %.3g hides digits),
    the drift as a percentage."""
    out = []
    for r in rows:
        d = {k: (round(v) if isinstance(v, float) and abs(v) >= 1000 else v)
             for k, v in r.items()}
        if isinstance(r.get("drift"), float):
            d["drift"] = f"{100 * r['drift']:+.1f}%"
        out.append(d)
    return out


def _write_md(path: Path, rec: dict, table: str) -> None:
    env = rec["environment"]
    lines = [f"# tp_step ({rec['mode']})", "",
             f"{env.get('device')}, torch {env['torch']}, triton {env['triton']}, commit "
             f"{env['git_commit'][:12]}{' (dirty)' if env.get('git_dirty') else ''}, "
             f"{env['date_utc']}", "",
             f"Step: {rec['step']}. Checkpoint: {rec['checkpoint']}. dtype {rec['dtype']}"
             + ("" if rec["mode"] == "dry-run" else
                f", {rec['steps']} timed steps after {rec['warmup']} untimed")
             + f". Timing: {rec['timing']}.",
             ""]
    if rec["mode"] == "cpu":
        lines += ["ratio_to_tp1 = this rank's compute / the TP = 1 step, same bucket.", ""]
    elif rec["mode"] == "dry-run":
        lines += [rec["collectives"] + ".", "Dry run: one uncaptured step per TP and bucket, "
                  "untimed; outputs checked (ids in range, counts, no NaN in the state).", ""]
    else:
        lines += [rec["collectives"] + ".",
                  f"ratio_to_tp1 = rank 0's step / the TP = 1 step, same bucket (target <= "
                  f"0.55); predicted_2gpu_us = rank 0's step + calls x {rec['collective_us']} "
                  f"µs.", ""]
    if rec.get("rewritten_nodes"):
        lines += ["Collective nodes rewritten in rank 0's programs: " + "; ".join(
            f"{rel}: " + ", ".join(f"{n} x {op.split('.')[1]}" for op, n in c.items())
            for rel, c in rec["rewritten_nodes"].items()) + ".", ""]
    lines += ["collective_calls / collective_kb: the gathers of one step and the bytes this rank "
              "contributes to them (an all-gather at tp = 2 also receives as many).", "",
              "```", table, "```", ""]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
