"""Random live requests in a decode state: what pass verification, the engine tests and the
benchmarks run a step on.

A step's numerics depend on the rows it sees: greedy and sampled rows take different sampler
paths, top-k / top-p rows add the threshold search, and prompt lengths decide where the caches'
ring buffers and compression blocks stand. One helper builds such rows so that every caller
exercises the same mix.
"""
from __future__ import annotations

import random

import torch

MIXES = ("random", "alternate", "greedy")


def random_sampling(rng: random.Random, greedy: bool | None = None):
    """Sampling parameters of one random request: greedy half the time (or as `greedy` says),
    otherwise temperature 0.8 or 1.0 with top-k 0 or 7 and top-p 1.0 or 0.9."""
    from dspark_compile.models.request import SamplingParams
    if greedy is None:
        greedy = rng.random() < 0.5
    if greedy:
        return SamplingParams(seed=rng.randrange(1 << 30))
    return SamplingParams(temperature=rng.choice([0.8, 1.0]), top_k=rng.choice([0, 7]),
                          top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 30))


def prefill_random_requests(model, state: dict, rows, seed: int, chunk: int, *,
                            max_prompt_len: int = 12, mix: str = "random") -> None:
    """Admit one random request into each state row of `rows`: its sampling parameters
    (`mix`: "random" per row, "alternate" greedy on even positions of `rows`, "greedy" all),
    then an eager prefill of a random prompt of 1..max_prompt_len tokens in chunks of `chunk`
    tokens (the cache's max_step_tokens)."""
    from dspark_compile.models.generate import set_row_sampling
    from dspark_compile.models.step import prefill
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    rng = random.Random(seed)
    V = model.cfg.vocab_size
    for i, row in enumerate(rows):
        greedy = {"random": None, "alternate": i % 2 == 0, "greedy": True}[mix]
        set_row_sampling(state, row, random_sampling(rng, greedy))
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, max_prompt_len))]
        prefill(model, state, row, prompt, chunk, speculative=True)


def prefilled_state(model, cache, bucket: int, seed: int):
    """A fresh state holding random requests for a `bucket`-row step: (rows, state), the last row
    of a multi-row bucket left as padding (the trash row), so padded rows are exercised too."""
    from dspark_compile.models.state import allocate_state, trash_row
    device = next(model.buffers()).device
    state = allocate_state(model.cfg, cache, model.prec, device)
    live = bucket - 1 if bucket > 1 else 1
    prefill_random_requests(model, state, range(live), seed, cache.max_step_tokens)
    rows = torch.tensor([r if r < live else trash_row(state) for r in range(bucket)], device=device)
    return rows, state
