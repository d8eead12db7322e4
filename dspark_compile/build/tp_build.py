"""`build --tp N`: one engine directory holding each rank's programs and weight shard.

    ENGINE/ranks.json          the rank count, each rank's directory and hashes (below)
    ENGINE/rank0/ ... rank{N-1}/
                               each a whole engine (manifest.json, programs/,
                               weights.safetensors: that rank's shard, tokenizer) as build
                               writes one, its programs calling the functional collectives
                               (models/parallel.py) and its manifest recording
                               build_config.tp = N and tp_rank = r

The build spawns the N ranks itself (torch.multiprocessing, gloo on the CPU, NCCL on CUDA with
rank r on cuda:r); each reads only its share of the native checkpoint (models/sharding.py
load_rank_tensors), exports, runs the pass pipeline and writes its directory exactly as a
one-device build does (build/pipeline.py build_model). The parent writes ranks.json and renames
the whole directory into place: a build that fails in any rank leaves no engine.

ranks.json and the directory's names: dspark_compile/engine_dir/tp_format.py; the runtime's
loader: dspark_compile/runtime/ranks.py.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch

from dspark_compile.atomic_dir import move_into_place, temp_dir
from dspark_compile.engine_dir.build_config import BuildConfig
from dspark_compile.engine_dir.tp_format import (RANKS_FILE, TP_FORMAT, TP_VERSION,
                                                 describe_ranks, rank_dir)
from dspark_compile.runtime.ranks import free_port, init_rank, join_ranks



def check_tp_build(ckpt, bc: BuildConfig) -> None:
    """What --tp refuses before any rank starts: the backend, the devices, and a split of the
    checkpoint that the rank count does not divide or that cuts an FP8 scale block (naming the
    tensor: models/sharding.py check_splits)."""
    from dspark_compile.models.checkpoint import read_config
    from dspark_compile.models.schema import checkpoint_schema
    from dspark_compile.models.sharding import check_splits

    if bc.backend != "aten":
        raise ValueError(f"--tp {bc.tp}: only --backend aten builds per-rank programs (got "
                         f"--backend {bc.backend})")
    if torch.device(bc.device).type == "cuda" and torch.cuda.device_count() < bc.tp:
        raise ValueError(f"--tp {bc.tp}: this machine has {torch.cuda.device_count()} CUDA "
                         f"devices, a rank needs its own (build on the CPU: --device cpu)")
    cfg = read_config(Path(ckpt) / "config.json")
    check_splits(cfg, bc.tp, checkpoint_schema(cfg))


def build_ranks(ckpt, out: Path, bc: BuildConfig, build_model, log) -> dict:
    """Build the `bc.tp` ranks' engines into `out` (the caller holds its lock and has checked
    that it may be written), each rank calling `build_model` (build/pipeline.py's, passed in:
    a module-level function the spawned ranks import by name) on its sharded model; returns
    ranks.json's content."""
    import torch.multiprocessing as mp

    check_tp_build(ckpt, bc)
    why = replace_refusal(out)
    if why:
        raise ValueError(f"refusing to replace {out}: {why}")
    t0 = time.perf_counter()
    tmp = temp_dir(out)
    try:
        log(f"[tp] building {bc.tp} ranks in spawned processes ({_backend(bc)}); rank 0's log "
            "follows")
        ctx = mp.spawn(_rank_main, args=(bc, str(ckpt), str(tmp), free_port(), build_model,
                                         torch.get_num_threads()), nprocs=bc.tp, join=False)
        join_ranks(ctx, "build")
        ranks = describe_ranks(tmp, bc.tp)
        doc = {"format": TP_FORMAT, "version": TP_VERSION, "tp": bc.tp,
               "build_config": bc.to_manifest(), "ranks": ranks}
        (tmp / RANKS_FILE).write_text(json.dumps(doc, indent=1))
        move_into_place(tmp, out, replace=bc.overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"[tp] {out}: {bc.tp} ranks, shards "
        + ", ".join(f"{r['weights_bytes'] / 2**20:.1f} MiB" for r in ranks)
        + f" (total {time.perf_counter() - t0:.1f}s)")
    return doc


def replace_refusal(out: Path):
    """Why the build may not replace `out` (None: absent, empty, an engine, or a tp engine:
    ranks.json and rank directories that are each an engine)."""
    from dspark_compile.engine_dir.write import not_an_engine
    if not out.exists() or (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        return None
    if not (out / RANKS_FILE).is_file():
        return not_an_engine(out)
    for p in out.iterdir():
        if p.name == RANKS_FILE:
            continue
        why = not_an_engine(p) if p.is_dir() and p.name.startswith("rank") else \
            "it holds other files than ranks.json and rank directories"
        if why:
            return f"{p.name}: {why}" if p.is_dir() else why
    return None


def _backend(bc: BuildConfig) -> str:
    return "nccl" if torch.device(bc.device).type == "cuda" else "gloo"


def _rank_main(rank: int, bc: BuildConfig, ckpt: str, tmp: str, port: int,
               build_model, threads: int) -> None:
    import torch.distributed as dist
    from dspark_compile.models.checkpoint import read_config
    from dspark_compile.models.parallel import ParallelConfig
    from dspark_compile.models.sharding import build_rank_model

    device = init_rank(rank, bc.tp, port, bc.device, threads)
    try:
        t0 = time.perf_counter()
        rbc = dataclasses.replace(bc, device=device) if device != bc.device else bc

        def log(line: str) -> None:
            if rank == 0:
                print(line, flush=True)

        block = read_config(Path(ckpt) / "config.json").dspark_block_size
        model, read = build_rank_model(ckpt, ParallelConfig.from_group(), rbc.precision(),
                                       rbc.rope_positions(block), True, device)
        log(f"[load] rank {rank}: {read / 2**20:.1f} MiB of the checkpoint read")
        build_model(model, model.full_cfg, ckpt, Path(tmp) / rank_dir(rank), rbc, log, None, t0,
                    manifest_fields={"tp_rank": rank})
    finally:
        dist.destroy_process_group()
