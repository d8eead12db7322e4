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

The parts: bench_args.py (the flags the engine benchmarks share, --out and --work),
bench_setup.py (device, checkpoint and engine under --work), step_floor.py (the byte floor),
step_variants.py (how each variant runs one step, the compile budget, replay timing),
step_launches.py (what a step launches, per layer); this file is the run that ties them:
`main` -> `StepRun` (set-up, then per case and bucket: `floor`, `variant`, `per_layer`) ->
`_report`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402
from dspark_compile.engine_dir.format import STEP, ProgramKey  # noqa: E402
from dspark_compile.factory.presets import PRESETS as MODEL_PRESETS  # noqa: E402
import step_floor  # noqa: E402
import step_predict  # noqa: E402
import step_roofline  # noqa: E402
# the parts of the benchmark, in the order a run uses them
from bench_setup import begin, log, setup_engine  # noqa: E402
from step_launches import (_counts, _sync, dspark_kernel_names,  # noqa: E402
                           graph_kernel_nodes, per_layer, profile_launches)
from step_variants import (Skipped, _cpu_copy_bandwidth, _l2_flusher,  # noqa: E402
                           make_runner, time_runner)

VARIANTS = ("eager", "eager-graph", "compile-graph", "engine", "engine-greedy",
            "engine-batch-dependent")
CASES = {"mixed": "random", "greedy": "greedy"}   # case -> prefill_random_requests mix
SCHEMA = "dspark-step-benchmark/1"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_args.add_preset(p)
    bench_args.add_buckets(p, "1,4,16,64",
                           help="batch buckets (all rows live); --dry-run uses the first")
    p.add_argument("--variants", type=bench_args.names(VARIANTS, empty_ok=True),
                   default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--cases", type=bench_args.names(tuple(CASES), empty_ok=True),
                   default="mixed,greedy", help="comma-separated subset of mixed,greedy")
    p.add_argument("--replays", type=int, default=30, help="timed replays per variant and bucket")
    p.add_argument("--warmup", type=int, default=3, help="untimed replays before them")
    p.add_argument("--compile-budget-s", type=float, default=900.0,
                   help="seconds one bucket's torch.compile may take (enforced with SIGALRM in "
                        "the main thread); over it the variant is skipped with the reason")
    bench_args.add_max_seq_len(p)
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="random prompt lengths 1..this (default 64; --dry-run 12)")
    bench_args.add_dtype(p)
    p.add_argument("--per-layer", default="all", choices=("all", "smallest", "none"),
                   help="buckets that get the per-layer attribution (an export of the reference "
                        "step each: ~10-30 s)")
    bench_args.add_backend(p)
    p.add_argument("--mma-tflops", type=_rates, default=None,
                   help="peak dense MMA TFLOP/s by operand dtype for the honest floor, e.g. "
                        "bf16=989.4,fp8=1978.9 (default: the datasheet's for H100 / H200; "
                        "another device without it gets the byte floor only)")
    p.add_argument("--predict", type=bench_args.names(tuple(MODEL_PRESETS), empty_ok=True),
                   default=None,
                   help="presets whose step is predicted from this one's per-layer times "
                        "(default: flash-0731 from flash-slice, tiny-deep from tiny)")
    p.add_argument("--accepted-lengths", type=_floats, default=[1.0, 2.6, 4.33],
                   help="mean accepted lengths for the predicted tokens/s (default 1: nothing "
                        "accepted; 2.6: DSpark's published at temperature 1; 4.33: the trained "
                        "tiny pair's greedy on the H100)")
    bench_args.add_run_flags(p, "step", "CPU, tiny, one bucket, no timing")
    a = p.parse_args(argv)
    if a.dry_run:
        a.preset, a.buckets = "tiny", a.buckets[:1]
    bench_args.dry_run_defaults(a, "dtype", "max_seq_len")
    # prompts up to 64 tokens put the SWA rings (window 128 at Flash dims, 8 tiny) and the C4 /
    # C128 compressed caches part-way full; the dry run keeps its prefill short
    a.max_prompt_len = a.max_prompt_len or (12 if a.dry_run else 64)
    if a.predict is None:
        a.predict = [step_predict.PREDICT_FOR[a.preset]] if a.preset in step_predict.PREDICT_FOR else []
    return a


def _rates(text: str) -> dict:
    try:
        out = {k.strip(): float(v) for k, v in (kv.split("=") for kv in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected dtype=TFLOPS[,dtype=TFLOPS], got {text!r}")
    if not out or any(v <= 0 for v in out.values()):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return out


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if any(not x > 0 for x in out):
        raise argparse.ArgumentTypeError(f"accepted lengths must be > 0, got {text!r}")
    return out


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
         "floor_us", "ratio_to_floor", "honest_us", "ratio_to_honest", "compile_s"]


def main(argv=None) -> int:
    args = _args(argv)
    if (started := begin(args, "step")) is None:
        return 1
    env, out = started
    rec = _record(args, env)
    with bench_args.work_dir(args, "step_bench_") as work, \
            bench_args.result_file(out / "step.json", rec) as write:
        run = StepRun(args, rec, write, work)
        write()
        for case in args.cases:
            run.case(case)
        rec["complete"] = True
    _report(args, env, rec, out)
    return 0


def _record(args, env: dict) -> dict:
    """The result record as the run starts: what it measures and how; rows filled as it goes."""
    return {"schema": SCHEMA, "complete": False, "dry_run": args.dry_run, "environment": env,
            "preset": args.preset, "dtype": args.dtype, "buckets": args.buckets,
            "max_seq_len": args.max_seq_len, "max_prompt_len": args.max_prompt_len,
            "variants": args.variants, "cases": args.cases, "replays": args.replays,
            "warmup": args.warmup, "compile_budget_s": args.compile_budget_s,
            "launch_counting": (
                "ops: top-level aten/dspark ops in torch.profiler (CPU)" if args.dry_run else
                "kernels: CUDA events torch.profiler (CUPTI) records over one call"),
            "mma_tflops": step_roofline.peak_tflops(env.get("device"), args.mma_tflops),
            "predict": args.predict, "accepted_lengths": args.accepted_lengths,
            "rows": [], "floors": {}, "per_layer": {}, "kernel_names": {},
            "kernel_us": {}, "op_class_us": {}, "predictions": {}}


class StepRun:
    """One run's engine and what it keeps between cases and buckets: the variants' runners (a
    bucket's graphs stay valid for the next case: same state tensors, restored in place), the
    exported reference programs, whether torch.compile went over its budget."""

    def __init__(self, args, rec: dict, write, work):
        from dspark_compile.models.step import DraftVerifyStep
        self.args, self.rec, self.write = args, rec, write
        self.dspark = set(dspark_kernel_names())
        rec["dspark_kernel_names"] = sorted(self.dspark)
        eng, rec["setup"] = setup_engine(args, work, log)
        dev = eng.device
        self.eng, self.dev = eng, dev
        rec["max_rows"] = eng.cache.max_rows
        rec["backend"] = eng.backend
        rec["compile_seconds"] = eng.manifest.get("compiled", {}).get("compile_seconds")
        rec["copy_bandwidth"] = (harness.measure_copy_bandwidth() if dev.type == "cuda"
                                 else _cpu_copy_bandwidth())
        self.bw = rec["copy_bandwidth"]["bytes_per_s"]
        self.step = DraftVerifyStep(eng.model).eval()
        self.ctx = {"engine": eng, "step": self.step, "state": eng.state, "device": dev,
                    "compile_budget_s": args.compile_budget_s, "flush": _l2_flusher(dev),
                    "rows": {B: torch.arange(B, device=dev) for B in args.buckets}}
        self.runners: dict = {}
        self.ref_programs: dict = {}  # bucket -> the exported reference step's module (per layer)
        self.layer_buckets = {"all": args.buckets, "smallest": args.buckets[:1],
                              "none": []}[args.per_layer]
        self.compile_over = None  # once one bucket's compile is skipped, larger ones are too

    def restore(self) -> None:
        self.ctx["restore"]()

    def case(self, case: str) -> None:
        """The case's requests prefilled, then per bucket: the floor, every variant, the layers."""
        from dspark_compile.models.state import restore_state
        eng = self.eng
        t = time.perf_counter()
        snap = prefill_case(eng, case, self.args)
        log(f"[prefill] case {case}: {eng.cache.max_rows} rows in {time.perf_counter() - t:.1f}s")
        self.ctx["restore"] = lambda: restore_state(eng.state, snap)
        for B in self.args.buckets:
            key = f"{case}/B{B}"
            floor, tokens_per_row = self.floor(key, B)
            for v in self.args.variants:
                if v == "engine-greedy" and case != "greedy":
                    continue
                row = self.variant(case, B, v, floor, tokens_per_row)
                self.restore()
                self.rec["rows"].append(row)
                self.write()
                log(f"[{key}] {v}: {row['status']} "
                    + (f"{row['us_median']:.1f} us " if row.get("us_median") else "")
                    + (f"launches {row.get('launches_total')}" if row["status"] == "ok"
                       else row.get("reason", "")))
            if B in self.layer_buckets:
                self.per_layer(case, B)

    def floor(self, key: str, B: int) -> tuple[dict, float]:
        """The byte floor from the routers' top-k ids of one eager reference step; the step's
        mean tokens per row."""
        eng = self.eng
        self.restore()
        with torch.no_grad(), step_floor.record_routing(eng.model) as routing:
            _, num = self.step(self.ctx["rows"][B], eng.state)
        tokens_per_row = float(num.double().mean())
        self.restore()
        log(f"[eager] {key}: routing recorded")
        floor = step_floor.byte_floor(eng.model, eng.state, list(range(B)), routing)
        floor["us"] = floor["bytes"] / self.bw * 1e6
        # the honest floor: one more eager step, every matmul-like op's FLOPs and bytes
        with torch.no_grad(), step_roofline.ledger(eng.model, eng.state, floor) as led:
            self.step(self.ctx["rows"][B], eng.state)
        self.restore()
        head = eng.model.head.weight
        floor["honest"] = step_roofline.honest_floor(
            floor, led.ops, head.numel() * head.element_size(), self.bw, self.rec["mma_tflops"])
        floor["honest_us"] = floor["honest"]["honest_us"]
        self.rec["floors"][key] = floor
        log(f"[floor] {key}: {floor['bytes'] / 1e6:.2f} MB -> {floor['us']:.2f} us; honest "
            f"{floor['honest_us']:.2f} us (head again {floor['honest']['head_second_read_us']:.1f}"
            f", FLOP-bound ops +{floor['honest']['flop_excess_us']:.1f})")
        return floor, tokens_per_row

    def variant(self, case: str, B: int, v: str, floor: dict, tokens_per_row: float) -> dict:
        """One variant's row: its launches, its timing (CUDA), its ratio to the floor; a
        variant that fails or is skipped is a row with the reason."""
        row = {"name": f"{self.args.preset} {case}", "case": case, "B": B, "variant": v,
               "tokens_per_row_step": tokens_per_row, "floor_bytes": floor["bytes"],
               "floor_us": floor["us"]}
        try:
            self._measure(row, f"{case}/B{B}/{v}", floor)
            row["status"] = "ok"
        except Skipped as e:
            row.update(status="skipped", reason=str(e))
            if v == "compile-graph":
                self.compile_over = f"bucket {B}: {e}"
        except Exception as e:  # noqa: BLE001 -- one variant's failure is a result
            traceback.print_exc()
            row.update(status="skipped", reason=f"{type(e).__name__}: {str(e)[:300]}")
            _sync(self.dev)
        return row

    def _measure(self, row: dict, key: str, floor: dict) -> None:
        v, B = row["variant"], row["B"]
        if v == "compile-graph" and self.compile_over:
            raise Skipped(self.compile_over)
        if (v, B) not in self.runners:
            t = time.perf_counter()
            self.runners[(v, B)] = make_runner(v, B, self.ctx)
            row["setup_s"] = round(time.perf_counter() - t, 2)
        r = self.runners[(v, B)]
        row.update(r.info)
        self.restore()
        times: dict = {}
        with torch.no_grad():
            names = profile_launches(r.call, self.dev, times)
        self.restore()
        row.update({f"launches_{k}": n for k, n in _counts(names, self.dspark).items()})
        self.rec["kernel_names"][key] = dict(sorted(
            {n: names.count(n) for n in set(names)}.items()))
        if times:
            self.rec["kernel_us"][key] = dict(sorted(
                ((n, round(t, 2)) for n, t in times.items()), key=lambda kv: -kv[1]))
        if r.graph is not None:
            row["graph_nodes"] = graph_kernel_nodes(r.graph)
        if self.dev.type == "cuda":
            row.update(time_runner(r, self.ctx, self.args.replays, self.args.warmup))
            row["ratio_to_floor"] = row["us_median"] / floor["us"]
            row["honest_us"] = floor["honest_us"]
            row["ratio_to_honest"] = row["us_median"] / floor["honest_us"]
        else:
            row["us_median"] = None     # dry run: no timing
        if times and "honest" in floor:
            table = step_roofline.op_class_table(self.rec["kernel_us"][key], row["us_median"],
                                                 floor["honest"]["op_classes"])
            self.rec["op_class_us"][key] = table
            log(f"[classes] {key}: " + ", ".join(
                f"{c['class']} {c['us']:.0f}" + (f" ({c['ratio']:.2f}x)" if c["ratio"] else "")
                for c in table))

    def per_layer(self, case: str, B: int) -> None:
        """The reference step's and the engine's programs run per layer, each kernel attributed
        to its layer (step_launches.per_layer)."""
        from dspark_compile.build.pipeline import export_step
        eng, key = self.eng, f"{case}/B{B}"
        layers = {}
        t = time.perf_counter()
        if B not in self.ref_programs:   # the same program for both cases
            ep = export_step(eng.model, eng.state, B)
            ep.example_inputs = None
            self.ref_programs[B] = ep.module()
            del ep
        progs = {"reference": self.ref_programs[B]}
        if any(v.startswith("engine") for v in self.args.variants):
            progs["engine"] = eng.program(ProgramKey(STEP, B)).fn
            if case == "greedy" and eng.has(ProgramKey(STEP, B, "greedy")):
                progs["engine-greedy"] = eng.program(ProgramKey(STEP, B, "greedy")).fn
        for name, gm in progs.items():
            self.restore()
            try:
                layers[name] = per_layer(gm, self.ctx["rows"][B], eng.state, self.dev, self.dspark)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                layers[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        self.restore()
        del progs
        self.rec["per_layer"][key] = layers
        self.predict(case, B, layers.get("engine"))
        log(f"[per-layer] {key} in {time.perf_counter() - t:.1f}s: "
            + ", ".join(f"{n} {sum(c.get('total', 0) for c in d.values() if isinstance(c, dict))}"
                        for n, d in layers.items()))
        self.write()


    def predict(self, case: str, B: int, layers: dict | None) -> None:
        """The --predict presets' step at this bucket from the engine's per-layer times (CUDA:
        they need device µs; step_predict.py)."""
        from dspark_compile.factory.presets import preset
        from dspark_compile.models.config import ModelConfig
        key = f"{case}/B{B}"
        row = next((r for r in self.rec["rows"] if r["case"] == case and r["B"] == B
                    and r["variant"] == "engine" and r.get("us_median")), None)
        if not layers or "error" in layers or row is None:
            return
        floors = step_predict.part_floors(self.rec["floors"][key], self.eng.model, self.bw)
        replay = sum(self.rec["kernel_us"].get(f"{key}/engine", {}).values())
        out = {}
        for name in self.args.predict:
            try:
                out[name] = step_predict.predict(
                    self.eng.model.cfg, ModelConfig.from_dict(preset(name)), layers, row, replay,
                    floors, B, self.args.accepted_lengths)
                log(f"[predict] {key} {name}: {out[name]['step_us']:.0f} us, floor "
                    f"{out[name]['floor_us']:.0f} us")
            except (KeyError, ValueError) as e:
                out[name] = {"error": str(e)}
        self.rec["predictions"][key] = out
        self.write()


def _report(args, env: dict, rec: dict, out) -> None:
    """CSV, plot (CUDA runs), the printed table."""
    harness.write_csv(str(out / "step.csv"), rec["rows"])
    msg = harness.write_plot(str(out / "step.png"), [r for r in rec["rows"] if r.get("us_median")],
                             x="B", y="us_median") if not args.dry_run else "dry run: no plot"
    print(f"\n{env.get('device')}  torch {env['torch']}  triton {env['triton']}  "
          f"commit {env['git_commit'][:12]}  {env['date_utc']}  copy "
          f"{rec['copy_bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s")
    print(harness.format_table(rec["rows"], TABLE))
    print(msg)
    print(f"written: {out / 'step.json'}")


if __name__ == "__main__":
    sys.exit(main())
