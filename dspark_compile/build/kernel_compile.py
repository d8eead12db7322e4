"""The engine's kernel store filled at build time: every program of the engine run once on this
GPU, every Triton kernel it compiles or reads from the cache recorded, and the cubins and
metadata collected into the store's files (the format, the checks and the load side:
dspark_compile/engine_dir/kernel_store.py). Before that run, kernel_pool.py compiles the
distinct kernel configurations in worker processes, so the run finds them in Triton's cache.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Iterable

import torch
from triton.runtime.jit import JITFunction

from dspark_compile.engine_dir.kernel_store import (
    _KEPT, _PROC, GROUP_PREFIX, _activate, compiles, store_dir, toolchain)
from dspark_compile.build import kernel_pool
from dspark_compile.models.prefill_chunk import chunk_inputs
from dspark_compile.models.state import allocate_state
from dspark_compile.runtime.variants import sampler_mode_variant


@contextlib.contextmanager
def record():
    """Note every cache entry Triton reads or writes inside the block (the build's warm-up
    runs): `collect()` turns them into the engine's files."""
    _activate()
    outer, _PROC.recording = _PROC.recording, {}
    try:
        yield _PROC.recording
    finally:
        inner, _PROC.recording = _PROC.recording, outer
        if outer is not None:
            for k, files in inner.items():
                outer.setdefault(k, {}).update(files)


def _compiled_in_process() -> dict:
    """{cache key: {filename: path}} of every kernel of dspark_compile.kernels compiled in this
    process (JITFunction.device_caches), its group file marked for collect() to write."""
    try:
        from triton.runtime.cache import _base32 as cache_key
    except ImportError:            # a Triton whose cache keys are the hash itself
        def cache_key(h):
            return h
    out: dict = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("dspark_compile.kernels") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if not isinstance(obj, JITFunction):
                continue
            for caches in getattr(obj, "device_caches", {}).values():
                for kernel in caches[0].values():
                    group = getattr(kernel, "metadata_group", None)
                    meta = next((c for c in group or {} if c.endswith(".json")), None)
                    if meta is None:
                        continue
                    files = out.setdefault(cache_key(kernel.hash), {})
                    files.update(group)
                    files[GROUP_PREFIX + meta] = None     # written by collect()
    return out


def collect(recorded: dict, tc: dict) -> tuple[dict, dict]:
    """The store's files {engine path: bytes} and its manifest entry, from what `record()`
    noted plus the kernels compiled earlier in this process."""
    entries: dict = {}
    for source in (recorded, _compiled_in_process()):
        for key, files in source.items():
            have = entries.setdefault(key, {})
            for f, p in files.items():
                if p is not None or f not in have:   # a known path is never replaced by None
                    have[f] = p
    root = store_dir(tc)
    out: dict = {}
    kernels = 0
    for key, files in sorted(entries.items()):
        # a load reads the binary and the metadata; the IRs Triton also caches (ttir, ttgir,
        # llir, ptx) are 85 % of the bytes and never read back, and a launcher module (.so) is
        # host code the loading machine builds itself
        members = {f: p for f, p in files.items() if p and not f.startswith(GROUP_PREFIX)
                   and f.endswith(_KEPT) and "/" not in f}
        data = {}
        for f, p in members.items():
            try:
                data[f] = Path(p).read_bytes()
            except OSError:
                data = None          # an entry another process evicted: it compiles at load
                break
        if not data:
            continue
        for f, b in data.items():
            out[f"{root}/{key}/{f}"] = b
        for g in (f for f in files if f.startswith(GROUP_PREFIX)):
            kernels += 1
            names = {c: c for c in data}
            out[f"{root}/{key}/{g}"] = json.dumps({"child_paths": names}, sort_keys=True)
    entry = {**tc, "path": root, "entries": len({k.split("/")[-2] for k in out}),
             "kernels": kernels,
             "bytes": int(sum(len(b) if isinstance(b, bytes) else len(b.encode())
                              for b in out.values()))}
    return out, entry


def _weights(programs: Iterable) -> set:
    """The storage addresses of the programs' weights and constants: what the discovery pass
    never zeroes (kernel_pool.discovering)."""
    out = set()
    for ep in programs:
        for t in (*ep.state_dict.values(), *ep.constants.values()):
            if isinstance(t, torch.Tensor):
                out.add(t.untyped_storage().data_ptr())
    return out


def compile_engine_kernels(programs: dict, prefill_programs: dict, cfg, cache, prec,
                           device: torch.device, log=print,
                           target_programs: dict | None = None,
                           workers: int = 0) -> tuple[dict, dict]:
    """Run every program of the engine once, as a load warms it up before capture (each
    bucket's step, its greedy variant and its target-only program on padded rows, each prefill
    program on the trash row, on a fresh decode state), so every kernel it launches is compiled
    for this device; returns the store's files and manifest entry (`collect`).

    `workers` (BuildConfig.compile_workers): 1 compiles each kernel at its first launch in this
    process; otherwise the distinct kernel configurations are found first and compiled in that
    many worker processes (0: one per core, bounded by host memory; kernel_pool.py), so the
    run that records the store finds them in Triton's cache."""
    t = time.perf_counter()
    trash = cache.max_rows
    target_programs = target_programs or {}

    # each program's module built once: a program of dynamic size serves every bucket (the
    # build's default) and run() runs twice (the pool's discovery, then the recording run),
    # while each unlift of a step costs ~0.5 s on the tiny model and grows with depth
    modules: dict = {}

    def module(ep, greedy: bool = False):
        key = (id(ep), greedy)
        if key not in modules:
            modules[key] = sampler_mode_variant(ep) if greedy else ep.module()
        return modules[key]

    def run() -> None:
        state = allocate_state(cfg, cache, prec, device)
        for b, ep in sorted(programs.items()):
            rows = torch.full((b,), trash, dtype=torch.int64, device=device)
            for m in (module(ep), module(ep, greedy=True)):
                if m is not None:
                    m(rows, state)
        for b, ep in sorted(target_programs.items()):
            module(ep)(torch.full((b,), trash, dtype=torch.int64, device=device), state)
        for c, ep in sorted(prefill_programs.items()):
            module(ep)(chunk_inputs(trash, 0, [0], c).to(device), state)
        torch.cuda.synchronize(device)

    if workers < 0:
        raise ValueError(f"compile_workers must be >= 0, got {workers}")
    if workers != 1:
        every = [*programs.values(), *target_programs.values(), *prefill_programs.values()]
        kernel_pool.precompile(run, _weights(every), workers, device, log)
    before = compiles()
    with record() as seen, torch.no_grad():
        run()
    files, entry = collect(seen, toolchain(device))
    late = sorted({g[len(GROUP_PREFIX):-len(".json")] for fs in seen.values() for g in fs
                   if g.startswith(GROUP_PREFIX)})
    if late and workers != 1:
        log(f"[kernels] compiled in the recording run: {', '.join(late[:20])}")
    log(f"[kernels] {entry['kernels']} Triton kernels for sm_{entry['sm']} (triton "
        f"{entry['triton']}, {compiles() - before} compiled in the recording run), "
        f"{entry['bytes'] / 1e6:.1f} MB in {time.perf_counter() - t:.1f}s")
    return files, entry
