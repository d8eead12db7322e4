"""The tensor-parallel engine's checks on CPU processes (tests/runtime/test_tp_engine.py): each
rank's programs, as a `build --tp` engine holds them, against the rank's eager sharded model on
the same state; and a rank that exits while the others decode.

The ranks are spawned gloo processes (one intra-op thread each); each writes its results to
`out_dir/rank{r}.pt`.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_compile.models.request import SamplingParams
from dspark_compile.models.sharding import build_rank_model
from dspark_compile.models.step import DraftVerifyStep, TargetStep
from dspark_compile.runtime.ranks import free_port, init_rank, load_rank


def program_scenario(eng, model, bucket: int, chunk: int | None, seed: int = 1) -> dict:
    """{program: (outputs, state after)} of each kind of the rank engine `eng` (its step,
    target-only step and prefill program as loaded from the engine directory) and of `model`
    (the rank's eager ParallelDeepseekV4) on the same prefilled state: random requests in a
    `bucket`-row batch (its last row the trash row); the prefill chunk of `chunk` fresh ids
    into a further row behind live caches (chunk None: an engine without prefill programs,
    no prefill kind). Keys "<kind>:program" and "<kind>:eager"."""
    import random

    from dspark_compile.engine_dir.format import PREFILL, STEP, TARGET, ProgramKey
    from dspark_compile.models.prefill_chunk import PrefillChunk, chunk_inputs
    from dspark_compile.models.random_requests import prefilled_state

    rows, state = prefilled_state(model, eng.cache, bucket, seed)
    rng = random.Random(seed)
    row = bucket if bucket < eng.cache.max_rows else 0
    start = int(state["row.last_pos"][row]) + 1
    calls = {
        STEP: (eng.table[ProgramKey(STEP, bucket)].fn, DraftVerifyStep(model), rows),
        TARGET: (eng.table[ProgramKey(TARGET, bucket)].fn, TargetStep(model), rows),
    }
    if chunk is not None:
        ids = [rng.randrange(model.full_cfg.vocab_size) for _ in range(chunk)]
        calls[PREFILL] = (eng.prefill_programs.modules[chunk], PrefillChunk(model, chunk),
                          chunk_inputs(row, start, ids, chunk))
    out = {}
    with torch.no_grad():
        for kind, (program, eager, first) in calls.items():
            for name, fn in (("program", program), ("eager", eager)):
                s = {k: v.clone() for k, v in state.items()}
                out[f"{kind}:{name}"] = (fn(first, s), s)
    return out


def _program_rank(rank: int, tp: int, port: int, engine: str, ckpt: str, out_dir: str,
                  bucket: int, chunk: int | None) -> None:
    from dspark_compile.models.moe import use_kernel_layouts

    init_rank(rank, tp, port, "cpu", threads=1)
    try:
        eng = load_rank(engine, rank, tp, prefill="programs" if chunk else "eager")
        b = eng.build
        model, _ = build_rank_model(ckpt, eng.pc, b.precision(),
                                    b.rope_positions(eng.cfg.dspark_block_size))
        use_kernel_layouts(model, b.precision().dtype)     # as the build exported it
        torch.save(program_scenario(eng, model, bucket, chunk), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_program_check(engine: str | Path, ckpt: str | Path, tp: int, out_dir: str | Path,
                      bucket: int, chunk: int | None) -> list:
    """Each rank's program_scenario, run on `tp` spawned gloo ranks loading the engine at
    `engine` (build --tp) and the checkpoint `ckpt` it was built from."""
    mp.spawn(_program_rank, args=(tp, free_port(), str(engine), str(ckpt), str(out_dir),
                                  bucket, chunk), nprocs=tp)
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(tp)]


def exit_on_rank(eng, rank: int, victim: int, code: int) -> None:
    """A run_ranks body for the dead-rank check: rank `victim` exits with `code` at once; rank 0
    decodes (blocked in its first broadcast or collective on the dead peer), the others
    follow."""
    import os
    if rank == victim:
        os._exit(code)
    if rank:
        eng.follow()
        return
    eng.generate([[1, 2, 3]], [SamplingParams(max_new_tokens=4)])
    eng.stop()
