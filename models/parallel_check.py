"""The tensor-parallel check: one fixed decoding scenario on `tp` CPU processes (gloo) running
the sharded reference (models/sharding.py) and on the unsharded model, so the two can be
compared tensor by tensor (tests/models/test_parallel.py).

The scenario: a greedy and a sampled row prefilled in two chunks (speculative), one
DraftVerifyStep over both rows and a padded one, one TargetStep; it returns every output and
the whole decode state after, and a greedy row's tokens from three speculative steps and from
target-only decoding (equal when speculation is lossless). Ranks rendezvous on a free loopback
port; each writes its results to `out_dir/rank{r}.pt`, and a rank that fails ends the run with
its exception (torch.multiprocessing.spawn's ProcessRaisedException).
"""
from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dspark_compile.models.config import CacheConfig, Precision
from dspark_compile.models.generate import set_row_sampling
from dspark_compile.models.loading import load_model
from dspark_compile.models.parallel import ParallelConfig
from dspark_compile.models.request import SamplingParams
from dspark_compile.models.sharding import build_rank_model
from dspark_compile.models.state import allocate_state
from dspark_compile.models.step import DraftVerifyStep, TargetStep, prefill

MAX_POSITIONS = 128


def scenario(model) -> dict:
    """Outputs and final decode state of the fixed scenario (module docstring) on `model`."""
    state = allocate_state(model.cfg, CacheConfig(max_rows=2, max_seq_len=64,
                                                  max_step_tokens=16), model.prec)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 1, 4, 1, 5]]
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=4)]
    out = {"first": [], "prefill_logits": []}
    with torch.no_grad():
        for r, (p, sp) in enumerate(zip(prompts, params)):
            set_row_sampling(state, r, sp)
            tok, logits = prefill(model, state, r, p, 8, speculative=True, return_logits=True)
            out["first"].append(tok)
            out["prefill_logits"].append(logits)
        rows = torch.tensor([0, 1, 2])                # 2: the trash row, padding
        out["spec_tokens"], out["spec_num"] = DraftVerifyStep(model)(rows, state)
        out["target_tokens"], out["target_num"] = TargetStep(model)(rows, state)
    out["state"] = {k: v.clone() for k, v in state.items()}
    out["lossless"] = lossless_tokens(model)
    return out


def lossless_tokens(model, steps: int = 3) -> tuple[list[int], list[int]]:
    """(greedy speculative tokens, greedy target-only tokens) of one row: `steps` speculative
    steps, then target-only steps up to as many tokens; equal when speculation is lossless."""
    cache = CacheConfig(max_rows=1, max_seq_len=64, max_step_tokens=16)
    prompt, rows = [7, 3, 9, 2, 8], torch.tensor([0])
    runs = []
    with torch.no_grad():
        for speculative in (True, False):
            state = allocate_state(model.cfg, cache, model.prec)
            set_row_sampling(state, 0, SamplingParams())
            toks = [prefill(model, state, 0, prompt, 8, speculative=True)]
            if speculative:
                for _ in range(steps):
                    t, n = DraftVerifyStep(model)(rows, state)
                    toks += t[0, :int(n[0])].tolist()
            else:
                while len(toks) < len(runs[0]):
                    toks += TargetStep(model)(rows, state)[0][0].tolist()
            runs.append(toks)
    return runs[0], runs[1]


def _rank(rank: int, tp: int, port: int, ckpt: str, out_dir: str, prec: Precision) -> None:
    torch.set_num_threads(1)            # tp processes share the host's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)
    try:
        model, read = build_rank_model(ckpt, ParallelConfig.from_group(), prec,
                                       max_positions=MAX_POSITIONS)
        out = scenario(model)
        out["bytes_read"] = read
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_check(ckpt: str | Path, tp: int, out_dir: str | Path, prec: Precision):
    """(the unsharded model's scenario, [each rank's]); the unsharded one runs in this process
    while the ranks run."""
    out_dir = Path(out_dir)
    ctx = mp.spawn(_rank, args=(tp, free_port(), str(ckpt), str(out_dir), prec), nprocs=tp,
                   join=False)
    ref = scenario(load_model(ckpt, prec, max_positions=MAX_POSITIONS))
    while not ctx.join():
        pass
    return ref, [torch.load(out_dir / f"rank{r}.pt") for r in range(tp)]
