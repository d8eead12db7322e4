"""benchmarks/tp_step.py's default one-GPU mode: the ENGINES' step programs (the build's
exported, fused aten programs) at TP = 1 and rank 0's at TP = 2, each bucket's step captured in
one CUDA graph (the engine's own capture) and timed in the same run, rank 0's program with its
COLLECTIVES REPLACED BY LOCAL COPIES (benchmarks/tp_standin.py: each all-gather becomes rank 0's
tensor followed by zeros, the same shape and bytes; each wait the identity; no process group).

Both engines are built under --work with one build config (--buckets, --max-seq-len, --dtype,
--backend aten, no prefill or target-only programs), each in a spawned process (the build's
memory goes with it): TP = 1 with build_engine, TP = 2's rank 0 alone with
tp_standin.build_rank_standin (a "fake" process group: this machine has one device; the program
is the one `build --tp 2` writes under rank0/). A build is reused when --work holds one of the
same build config.

Per bucket B: every row 0..B-1 holds a random live request (eager prefill through each
engine's reference model, the same prompts and sampling at both TPs), one uncaptured step counts
the stand-in's gathers and their bytes and checks the outputs (ids in [0, V), accepted counts in
[1, block + 1], no NaN in the state), then --steps graph replays are timed (CUDA events, state
restored and L2 flushed outside the timed region: step_variants.time_runner), then TP = 1 again
(drift). --dry-run (CPU, no CUDA): the same path untimed, one step each, on the tp checkpoint.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

import tp_standin

MODE = "engine programs"


def build_config(args, device: str, tp: int):
    from dspark_compile.engine_dir.build_config import BuildConfig
    return BuildConfig(buckets=tuple(args.buckets), max_seq_len=args.max_seq_len,
                       prefill_chunks=(), target_programs=False, dtype=args.dtype,
                       device=device, backend="aten", tp=tp, overwrite=True)


def _build_child(kind: str, ckpt: str, out: str, bc) -> None:
    """A spawned process's build (module-level: spawn imports it by name)."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    if kind == "tp1":
        from dspark_compile.build.pipeline import build_engine
        build_engine(ckpt, out, bc, log=lambda s: None)
    else:
        import tp_standin as standin
        standin.build_rank_standin(ckpt, out, bc, log=lambda s: None)


def ensure_engine(kind: str, ckpt: Path, out: Path, bc, log) -> float:
    """The engine at `out` built with `bc` (reused when its manifest records the same build
    config); returns the build's seconds (0 when reused)."""
    import multiprocessing as mp
    m = out / "manifest.json"
    if m.is_file() and json.loads(m.read_text()).get("build_config") == bc.to_manifest():
        log(f"[build] {kind}: reusing {out}")
        return 0.0
    t = time.perf_counter()
    log(f"[build] {kind} -> {out} (a spawned process)")
    p = mp.get_context("spawn").Process(target=_build_child, args=(kind, str(ckpt), str(out), bc))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"tp_step: the {kind} build failed (exit code {p.exitcode}); its "
                           "traceback is above")
    return round(time.perf_counter() - t, 1)


def load_engines(dirs: dict, dev: torch.device, cuda: bool) -> dict:
    from dspark_compile.runtime.engine import Engine
    opts = dict(device=dev, use_graphs=cuda, greedy_variants=False, target=False,
                logprobs=False, prefill="eager")
    return {1: Engine.load(dirs[1], record_graph_memory=False, **opts),
            2: tp_standin.load_rank_standin(dirs[2], **opts)}


def check_step(out, eng, B: int) -> dict:
    """The step's outputs (tokens [B, block + 1], -1 past each row's count; counts [B]): ids
    in [0, V), counts in [1, block + 1], shapes right, no NaN in the decode state; raises
    AssertionError naming what is wrong; returns a summary."""
    tokens, num = out
    V, blk = eng.cfg.vocab_size, eng.cfg.dspark_block_size
    assert tuple(tokens.shape) == (B, blk + 1) and tuple(num.shape) == (B,), \
        f"output shapes {list(tokens.shape)}, {list(num.shape)} (want [{B}, {blk + 1}], [{B}])"
    assert bool(((num >= 1) & (num <= blk + 1)).all()), f"accepted counts {num.tolist()}"
    live = torch.arange(blk + 1, device=tokens.device)[None, :] < num[:, None]
    ids = tokens[live]
    assert bool(((ids >= 0) & (ids < V)).all()), f"ids out of [0, {V}): {ids.tolist()[:16]}"
    for k, t in eng.state.items():
        if t.is_floating_point():
            assert not bool(t.isnan().any()), f"NaN in the decode state's {k}"
    return {"accepted": num.tolist(), "ids_in_range": True}


def run_program(args, work: Path, rec: dict, write, log, dev: torch.device) -> None:
    from dspark_compile.engine_dir.format import STEP, ProgramKey
    from dspark_compile.models.random_requests import prefill_random_requests
    from dspark_compile.models.state import restore_state, snapshot_state
    from step_variants import Runner, _l2_flusher, time_runner
    cuda = dev.type == "cuda"
    ckpt = checkpoint(args, work, rec, log, dev)
    dirs = {}
    for tp in (1, 2):
        bc = build_config(args, str(dev) if cuda else "cpu", tp)
        dirs[tp] = work / f"engine_{ckpt.name}_tp{tp}{'_rank0' if tp == 2 else ''}"
        rec["setup"][f"build_tp{tp}_s"] = ensure_engine(f"tp{tp}", ckpt, dirs[tp], bc, log)
    rec["build_config"] = {k: v for k, v in build_config(args, str(dev), 2).to_manifest().items()
                           if k != "tp"}
    if args.build_only:
        rec["build_only"] = True
        log(f"[build] --build-only: engines under {work}; run again with the same --work and "
            "flags to time them")
        return
    t = time.perf_counter()
    engines = load_engines(dirs, dev, cuda)
    rec["setup"]["load_s"] = round(time.perf_counter() - t, 1)
    rec["rewritten_nodes"] = engines[2].rewritten
    flush = _l2_flusher(dev)
    standin = engines[2].standin
    for B in args.buckets:
        key = ProgramKey(STEP, B)
        kept = {}
        for tp in (1, 2):
            eng = engines[tp]
            rows = torch.arange(B, device=dev)
            with torch.no_grad():
                prefill_random_requests(eng.model, eng.state, range(B), args.seed,
                                        eng.cache.max_step_tokens,
                                        max_prompt_len=args.max_prompt_len)
            snap = snapshot_state(eng.state)
            program = eng.program(key)
            standin.reset()
            with torch.no_grad():
                out = program.fn(rows, eng.state)           # uncaptured: counts the gathers
            checked = check_step(pytree.tree_leaves(out)[:2], eng, B)
            calls, b_in, b_out = ((standin.calls, standin.bytes_in, standin.bytes_out)
                                  if tp == 2 else (0, 0, 0))
            restore_state(eng.state, snap)
            row = {"TP": tp, "rank": 0, "B": B, "collective_calls": calls,
                   "collective_bytes": b_in, "collective_kb": b_in / 1e3,
                   "collective_kb_written": b_out / 1e3, "check": checked}
            if cuda:
                g = program.graph
                g.rows.copy_(rows)
                ctx = {"device": dev, "flush": flush,
                       "restore": lambda s=eng.state, n=snap: restore_state(s, n)}
                r = Runner(g.graph.replay, g.graph)
                tm = time_runner(r, ctx, args.steps, args.warmup)
                kept[tp] = (r, ctx)
                row.update(step_us=tm["us_median"], step_us_p10=tm["us_p10"],
                           step_us_p90=tm["us_p90"], replays=tm["replays"])
                if tp == 2:
                    row["predicted_2gpu_us"] = tm["us_median"] + calls * args.collective_us
                log(f"[B={B}] TP = {tp}: {tm['us_median']:.1f} us, {calls} collectives "
                    f"({b_in / 1e3:.1f} KB)")
            else:
                log(f"[B={B}] TP = {tp}: dry run, one step, accepted {checked['accepted']}, "
                    f"{calls} collectives ({b_in / 1e3:.1f} KB)")
            rec["rows"].append(row)
            write()
        if cuda:
            r, ctx = kept[1]
            again = time_runner(r, ctx, args.steps, args.warmup)["us_median"]
            first = next(x for x in rec["rows"] if x["TP"] == 1 and x["B"] == B)
            first.update(step_us_again=again, drift=again / first["step_us"] - 1)
            log(f"[B={B}] TP = 1 again: {again:.1f} us")
    if cuda:
        base = {row["B"]: row["step_us"] for row in rec["rows"] if row["TP"] == 1}
        for row in rec["rows"]:
            row["ratio_to_tp1"] = row["step_us"] / base[row["B"]]


def checkpoint(args, work: Path, rec: dict, log, dev: torch.device) -> Path:
    """The preset's synthetic checkpoint (GPU) or, in a dry run, the tp checkpoint: tiny
    widened for tp = 2 and cut to 3 target layers (a hash, a compressed and an indexed one)."""
    from dspark_compile.factory.synth import synth_checkpoint
    if dev.type == "cuda":
        ckpt = work / f"ckpt_{args.preset}"
        if not (ckpt / "config.json").exists():
            t = time.perf_counter()
            log(f"[synth] {args.preset} -> {ckpt}")
            synth_checkpoint(args.preset, ckpt, seed=0, device="cuda", overwrite=True)
            rec["setup"]["synth_s"] = round(time.perf_counter() - t, 1)
        rec["checkpoint"] = f"{args.preset} (synthetic)"
        return ckpt
    from dspark_compile.factory.tp_checkpoint import tp_checkpoint
    tiny, wide = work / "ckpt_tiny", work / "ckpt_tp_wide3"
    if not (wide / "config.json").exists():
        if not (tiny / "config.json").exists():
            synth_checkpoint("tiny", tiny, seed=0, overwrite=True)
        tp_checkpoint(tiny, wide, (0, 3, 4))
    rec["checkpoint"] = "tiny widened for tp = 2, 3 target layers (dry run)"
    return wide


def describe(rec: dict) -> None:
    rec["step"] = ("the engines' step programs (build --backend aten: exported, fused; the "
                   "TP = 1 engine and rank 0 of the TP = 2 engine, one build config), each "
                   "bucket's captured in one CUDA graph by the engine")
    rec["collectives"] = (f"TP = 2 rank 0: {tp_standin.STANDIN} (benchmarks/tp_standin.py: "
                          "each all_gather_into_tensor node -> rank 0's tensor then zeros, the "
                          "same shape and bytes; each wait_tensor -> identity; no process "
                          "group)")

