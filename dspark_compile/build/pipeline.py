"""Build: export the draft-plus-verify step once per batch bucket, run the passes, write the engine.

    checkpoint ──load──► reference model ──torch.export (non-strict)──► one program per bucket
               ──PassManager (cleanup → fusions → lint)──► save_engine (atomic)

The program's inputs are `(rows, state)`: `rows` [B] maps batch rows to state rows (the trash
row for padding) and `state` is the dict of preallocated decode-state tensors, updated in place
(the program runs on the IR as exported: `run_decompositions()` would functionalise every cache
update into a whole-cache copy: docs/architecture.md, "Toolchain facts"). Shapes are static
per bucket (export_step / export_target `dynamic=True`: one program for every batch size).

With `prefill_chunks`, one prefill program per chunk length C goes the same way (export, the
same pass pipeline, the same lowering): `PrefillChunk` (models/prefill_chunk.py), inputs
`(inputs [C + 3], state)`. With `target_programs`, each bucket also gets its target-only program
(`TargetStep`, models/step.py: one token per row, inputs `(rows, state)` like the step).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from dspark_compile.engine_dir.format import (PREFILL, STEP, TARGET, ProgramKey, TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE)
from dspark_compile.engine_dir.write import save_engine
from dspark_compile.engine_dir.build_config import BuildConfig
from dspark_compile.models.random_requests import prefilled_state
from dspark_compile.atomic_dir import canonical, check_free_space, output_lock
from dspark_compile.build.checks import check_build
from dspark_compile.build.compile_workers import compile_programs
from dspark_compile.build.dynamic_batch import hoist_sizes
from dspark_compile.build.kernel_compile import compile_engine_kernels
from dspark_compile.build.tp_build import build_ranks
from dspark_compile.engine_dir.write import engine_bytes, occupied, tensor_bytes
from dspark_compile.kernels.sm12x import resource_report
from dspark_compile.models import load_model
from dspark_compile.models.checkpoint import load_checkpoint
from dspark_compile.models.moe import use_kernel_layouts
from dspark_compile.models.prefill_chunk import chunk_inputs, HEADER, PrefillChunk
from dspark_compile.models.state import allocate_state
from dspark_compile.models.step import DraftVerifyStep, TargetStep
from dspark_compile.passes import PassConfig, PassManager
from dspark_compile.models.chat_format import tokenizer_config
from dspark_compile.runtime.variants import GREEDY, variant_graph


def export_step(model, state: dict, bucket: int, dynamic: bool = False
                ) -> torch.export.ExportedProgram:
    """One static program for `bucket` request rows (with `dynamic`, one program for every
    batch of 1 to the state's max_rows rows: _export_rows).

    Node meta is preserved during tracing so that each call of a `@fusable` reference function
    (kernels/region.py) lands in the graph as an annotated region the fusion passes replace."""
    return _export_rows(DraftVerifyStep(model), state, bucket, dynamic)


def export_target(model, state: dict, bucket: int, dynamic: bool = False
                  ) -> torch.export.ExportedProgram:
    """The target-only program of `bucket` (models/step.py TargetStep), traced like
    export_step: the fusion passes find the same regions in its target forward."""
    return _export_rows(TargetStep(model), state, bucket, dynamic)


def _export_rows(module, state: dict, bucket: int, dynamic: bool = False
                 ) -> torch.export.ExportedProgram:
    """`module(rows, state)` exported for `bucket` rows, node meta preserved.

    `dynamic`: `rows`' length is a symbol B in [1, max_rows] (the state's rows but the trash
    row), traced on min(max(bucket, 2), max_rows) rows; each batch size then runs the one
    program (its own CUDA graph per bucket at load): _export."""
    device = state["row.last_pos"].device
    max_rows = state["row.last_pos"].shape[0] - 1
    if not dynamic or max_rows < 2:
        return _export(module, torch.arange(bucket, device=device), state)
    rows = torch.arange(min(max(bucket, 2), max_rows), device=device)
    return _export(module, rows, state, torch.export.Dim("B", min=1, max=max_rows))


def export_prefill(model, state: dict, chunk: int, dynamic: bool = False
                   ) -> torch.export.ExportedProgram:
    """One static prefill program for chunks of `chunk` tokens (models/prefill_chunk.py);
    traced like export_step, so the fusion passes find the same regions. `dynamic`: one
    program for every chunk length C in [1, chunk] (inputs [C + 3]): _export."""
    inputs = torch.zeros(chunk + HEADER, dtype=torch.int64, device=state["row.last_pos"].device)
    if not dynamic or chunk < 2:
        return _export(PrefillChunk(model, chunk), inputs, state)
    # the length itself is the symbol (a derived `Dim + 3` would start at C = 2)
    length = torch.export.Dim("C_plus_header", min=1 + HEADER, max=chunk + HEADER)
    return _export(PrefillChunk(model, chunk), inputs, state, length)


def _export(module, first: torch.Tensor, state: dict, dim=None) -> torch.export.ExportedProgram:
    """`module(first, state)` exported non-strict with node meta preserved; static, or with
    `dim` (a torch.export.Dim) as `first`'s length and the state's shapes static.

    A dynamic length is traced size-oblivious (`backed_size_oblivious`): the symbol is not
    assumed to be 1 anywhere, which lets it take 1 as well (a reference whose result would
    depend on it being 1 fails the export with a guard rather than specializing; the results
    at every length are checked by tests/passes/test_dynamic_batch.py). The references'
    row-chunked paths take their traced form for a symbolic row count (kernels/common.py
    row_matmul, simd_pointwise), and the size nodes are moved out of the fusable regions
    (build/dynamic_batch.py)."""
    with torch.no_grad(), torch.fx.traceback.preserve_node_meta():
        if dim is None:
            return torch.export.export(module, (first, state), strict=False)
        shapes = ({0: dim}, {k: None for k in state})
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            ep = torch.export.export(module, (first, state), strict=False,
                                     dynamic_shapes=shapes)
    hoist_sizes(ep.graph_module)
    return ep


def state_input_names(ep) -> list[str]:
    """User-input names of the program that are state tensors (everything but the first input:
    a step's `rows`, a prefill program's packed inputs)."""
    return [n for n in ep.graph_signature.user_inputs][1:]


def _compile(programs: dict, state: dict, bc: BuildConfig, log) -> dict:
    """Every program ({ProgramKey: ep}) and its variants Inductor-compiled
    (dspark_compile/build/compile_workers.py); the manifest's `compiled` table, plus "files"
    {engine path: artifact bytes}: the steps under `programs` / `compile_seconds`, the other
    kinds under their own table (`prefill_programs` / `prefill_compile_seconds` ...), each
    program by ProgramKey.listed."""
    t = time.perf_counter()
    files, seconds, workers = compile_programs(programs, state, bc.compile_workers, log)
    wall = time.perf_counter() - t
    total = sum(s for per in seconds.values() for s in per.values())
    log(f"[compile] inductor: {len(files)} programs in {wall:.1f}s ({total:.1f}s of compiles, "
        f"{workers} workers)")
    out = {"programs": {}, "compile_seconds": {}, "workers": workers,
           "total_compile_seconds": round(total, 1), "wall_seconds": round(wall, 1),
           "files": files}
    for key, per in sorted(seconds.items()):
        prefix = "" if key.kind == STEP else f"{key.kind}_"
        out.setdefault(f"{prefix}programs", {})[key.listed] = {
            v: key.with_variant(v).compiled_path for v in per}
        out.setdefault(f"{prefix}compile_seconds", {})[key.listed] = per
    return out


def _prefill_inputs(model, cache, chunk: int, seed: int) -> tuple:
    """--verify-passes inputs of a prefill program: a random request's state (one row
    prefilled, so the chunk lands behind live caches) and a chunk of fresh ids whose tail is
    padding."""
    import random
    rows, state = prefilled_state(model, cache, 1, seed)
    rng = random.Random(seed)
    row, start = int(rows[0]), int(state["row.last_pos"][rows[0]]) + 1
    ids = [rng.randrange(model.cfg.vocab_size) for _ in range(rng.randint(1, chunk))]
    x = chunk_inputs(row, start, ids, chunk).to(state["row.last_pos"].device)
    return tuple(pytree.tree_flatten((x, state))[0])


def _export_bucket(model, state: dict, cache, b: int, pm, bc: BuildConfig, log, chunk: int = 0,
                   target: bool = False, dynamic: bool = False):
    """Bucket b's step (with `target`, its target-only program; with `chunk`, the prefill
    program for that chunk length; with `dynamic`, the program of every bucket, traced at b)
    exported and run through the pass pipeline; (program, pass stats)."""
    what = (f"prefill chunk {chunk}" if chunk else f"target bucket {b}" if target
            else f"bucket {b}") + ((" (every chunk)" if chunk else " (every bucket)")
                                   if dynamic else "")
    t = time.perf_counter()
    ep = (export_prefill(model, state, chunk, dynamic) if chunk else
          export_target(model, state, b, dynamic) if target else
          export_step(model, state, b, dynamic))
    log(f"[export] {what}: {len(ep.graph.nodes)} nodes in {time.perf_counter() - t:.1f}s")
    factory = None
    if bc.verify_passes:
        def factory(seed):
            if chunk:
                return _prefill_inputs(model, cache, chunk, seed)
            return tuple(pytree.tree_flatten(prefilled_state(model, cache, b, seed))[0])
    rows = pm.run(ep, input_factory=factory, state_inputs=state_input_names(ep))
    for r in rows:
        log(f"[pass] {what}: {r['name']:<28} {r['time_ms']:>9.1f} ms  nodes "
            f"{r['nodes_before']:>6} -> {r['nodes_after']:<6} matches {r['matches']}"
            + ("  verified" if r.get("verified") else ""))
    # export keeps the example inputs (here: the whole decode state, ~100 MB even for the
    # tiny model), which the Inductor backend's job files (build/compile_workers.py) would
    # carry and a deep copy would duplicate; the runtime allocates its own state
    ep.example_inputs = None
    return ep, rows


def build_engine(ckpt: str | Path, out: str | Path, bc: BuildConfig,
                 log: Callable[[str], None] = print,
                 free_bytes: Callable[[Path], int] | None = None) -> dict:
    """Build the engine of checkpoint `ckpt` into `out` (atomically); returns the manifest.

    The output is locked from the checks on (a second build of the same `out` is refused
    naming this one, dspark_compile/atomic_dir.py output_lock); `bc.overwrite` False refuses an `out`
    that is not absent or empty (the CLI without --overwrite). The output file system's free
    space is checked once the weights are loaded, before minutes of export, and again before
    the write (save_engine). free_bytes: the free bytes of a path's file system (default:
    shutil.disk_usage's); the tests' seam for a full disk."""

    out = canonical(Path(out).absolute())
    # options, output and config.json first: loading and exporting take minutes
    check_build(ckpt, out, bc, log=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, "build"):
        why = None if bc.overwrite else occupied(out)
        if why:
            raise ValueError(f"out_dir {out} {why}; pass overwrite=True to replace an engine")
        return _build(ckpt, out, bc, log, free_bytes)


def _weights_estimate(model, bc: BuildConfig, ckpt: Path) -> int:
    """The engine's bytes as far as they are known before export (artifact.engine_bytes with
    programs of no nodes): the model's weights and buffers, the tokenizer, the manifest."""
    tensors = [*model.parameters(), *model.buffers()]
    n_programs = len(bc.buckets) * (2 if bc.target_programs else 1) + len(bc.prefill_chunks)
    tok = ckpt / TOKENIZER_FILE
    return engine_bytes(tensor_bytes(tensors), len(tensors), [0] * n_programs,
                        tok.stat().st_size if tok.is_file() else 0)


def _export_programs(model, cfg, cache, bc: BuildConfig, pconf: PassConfig, log) -> tuple:
    """Every program of the engine exported and run through the passes, each on a fresh decode
    state, largest first (the steps, the target-only steps, the prefill chunks): ({ProgramKey:
    ExportedProgram}, pass statistics by ProgramKey.listed, the last PassManager, the last
    state)."""
    keys = [ProgramKey(STEP, b) for b in sorted(bc.buckets, reverse=True)]
    if bc.target_programs:
        keys += [ProgramKey(TARGET, b) for b in sorted(bc.buckets, reverse=True)]
    keys += [ProgramKey(PREFILL, c) for c in sorted(bc.prefill_chunks, reverse=True)]
    every, stats = {}, {}
    # --dynamic-batch: the largest size of each kind is exported for every size of its kind
    # (buckets; prefill chunk lengths), when it has more than one
    sizes = {kind: sorted({k.size for k in keys if k.kind == kind}) for kind in (STEP, TARGET,
                                                                                PREFILL)}
    dynamic = {kind: bc.dynamic_batch and len(s) > 1 for kind, s in sizes.items()}
    for key in keys:
        if dynamic[key.kind] and key.size != sizes[key.kind][-1]:
            continue                 # served by the largest size's program (below)
        state = allocate_state(cfg, cache, bc.precision(), bc.device)
        pm = PassManager(bc.passes, pconf)
        kind = ({"chunk": key.size} if key.kind == PREFILL else
                {"target": True} if key.kind == TARGET else {})
        every[key], stats[key.listed] = _export_bucket(
            model, state, cache, 0 if key.kind == PREFILL else key.size, pm, bc, log, **kind,
            dynamic=dynamic[key.kind])
    for key in keys:
        if key not in every:         # a size served by the dynamic program of its kind
            top = ProgramKey(key.kind, sizes[key.kind][-1])
            every[key], stats[key.listed] = every[top], stats[top.listed]
    return every, stats, pm, state


def _tokenizer_files(ckpt: Path, cfg, bc: BuildConfig) -> dict:
    """The checkpoint's tokenizer (checked by check_build), checksummed with the engine's
    files, and beside it its special tokens and chat template: the checkpoint's
    tokenizer_config.json, else one with DeepSeek-V4's chat format (a Hugging Face tokenizer
    directory). {} without a tokenizer."""
    tok = ckpt / TOKENIZER_FILE
    if not tok.is_file():
        return {}
    data = tok.read_bytes()
    return {TOKENIZER_FILE: data, TOKENIZER_CONFIG_FILE: tokenizer_config(
        ckpt, json.loads(data), getattr(cfg, "bos_token_id", None),
        getattr(cfg, "eos_token_id", None), bc.max_seq_len)}


def _build(ckpt, out: Path, bc: BuildConfig, log, free_bytes) -> dict:
    if bc.tp > 1:
        # each rank's programs and shard, built by tp spawned processes (gloo on CPU), each
        # running build_model on its sharded model
        return build_ranks(ckpt, out, bc, build_model, log)
    t0 = time.perf_counter()
    log(f"[load] checkpoint {ckpt}")
    cfg, tensors = load_checkpoint(ckpt, device=bc.device)   # names a missing/bad checkpoint
    prec = bc.precision()
    # one model for every program: the step and prefill programs share its weight tensors
    model = load_model(None, prec, bc.rope_positions(cfg.dspark_block_size), True, bc.device,
                       tensors=tensors, cfg=cfg)
    del tensors
    return build_model(model, cfg, ckpt, out, bc, log, free_bytes, t0)


def build_model(model, cfg, ckpt, out: Path, bc: BuildConfig, log, free_bytes,
                t0: float, manifest_fields: dict | None = None) -> dict:
    """The engine of the loaded `model` (the checkpoint's `cfg`: the decode state and the
    manifest's model_config) written to `out`; a tensor-parallel rank passes its sharded model
    (build/tp_build.py) and `manifest_fields` to add. Returns the manifest."""
    raw_config = json.loads((Path(ckpt) / "config.json").read_text(encoding="utf-8"))
    prec = bc.precision()
    # the MoE experts in their kernel's weight layout, once (models/moe.py use_kernel_layouts);
    # each moe_experts call in the programs names the layout it reads
    use_kernel_layouts(model, prec.dtype)
    cache = bc.cache(cfg.dspark_block_size)
    log(f"[load] done in {time.perf_counter() - t0:.1f}s")
    check_free_space(out, _weights_estimate(model, bc, Path(ckpt)), "the engine", free_bytes)

    pconf = PassConfig(disabled=frozenset(bc.disabled_passes), verify=bc.verify_passes,
                       dump_dir=bc.dump_dir, target_device=bc.device)
    every, stats, pm, state = _export_programs(model, cfg, cache, bc, pconf, log)
    programs, target_programs, prefill_programs = (
        {k.size: ep for k, ep in every.items() if k.kind == kind}
        for kind in (STEP, TARGET, PREFILL))

    # the engine's extra files: compiled programs (--backend inductor), kernel reports (--arch),
    # the tokenizer
    extra = _tokenizer_files(Path(ckpt), cfg, bc)
    compiled = None
    if bc.backend == "inductor":
        compiled = _compile(every, state, bc, log)
        extra.update(compiled.pop("files"))
    if bc.arch:
        report = resource_report(bc.arch)
        extra[f"kernels/{bc.arch}/resources.json"] = json.dumps(report, indent=1)
    fields = {
        "model_config": raw_config,
        "build_config": bc.to_manifest(),
        "passes": pm.manifest_entries(),
        "pass_config_hash": pconf.hash(),
        "pass_stats": stats,
        **(manifest_fields or {}),
    }
    if compiled is not None:
        fields["compiled"] = compiled
    if torch.device(bc.device).type == "cuda":
        # every Triton kernel the programs launch, compiled here for this SM and stored, so a
        # load compiles nothing (dspark_compile/engine_dir/kernel_store.py)
        files, fields["kernel_store"] = compile_engine_kernels(
            programs, prefill_programs, cfg, cache, prec, torch.device(bc.device), log,
            target_programs, workers=bc.compile_workers)
        extra.update(files)
    if bc.arch:
        fields["kernel_resources"] = {bc.arch: report}
    t = time.perf_counter()
    # each step's greedy sampler variant, derived here once instead of at every load
    graphs: dict = {}                # one per program object (a dynamic one serves all)
    for ep in programs.values():
        if id(ep) not in graphs:
            graphs[id(ep)] = variant_graph(ep)
    variants = {ProgramKey(STEP, b, GREEDY): graphs[id(ep)] for b, ep in programs.items()
                if graphs[id(ep)] is not None}
    manifest = save_engine(out, programs, manifest_fields=fields, extra_files=extra,
                           prefill_programs=prefill_programs, target_programs=target_programs,
                           overwrite=bc.overwrite, free_bytes=free_bytes,
                           variant_graphs=variants)
    log(f"[write] {out} in {time.perf_counter() - t:.1f}s (total {time.perf_counter() - t0:.1f}s)")
    log(pm.format_stats(stats[str(max(bc.buckets))]))
    return manifest
