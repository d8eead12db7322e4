"""CUDA-graph capture and the step's packed output, shared by the step graphs
(dspark_compile/runtime/engine.py) and the prefill graphs (dspark_compile/runtime/prefill.py).

    warm_up(fn, args)          side-stream calls, then the device idle: what a capture records
                               must have run once outside it (lazy initialisation, allocations)
    capture_graph(fn, args)    fn(*args) captured into the shared pool on the capture stream
    packed(fn)                 a step whose two outputs (tokens [B, N+1], num [B]) come back as
                               one int64 tensor [B, N+2], so one device-to-host copy reads a step
                               (a logprobs step's payload after them)
    StepGraph                  a captured step: its graph, its static rows input, its output

A graph's outputs are static tensors in the pool: valid until the next replay of any graph of
the pool. Reading them is stream-ordered, so a copy enqueued right after a replay reads them
before the next replay (enqueued later on the same stream) overwrites them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def warm_up(fn, args: tuple, device: torch.device, stream, warmup: int) -> None:
    """`warmup` calls fn(*args) on the side stream `stream`, then the device idle: what a capture
    records must have run once outside it, and on the stream the capture uses."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)


def capture_graph(fn, args: tuple, device: torch.device, pool, stream):
    """fn(*args) captured into the graph pool `pool` on `stream`, once warmed up (warm_up);
    returns (the CUDAGraph, fn's outputs: static tensors in the pool, valid until the next replay
    of any graph of the pool)."""
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn(*args)
    torch.cuda.synchronize(device)
    return graph, out


def pack(tokens: torch.Tensor, num: torch.Tensor, payload: torch.Tensor | None = None
         ) -> torch.Tensor:
    """[B, N+1] committed tokens and [B] counts as one [B, N+2] int64 tensor (the count last);
    a logprobs step's float32 payload [B, P] (runtime/logprobs.py) follows as P int64 columns
    holding its bits: [B, N+2+P], still one device-to-host copy."""
    parts = [tokens.to(torch.int64), num.to(torch.int64)[:, None]]
    if payload is not None:
        parts.append(payload.contiguous().view(torch.int32).to(torch.int64))
    return torch.cat(parts, 1)


def unpack(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack's inverse: (tokens [B, N+1], num [B]), views of `out`."""
    return out[:, :-1], out[:, -1]


def packed(fn):
    """The step `fn(rows, state) -> (tokens, num[, payload])` returning pack(...): a graph of it
    ends with one small concatenation, and a step's outputs are one contiguous tensor."""
    def step(rows, state):
        return pack(*fn(rows, state))
    return step


@dataclass
class StepGraph:
    graph: object               # torch.cuda.CUDAGraph
    rows: torch.Tensor          # [B] static input: the state row of each batch row
    out: torch.Tensor           # [B, N+2] static output (pack), in the pool

    @property
    def out_tokens(self) -> torch.Tensor:
        return unpack(self.out)[0]

    @property
    def out_num(self) -> torch.Tensor:
        return unpack(self.out)[1]
