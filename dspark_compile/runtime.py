"""Runtime: load an engine, capture one CUDA graph per bucket, generate.

    Engine.load(dir) → validate manifest → register ops → load programs + shared weights →
      allocate the decode state once → (CUDA) capture every bucket's step, largest first, into
      one memory pool on one capture stream, after warm-up runs on padded rows only
    Engine.generate(prompts, params) → per request: eager prefill into a free state row (the
      rebuilt reference model, same weights) → per step: split the live rows into groups of at
      most the largest bucket, pad each group to its bucket with the trash row, replay, read the
      committed tokens → requests that finish (stop id, max tokens) free their rows; waiting
      requests are admitted into free rows.

Warm-up and capture run with every batch row pointing at the trash row, so they never touch a
live request's state. On CPU the programs run directly (no graphs).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .artifact import load_engine, update_manifest_field
from .trace import BuildConfig


@dataclass
class _Graph:
    graph: object
    rows: torch.Tensor
    out_tokens: torch.Tensor
    out_num: torch.Tensor


@dataclass
class StepTimes:
    steps: int = 0
    seconds: float = 0.0
    per_bucket: dict = field(default_factory=dict)


class Engine:
    def __init__(self, engine_dir: Path, manifest: dict, programs: dict, weights: dict,
                 device: torch.device, use_graphs: bool):
        from .models.config import ModelConfig
        from .models.state import allocate_state

        self.dir, self.manifest, self.device = engine_dir, manifest, device
        self.cfg = ModelConfig.from_dict(manifest["model_config"])
        bc = dict(manifest["build_config"])
        bc["buckets"] = tuple(bc["buckets"])
        self.build = BuildConfig(**bc)
        self.buckets = sorted(int(b) for b in manifest["buckets"])
        self.model = self._reference_model(weights)
        self.cache = self.build.cache(self.cfg.dspark_block_size)
        self.state = allocate_state(self.cfg, self.cache, self.model.prec, device)
        self.trash = self.cache.max_rows
        self.modules = {b: ep.module() for b, ep in programs.items()}
        self.graphs: dict[int, _Graph] = {}
        self.capture_seconds: dict[int, float] = {}
        self.graph_pool_bytes: dict[int, int] = {}
        self.times = StepTimes()
        if use_graphs:
            self._capture_all()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, engine_dir, device=None, use_graphs: bool | None = None, expect: dict | None = None,
             record_graph_memory: bool = True) -> "Engine":
        engine_dir = Path(engine_dir)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        manifest, programs, weights = load_engine(engine_dir, expect=expect, device=device)
        use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        eng = cls(engine_dir, manifest, programs, weights, device, use_graphs)
        if use_graphs and record_graph_memory:
            for b in eng.buckets:
                update_manifest_field(engine_dir, f"graph_memory_bytes.{b}", eng.graph_pool_bytes[b])
        return eng

    def _reference_model(self, weights: dict):
        """The eager model for prefill, sharing the engine's weight tensors (no copy)."""
        from .models.target import DeepseekV4
        with torch.device(self.device):
            model = DeepseekV4(self.cfg, self.build.precision(),
                               self.build.max_seq_len + self.cfg.dspark_block_size + 2)
        prefix = "model."
        sd = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        persistent = set(model.state_dict())
        # non-persistent buffers (RoPE tables) are rebuilt by the model itself
        missing, unexpected = model.load_state_dict({k: v for k, v in sd.items() if k in persistent},
                                                    strict=False, assign=True)
        unexpected += [k for k in sd if k not in persistent and k not in dict(model.named_buffers(remove_duplicate=False))]
        if missing or unexpected:
            raise ValueError(f"engine weights do not fit the model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        return model.eval()

    # ------------------------------------------------------------------ CUDA graphs
    def _padded_rows(self, bucket: int) -> torch.Tensor:
        return torch.full((bucket,), self.trash, dtype=torch.int64, device=self.device)

    def _capture_all(self, warmup: int = 2) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in sorted(self.buckets, reverse=True):   # largest first: smaller ones reuse its pool
            t = time.perf_counter()
            before = torch.cuda.memory_stats(self.device).get("reserved_bytes.all.current", 0)
            rows = self._padded_rows(b)
            fn = self.modules[b]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(warmup):
                    fn(rows, self.state)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph, pool=pool, stream=stream):
                out_tokens, out_num = fn(rows, self.state)
            torch.cuda.synchronize(self.device)
            after = torch.cuda.memory_stats(self.device).get("reserved_bytes.all.current", 0)
            self.graphs[b] = _Graph(graph, rows, out_tokens, out_num)
            self.capture_seconds[b] = time.perf_counter() - t
            self.graph_pool_bytes[b] = int(after - before)

    # ------------------------------------------------------------------ one step
    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        if i == len(self.buckets):
            raise ValueError(f"{n} rows exceed the largest bucket {self.buckets[-1]}")
        return self.buckets[i]

    @torch.no_grad()
    def run_step(self, rows: list[int], use_graph: bool = True):
        """One draft-plus-verify step for up to `largest bucket` state rows; returns
        (tokens [n, N+1], num_sampled [n]) on the host, rows in the given order."""
        n = len(rows)
        b = self.bucket_for(n)
        padded = rows + [self.trash] * (b - n)
        t = time.perf_counter()
        if use_graph and b in self.graphs:
            g = self.graphs[b]
            g.rows.copy_(torch.tensor(padded, dtype=torch.int64))
            g.graph.replay()
            tokens, num = g.out_tokens, g.out_num
        else:
            tokens, num = self.modules[b](torch.tensor(padded, device=self.device), self.state)
        tokens, num = tokens[:n].cpu(), num[:n].cpu()
        self.times.steps += 1
        dt = time.perf_counter() - t
        self.times.seconds += dt
        self.times.per_bucket[b] = self.times.per_bucket.get(b, 0) + 1
        return tokens, num

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params):
        from .models.generate import (GenerationResult, SamplingParams, append_committed,
                                      set_row_sampling, validate_prompts)
        from .models.step import prefill

        cfg = self.cfg
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        validate_prompts(prompts, cfg.vocab_size)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        N = cfg.dspark_block_size
        for i, (p, sp) in enumerate(zip(prompts, params)):
            sp.validate(cfg.vocab_size)
            if len(p) + sp.max_new_tokens + N + 2 > self.cache.max_seq_len:
                raise ValueError(f"prompt {i}: {len(p)} + {sp.max_new_tokens} new tokens exceed the "
                                 f"engine's max_seq_len={self.cache.max_seq_len}")
        res = GenerationResult(tokens=[[] for _ in prompts], accepted_at=[0] * N)
        waiting = list(range(len(prompts)))
        free = list(range(self.cache.max_rows))
        live: dict[int, int] = {}   # state row -> request

        def admit():
            while waiting and free:
                req, row = waiting.pop(0), free.pop(0)
                set_row_sampling(self.state, row, params[req])
                first = prefill(self.model, self.state, row, prompts[req], self.cache.max_step_tokens,
                                speculative=True)
                if append_committed(res.tokens[req], [first], params[req]):
                    free.append(row)
                else:
                    live[row] = req

        admit()
        big = self.buckets[-1]
        while live:
            rows = sorted(live)
            for start in range(0, len(rows), big):
                group = rows[start:start + big]
                tokens, num = self.run_step(group)
                for i, row in enumerate(group):
                    req, n = live[row], int(num[i])
                    res.row_steps += 1
                    for k in range(n - 1):
                        res.accepted_at[k] += 1
                    if append_committed(res.tokens[req], tokens[i, :n].tolist(), params[req]):
                        del live[row]
                        free.append(row)
            res.steps += 1
            admit()
        return res

