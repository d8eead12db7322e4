"""`generate`, `build`, `run` and `inspect` subcommands (registered into cli_common.COMMANDS
on import; cli.py imports this module).

Everything a command can be refused for without its expensive part is checked first, with the
flag named: sampling flags before anything, prompts against the checkpoint's config.json or
the engine's manifest before the weights are loaded, build options before the checkpoint is
loaded and exported (dspark_compile/build/checks.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from dspark_compile.cli.common import (command, device, engine_errors, engine_load_args, path_arg,
                                       prefill_chunks_arg)
from dspark_compile.build.checks import writable_dir, writable_file
from dspark_compile.build.pipeline import build_engine
from dspark_compile.engine_dir.tp_format import RANKS_FILE, rank_dir
from dspark_compile.engine_dir.build_config import BuildConfig, DEFAULT_BUCKETS, DTYPES
from dspark_compile.engine_dir.fields import engine_configs
from dspark_compile.engine_dir.format import BACKENDS
from dspark_compile.engine_dir.format import ArtifactError, MANIFEST
from dspark_compile.engine_dir.load import load_manifest
from dspark_compile.inspection.report import write_report
from dspark_compile.models import load_model
from dspark_compile.models.checkpoint import CheckpointError, missing_dir, read_config
from dspark_compile.models.config import Precision, rope_positions
from dspark_compile.models.generate import cache_config_for, generate
from dspark_compile.models.request import check_room, prompt_ids, prompt_seeds, SamplingParams
from dspark_compile.models.state import check_state_fits
from dspark_compile.passes import format_stats_table
from dspark_compile.runtime.engine import Engine
from dspark_compile.runtime.lossless import check_lossless, compare_outputs, reference_tolerance

PRECISIONS = ("bfloat16", "float32", "float64")

# SamplingParams' fields -> the flags that set them (SamplingParams.validate's `names`, and
# to_flags for the engine's own messages, which name the fields)
SAMPLING_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                  "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
                  "stop_ids": "--stop-ids", "verify": "--verify"}


IDS_RULE = ("comma-separated token ids >= 0; spaces around an id are ignored, an empty item "
            "(1,,2 or a trailing comma) is refused")


def _ids(text: str) -> list[int]:
    """Token ids as IDS_RULE says: an empty item is a typo more often than not (a dropped
    digit), so it is refused rather than skipped."""
    items = [t.strip() for t in text.split(",")]
    if items == [""]:
        raise argparse.ArgumentTypeError("no token ids given")
    if "" in items:
        raise argparse.ArgumentTypeError(f"empty item in {text!r} (expected {IDS_RULE})")
    try:
        ids = [int(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {IDS_RULE}, got {text!r}") from None
    bad = [t for t in ids if t < 0]
    if bad:
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {bad[0]} in {text!r}")
    return ids


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-ids", type=_ids, required=True, action="append",
                   help=f"prompt token ids, {IDS_RULE} (repeat for a batch of prompts)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="new tokens per request at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default), as is any value below 1e-5; finite, >= 0")
    p.add_argument("--top-k", type=int, default=0,
                   help="0 = off (default), as is any value >= the vocabulary; >= 0")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 = off (default)")
    p.add_argument("--seed", type=int, default=0,
                   help="prompt i samples with seed + i (default 0; seed + i fits in 64 bits)")
    p.add_argument("--stop-ids", type=_ids, default=None,
                   help="stop token ids, comma-separated, in the vocabulary (default: none)")
    p.add_argument("--verify", choices=("block", "token"), default="block",
                   help="how sampled requests' drafts are verified: block (the default; the "
                        "accepted prefix decided jointly, Sun et al. 2024) or token (token-wise "
                        "rejection); greedy requests ignore it")


def _params(args):
    """One SamplingParams per prompt (prompt i samples with --seed + i), checked by
    models/request.py's rules, their messages naming these flags; stop ids are checked against
    the vocabulary in _check_requests."""
    base = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          seed=args.seed, max_new_tokens=args.max_new_tokens,
                          stop_ids=tuple(args.stop_ids or ()), verify=args.verify)
    base = base.validate(None, SAMPLING_FLAGS)
    seeds = prompt_seeds(base.seed, len(args.prompt_ids), SAMPLING_FLAGS)
    return [dataclasses.replace(base, seed=s) for s in seeds]


def _check_requests(args, params, vocab: int, max_seq_len: int | None = None, block: int = 0,
                    max_positions: int | None = None):
    """Prompt ids in the vocabulary and, for an engine, every request within its max_seq_len;
    for the eager models (`max_positions`), within the model's max_position_embeddings
    (models/request.py's rules, their messages naming the flags)."""
    limits = []
    if max_seq_len is not None:
        limits.append((max_seq_len, f"the engine holds max_seq_len={max_seq_len} "
                                    "(build --max-seq-len)"))
    if max_positions is not None:
        limits.append((max_positions, f"the model's max_position_embeddings is "
                                      f"{max_positions} (config.json)"))
    for i, (p, sp) in enumerate(zip(args.prompt_ids, params)):
        label = f"--prompt-ids (prompt {i})"
        prompt_ids(p, vocab, label)
        for limit, holds in limits:
            check_room(len(p), sp.max_new_tokens, block, limit, holds, label, SAMPLING_FLAGS)
    for sp in params:
        sp.validate(vocab, SAMPLING_FLAGS)


def _report(res, seconds: float, speculative: bool) -> None:
    for i, toks in enumerate(res.tokens):
        print(f"tokens[{i}]: {','.join(map(str, toks))}")
    if speculative:
        acc = " ".join(f"{a:.3f}" for a in res.acceptance_per_position)
        print(f"acceptance per draft position: {acc}")
        print(f"mean accepted length: {res.mean_accepted_length:.3f} tokens/step")
        for method, a in res.by_method.items():
            print(acceptance_line(method, a))
    n = sum(len(t) for t in res.tokens)
    print(f"steps: {res.steps}  time: {seconds:.2f}s  ({1e3 * seconds / max(res.steps, 1):.1f} ms/step, "
          f"{n / seconds if seconds else 0:.1f} tok/s)")


def acceptance_line(method: str, a) -> str:
    """One line per verification method (greedy / token / block): the fraction of row-steps
    that accepted draft k or more, per k, and the mean accepted length."""
    per = " ".join(f"{x:.3f}" for x in a.acceptance_per_position)
    return (f"acceptance [{method}]: {per} | mean accepted length {a.mean_accepted_length:.3f} "
            f"({a.row_steps} row-steps)")


# ---- generate (eager reference) ------------------------------------------------------------

def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=path_arg,
                   help="checkpoint directory (config.json + safetensors)")
    _sampling_args(p)
    p.add_argument("--no-speculation", action="store_true", help="plain target decoding")
    p.add_argument("--dtype", choices=PRECISIONS, default="float32",
                   help="compute dtype (default float32)")
    p.add_argument("--device", default="cpu", help="device the models run on (default cpu)")


@command("generate", "decode with the eager reference models (no compilation)", _generate_args,
         flags={**SAMPLING_FLAGS, "include_draft=False": "--no-speculation"})
def cmd_generate(args) -> int:

    params = _params(args)
    dev = device(args.device)
    root = Path(args.checkpoint)
    if not root.is_dir():
        raise CheckpointError(missing_dir(root))
    # read_config: the size cap, FIFO and nesting checks the build's loader makes
    cfg = read_config(root / "config.json")
    spec = not args.no_speculation
    if spec and not cfg.has_draft:
        raise ValueError("the checkpoint has no DSpark draft (config field 'dspark_block_size'): "
                         "pass --no-speculation")
    N = cfg.dspark_block_size if spec else 0
    _check_requests(args, params, cfg.vocab_size, block=N,
                    max_positions=cfg.max_position_embeddings)
    cache = cache_config_for(args.prompt_ids, params, N)
    check_state_fits(cfg, cache, Precision(dtype=DTYPES[args.dtype]), dev,
                     f"{len(args.prompt_ids)} prompts of up to {cache.max_seq_len} positions "
                     f"(prompt + max_new_tokens + the lookahead)")
    model = load_model(root, Precision(dtype=DTYPES[args.dtype]),
                       rope_positions(cache.max_seq_len, N), with_draft=spec, device=dev)
    t = time.perf_counter()
    res = generate(model, args.prompt_ids, params, speculative=spec, cache=cache, device=dev)
    _report(res, time.perf_counter() - t, spec)
    return 0


# ---- build -----------------------------------------------------------------------------------

def _buckets(text: str) -> tuple[int, ...]:
    try:
        b = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated bucket sizes, got {text!r}") from None
    if not b or min(b) < 1:
        raise argparse.ArgumentTypeError(f"bucket sizes must be positive, got {text!r}")
    return b


PREFILL_RULE = ("powers of two from 64 up to min(512, --max-seq-len): 64,128,256,512 at the "
                "default --max-seq-len")


def _build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=path_arg,
                   help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--out", required=True, type=path_arg,
                   help="engine directory (written atomically)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing engine at --out (only an engine directory: every "
                        "file in it one the engine's manifest lists)")
    p.add_argument("--buckets", type=_buckets, default=DEFAULT_BUCKETS,
                   help=f"batch buckets (default {','.join(map(str, DEFAULT_BUCKETS))})")
    p.add_argument("--max-rows", type=int, default=None,
                   help="concurrent requests, >= the largest bucket (default: the largest bucket)")
    p.add_argument("--prefill-chunks", type=prefill_chunks_arg, default="auto",
                   metavar="C1,C2|auto|none",
                   help=f"chunk lengths with a compiled prefill program each (default auto: "
                        f"{PREFILL_RULE}; none: no prefill programs, prompts prefill with the "
                        "eager reference)")
    p.add_argument("--max-seq-len", type=int, default=1024,
                   help="positions per request: prompt + new tokens + the step's lookahead "
                        "(the draft block + 2); default 1024")
    p.add_argument("--dtype", choices=PRECISIONS, default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--no-act-quant", action="store_true", help="do not simulate FP8 activation quant")
    p.add_argument("--no-kv-fp8", action="store_true", help="keep KV caches in the compute dtype")
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME",
                   help="leave a pass out of the pipeline (repeatable)")
    p.add_argument("--verify-passes", action="store_true",
                   help="check every pass numerically on fresh random inputs")
    p.add_argument("--dump-graphs", metavar="DIR", default=None, type=path_arg, help="write graphs before/after each pass")
    p.add_argument("--arch", default=None, help="also compile the kernels for this arch (e.g. sm_120) "
                   "and store their resource report")
    p.add_argument("--device", default=None,
                   help="device the programs are built for (default: cuda when this machine has "
                        "a CUDA device, else cpu, with a line saying so)")
    p.add_argument("--backend", choices=BACKENDS, default="aten",
                   help="aten (the default, every device): run the exported program op by op; "
                        "inductor: compile the glue between the fused ops with Inductor at build "
                        "time (slow to build: one tiny-model program took > 465 s on an H200)")
    p.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="processes compiling side by side: a CUDA build's Triton kernels (default "
                        "0: one per core, bounded by memory) and, with --backend inductor, its "
                        "programs (0: one per program, up to half the cores); 1: in this process")
    p.add_argument("--static-batch", action="store_true",
                   help="one program per bucket and per prefill chunk length, each exported at "
                        "its own size (default: one step, one target-only and one prefill "
                        "program exported with a dynamic size for every bucket / chunk length, "
                        "so export, passes and load do not grow with the bucket count; each "
                        "bucket still gets its own CUDA graph)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (a power of two dividing the model's heads, "
                        "output groups, experts and vocabulary; default 1): one engine "
                        "directory with each rank's programs and weight shard, built by N "
                        "processes this command starts (gloo on the CPU)")
    p.add_argument("--no-target-programs", action="store_true",
                   help="leave out each bucket's target-only program (one token per row, no "
                        "draft: the engine's own non-speculative decoding, which run "
                        "--no-speculation and run --check-lossless need); saves about half a "
                        "step's export per bucket")


def _build_device(args) -> str:
    """--device, or cuda when this machine has one: the programs run where they are built."""
    import torch
    if args.device is not None:
        return str(device(args.device))
    if torch.cuda.is_available():
        return "cuda"
    print("build: no CUDA device on this machine: building for the CPU (--device cpu)",
          flush=True)
    return "cpu"


@command("build", "compile a checkpoint into an engine (one program per batch bucket)", _build_args,
         flags={"max_seq_len": "--max-seq-len", "max_rows": "--max-rows", "buckets": "--buckets",
                "out_dir": "--out", "compile_workers": "--compile-workers",
                "disabled_passes": "--disable-pass", "arch": "--arch", "dump_dir": "--dump-graphs",
                "prefill_chunks": "--prefill-chunks", "target_programs": "--no-target-programs",
                "dynamic_batch": "--static-batch", "tp": "--tp",
                "overwrite=True": "--overwrite"})
def cmd_build(args) -> int:

    if args.max_rows is not None and args.max_rows < 1:
        raise ValueError(f"--max-rows must be >= 1 (leave it out for the largest bucket), got "
                         f"{args.max_rows}")
    if args.compile_workers is not None and args.compile_workers < 0:
        raise ValueError(f"--compile-workers must be >= 0 (0: one per core), got "
                         f"{args.compile_workers}")
    dev = _build_device(args)
    dtype = args.dtype or ("bfloat16" if dev.startswith("cuda") else "float32")
    bc = BuildConfig(buckets=args.buckets, max_rows=args.max_rows or 0,
                     max_seq_len=args.max_seq_len, dtype=dtype, act_quant=not args.no_act_quant,
                     kv_fp8=not args.no_kv_fp8, disabled_passes=tuple(args.disable_pass),
                     verify_passes=args.verify_passes, dump_dir=args.dump_graphs, arch=args.arch,
                     device=dev, backend=args.backend, compile_workers=args.compile_workers or 0,
                     prefill_chunks=args.prefill_chunks,
                     target_programs=not args.no_target_programs, overwrite=args.overwrite,
                     dynamic_batch=not args.static_batch, tp=args.tp)
    out = Path(args.out)
    if ((out / MANIFEST).is_file() or (out / RANKS_FILE).is_file()) and not args.overwrite:
        raise ValueError(f"--out {out} already holds an engine; pass --overwrite to replace it")
    with engine_errors():   # e.g. --out names a directory that is not an engine
        build_engine(args.checkpoint, out, bc, log=lambda s: print(s, flush=True))
    return 0


# ---- run -------------------------------------------------------------------------------------

def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine", type=path_arg, help="engine directory (dspark-compile build)")
    _sampling_args(p)
    p.add_argument("--no-speculation", action="store_true",
                   help="decode with the target alone, through the engine's target-only programs")
    p.add_argument("--check-lossless", action="store_true",
                   help="also decode greedily through the engine's target-only programs and "
                        "compare token for token (exit 3 on a difference: 'lossless:'), then "
                        "report how far that decoding is from the eager reference's "
                        "('reference:', exit 4 beyond its rounding tolerance)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="run an engine built with build --tp N on N ranks, which this command "
                        "starts (gloo on the CPU, NCCL with rank r on cuda:r); must be the "
                        "engine's rank count")
    engine_load_args(p)


@command("run", "generate with a built engine", _run_args, flags=SAMPLING_FLAGS)
def cmd_run(args) -> int:
    from dspark_compile.engine_dir.tp_format import check_tp

    tp = 1 if args.tp is None else args.tp
    with engine_errors():
        check_tp(args.engine, tp)
    if tp > 1:
        return _run_tp(args, tp)

    params = _run_params(args)
    dev = device(args.device) if args.device else None
    # the manifest alone decides whether these requests fit: read it before the programs
    with engine_errors():
        cfg, build = engine_configs(load_manifest(args.engine, check_files=False, device=dev))
    _check_requests(args, params, cfg.vocab_size, build.max_seq_len, cfg.dspark_block_size)
    import torch

    target = dev or torch.device(build.device)
    if target.type == "cpu" or torch.cuda.is_available():   # else Engine.load names the device
        check_state_fits(cfg, build.cache(cfg.dspark_block_size), build.precision(), target,
                         f"the manifest's build_config.max_rows={build.max_rows} and "
                         f"build_config.max_seq_len={build.max_seq_len}")
    t = time.perf_counter()
    with engine_errors():
        need_target = args.no_speculation or args.check_lossless
        if need_target and not build.target_programs:
            raise ValueError(f"engine {args.engine} has no target-only programs (built with "
                             f"--no-target-programs): rebuild it without that flag for "
                             f"{'--no-speculation' if args.no_speculation else '--check-lossless'}")
        # run asks no logprobs: their copies of the programs are neither built nor captured
        eng = Engine.load(args.engine, device=dev, use_graphs=False if args.no_graphs else None,
                          target=need_target, trust_code=args.trust_engine_code,
                          logprobs=False)
    print(f"loaded {args.engine} on {eng.device} in {time.perf_counter() - t:.2f}s"
          + (f" (graphs captured: {sorted({k.size for k in eng.captured()})})"
             if eng.captured() else ""))
    spec = not args.no_speculation
    t = time.perf_counter()
    res = eng.generate(args.prompt_ids, params, speculative=spec)
    _report(res, time.perf_counter() - t, spec)
    if args.check_lossless:
        return _check_lossless(eng, args.prompt_ids, params, res.tokens)
    return 0


def _run_params(args) -> list:
    """run's sampling parameters, one per prompt, with --check-lossless's conditions checked."""
    params = _params(args)
    if args.check_lossless and params[0].method != "greedy":
        raise ValueError("--check-lossless compares greedy decoding; use --temperature 0")
    if args.check_lossless and args.no_speculation:
        raise ValueError("--check-lossless compares speculative decoding with --no-speculation "
                         "decoding: pass one of them")
    return params


def _run_tp(args, tp: int) -> int:
    """run --tp N: the request checks against rank 0's manifest, then N ranks started here
    (dspark_compile/runtime/ranks.py run_ranks): rank 0 decodes and prints, the others follow
    its calls; rank 0's exit status is the command's."""
    import tempfile
    from dspark_compile.runtime.ranks import run_ranks

    params = _run_params(args)
    rank0 = Path(args.engine) / rank_dir(0)
    with engine_errors():
        cfg, build = engine_configs(load_manifest(rank0, check_files=False))
    _check_requests(args, params, cfg.vocab_size, build.max_seq_len, cfg.dspark_block_size)
    need_target = args.no_speculation or args.check_lossless
    if need_target and not build.target_programs:
        raise ValueError(f"engine {args.engine} has no target-only programs (built with "
                         "--no-target-programs): rebuild it without that flag")
    dev = str(device(args.device)) if args.device else build.device.split(":")[0]
    with tempfile.TemporaryDirectory() as d:
        rc = Path(d) / "rc"
        run_ranks(args.engine, tp, _rank_run,
                  (args.prompt_ids, params, not args.no_speculation, args.check_lossless,
                   str(rc)), device=dev,
                  load_options={"use_graphs": False if args.no_graphs else None,
                                "target": need_target, "trust_code": args.trust_engine_code})
        return int(rc.read_text())


def _rank_run(eng, rank: int, prompts, params, spec: bool, check: bool, rc: str) -> None:
    """One rank of run --tp: rank 0 decodes, prints and writes the exit status to `rc`; the
    others run its calls (dspark_compile/runtime/ranks.py RankEngine.follow)."""
    if rank:
        eng.follow()
        return
    try:
        print(f"loaded {eng.dir.parent} on {eng.device} ({eng.pc.tp} ranks)")
        t = time.perf_counter()
        res = eng.generate(prompts, params, speculative=spec)
        _report(res, time.perf_counter() - t, spec)
        status = _check_lossless(eng, prompts, params, res.tokens) if check else 0
    finally:
        eng.stop()
    Path(rc).write_text(str(status))


def _check_lossless(eng, prompts, params, outputs) -> int:
    """run --check-lossless: the speculative `outputs` against the engine's target-only
    decoding (bit-exact), then that decoding against the eager reference (within its
    tolerance); the exit status."""
    target = eng.generate(prompts, params, speculative=False).tokens
    report = compare_outputs(target, outputs)
    print(report.line())
    # a tensor-parallel rank 0 runs the eager reference on every rank (its collectives)
    everywhere = getattr(eng, "run_everywhere", lambda fn, *a: fn(eng, *a))
    ref = everywhere(_reference, prompts, params, target)
    ref.expected_name, ref.got_name = "eager reference", "engine target-only"
    tol = reference_tolerance(eng.model.prec)
    print(ref.line(tol))
    return 0 if report.ok and ref.within(tol) else 3 if not report.ok else 4


def _reference(eng, prompts, params, target):
    """The engine's target-only tokens against its eager reference (runtime/lossless.py)."""
    return check_lossless(eng.model, prompts, params, target, device=eng.device,
                          label="reference")


# ---- inspect ---------------------------------------------------------------------------------

def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine", type=path_arg, help="engine directory (dspark-compile build)")
    p.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    p.add_argument("--onnx", metavar="OUT_DIR", default=None, type=path_arg,
                   help="write each bucket's optimized program as OUT_DIR/step_b{B}.onnx "
                        "(dspark:: ops as nodes of the custom 'dspark' domain, weights as "
                        "external data); needs the 'onnx' extra")
    p.add_argument("--bucket", type=int, action="append", default=None, metavar="B",
                   help="with --onnx: export only this bucket (repeatable; default: all)")
    p.add_argument("--report", metavar="HTML", default=None, type=path_arg,
                   help="write a self-contained HTML build report; needs the 'report' extra")


def _inspect_outputs(args, m: dict, loadable: str, out=None) -> None:
    """--report and --onnx, after the summary; their progress goes to `out` (stderr under
    --json, whose stdout is the manifest alone)."""
    def log(line: str) -> None:
        print(line, file=out or sys.stdout, flush=True)

    if args.report:
        log(f"report: {write_report(args.engine, m, args.report, loadable)}")
    if args.onnx:
        from dspark_compile.inspection.onnx_export import export_engine
        with engine_errors():
            export_engine(args.engine, m, args.onnx, args.bucket, log=log)


@command("inspect", "print an engine's manifest, buckets and pass table; --onnx, --report",
         _inspect_args)
def cmd_inspect(args) -> int:

    # the optional dependencies first: the one-line error names the extra to install
    if args.onnx:
        from dspark_compile.inspection.onnx_export import check_onnx_available
        check_onnx_available()
    if args.report:
        from dspark_compile.inspection.report_plots import check_matplotlib_available
        check_matplotlib_available()
    if args.bucket and not args.onnx:
        raise ValueError("--bucket selects what --onnx exports; pass --onnx OUT_DIR")
    # every output path before anything is printed: the summary is 25 lines
    if args.report:
        writable_file(args.report, "--report")
    if args.onnx:
        writable_dir(args.onnx, "--onnx")
    # a stale engine (other toolchain, changed pass or op) is still worth reading: only the
    # checksum, structure and file hashes must hold here; staleness is reported below
    with engine_errors():
        m = load_manifest(args.engine, skip=("torch_version", "triton_version", "cuda_version",
                                             "target_sm", "dspark_compile_version", "passes",
                                             "dspark_ops"))
    unknown = sorted(set(args.bucket or ()) - set(m.get("buckets", [])))
    if unknown:
        raise ValueError(f"--bucket {unknown[0]}: the engine has buckets {m.get('buckets')}")
    try:
        load_manifest(args.engine, check_files=False)
        loadable = "yes"
    except ArtifactError as e:
        loadable = f"no: {e}"
    if args.json:
        print(json.dumps(m, indent=1))
        _inspect_outputs(args, m, loadable, out=sys.stderr)
        return 0
    for k in ("format_version", "dspark_compile_version", "torch_version", "triton_version",
              "cuda_version", "target_sm", "model_config_hash", "created_utc"):
        print(f"{k:>24}: {m.get(k)}")
    print(f"{'buckets':>24}: {m['buckets']}")
    print(f"{'build_config':>24}: {json.dumps(m.get('build_config'))}")
    print(f"{'graph_memory_bytes':>24}: {m.get('graph_memory_bytes')}")
    if m.get("compiled"):
        print(f"{'compile_seconds':>24}: {json.dumps(m['compiled'].get('compile_seconds'))}")
    if m.get("runtime_load"):
        print(f"{'runtime_load':>24}: {json.dumps(m['runtime_load'])}")
    print(f"{'loads here':>24}: {loadable}")
    stats = m.get("pass_stats", {})
    if stats:
        b = str(max(m["buckets"]))
        print(f"passes (bucket {b}):")
        print(format_stats_table(stats[b]))
    _inspect_outputs(args, m, loadable)
    return 0
