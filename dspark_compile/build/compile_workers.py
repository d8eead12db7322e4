"""Compile a build's programs with Inductor, several at a time, in worker processes (what
each compile is, and how, is dspark_compile/build/inductor.py's `compile_variant`; this file only
runs them side by side).

Inductor spends most of one program's compile in single-threaded Python (lowering, the
scheduler's fusion search, code generation: 47 s + 78 s of the tiny step's 208 s at bucket 1 on
a CPU, docs/architecture.md "Toolchain facts"); only the kernel builds at its end use its thread
pool. Seven buckets, each with its greedy sampler variant, are 14 such compiles, so a build runs
them side by side in processes, one program each:

    parent: save each bucket's program with stand-in weights + the weights' and state's
            metadata into a job directory
    worker: load the program, allocate uninitialised weights and state of the recorded shapes
            and strides (only metadata reaches the compiled code), compile one variant, write
            the artifact
    parent: collect the artifacts (engine files compiled/step_b{B}[_greedy].bin)

A worker's weights are real device allocations (Inductor compiles for concrete tensors), so the
number of workers is also capped by the device memory free for them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from dspark_compile.build.inductor import compile_variant, variants_of
from dspark_compile.engine_dir.format import VARIANTS, ProgramKey
from dspark_compile.engine_dir.weights import _attach_weights, _save_program, _weight_entries
from dspark_compile.engine_dir.format import register_kernel_ops

_DTYPES = {str(getattr(torch, n)): getattr(torch, n) for n in dir(torch)
           if isinstance(getattr(torch, n, None), torch.dtype)}


def _device(state: dict) -> torch.device:
    return next(iter(state.values())).device


def _meta(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype)}


def _empty(meta: dict, device) -> torch.Tensor:
    return torch.empty_strided(meta["shape"], meta["stride"], dtype=_DTYPES[meta["dtype"]],
                               device=device)


def default_workers(n_jobs: int) -> int:
    """One worker per job, two CPU cores each (a worker's kernel builds use the second)."""
    return max(1, min(n_jobs, (os.cpu_count() or 2) // 2))


def _write_job(ep, key: ProgramKey, state: dict, job: Path) -> int:
    """The worker's inputs for one program; returns the device bytes a worker allocates."""
    job.mkdir()
    weights = {n: t for n, (t, _) in _weight_entries(ep).items()}
    _save_program(ep, job / "step.pt2", sorted(weights))
    meta = {"program": key.listed, "device": str(_device(state)),
            "weights": {n: _meta(t) for n, t in weights.items()},
            "state": {k: _meta(v) for k, v in state.items()}}
    (job / "job.json").write_text(json.dumps(meta))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(weights.values()) + list(state.values())}
    return sum(storages.values())


# a worker's CUDA context, Inductor's compile-time kernel tuning buffers and allocator slack,
# on top of its weights and state
_WORKER_OVERHEAD = 2 << 30


def _memory_cap(device: torch.device, per_worker: int) -> int:
    if device.type != "cuda":
        return sys.maxsize
    torch.cuda.empty_cache()        # the exports' freed blocks are free for the workers
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, int(0.8 * free) // (per_worker + _WORKER_OVERHEAD))


def compile_programs(programs: dict, state: dict, workers: int, log) -> tuple[dict, dict, int]:
    """Compile every program ({ProgramKey: ExportedProgram}) and its variants; returns
    ({engine path: artifact bytes}, {ProgramKey: {variant: compile seconds}}, the number of
    workers used). `workers`: 0 = one per job up to half the CPU cores, 1 = in this process."""
    keys = sorted(programs)
    jobs = [(k, v) for k in keys for v in variants_of(programs[k])]
    workers = workers or default_workers(len(jobs))
    files, seconds = {}, {}
    if workers <= 1:
        for k, v in jobs:
            data, secs = compile_variant(programs[k], v, state)
            files[k.with_variant(v).compiled_path] = data
            seconds.setdefault(k, {})[v] = round(secs, 2)
            log(f"[compile] {k} {v}: {secs:.1f}s, {len(data) / 1e6:.1f} MB")
        return files, seconds, 1
    with tempfile.TemporaryDirectory(prefix="dspark-compile-") as tmp:
        per_worker = 0
        for k in keys:
            per_worker = max(per_worker, _write_job(programs[k], k, state, Path(tmp) / k.stem))
        n = min(workers, len(jobs), _memory_cap(_device(state), per_worker))
        threads = max(1, (os.cpu_count() or 2) // n)
        log(f"[compile] {len(jobs)} programs in {n} worker processes, {threads} compile "
            f"threads each")
        for (k, v), secs in _run_workers(Path(tmp), jobs, n, threads, log).items():
            files[k.with_variant(v).compiled_path] = (Path(tmp) / k.stem / f"{v}.bin").read_bytes()
            seconds.setdefault(k, {})[v] = secs
    return files, seconds, n


def _run_workers(tmp: Path, jobs: list, n: int, threads: int, log) -> dict:
    """Run the jobs, at most n at a time; {(ProgramKey, variant): compile seconds}. A failed
    worker stops the build with its output."""
    pending, running, done = list(jobs), {}, {}
    try:
        while pending or running:
            while pending and len(running) < n:
                k, v = pending.pop(0)
                log_path = tmp / k.stem / f"{v}.log"
                cmd = [sys.executable, "-m", "dspark_compile.build.compile_workers",
                       str(tmp / k.stem), "--variant", v, "--threads", str(threads)]
                with open(log_path, "w") as f:
                    # its own session: a stop kills the worker and Inductor's compile pool
                    running[(k, v)] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                                        start_new_session=True),
                                       log_path, time.perf_counter())
            time.sleep(0.2)
            for key, (proc, log_path, t) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[key]
                if proc.returncode != 0:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"compiling {key[0]} ({key[1]}) failed in its "
                                       f"worker (exit {proc.returncode}):\n{tail}")
                done[key] = json.loads((log_path.with_suffix(".json")).read_text())["seconds"]
                log(f"[compile] {key[0]} {key[1]}: {done[key]:.1f}s in its worker "
                    f"({time.perf_counter() - t:.1f}s wall)")
    finally:
        for proc, _, _ in running.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return done


def _worker(job: Path, variant: str, threads: int) -> None:
    torch._inductor.config.compile_threads = threads
    meta = json.loads((job / "job.json").read_text())
    device, key = torch.device(meta["device"]), ProgramKey.of_listed(meta["program"])
    register_kernel_ops()
    ep = torch.export.load(str(job / "step.pt2"))
    weights = {n: _empty(m, device) for n, m in meta["weights"].items()}
    _attach_weights(ep, sorted(weights), weights, key)
    state = {k: _empty(m, device) for k, m in meta["state"].items()}
    data, seconds = compile_variant(ep, variant, state)
    (job / f"{variant}.bin").write_bytes(data)
    (job / f"{variant}.json").write_text(json.dumps({"seconds": round(seconds, 2)}))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="compile one program of a build (internal)")
    p.add_argument("job")
    p.add_argument("--variant", required=True, choices=VARIANTS)
    p.add_argument("--threads", type=int, required=True)
    a = p.parse_args()
    _worker(Path(a.job), a.variant, a.threads)
