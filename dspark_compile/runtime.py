"""Runtime: load an engine, capture one CUDA graph per bucket, generate.

    Engine.load(dir) → validate manifest → register ops → load programs + shared weights →
      per bucket the step to run: the Inductor-compiled step from the engine's compiled/
      (--backend inductor, dspark_compile/compiled.py) or the exported program's module (aten),
      and its greedy variant (dspark_compile/variants.py) → allocate the decode
      state once → (CUDA) capture every bucket's step and its greedy variant, largest first,
      into one memory pool on one capture stream, after warm-up runs on padded rows only
    Engine.generate(prompts, params) → per request: prefill into a free state row (the
      engine's prefill programs, dspark_compile/prefill_programs.py, when it has them and runs
      on CUDA or is an aten engine; else the rebuilt reference model, same weights) → per step: split the live rows into groups of at
      most the largest bucket, pad each group to its bucket with the trash row, replay (the
      greedy variant when every live row is greedy), read the
      committed tokens → requests that finish (stop id, max tokens) free their rows; waiting
      requests are admitted into free rows.

Warm-up and capture run with every batch row pointing at the trash row, so they never touch a
live request's state. On CPU the programs run directly (no graphs).

A graph's outputs are static tensors in the shared pool: they are valid until the next replay of
any bucket's graph, so `run_step` copies them to the host before it returns.
"""
from __future__ import annotations

import bisect
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark_compile.artifact import (MANIFEST, check_state_layout, load_engine,
                                     update_manifest_field)


def _build_device(engine_dir: Path) -> str | None:
    """The device the engine's programs were built for, read without validation (a missing or
    corrupted manifest is reported by the validated load that follows)."""
    try:
        return json.loads((engine_dir / MANIFEST).read_text())["build_config"]["device"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def warm_up(fn, args: tuple, device: torch.device, stream, warmup: int) -> None:
    """`warmup` calls fn(*args) on the side stream `stream`, then the device idle: what a capture
    records must have run once outside it (lazy initialisation, allocations), and on the stream
    the capture uses. The step graphs and the prefill graphs (dspark_compile/prefill_programs.py)
    warm up alike."""
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


@dataclass
class _Graph:
    graph: object
    rows: torch.Tensor
    out_tokens: torch.Tensor
    out_num: torch.Tensor


@dataclass
class StepTimes:
    steps: int = 0
    greedy_steps: int = 0          # of which ran the greedy draft-sampler variant
    seconds: float = 0.0
    per_bucket: dict = field(default_factory=dict)


class Engine:
    def __init__(self, engine_dir: Path, manifest: dict, programs: dict, weights: dict,
                 device: torch.device, use_graphs: bool, greedy_variants: bool = True,
                 prefill: str | None = None):
        from dspark_compile.engine_fields import engine_configs
        from dspark_compile.models.state import allocate_state

        self.dir, self.manifest, self.device = engine_dir, manifest, device
        self.cfg, self.build = engine_configs(manifest)   # names a missing or broken field
        self.buckets = sorted(int(b) for b in manifest["buckets"])
        self.model = self._reference_model(weights)
        self.cache = self.build.cache(self.cfg.dspark_block_size)
        self.state = allocate_state(self.cfg, self.cache, self.model.prec, device)
        check_state_layout(programs, self.state)      # names the fields an old engine lacks
        self.trash = self.cache.max_rows
        self.programs = programs   # the ExportedPrograms as loaded (inspection, checks)
        self.backend = self.build.backend
        self.compiled_load_seconds: dict[int, float] = {}
        # per bucket, the step with the draft sampler's greedy launch plan, run when every live
        # row is greedy (dspark_compile/variants.py); empty when disabled or nothing to switch
        if self.backend == "inductor":
            self.modules, self.greedy_modules = self._compiled_modules(greedy_variants)
        else:
            self.modules = {b: ep.module() for b, ep in programs.items()}
            self.greedy_modules = {}
            if greedy_variants:
                from dspark_compile.variants import sampler_mode_variant
                self.greedy_modules = {b: m for b, ep in programs.items()
                                       if (m := sampler_mode_variant(ep)) is not None}
        self.prefill_programs = self._load_prefill(weights, prefill)
        self.graphs: dict[int, _Graph] = {}
        self.greedy_graphs: dict[int, _Graph] = {}
        self.capture_seconds: dict[int, float] = {}
        self.graph_pool_bytes: dict[int, int] = {}
        self.load_seconds = 0.0
        self.times = StepTimes()
        if use_graphs:
            self._capture_all()

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, engine_dir, device=None, use_graphs: bool | None = None, expect: dict | None = None,
             record_graph_memory: bool = True, greedy_variants: bool = True,
             backend: str | None = None, prefill: str | None = None,
             kernels: str = "use") -> "Engine":
        """`greedy_variants`: also keep (and on CUDA capture) each bucket's step with the greedy
        draft-sampler plan, used for steps whose live rows are all greedy. `backend`: refuse an
        engine built with another --backend (manifest field 'build_config.backend'); None =
        either. `prefill`: "programs" (the engine's prefill programs), "eager" (the reference
        model) or None: the programs when the engine has them, unless it is an Inductor
        engine on CPU. `kernels`: the engine's compiled Triton kernels
        (dspark_compile/kernel_store.py) "use"d when they match this machine's SM and Triton
        (else one line says so and they compile at first use), "require"d (ArtifactError
        otherwise) or "ignore"d."""
        t0 = time.perf_counter()
        if prefill not in (None, "programs", "eager"):
            raise ValueError(f"prefill must be 'programs', 'eager' or None, got {prefill!r}")
        if backend is not None:
            from dspark_compile.compiled import BACKENDS
            if backend not in BACKENDS:
                raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
            expect = {**(expect or {}), "build_config.backend": backend}
        engine_dir = Path(engine_dir)
        built_for = _build_device(engine_dir)
        if device is None:
            device = built_for or ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(device)
        if built_for is not None and torch.device(built_for).type != device.type:
            # the programs hold device-specific constants and ops: they run where they were built
            raise ValueError(f"engine {engine_dir} was built for {built_for}, cannot run on "
                             f"{device}: load it with device='{built_for}' or rebuild it with "
                             f"--device {device.type}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        if use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        manifest, programs, weights = load_engine(engine_dir, expect=expect, device=device)
        from dspark_compile.kernel_store import install
        install(engine_dir, manifest, device, kernels)    # before anything launches a kernel
        eng = cls(engine_dir, manifest, programs, weights, device, use_graphs, greedy_variants,
                  prefill)
        eng.load_seconds = time.perf_counter() - t0
        if use_graphs and record_graph_memory:
            eng._record_load()
        return eng

    def _compiled_modules(self, greedy_variants: bool):
        """The Inductor-compiled steps of every bucket, loaded from the engine
        (dspark_compile/compiled.py): ({bucket: full step}, {bucket: greedy step})."""
        from dspark_compile.compiled import CompiledStep, compiled_entries
        full, greedy = {}, {}
        for b, entry in compiled_entries(self.manifest).items():
            rows = self._padded_rows(b)
            full[b] = CompiledStep(self.dir / entry["full"], self.programs[b], rows, self.state)
            seconds = full[b].load_seconds
            if greedy_variants and "greedy" in entry:
                greedy[b] = CompiledStep(self.dir / entry["greedy"], self.programs[b], rows,
                                         self.state)
                seconds += greedy[b].load_seconds
            self.compiled_load_seconds[b] = seconds
        return full, greedy

    def _load_prefill(self, weights: dict, prefill: str | None):
        """The engine's prefill programs bound to the state, or None: prefill runs the eager
        reference (an engine without them, `prefill="eager"`, or by default an Inductor engine
        on CPU, whose eager reference is the CPU path)."""
        chunks = self.build.prefill_chunks      # `prefill` itself was checked by load
        if prefill == "programs" and not chunks:
            raise ValueError(f"prefill='programs': engine {self.dir} has no prefill programs "
                             "(build --prefill-chunks)")
        if prefill == "eager" or not chunks or (
                prefill is None and self.device.type != "cuda" and self.backend != "aten"):
            return None
        from dspark_compile.artifact import load_prefill_programs
        from dspark_compile.prefill_programs import PrefillPrograms
        return PrefillPrograms(self.dir, self.manifest,
                               load_prefill_programs(self.dir, self.manifest, weights),
                               self.state, self.device, self.backend, chunks)

    def _record_load(self) -> None:
        """Write this load's graph memory and timings into the manifest (docs/architecture.md,
        "Honest artifacts"). A read-only engine directory is not an error: the engine runs, the
        record is skipped."""
        stats = {"device": torch.cuda.get_device_name(self.device),
                 "torch_version": torch.__version__,
                 "load_seconds": round(self.load_seconds, 3),
                 "capture_seconds": {str(b): round(s, 4) for b, s in self.capture_seconds.items()},
                 "compiled_load_seconds": {str(b): round(s, 3)
                                           for b, s in self.compiled_load_seconds.items()},
                 "graph_pool_total_bytes": int(sum(self.graph_pool_bytes.values()))}
        if self.prefill_programs is not None:
            stats["prefill_capture_seconds"] = {
                str(c): round(s, 4) for c, s in self.prefill_programs.capture_seconds.items()}
        try:
            update_manifest_field(self.dir, "graph_memory_bytes",
                                  {str(b): self.graph_pool_bytes[b] for b in self.buckets})
            update_manifest_field(self.dir, "runtime_load", stats)
        except OSError as e:
            warnings.warn(f"could not record graph memory in {self.dir}/manifest.json: {e}")

    def _reference_model(self, weights: dict):
        """The eager model for prefill, sharing the engine's weight tensors (no copy)."""
        from dspark_compile.models.config import rope_positions
        from dspark_compile.models.target import DeepseekV4
        with torch.device(self.device):
            model = DeepseekV4(self.cfg, self.build.precision(),
                               rope_positions(self.build.max_seq_len, self.cfg.dspark_block_size))
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

    def _reserved(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("reserved_bytes.all.current", 0))

    def _capture_all(self, warmup: int = 2) -> None:
        """`graph_pool_bytes[b]`: memory the captures of bucket b (program and greedy variant)
        added to the shared pool (the largest bucket's capture allocates it; smaller ones mostly
        reuse it). Measured around
        the capture alone: warm-up runs allocate from the ordinary cache, not the pool."""
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream(self.device)
        for b in sorted(self.buckets, reverse=True):   # largest first: smaller ones reuse its pool
            t = time.perf_counter()
            self.graphs[b], added = self._capture(self.modules[b], b, pool, stream, warmup)
            if b in self.greedy_modules:
                try:
                    self.greedy_graphs[b], more = self._capture(self.greedy_modules[b], b, pool,
                                                                stream, warmup)
                    added += more
                except Exception as e:  # noqa: BLE001 -- an optimisation must not fail the load
                    # all-greedy batches of this bucket then run the full program (correct,
                    # slower); the warning says why
                    del self.greedy_modules[b]
                    warnings.warn(f"bucket {b}: the greedy variant could not be captured "
                                  f"({type(e).__name__}: {str(e)[:200]}); all-greedy batches run "
                                  f"the full program")
            self.capture_seconds[b] = time.perf_counter() - t
            self.graph_pool_bytes[b] = int(added)
        if self.prefill_programs is not None:
            self.prefill_programs.capture(pool, stream, self.trash, warmup)

    def _capture(self, fn, b: int, pool, stream, warmup: int):
        """Warm up `fn` on bucket b's padded rows, capture it into the shared pool; returns the
        graph and the pool bytes the capture added."""
        rows = self._padded_rows(b)
        warm_up(fn, (rows, self.state), self.device, stream, warmup)
        # only the step graphs measure what their capture adds (graph_pool_bytes; the prefill
        # graphs do not): torch.cuda.graph empties the allocator cache on entry, so do it first,
        # or the warm-up's freed blocks show up as a negative pool size
        torch.cuda.empty_cache()
        before = self._reserved()
        graph, (out_tokens, out_num) = capture_graph(fn, (rows, self.state), self.device, pool,
                                                     stream)
        return _Graph(graph, rows, out_tokens, out_num), self._reserved() - before

    # ------------------------------------------------------------------ one step
    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        if i == len(self.buckets):
            raise ValueError(f"{n} rows exceed the largest bucket {self.buckets[-1]}")
        return self.buckets[i]

    @torch.no_grad()
    def run_step(self, rows: list[int], use_graph: bool = True, bucket: int | None = None,
                 variant: str | None = None):
        """One draft-plus-verify step for up to `largest bucket` state rows (the trash row may
        appear among them as explicit padding); returns (tokens [n, N+1], num_sampled [n]) on
        the host, rows in the given order. `bucket`: run that bucket's program (default: the
        smallest that fits), padding with the trash row. `variant`: "full" or "greedy" (the
        greedy draft-sampler plan: only valid when every live row is greedy); default: greedy
        exactly when every live row's temperature is <= 0 and the engine has the variant."""
        rows = [int(r) for r in rows]
        n = len(rows)
        if n == 0:
            raise ValueError("run_step needs at least one row")
        bad = [r for r in rows if not 0 <= r <= self.trash]
        if bad:
            raise ValueError(f"rows {bad[:5]} outside [0, {self.trash}] (state rows, trash row "
                             f"{self.trash})")
        live = [r for r in rows if r != self.trash]
        if len(set(live)) != len(live):
            # two batch rows on one state row would both write its caches in one step
            raise ValueError(f"rows {rows} name a state row twice")
        if bucket is None:
            b = self.bucket_for(n)
        elif bucket not in self.buckets or bucket < n:
            raise ValueError(f"bucket {bucket}: not one of {self.buckets} or smaller than the "
                             f"{n} rows given")
        else:
            b = bucket
        return self._step(rows, b, self._use_greedy(live, b, variant), use_graph)

    def _step(self, rows: list[int], b: int, greedy: bool, use_graph: bool = True):
        """run_step once rows, bucket and variant are decided (and valid)."""
        n = len(rows)
        padded = torch.tensor(rows + [self.trash] * (b - n), dtype=torch.int64)
        t = time.perf_counter()
        graphs, modules = ((self.greedy_graphs, self.greedy_modules) if greedy
                           else (self.graphs, self.modules))
        if use_graph and b in graphs:
            g = graphs[b]
            g.rows.copy_(padded)
            g.graph.replay()
            tokens, num = g.out_tokens, g.out_num
        else:
            tokens, num = modules[b](padded.to(self.device), self.state)
        # the graph's outputs live in the shared pool: copy them out before any other replay
        tokens, num = tokens[:n].cpu(), num[:n].cpu()
        self.times.steps += 1
        dt = time.perf_counter() - t
        self.times.seconds += dt
        self.times.per_bucket[b] = self.times.per_bucket.get(b, 0) + 1
        self.times.greedy_steps += int(greedy)
        return tokens, num

    def _use_greedy(self, live: list[int], bucket: int, variant: str | None) -> bool:
        if variant not in (None, "full", "greedy"):
            raise ValueError(f"variant must be 'full', 'greedy' or None, got {variant!r}")
        if variant == "greedy" and bucket not in self.greedy_modules:
            raise ValueError(f"bucket {bucket} has no greedy variant (engine loaded with "
                             f"greedy_variants=False, or built without fuse_sampler)")
        if variant == "full" or bucket not in self.greedy_modules or not live:
            return False
        # a direct caller: the rows' temperatures as the step will read them (one device-to-host
        # copy of max_rows + 1 floats), since a sampled row must never run the greedy plan.
        # generate() knows its requests' parameters and decides without this read.
        temps = self.state["row.temperature"].cpu()
        all_greedy = bool((temps[live] <= 0).all())
        if variant == "greedy" and not all_greedy:
            raise ValueError("variant='greedy' with a sampled (temperature > 0) row in the batch")
        return all_greedy

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def prefill(self, row: int, prompt: list[int]) -> int:
        """The prompt's forward into state row `row` (its sampling parameters set): the
        engine's prefill programs (`self.prefill_programs`) or the eager reference; returns
        the first generated token."""
        from dspark_compile.models.state import check_prefill
        from dspark_compile.models.step import prefill
        if self.prefill_programs is None:
            return prefill(self.model, self.state, row, prompt, self.cache.max_step_tokens,
                           speculative=True)
        check_prefill(self.model, self.state, row, prompt, max(self.prefill_programs.chunks),
                      True)
        return self.prefill_programs.prefill(row, prompt)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params):
        from dspark_compile.models.generate import (
            GenerationResult, SamplingParams, append_committed, check_request_positions,
            set_row_sampling, validate_prompts)

        cfg = self.cfg
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        validate_prompts(prompts, cfg.vocab_size)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        N = cfg.dspark_block_size
        for sp in params:
            sp.validate(cfg.vocab_size)
        check_request_positions(prompts, params, self.cache.max_seq_len, N)
        res = GenerationResult(tokens=[[] for _ in prompts], accepted_at=[0] * N)
        waiting = list(range(len(prompts)))
        free = list(range(self.cache.max_rows))
        live: dict[int, int] = {}   # state row -> request

        def admit():
            while waiting and free:
                req, row = waiting.pop(0), free.pop(0)
                set_row_sampling(self.state, row, params[req])
                first = self.prefill(row, prompts[req])
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
                b = self.bucket_for(len(group))
                greedy = b in self.greedy_modules and all(
                    params[live[r]].temperature <= 0 for r in group)
                tokens, num = self._step(group, b, greedy)
                for i, row in enumerate(group):
                    req, n = live[row], int(num[i])
                    res.record(n, params[req].method)
                    if append_committed(res.tokens[req], tokens[i, :n].tolist(), params[req]):
                        del live[row]
                        free.append(row)
            res.steps += 1
            admit()
        return res

