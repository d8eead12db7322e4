"""What the engine hands its callers for each program call (dspark_compile/runtime/engine.py):
`Launched`, one call in flight; `StepTimes`, the calls counted; `Program`, a loaded program with
its captured graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_compile.engine_dir.format import TARGET, ProgramKey
from dspark_compile.runtime.cuda_graphs import StepGraph


@dataclass
class StepTimes:
    """Program calls of the engine's steps (run_step, and the launches of a GenerationStream)."""
    steps: int = 0
    greedy_steps: int = 0          # of which ran the greedy draft-sampler variant
    target_steps: int = 0          # of which ran the target-only program (no speculation)
    seconds: float = 0.0           # host seconds inside the launches and the waits for them
    per_bucket: dict = field(default_factory=dict)
    # calls launched ahead (GenerationStream's overlap) whose every row had ended by the time
    # their outputs were read: their tokens went to no request
    discarded: int = 0


@dataclass
class Launched:
    """One program call in flight: its packed outputs (cuda_graphs.pack: tokens | num, or a
    prefill's first token) reach `host` once `event` has completed (None: already there).
    `key`: the step program it ran (None: a prefill)."""
    host: torch.Tensor
    event: object = None
    key: ProgramKey | None = None
    # a logprobs call's payload columns (the same host copy; runtime/logprobs.py), else None
    payload: torch.Tensor | None = None

    @property
    def bucket(self) -> int:
        return self.key.size if self.key is not None else 0

    @property
    def greedy(self) -> bool:
        return self.key is not None and self.key.variant == "greedy"

    @property
    def target(self) -> bool:
        return self.key is not None and self.key.kind == TARGET

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


@dataclass
class Program:
    """A loaded program as the engine runs it: its callable `fn(rows, state)` (the exported
    program's module, its greedy variant, or the Inductor-compiled step) and, once captured on
    CUDA, its graph."""
    fn: object
    graph: StepGraph | None = None
