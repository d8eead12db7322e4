"""End-to-end speed-up of DSpark speculation: tokens/s of `Engine.generate` against decoding
without speculation, for the trained tiny pair on held-out standard-library prompts:

    python benchmarks/speedup.py --out DIR                    # CUDA if present, else the CPU
    python benchmarks/speedup.py --device cpu --batches 1,16,64 --new-tokens 64 --out DIR
    python benchmarks/speedup.py --dry-run --out DIR          # CPU smoke run (seconds of work)
    python benchmarks/speedup.py --modes sampled --verify block --batches 1 --out DIR

checkpoint (`synth --preset tiny-trained` into --work, or --ckpt) -> engine for the batch
buckets (built into --work, reused when its build config matches, or --engine) -> prompts: the
first --batches max windows of --prompt-len tokens, evenly spaced over the held-out modules
(f*, g*, h* of the standard library: never trained on) -> per mode (greedy; sampled at the
model card's temperature 1.0, top-p 0.95, request i seeded --seed + i, its drafts verified by
each --verify rule: "block", the accepted prefix decided jointly, or "token", token-wise
rejection) and batch B:

  - `engine-speculative`: Engine.generate over B requests (prefill included, through the
    engine's prefill programs: --prefill-chunks, default auto as `build`'s): one untimed
    warm-up call on the same B requests, then the median of --repeats timed calls (each the
    same tokens: greedy, or sampled from the same seeds); acceptance per draft position and
    the mean accepted length;
  - `engine-target-only`: THE BASELINE. Engine.generate(speculative=False): the same engine's
    non-speculative decoding through its target-only programs (one token per row and step,
    the same kernels, the same prefill, CUDA graphs on the GPU);
  - `reference-target-only` / `reference-speculative`: the eager reference (models/generate.py)
    on the engine's own weights and precision, without and with speculation: the speed-up
    speculation buys at equal implementation with no compilation on either side.

tokens/s counts every committed token of the B requests over the call's wall time; the
speed-up of a row is its tokens/s over the baseline's. A request's time is its prompt's prefill
and then its decoding: each row also times the same calls with max_new_tokens=1 (the prefill
and its first token, no step; `prefill_s`, the median of --repeats after a warm-up), and
reports the decoding alone: `decode_tokens_per_s`, the tokens after the first over the
difference, and its `decode_speedup` over the baseline's. Greedy rows also report the fraction of
requests whose tokens equal the baseline's (FP8 rounding can flip a near-tie between a batched
verify and a one-token decode). -> JSON (rewritten after every row), CSV, a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark_compile.cli.common import prefill_chunks_arg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_args  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import harness  # noqa: E402

SCHEMA = "dspark-speedup-benchmark/1"
MODES = ("greedy", "sampled")
VERIFY = ("block", "token")     # SamplingParams.verify: how a sampled row's drafts are verified
VARIANTS = ("engine-speculative", "engine-target-only", "reference-target-only",
            "reference-speculative")
BASELINE = "engine-target-only"
BASELINE_NOTE = ("baseline: the engine's own non-speculative decoding (its target-only "
                 "programs: Engine.generate(speculative=False))")
TABLE = ["mode", "B", "variant", "verify", "tokens", "seconds", "tokens_per_s", "speedup",
         "prefill_s", "decode_tokens_per_s", "decode_speedup", "mean_accepted_length",
         "acceptance", "greedy_match"]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default=None, help="checkpoint (default: tiny-trained, synthesized "
                   "into --work)")
    p.add_argument("--engine", default=None, help="a built engine of that checkpoint to use "
                   "instead of building one (its buckets must cover --batches' largest)")
    p.add_argument("--prefill-chunks", type=prefill_chunks_arg, default="auto",
                   metavar="C1,C2|auto|none", help="the engine's prefill programs, as `build "
                   "--prefill-chunks` (default auto, build's default; none: every prompt "
                   "prefills through the eager reference, ~0.2 s a 32-token prompt on an H100)")
    p.add_argument("--batches", type=bench_args.ints, default="1,16,64",
                   help="requests per generate call")
    p.add_argument("--modes", type=bench_args.names(MODES), default=",".join(MODES),
                   help=f"subset of {','.join(MODES)}")
    p.add_argument("--verify", type=bench_args.names(VERIFY), default=",".join(VERIFY),
                   help=f"subset of {','.join(VERIFY)}: the verification rules of the sampled "
                   "mode's speculative variants (one row each; greedy rows need none)")
    p.add_argument("--variants", type=bench_args.names(VARIANTS, empty_ok=True),
                   default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}"
                   f" ({BASELINE} is the baseline of the speed-up)")
    p.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per row after its warm-up, the median reported (default 3; "
                   "--dry-run 1)")
    bench_args.add_dtype(p, help="compute dtype (default bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="default: cuda when present")
    bench_args.add_backend(p)
    bench_args.add_run_flags(p, "speedup", "CPU, B = 1 and 2 in one bucket, a few tokens: that "
                             "the benchmark runs, not a measurement")
    a = p.parse_args(argv)
    if a.dry_run:
        a.device, a.batches = "cpu", [1, 2]
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device on this machine")
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    a.prompt_len = a.prompt_len or (12 if a.dry_run else 32)
    a.new_tokens = a.new_tokens or (6 if a.dry_run else 64)
    a.repeats = a.repeats or (1 if a.dry_run else 3)
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _buckets(args) -> tuple:
    # the dry run serves B = 1 and 2 from one bucket of 2 (one export instead of two)
    return (2,) if args.dry_run else tuple(args.batches)


def _build_matches(engine_dir: Path, args, max_seq_len: int, chunks: tuple) -> bool:
    try:
        bc = json.loads((engine_dir / "manifest.json").read_text())["build_config"]
        return (set(_buckets(args)) <= {int(b) for b in bc["buckets"]}
                and bc["dtype"] == args.dtype and int(bc["max_seq_len"]) >= max_seq_len
                and torch.device(bc["device"]).type == args.device
                and int(bc["max_rows"]) >= max(args.batches)
                and bc.get("target_programs") is True
                and tuple(bc.get("prefill_chunks") or ()) == chunks
                and (args.backend is None or bc.get("backend") == args.backend))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def setup(args, work: Path, log) -> tuple[object, Path, dict]:
    """(loaded engine, checkpoint directory, setup times)."""
    import shutil

    from dspark_compile.engine_dir.build_config import BuildConfig, resolve_prefill_chunks
    from dspark_compile.models.config import ModelConfig, request_positions
    from dspark_compile.factory.synth import synth_checkpoint
    from dspark_compile.runtime.engine import Engine
    from dspark_compile.build.pipeline import build_engine

    times = {}
    ckpt = Path(args.ckpt) if args.ckpt else work / "ckpt_tiny-trained"
    if not args.ckpt and not (ckpt / "config.json").exists():
        synth_checkpoint("tiny-trained", ckpt, overwrite=True)
    cfg = ModelConfig.from_file(ckpt / "config.json")
    need = request_positions(args.prompt_len, args.new_tokens, cfg.dspark_block_size)
    try:    # as the build resolves it ("auto": default_prefill_chunks(need))
        chunks = resolve_prefill_chunks(args.prefill_chunks, need)
    except ValueError as e:
        raise SystemExit(f"--prefill-chunks: {e}") from None
    engine_dir = Path(args.engine) if args.engine else work / f"engine_{args.device}_{args.dtype}"
    if not args.engine and not _build_matches(engine_dir, args, need, chunks):
        if engine_dir.exists():      # made by an earlier run of this script for other options
            log(f"[build] {engine_dir} does not fit this run: rebuilding")
            shutil.rmtree(engine_dir)
        t = time.perf_counter()
        build_engine(ckpt, engine_dir, BuildConfig(
            buckets=_buckets(args), max_rows=max(args.batches), max_seq_len=need,
            dtype=args.dtype, device=args.device, backend=args.backend or "",
            target_programs=True, prefill_chunks=chunks), log=log)
        times["build_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    eng = Engine.load(engine_dir, device=args.device, trust_code=True)  # an engine of this checkout
    times["load_s"] = round(time.perf_counter() - t, 2)
    if eng.cache.max_rows < max(args.batches):
        raise ValueError(f"--engine {engine_dir}: max_rows={eng.cache.max_rows} < the largest "
                         f"batch {max(args.batches)}")
    times["engine_dir"] = str(engine_dir)
    return eng, ckpt, times


def held_out_prompts(ckpt: Path, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens evenly spaced over the held-out modules, tokenized with
    the checkpoint's tokenizer."""
    from dspark_compile.models.config import ModelConfig
    from dspark_compile.factory.tokenizer import load_tokenizer
    from dspark_compile.factory.train_data import Corpus, encode_stream, spaced_windows
    cfg = ModelConfig.from_file(ckpt / "config.json")
    corpus = Corpus.stdlib()
    held = encode_stream(load_tokenizer(ckpt), Corpus.read(corpus.held_out), cfg.eos_token_id)
    return spaced_windows(held, n, length).tolist()


def sampling(mode: str, B: int, args, verify: str | None = None) -> list:
    """The B requests' SamplingParams: greedy, or the model card's sampling with drafts
    verified by `verify` (the target-only variants have no drafts: None, the default rule)."""
    from dspark_compile.models.request import SamplingParams
    if mode == "greedy":
        return [SamplingParams(max_new_tokens=args.new_tokens) for _ in range(B)]
    return [SamplingParams(temperature=1.0, top_p=0.95, seed=args.seed + i,
                           max_new_tokens=args.new_tokens, verify=verify or VERIFY[0])
            for i in range(B)]


def run_variant(variant: str, eng, prompts, params):
    from dspark_compile.models.generate import generate
    if variant.startswith("engine-"):
        return eng.generate(prompts, params, speculative=variant == "engine-speculative")
    return generate(eng.model, prompts, params, speculative=variant == "reference-speculative",
                    device=eng.device)


def timed(variant: str, eng, prompts, params, repeats: int) -> tuple[object, list[float]]:
    """One untimed call on these very requests (a variant's first call at a batch size pays
    one-time costs: allocations, prefill lengths, the bucket's first replays), then `repeats`
    timed ones: the last call's result and every call's seconds."""
    with torch.no_grad():
        run_variant(variant, eng, prompts, params)
    secs = []
    for _ in range(repeats):
        _sync(eng.device)
        t = time.perf_counter()
        with torch.no_grad():
            res = run_variant(variant, eng, prompts, params)
        _sync(eng.device)
        secs.append(time.perf_counter() - t)
    return res, secs


def row_of(mode: str, B: int, variant: str, res, secs: list[float],
           prefill_secs: list[float]) -> dict:
    tokens = sum(len(t) for t in res.tokens)
    seconds, prefill_s = statistics.median(secs), statistics.median(prefill_secs)
    row = {"mode": mode, "B": B, "variant": variant, "tokens": tokens,
           "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 2),
           "seconds_each": [round(x, 4) for x in secs], "steps": res.steps,
           "prefill_s": round(prefill_s, 4)}
    # the decoding alone: the tokens after each request's first (the prefill's) over the time
    # the call spent past its prefill; none when timing noise leaves no time (a few tokens)
    if seconds > prefill_s and tokens > B:
        row["decode_tokens_per_s"] = round((tokens - B) / (seconds - prefill_s), 2)
    if variant.endswith("-speculative"):
        row["mean_accepted_length"] = round(res.mean_accepted_length, 4)
        row["acceptance_per_position"] = [round(a, 4) for a in res.acceptance_per_position]
        row["acceptance"] = " ".join(f"{a:.2f}" for a in res.acceptance_per_position)
        row["row_steps"] = res.row_steps
    return row


def main(argv=None) -> int:
    args = _args(argv)
    torch.set_num_threads(args.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731
    env = harness.environment(args.git_commit)
    if args.device == "cpu":
        env["device"] = "cpu"
    out = bench_args.out_dir(args, env, "speedup")
    rec = {"schema": SCHEMA, "complete": False, "dry_run": args.dry_run, "environment": env,
           "device": args.device, "dtype": args.dtype, "batches": args.batches,
           "modes": args.modes, "verify": args.verify, "variants": args.variants,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
           "threads": args.threads, "baseline": BASELINE,
           "baseline_note": BASELINE_NOTE, "rows": []}
    with bench_args.work_dir(args, "speedup_") as work, \
            bench_args.result_file(out / "speedup.json", rec) as write:
        eng, ckpt, rec["setup"] = setup(args, work, log)
        rec["checkpoint"], rec["backend"] = str(ckpt), eng.backend
        rec["prefill_chunks"] = list(eng.prefill_programs.chunks) if eng.prefill_programs else []
        prompts = held_out_prompts(ckpt, max(args.batches), args.prompt_len)
        log(BASELINE_NOTE)
        write()
        for mode in args.modes:
            for B in args.batches:
                measure(mode, B, eng, prompts[:B], args, rec, write)
                log(f"[{mode} B={B}] " + "  ".join(
                    f"{r['variant']}{'/' + r['verify'] if 'verify' in r else ''} "
                    f"{r['tokens_per_s']:.1f} tok/s"
                    for r in rec["rows"] if (r["mode"], r["B"]) == (mode, B)))
        rec["complete"] = True
    harness.write_csv(str(out / "speedup.csv"),
                      [{k: v for k, v in r.items() if k != "acceptance_per_position"}
                       for r in rec["rows"]])
    print(BASELINE_NOTE)
    print(harness.format_table(rec["rows"], TABLE))
    print(f"written: {out / 'speedup.json'}, {out / 'speedup.csv'}")
    return 0


def measure(mode: str, B: int, eng, prompts, args, rec: dict, write) -> None:
    """Every variant's row for one (mode, batch) -- a sampled speculative variant once per
    --verify rule -- then each row's speed-up over the baseline and, greedy, its share of
    requests whose tokens equal the baseline's."""
    runs = []
    for variant in args.variants:
        spec = variant.endswith("-speculative") and mode == "sampled"
        runs += [(variant, v) for v in args.verify] if spec else [(variant, None)]
    results = {}
    for variant, verify in runs:
        params = sampling(mode, B, args, verify)
        res, secs = timed(variant, eng, prompts, params, args.repeats)
        first = [dataclasses.replace(p, max_new_tokens=1) for p in params]
        first_res, prefill_secs = timed(variant, eng, prompts, first, args.repeats)
        results[(variant, verify)] = res
        row = row_of(mode, B, variant, res, secs, prefill_secs)
        row["prefill_steps"] = first_res.steps      # 0: those calls ran no decoding step
        if verify is not None:
            row["verify"] = verify
        rec["rows"].append(row)
        write()
    base = next((r for r in rec["rows"] if (r["mode"], r["B"], r["variant"])
                 == (mode, B, BASELINE)), None)
    for r in rec["rows"]:
        if (r["mode"], r["B"]) != (mode, B):
            continue
        if base is not None:
            r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            if "decode_tokens_per_s" in r and "decode_tokens_per_s" in base:
                r["decode_speedup"] = round(r["decode_tokens_per_s"]
                                            / base["decode_tokens_per_s"], 3)
        if mode == "greedy" and (BASELINE, None) in results and r["variant"] != BASELINE:
            same = sum(a == b for a, b in zip(results[(r["variant"], None)].tokens,
                                              results[(BASELINE, None)].tokens))
            r["greedy_match"] = round(same / B, 3)
    write()


if __name__ == "__main__":
    sys.exit(main())
