"""Set-up shared by the engine benchmarks (benchmarks/step.py, prefill.py, host_overhead.py): the
device, the checkpoint and engine under --work (reused when they fit the run)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402
from dspark_compile.factory.presets import preset  # noqa: E402


# ------------------------------------------------------------------------------------------------
# setup
# ------------------------------------------------------------------------------------------------

def _engine_matches(engine_dir: Path, args, prefill_chunks: tuple = ()) -> bool:
    try:
        m = json.loads((engine_dir / "manifest.json").read_text())
        bc = m["build_config"]
        # prefill chunks decide a prompt's chunk schedule: a prefill run needs exactly its own
        return (set(args.buckets) <= {int(b) for b in m["buckets"]}
                and (not prefill_chunks
                     or tuple(bc.get("prefill_chunks") or ()) == tuple(prefill_chunks))
                and bc["dtype"] == args.dtype and int(bc["max_seq_len"]) == args.max_seq_len
                and torch.device(bc["device"]).type == args.device.type
                and int(bc["max_rows"]) >= max(args.buckets)
                and bc.get("backend") == _backend(args)
                and _preset_shape(m.get("model_config", {})) == _preset_shape(
                    preset(args.preset)))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _backend(args) -> str:
    from dspark_compile.engine_dir.build_config import BuildConfig
    return BuildConfig(device=args.device.type, backend=args.backend or "").backend


def _preset_shape(config: dict) -> tuple:
    """What tells the presets apart in a config: width and depth (tiny and tiny-deep share
    their widths)."""
    return config.get("hidden_size"), config.get("num_hidden_layers")


def setup_engine(args, work: Path, log, prefill_chunks: tuple = ()) -> tuple[object, dict]:
    """The checkpoint and engine under `work` (reused when they fit), loaded. `prefill_chunks`
    (benchmarks/prefill.py): the build's prefill programs, loaded with the engine; such an
    engine has a directory of its own."""
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.factory.synth import synth_checkpoint
    from dspark_compile.runtime.engine import Engine
    from dspark_compile.build.pipeline import build_engine

    times = {}
    ckpt = work / f"ckpt_{args.preset}"
    if not (ckpt / "config.json").exists():
        t = time.perf_counter()
        log(f"[synth] {args.preset} -> {ckpt}")
        synth_checkpoint(args.preset, ckpt, seed=0, device=args.device.type, overwrite=True)
        times["synth_s"] = time.perf_counter() - t
    engine_dir = work / (f"engine_{args.preset}" + "".join(f"_p{c}" for c in prefill_chunks))
    if not _engine_matches(engine_dir, args, prefill_chunks):
        if engine_dir.exists():
            # it lives under --work, made by an earlier run of this script for other options
            import shutil
            log(f"[build] {engine_dir} does not fit this run: rebuilding")
            shutil.rmtree(engine_dir)
        t = time.perf_counter()
        build_engine(ckpt, engine_dir, BuildConfig(
            buckets=tuple(args.buckets), max_rows=max(args.buckets), max_seq_len=args.max_seq_len,
            dtype=args.dtype, device=args.device.type, backend=_backend(args),
            prefill_chunks=tuple(prefill_chunks)), log=log)
        times["build_s"] = time.perf_counter() - t
        if args.device.type == "cuda":    # the build's model (24 GB at flash-slice) is gone
            torch.cuda.empty_cache()
    else:
        log(f"[build] reusing {engine_dir}")
    t = time.perf_counter()
    graphs = args.device.type == "cuda" and any(v.startswith("engine") for v in args.variants)
    eng = Engine.load(engine_dir, device=args.device, trust_code=True, use_graphs=graphs, record_graph_memory=False,
                      prefill="programs" if prefill_chunks else None)
    times["load_s"] = time.perf_counter() - t
    times["engine_dir"] = str(engine_dir)
    log(f"[load] {engine_dir} in {times['load_s']:.1f}s (graphs: {graphs})")
    return eng, times


def log(line: str) -> None:
    """A progress line, flushed at once (a run's output is read while it runs)."""
    print(line, flush=True)


def begin(args, kind: str) -> tuple[dict, Path] | None:
    """What an engine benchmark does first: `args.device` (bench_device), the environment record
    (device, versions, commit) and the output directory (--out, or one named by `kind`); None
    when a timed run finds no CUDA device."""
    args.device = bench_device(args)
    if args.device is None:
        return None
    env = harness.environment(args.git_commit)
    return env, bench_args.out_dir(args, env, kind)


def bench_device(args) -> torch.device | None:
    """The device a run works on (the CPU for --dry-run, else the current CUDA device), after
    setting --threads; None, with a message, when a timed run finds no CUDA device."""
    torch.set_num_threads(args.threads)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run for the CPU smoke run", file=sys.stderr)
        return None
    return torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())
