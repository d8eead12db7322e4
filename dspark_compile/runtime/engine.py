"""Runtime: load an engine, capture one CUDA graph per bucket, run steps, generate.

The runtime in three parts (the split of nano-vllm's engine/): who runs next
(dspark_compile/runtime/scheduler.py: requests, rows, admission, the loop of GenerationStream), how a
step runs (this file's Engine: programs, graphs, buffers, one launch per program call;
dspark_compile/runtime/cuda_graphs.py: capture), and what a user calls (Engine.stream / open_stream /
generate, built on the scheduler).

    Engine.load(dir) → validate manifest → register ops → load programs + shared weights →
      per bucket the step to run: the Inductor-compiled step from the engine's compiled/
      (--backend inductor, dspark_compile/build/inductor.py) or the exported program's module (aten),
      and its greedy variant (dspark_compile/runtime/variants.py), and its target-only program when the
      engine has one (`run --no-speculation`, models/step.py TargetStep) → allocate the decode
      state once → (CUDA) capture every bucket's step and its greedy variant, largest first,
      into one memory pool on one capture stream, after warm-up runs on padded rows only
    Engine.launch(rows, key) → the rows into the graph's static input (one pinned,
      asynchronous host-to-device copy), replay, the packed outputs [n, N+2] into pinned host
      memory (one asynchronous device-to-host copy), an event; nothing waits for the device.
      Every input of the next step (tokens, drafts, positions) is in the state on the device,
      so the scheduler launches step n + 1 before it reads step n's tokens.
    Engine.run_step(rows) → one launch, waited for: (tokens, num) on the host.
    speculative=False (run_step, open_stream, generate) → the same, through the target-only
      programs: one token per row and step, the engine's own non-speculative decoding.

Warm-up and capture run with every batch row pointing at the trash row, so they never touch a
live request's state. On CPU the programs run directly (no graphs, nothing asynchronous).

A graph's outputs are static tensors in the shared pool: they are valid until the next replay of
any bucket's graph; the launch's device-to-host copy is enqueued right behind the replay, so it
reads them before any later replay writes them.
"""
from __future__ import annotations

import bisect
import time
import warnings
from pathlib import Path

import torch

from dspark_compile.engine_dir.format import ArtifactError
from dspark_compile.engine_dir.tp_format import RANKS_FILE
from dspark_compile.engine_dir.load import check_state_layout, load_engine, _read_manifest
from dspark_compile.engine_dir.write import update_manifest_field
# warm_up / capture_graph: imported here too for callers of the runtime's old names
from dspark_compile.runtime.cuda_graphs import StepGraph, capture_graph, packed, unpack, warm_up  # noqa: F401
from dspark_compile.kernels.sampling.reference import GREEDY_BELOW, greedy_rows
from dspark_compile.engine_dir.fields import engine_configs
from dspark_compile.engine_dir.format import BACKENDS, STEP, TARGET, ProgramKey
from dspark_compile.engine_dir.kernel_store import install
from dspark_compile.engine_dir.graph_run import ProgramRunner
from dspark_compile.engine_dir.load import (load_prefill_programs, load_program,
    load_target_programs, program_variants)
from dspark_compile.models.config import rope_positions
from dspark_compile.models.moe import Experts, sync_kernel_layouts
from dspark_compile.models.prefill_chunk import chunk_schedule
from dspark_compile.models.request import SamplingParams, validate_batch
from dspark_compile.models.generate import set_row_sampling
from dspark_compile.models.state import allocate_state, check_prefill
from dspark_compile.models.step import prefill
from dspark_compile.models.target import DeepseekV4
from dspark_compile.runtime.inductor import compiled_entries, compiled_table_paths, CompiledStep
from dspark_compile.runtime import logprobs as lp
from dspark_compile.runtime.logprobs import logprob_table
from dspark_compile.runtime.calls import Launched, Program, StepTimes  # noqa: F401  (callers import them here)
from dspark_compile.runtime.prefill import PrefillPrograms
from dspark_compile.runtime.scheduler import GenerationStream, program_for


def _build_device(engine_dir: Path) -> str | None:
    """The device the engine's programs were built for, read through the manifest's checked
    reader (no link, no FIFO, bounded size) but not validated further (a missing or broken
    manifest is reported by the validated load that follows)."""
    try:
        dev = _read_manifest(engine_dir)["build_config"]["device"]
        torch.device(dev)
        return dev
    except (ArtifactError, KeyError, TypeError, RuntimeError):
        return None


class Engine:
    def __init__(self, engine_dir: Path, manifest: dict, programs: dict, weights: dict,
                 device: torch.device, use_graphs: bool, greedy_variants: bool = True,
                 prefill: str | None = None, target: bool = True, logprobs: bool = True):

        self.dir, self.manifest, self.device = engine_dir, manifest, device
        self.cfg, self.build = engine_configs(manifest)   # names a missing or broken field
        self.buckets = sorted(int(b) for b in manifest["buckets"])
        self.model = self._reference_model(weights)
        self.cache = self.build.cache(self.cfg.dspark_block_size)
        self.state = allocate_state(self.cfg, self.cache, self.model.prec, device)
        check_state_layout(programs, self.state)      # names the fields an old engine lacks
        self.trash = self.cache.max_rows
        self.programs = programs   # the steps' GraphPrograms as loaded (inspection, checks)
        self.backend = self.build.backend
        self.compiled_load_seconds: dict[int, float] = {}
        # every step-sized program the engine runs, one table: per bucket the step, its greedy
        # variant (the draft sampler's greedy launch plan, run when every live row is greedy,
        # dspark_compile/runtime/variants.py; absent when disabled or nothing to switch) and
        # the target-only step (speculative=False; absent without target programs)
        self.table: dict[ProgramKey, Program] = {}
        # one module per program: a program exported with a dynamic batch serves every bucket
        # (each bucket still captures its own CUDA graph)
        self._modules: dict[int, torch.nn.Module] = {}
        if self.backend == "inductor":
            self._compiled_steps(greedy_variants)
        else:
            loaded: dict = {}
            for b, program in programs.items():
                key = ProgramKey(STEP, b)
                self.table[key] = Program(self._module(program))
                # written at build (runtime/variants.py); absent when the step has no sampler
                # to switch
                if greedy_variants and "greedy" in program_variants(manifest, key):
                    greedy = load_program(engine_dir, manifest, key.with_variant("greedy"),
                                          weights, loaded)
                    self.table[key.with_variant("greedy")] = Program(self._module(greedy))
        self.prefill_programs = self._load_prefill(weights, prefill)
        if target:
            self._load_target(weights)
        # each step program's logprobs variant, derived from its graph (runtime/logprobs.py),
        # run only for steps where a row asks: {the step's key: its callable as a Program}
        self.logprob_programs = ({k: Program(fn) for k, fn in
                                  logprob_table(self.table, self._module).items()}
                                 if logprobs else {})
        if logprobs and self.prefill_programs is not None:
            self.prefill_programs.derive_logprobs(self._module)
        self._stream = None      # the open GenerationStream (weak reference), one at a time
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
             kernels: str = "use", target: bool = True, trust_code: bool = False,
             logprobs: bool = True) -> "Engine":
        """`greedy_variants`: also keep (and on CUDA capture) each bucket's step with the greedy
        draft-sampler plan, used for steps whose live rows are all greedy. `backend`: refuse an
        engine built with another --backend (manifest field 'build_config.backend'); None =
        either. `prefill`: "programs" (the engine's prefill programs), "eager" (the reference
        model) or None: the programs when the engine has them, unless it is an Inductor
        engine on CPU. `kernels`: the engine's compiled Triton kernels
        (dspark_compile/engine_dir/kernel_store.py) "use"d when they match this machine's SM and Triton
        (else one line says so and they compile at first use), "require"d (ArtifactError
        otherwise) or "ignore"d. `target`: also load (and on CUDA capture) the engine's
        target-only programs, when it has them (build --no-target-programs leaves them out),
        for speculative=False; False saves their load and capture. `trust_code`: load an
        engine whose programs are code (--backend inductor: generated Python in compiled/),
        refused otherwise; an aten engine's load executes nothing from its directory.
        `logprobs`: also derive (and on CUDA capture) each step's and prefill program's
        logprobs variant (runtime/logprobs.py), run for calls where a request asks.
        An engine built with `build --tp N` is loaded rank by rank:
        dspark_compile/runtime/ranks.py load_rank (its RankEngine subclasses this class)."""
        if (Path(engine_dir) / RANKS_FILE).is_file():
            raise ValueError(f"engine {engine_dir} is built for several ranks (build --tp): "
                             "load one with dspark_compile.runtime.ranks.load_rank(dir, rank, "
                             "tp), or run it with run --tp")
        t0 = time.perf_counter()
        if prefill not in (None, "programs", "eager"):
            raise ValueError(f"prefill must be 'programs', 'eager' or None, got {prefill!r}")
        if backend is not None:
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
        manifest, programs, weights = load_engine(engine_dir, expect=expect, device=device,
                                                  trust_code=trust_code)
        install(engine_dir, manifest, device, kernels)    # before anything launches a kernel
        eng = cls(engine_dir, manifest, programs, weights, device, use_graphs, greedy_variants,
                  prefill, target, logprobs)
        eng.load_seconds = time.perf_counter() - t0
        if use_graphs and record_graph_memory:
            eng._record_load()
        return eng

    def _compiled_steps(self, greedy_variants: bool) -> None:
        """The Inductor-compiled steps of every bucket (and their greedy variants), loaded
        from the engine (dspark_compile/build/inductor.py) into the table."""
        for b, entry in compiled_entries(self.manifest).items():
            rows = self._padded_rows(b)
            seconds = 0.0
            for variant in ("full", "greedy") if greedy_variants else ("full",):
                if variant in entry:
                    step = CompiledStep(self.dir / entry[variant], self.programs[b], rows,
                                        self.state)
                    self.table[ProgramKey(STEP, b, variant)] = Program(step)
                    seconds += step.load_seconds
            self.compiled_load_seconds[b] = seconds

    def _module(self, program) -> torch.nn.Module:
        """The runnable module of a loaded GraphProgram (engine_dir/graph_run.py
        ProgramRunner), built once per program."""
        if id(program) not in self._modules:
            self._modules[id(program)] = ProgramRunner(program)
        return self._modules[id(program)]

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
        return PrefillPrograms(self.dir, self.manifest,
                               load_prefill_programs(self.dir, self.manifest, weights),
                               self.state, self.device, self.backend, chunks, self._module)

    def _load_target(self, weights: dict) -> None:
        """Every bucket's target-only step into the table: the program's module (aten) or its
        Inductor-compiled program (inductor); none for an engine built without them."""
        if not self.build.target_programs:
            return
        programs = load_target_programs(self.dir, self.manifest, weights)
        check_state_layout(programs, self.state)
        paths = (compiled_table_paths(self.manifest, TARGET, programs)
                 if self.backend == "inductor" else {})
        for b, program in programs.items():
            fn = (CompiledStep(self.dir / paths[b], program, self._padded_rows(b), self.state)
                  if paths else self._module(program))
            self.table[ProgramKey(TARGET, b)] = Program(fn)

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
        with torch.device(self.device):
            model = DeepseekV4(self.cfg, self.build.precision(),
                               rope_positions(self.build.max_seq_len, self.cfg.dspark_block_size))
        prefix = "model."
        sd = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        own = dict(model.named_buffers())
        probe = next((k for k in sd if k.endswith(".experts.w1_weight") and k in own), None)
        tiled = probe is not None and sd[probe].shape != own[probe].shape
        if tiled:
            # the build stored the MoE experts in their kernel's layout (models/moe.py
            # use_kernel_layouts, an exact permutation): the eager model takes those tensors as
            # they are (its buffers shaped like them here, on the meta device: converting the
            # model's zero-filled experts first took 6 of a 12 s tiny-deep CPU load), and
            # sync_kernel_layouts names the layout its moe_experts calls pass
            for name, m in model.named_modules():
                if isinstance(m, Experts):
                    for b in m.NAMES:
                        t = sd.get(f"{name}.{b}")
                        if t is not None:
                            setattr(m, b, torch.empty(t.shape, dtype=t.dtype, device="meta"))
        persistent = set(model.state_dict())
        # non-persistent buffers (RoPE tables) are rebuilt by the model itself
        missing, unexpected = model.load_state_dict({k: v for k, v in sd.items() if k in persistent},
                                                    strict=False, assign=True)
        unexpected += [k for k in sd if k not in persistent and k not in dict(model.named_buffers(remove_duplicate=False))]
        if missing or unexpected:
            raise ValueError(f"engine weights do not fit the model: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        if tiled:
            # the layout's name (tiles and `wide` flag) follows the loaded tensors
            sync_kernel_layouts(model)
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
            added = 0
            for key in (ProgramKey(STEP, b), ProgramKey(STEP, b, "greedy"), ProgramKey(TARGET, b)):
                program = self.table.get(key)
                if program is None:
                    continue
                try:
                    program.graph, more = self._capture(program.fn, b, pool, stream, warmup)
                except Exception as e:  # noqa: BLE001 -- an optimisation must not fail the load
                    if key.variant != "greedy":
                        raise
                    # all-greedy batches of this bucket then run the full program (correct,
                    # slower); the warning says why
                    del self.table[key]
                    self.logprob_programs.pop(key, None)     # its logprobs copy goes unused
                    warnings.warn(f"bucket {b}: the greedy variant could not be captured "
                                  f"({type(e).__name__}: {str(e)[:200]}); all-greedy batches run "
                                  f"the full program")
                    continue
                added += more
            for key in (ProgramKey(STEP, b), ProgramKey(STEP, b, "greedy")):
                program = self.logprob_programs.get(key)
                if program is None:
                    continue
                try:
                    program.graph, more = self._capture(program.fn, b, pool, stream, warmup)
                except Exception as e:  # noqa: BLE001 -- logprobs must not fail the load
                    del self.logprob_programs[key]
                    warnings.warn(f"bucket {b}: the logprobs variant of {key} could not be "
                                  f"captured ({type(e).__name__}: {str(e)[:200]})")
                    continue
                added += more
            self.capture_seconds[b] = time.perf_counter() - t
            self.graph_pool_bytes[b] = int(added)
        if self.prefill_programs is not None:
            self.prefill_programs.capture(pool, stream, self.trash, warmup)

    def _capture(self, fn, b: int, pool, stream, warmup: int):
        """Warm up `fn` on bucket b's padded rows, capture it into the shared pool; returns the
        graph and the pool bytes the capture added."""
        rows = self._padded_rows(b)
        warm_up(packed(fn), (rows, self.state), self.device, stream, warmup)
        # only the step graphs measure what their capture adds (graph_pool_bytes; the prefill
        # graphs do not): torch.cuda.graph empties the allocator cache on entry, so do it first,
        # or the warm-up's freed blocks show up as a negative pool size
        torch.cuda.empty_cache()
        before = self._reserved()
        graph, out = capture_graph(packed(fn), (rows, self.state), self.device, pool, stream)
        return StepGraph(graph, rows, out), self._reserved() - before

    # ------------------------------------------------------------------ one step
    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        if i == len(self.buckets):
            raise ValueError(f"{n} rows exceed the largest bucket {self.buckets[-1]}")
        return self.buckets[i]

    @torch.no_grad()
    def run_step(self, rows: list[int], use_graph: bool = True, bucket: int | None = None,
                 variant: str | None = None, speculative: bool = True):
        """One draft-plus-verify step for up to `largest bucket` state rows (the trash row may
        appear among them as explicit padding); returns (tokens [n, N+1], num_sampled [n]) on
        the host, rows in the given order. `bucket`: run that bucket's program (default: the
        smallest that fits), padding with the trash row. `variant`: "full" or "greedy" (the
        greedy draft-sampler plan: only valid when every live row is greedy); default: greedy
        exactly when every live row is greedy (temperature < GREEDY_BELOW) and the engine has the
        variant.
        `speculative=False`: the bucket's target-only program instead (one token per row:
        tokens [n, 1]; `variant` does not apply)."""
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
        if not speculative:
            self.check_target(b)
            return self._step(rows, ProgramKey(TARGET, b), use_graph)
        return self._step(rows, self._step_key(live, b, variant), use_graph)

    def check_target(self, bucket: int | None = None) -> None:
        """ValueError saying why this engine cannot decode without speculation (at `bucket`)."""
        if not self.build.target_programs:
            raise ValueError(f"engine {self.dir} has no target-only programs (built with "
                             "--no-target-programs): rebuild it without that flag to decode "
                             "without speculation")
        if not any(k.kind == TARGET for k in self.table):
            raise ValueError("the engine was loaded with target=False: load it with "
                             "target=True to decode without speculation")
        if bucket is not None and ProgramKey(TARGET, bucket) not in self.table:
            raise ValueError(f"bucket {bucket} has no target-only program")

    def has(self, key: ProgramKey) -> bool:
        """Whether the engine can run program `key` (loaded: a greedy variant may be absent,
        target-only programs too)."""
        return key in self.table

    def has_logprobs(self, key: ProgramKey) -> bool:
        """Whether step program `key` has a logprobs variant (runtime/logprobs.py)."""
        return key in self.logprob_programs

    def program(self, key: ProgramKey) -> Program:
        """Program `key` as loaded: its callable and its captured graph (None off CUDA)."""
        if key not in self.table:
            raise ValueError(f"this engine has no program {key} (it has "
                             f"{', '.join(map(str, sorted(self.table)))})")
        return self.table[key]

    def captured(self) -> list[ProgramKey]:
        """The programs whose CUDA graphs were captured, in key order."""
        return sorted(k for k, p in self.table.items() if p.graph is not None)

    def _step(self, rows: list[int], key: ProgramKey, use_graph: bool = True):
        """run_step once rows and program are decided (and valid): one launch, waited for."""
        launched = self.launch(rows, key, use_graph)
        t = time.perf_counter()
        host = launched.wait()
        self.times.seconds += time.perf_counter() - t     # the launch counted its own
        return unpack(host)

    def launch(self, rows: list[int], key: ProgramKey, use_graph: bool = True,
               logprobs: bool = False) -> Launched:
        """Enqueue one call of program `key` (a step, its greedy variant, or a target-only step,
        of bucket b = key.size; which one: the scheduler's program_for) on `rows` (valid state
        rows, at most b; the rest padded with the trash row) and the copy of its outputs to the
        host; returns at
        once (on CUDA). The step reads all its other inputs from the state, which the previous
        call (stream-ordered) has updated on the device, so calls may be launched back to back
        without reading their outputs. On CUDA: one host-to-device copy of the rows (pinned,
        asynchronous) and one device-to-host copy of the packed outputs [n, N+2] (pinned,
        asynchronous, enqueued before any later replay can overwrite the pool). A target-only
        program's outputs are [n, 2]. `logprobs`: program `key`'s logprobs variant, its payload
        columns in the Launched's `payload`."""
        program = self.logprob_programs[key] if logprobs else self.program(key)
        n, b = len(rows), key.size
        t = time.perf_counter()
        cuda = self.device.type == "cuda"
        padded = torch.tensor(rows + [self.trash] * (b - n), dtype=torch.int64, pin_memory=cuda)
        if use_graph and program.graph is not None:
            g = program.graph
            # pinned: the copy is queued behind the previous replay instead of waiting for it
            g.rows.copy_(padded, non_blocking=True)
            g.graph.replay()
            out = g.out
        else:
            out = packed(program.fn)(padded.to(self.device, non_blocking=True), self.state)
        event = None
        if cuda:
            host = torch.empty((n, out.shape[1]), dtype=torch.int64, pin_memory=True)
            host.copy_(out[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = out[:n]
        self.times.steps += 1
        self.times.seconds += time.perf_counter() - t
        self.times.per_bucket[b] = self.times.per_bucket.get(b, 0) + 1
        w = self.cfg.dspark_block_size + 2            # tokens | num, then the payload
        launched = (Launched(host[:, :w], event, key, host[:, w:]) if logprobs
                    else Launched(host, event, key))
        self.times.greedy_steps += int(launched.greedy)
        self.times.target_steps += int(launched.target)
        return launched

    def set_row_sampling(self, row: int, params: SamplingParams) -> None:
        """State row `row`'s sampling parameters, read by the programs' samplers."""
        set_row_sampling(self.state, row, params)

    def _step_key(self, live: list[int], bucket: int, variant: str | None) -> ProgramKey:
        """run_step's program: `variant` as asked, else what program_for chooses for the live
        rows' temperatures as the state holds them."""
        if variant not in (None, "full", "greedy"):
            raise ValueError(f"variant must be 'full', 'greedy' or None, got {variant!r}")
        has_greedy = self.has(ProgramKey(STEP, bucket, "greedy"))
        if variant == "greedy" and not has_greedy:
            raise ValueError(f"bucket {bucket} has no greedy variant (engine loaded with "
                             f"greedy_variants=False, or built without fuse_sampler)")
        if variant == "full" or not has_greedy or not live:
            return ProgramKey(STEP, bucket)
        # a direct caller: the rows' temperatures as the step will read them (one device-to-host
        # copy of max_rows + 1 floats), since a sampled row must never run the greedy plan.
        # generate() knows its requests' parameters and decides without this read.
        temps = self.state["row.temperature"].cpu()
        all_greedy = bool(greedy_rows(temps[live]).all())
        if variant == "greedy" and not all_greedy:
            raise ValueError(f"variant='greedy' with a sampled (temperature >= {GREEDY_BELOW}) "
                             "row in the batch")
        return program_for(self, bucket, all_greedy)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def prefill(self, row: int, prompt: list[int]) -> int:
        """The prompt's forward into state row `row` (its sampling parameters set): the
        engine's prefill programs (`self.prefill_programs`) or the eager reference; returns
        the first generated token."""
        if self.prefill_programs is None:
            return prefill(self.model, self.state, row, prompt, self.cache.max_step_tokens,
                           speculative=True)
        check_prefill(self.model, self.state, row, prompt, max(self.prefill_programs.chunks),
                      True)
        return self.prefill_programs.prefill(row, prompt)

    def prefill_calls(self, prompt: list[int]) -> list[tuple[int, int, int]]:
        """The prefill calls of `prompt`: [(start, live tokens n, tokens the call computes)]
        (the prefill programs' chunk_schedule; one call for the whole prompt on the eager
        reference)."""
        if self.prefill_programs is None:
            return [(0, len(prompt), len(prompt))]
        return chunk_schedule(len(prompt), self.prefill_programs.chunks)

    @torch.no_grad()
    def launch_prefill(self, row: int, prompt: list[int], calls: list,
                       logprobs: bool = False) -> Launched:
        """Enqueue `calls` (consecutive entries of prefill_calls(prompt), in order) of the
        prompt's prefill into state row `row` (its sampling parameters set); when they end the
        prompt, returns the first token's Launched (its device-to-host copy enqueued like a
        step's), else a Launched already done. The eager reference runs the whole prompt at
        once, and synchronously. `logprobs`: the first token's payload (runtime/logprobs.py)
        in the Launched's `payload` [1, P]."""
        if self.prefill_programs is None:
            if not logprobs:
                return Launched(torch.tensor([self.prefill(row, prompt)]))
            first, logits = prefill(self.model, self.state, row, prompt,
                                    self.cache.max_step_tokens, speculative=True,
                                    return_logits=True)
            p = lp.payload(logits[None], torch.tensor([first], device=logits.device))
            return Launched(torch.tensor([first]), payload=lp.to_bits(p.cpu())[None])
        if calls[0][0] == 0:
            check_prefill(self.model, self.state, row, prompt,
                          max(self.prefill_programs.chunks), True)
        first = self.prefill_programs.launch(row, prompt, calls, logprobs=logprobs)
        if calls[-1][0] + calls[-1][1] < len(prompt):
            return Launched(torch.zeros(1, dtype=torch.int64))
        if self.device.type == "cuda":
            # the graph's output lives in the pool: copied out before any later replay
            host = torch.empty(first.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(first, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = first, None
        return Launched(host[:1], event, payload=host[1:][None] if logprobs else None)

    def logprobs_refusal(self) -> str | None:
        """Why this engine cannot return logprobs (None: it can)."""
        return lp.refusal(self)

    @torch.no_grad()
    def prompt_logprobs(self, row: int, prompt: list[int], k: int) -> list:
        """The target's logprobs of the prompt's tokens (echo), by the eager reference on state
        row `row`, which the request's prefill then rewrites (runtime/logprobs.py)."""
        return lp.prompt_logprobs(self.model, self.state, row, prompt,
                                  self.cache.max_step_tokens, k)

    # ------------------------------------------------------------------ streams
    def open_stream(self, overlap: bool | None = None, prefill_tokens: int | None = None,
                    speculative: bool = True):
        """A GenerationStream over this engine's state rows (dspark_compile/runtime/scheduler.py); one
        per engine at a time. `overlap`: launch step n + 1 before reading step n (default: on
        CUDA, where the host's work then runs while the GPU replays; on the CPU nothing runs
        asynchronously and a step launched ahead is only a wasted step when rows end).
        `prefill_tokens`: the prefill tokens one step() may run while requests decode
        (default: the largest prefill chunk, or max_step_tokens without prefill programs).
        `speculative=False`: every step runs the target-only programs (one token per request
        and step: the engine's own non-speculative decoding)."""
        import weakref

        if self._stream is not None:
            old = self._stream()
            if old is not None and not old.closed:
                raise RuntimeError("a GenerationStream is already open on this engine (one at "
                                   "a time): close() it first")
        overlap = self.device.type == "cuda" if overlap is None else bool(overlap)
        if prefill_tokens is None:
            prefill_tokens = (max(self.prefill_programs.chunks) if self.prefill_programs
                              else self.cache.max_step_tokens)
        if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int) \
                or prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be a positive int, got {prefill_tokens!r}")
        if not speculative:
            self.check_target()
        s = GenerationStream(self, overlap, prefill_tokens, bool(speculative))
        self._stream = weakref.ref(s)
        return s

    def _requests(self, prompts, params) -> list:
        """A whole request list checked before anything runs (models/request.py's rules;
        messages name the prompt's index): the params' checked copies."""
        if isinstance(params, SamplingParams) and hasattr(prompts, "__len__"):
            params = [params] * len(prompts)
        seq = self.cache.max_seq_len
        return validate_batch(prompts, params, self.cfg.vocab_size, seq,
                              self.cfg.dspark_block_size, f"the engine holds max_seq_len={seq}")[1]

    def _run(self, prompts, params, **options):
        """(the stream, an iterator of its events until every request ended; the stream is
        closed at the end, or when the iterator is closed early)."""
        params = self._requests(prompts, params)
        s = self.open_stream(**options)
        try:
            for p, sp in zip(prompts, params):
                s.add(p, sp)
        except BaseException:
            s.close()
            raise

        def events():
            try:
                while s.has_work:
                    yield from s.step()
            finally:
                s.close()
        return s, events()

    def stream(self, prompts: list[list[int]], params, **options):
        """Generate for `prompts` (params: one SamplingParams for all, or one each), yielding
        after every step one StreamEvent(request index, new tokens, finished) per request that
        committed tokens or ended. Requests are checked before anything runs. `options`:
        open_stream's."""
        return self._run(prompts, params, **options)[1]

    def generate(self, prompts: list[list[int]], params, **options):
        """Every request to its end (Engine.stream): a GenerationResult with each request's
        tokens, the acceptance counts and the scheduling iterations that ran a step."""
        s, events = self._run(prompts, params, **options)
        tokens = [[] for _ in prompts]
        for e in events:
            tokens[e.request].extend(e.tokens)
        res = s.result
        res.tokens = tokens
        return res
