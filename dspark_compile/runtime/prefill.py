"""An engine's prefill programs at run time (`build --prefill-chunks`, models/prefill_chunk.py).

    load:    per chunk length C: the exported program's module (aten) or its Inductor-compiled
             program from compiled/ (inductor), one static input buffer [C + 3]
    capture: (CUDA) per C, largest first, after warm-up runs on the trash row, into the step
             graphs' pool: a chunk's forward is thousands of kernel launches, which a replay
             issues at once
    prefill: a prompt of L tokens is chunk_schedule(L) calls, each replaying (or running) its
             length's program; only the last call's output (the first token) is read back, so
             the chunks queue on the stream without a host sync between them; `launch` enqueues
             some of the calls (the scheduler spreads a long prompt over several steps) and
             reads nothing

A graph's input buffer lives outside the pool and its output inside it (valid until the next
replay of any graph of the pool): `prefill` reads the first token at once.

Logprobs (runtime/logprobs.py): each chunk length's program also has a variant that returns
the first token's payload (the target's logprobs at the chunk's last position), derived at
load and captured beside it; a request that asks runs it for its prompt's last call only.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dspark_compile.engine_dir.format import PREFILL, ArtifactError
from dspark_compile.models.prefill_chunk import chunk_inputs, chunk_schedule, HEADER
from dspark_compile.runtime.cuda_graphs import capture_graph, warm_up
from dspark_compile.runtime.inductor import CompiledStep, compiled_table_paths


class PrefillPrograms:
    """The prefill programs of one loaded engine, bound to its decode state."""

    def __init__(self, engine_dir: Path, manifest: dict, programs: dict, state: dict,
                 device: torch.device, backend: str, chunks: tuple, runner):
        if sorted(programs) != sorted(chunks):
            raise ArtifactError(f"manifest field 'prefill_programs': programs for chunks "
                                f"{sorted(programs)}, build_config.prefill_chunks says "
                                f"{list(chunks)} — rebuild", field="prefill_programs")
        self.chunks = sorted(programs)
        self.state = state
        self.inputs = {c: torch.zeros(c + HEADER, dtype=torch.int64, device=device)
                       for c in self.chunks}
        if backend == "inductor":
            paths = compiled_table_paths(manifest, PREFILL, self.chunks)
            self.modules = {c: CompiledStep(Path(engine_dir) / paths[c], programs[c],
                                            self.inputs[c], state) for c in self.chunks}
        else:
            # `runner`: the engine's one callable per program (a dynamic program serves every
            # chunk length)
            self.modules = {c: runner(p) for c, p in programs.items()}
        self.graphs: dict[int, tuple] = {}     # C -> (CUDAGraph, output first [1])
        self.capture_seconds: dict[int, float] = {}
        self.logprob_modules: dict = {}        # C -> the logprobs variant (derive_logprobs)
        self.logprob_graphs: dict[int, tuple] = {}   # C -> (CUDAGraph, output [1 + P])

    def derive_logprobs(self, runner) -> None:
        """Each chunk length's logprobs variant (runtime/logprobs.py derive), where its program
        is a graph (an Inductor prefill is compiled code: none); `runner`: the engine's one
        callable per program."""
        from dspark_compile.runtime.logprobs import derive
        memo: dict = {}
        for c, m in self.modules.items():
            gp = getattr(m, "_program", None)
            if gp is None:
                continue
            if id(gp) not in memo:
                derived = derive(gp)
                memo[id(gp)] = None if derived is None else runner(derived)
            if memo[id(gp)] is not None:
                self.logprob_modules[c] = memo[id(gp)]

    def capture(self, pool, stream, trash: int, warmup: int = 2) -> None:
        """One graph per chunk length, largest first, into `pool` on `stream`; warm-up and
        capture run on the trash row, so no request's state is touched."""
        import time
        for c in sorted(self.chunks, reverse=True):
            t = time.perf_counter()
            x, fn = self.inputs[c], self.modules[c]
            x.copy_(chunk_inputs(trash, 0, [0], c))
            warm_up(fn, (x, self.state), x.device, stream, warmup)
            self.graphs[c] = capture_graph(fn, (x, self.state), x.device, pool, stream)
            if c in self.logprob_modules:
                fn = _packed(self.logprob_modules[c])
                try:
                    warm_up(fn, (x, self.state), x.device, stream, warmup)
                    self.logprob_graphs[c] = capture_graph(fn, (x, self.state), x.device,
                                                           pool, stream)
                except Exception as e:  # noqa: BLE001 -- logprobs must not fail the load
                    import warnings
                    del self.logprob_modules[c]
                    warnings.warn(f"prefill chunk {c}: the logprobs variant could not be "
                                  f"captured ({type(e).__name__}: {str(e)[:200]})")
            self.capture_seconds[c] = time.perf_counter() - t

    @torch.no_grad()
    def prefill(self, row: int, prompt: list[int], use_graphs: bool = True) -> int:
        """Prefill `prompt` into state row `row` (its sampling parameters already set): every
        cache of the row, the draft context, row.tokens / draft_logits / last_pos, as
        models/step.py `prefill` writes them; returns the first generated token."""
        return int(self.launch(row, prompt, chunk_schedule(len(prompt), self.chunks),
                               use_graphs)[0])

    @torch.no_grad()
    def launch(self, row: int, prompt: list[int], calls, use_graphs: bool = True,
               logprobs: bool = False):
        """Enqueue `calls` ((start, n, C) entries of chunk_schedule, in order) on state row `row`
        without reading anything back; returns the last call's output (the token after
        start + n - 1: the first token once the calls reach the prompt's end), on the device:
        a graph's output is valid until the next replay of any graph of the pool.
        `logprobs`: the prompt's last call runs its logprobs variant, whose output is [1 + P]
        int64: the first token, then its payload's bits (runtime/logprobs.py)."""
        out = None
        for start, n, c in calls:
            x = chunk_inputs(row, start, prompt[start:start + n], c)
            if logprobs and start + n == len(prompt):
                if c not in self.logprob_modules:
                    raise ValueError(f"prefill chunk {c} has no logprobs variant")
                if use_graphs and c in self.logprob_graphs:
                    graph, out = self.logprob_graphs[c]
                    self.inputs[c].copy_(x.pin_memory(), non_blocking=True)
                    graph.replay()
                else:
                    out = _packed(self.logprob_modules[c])(x.to(self.inputs[c].device),
                                                           self.state)
                continue
            if use_graphs and c in self.graphs:
                graph, out = self.graphs[c]
                # a copy from pageable memory would wait for the stream (the previous chunk's
                # replay) first; a pinned one is queued behind it, and the caching host
                # allocator keeps its block until the copy has run
                self.inputs[c].copy_(x.pin_memory(), non_blocking=True)
                graph.replay()
            else:
                out = self.modules[c](x.to(self.inputs[c].device), self.state)
        return out


def _packed(fn):
    """A prefill logprobs variant `fn(x, state) -> (first [1], payload [P])` returning one int64
    tensor [1 + P] (the payload's float32 bits), so one device-to-host copy reads it."""
    def call(x, state):
        first, payload = fn(x, state)
        return torch.cat((first.to(torch.int64).reshape(1),
                          payload.contiguous().view(torch.int32).to(torch.int64)))
    return call
