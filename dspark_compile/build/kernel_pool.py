"""The build's Triton kernels compiled side by side in worker processes, once per distinct
configuration, before the serial warm-up run that fills the kernel store
(dspark_compile/build/kernel_compile.py) finds each of them in Triton's on-disk cache.

Triton compiles a kernel lazily at its first launch, so a warm-up run of every program compiles
them one after another (the H100 issue build: 247 kernels, 160.5 s on a 16-core machine; on the
H200, 163 kernels took 167.9 s of a 233.5 s build). Here:

    discover  the same run with Triton's `jit_cache_hook` answering "handled" for every kernel
              that would compile: nothing compiles and nothing launches, each distinct
              configuration (Triton's own specialization data: signature, constexprs,
              alignment attributes, options, target) is noted once
    compile   each configuration in a pool of processes: the worker imports the kernel's
              module and calls `JITFunction.preload`, Triton's own path from specialization
              data to a compiled kernel, which writes it into the build's Triton cache
    record    (kernel_compile) the warm-up run as before: every kernel is a cache hit

A skipped launch leaves its outputs unwritten, and uninitialised memory read as an index by an
aten op (a gather of the accepted count, an index_put_ of positions) is a device-side assert
that ends the process's CUDA context. So while discovering, every tensor a launch is given is
zeroed first, except the programs' weights (`protect`): every other tensor is the pass's own
(its fresh decode state, its inputs, its intermediates), and an index computed from zeros is in
range. A kernel that appears during the pass without that zeroing hook compiles and runs for
real instead.

Nothing here decides what the store holds: the record pass does, as it always did. A worker's
failure is named (kernel and configuration) and that kernel compiles in the record pass; a
worker that dies leaves what it had not compiled to the record pass too; a configuration whose
cache key differs in the workers (a knob set in the building process only) just compiles there
again. The workers compile for the build device's target without touching the GPU (no CUDA
context: host memory and cores bound their number, not device memory).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

# A worker's host memory: the Python interpreter with torch, Triton and this package's kernel
# modules imported (~0.6 GB resident), plus the MLIR/LLVM compile of the largest kernel (peaks
# near 0.3 GB); 1.5 GB leaves headroom for a machine that is also running the build itself.
WORKER_BYTES = 3 << 29


@dataclass(frozen=True)
class KernelConfig:
    """One distinct compile: the kernel ("module:qualname" of its JITFunction) and Triton's
    specialization data for it (a JSON string, triton.runtime.jit serialize_specialization_data)."""
    fn: str
    data: str

    def describe(self) -> str:
        """The kernel and its configuration in one line: constexprs and launch options."""
        try:
            d = json.loads(self.data)
            names = list(d["signature"])
            consts = {".".join(names[k[0]] if i == 0 else str(x) for i, x in enumerate(k)): v
                      for k, v in zip(d["constant_keys"], d["constant_vals"])}
            opts = {k: d["options"].get(k) for k in ("num_warps", "num_stages", "num_ctas")}
            return f"{self.fn} {json.dumps(consts, sort_keys=True)} {opts}"
        except (ValueError, KeyError, IndexError, TypeError):
            return f"{self.fn} {self.data[:200]}"


@dataclass
class PoolReport:
    """What the parallel compile did (logged by kernel_compile)."""
    configs: int = 0                              # distinct configurations discovered
    workers: int = 0
    compiled: int = 0                             # compiled (or found cached) by a worker
    seconds: float = 0.0                          # wall time of the pool
    failed: list = field(default_factory=list)   # (KernelConfig, one-line error)
    crashed: list = field(default_factory=list)  # KernelConfig left when a worker died
    peak_rss: int = 0                             # the largest worker's peak resident bytes


# --------------------------------------------------------------------------- discovery
def supported() -> str | None:
    """Why this Triton cannot discover and preload configurations (one line), or None."""
    from triton import knobs
    from triton.runtime import jit
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        return "this Triton has no knobs.runtime.jit_cache_hook"
    for what in ("preload", "add_pre_run_hook"):
        if not hasattr(jit.JITFunction, what):
            return f"this Triton's JITFunction has no {what}"
    try:
        from triton.runtime.driver import driver
        driver.set_active                                  # noqa: B018
    except (ImportError, AttributeError):
        return "this Triton's driver cannot be set"
    return None


def _jit_functions() -> list:
    """Every JITFunction this process has created (Triton's registry), else those of the
    imported modules."""
    from triton.runtime import jit
    reg = getattr(jit, "_triton_jit_function_registry", None)
    if reg:
        return list(reg.values())
    import sys
    seen = {}
    for mod in list(sys.modules.values()):
        for obj in list(vars(mod).values()) if mod is not None else ():
            if isinstance(obj, jit.JITFunction):
                seen[id(obj)] = obj
    return list(seen.values())


def _tensors(args: Iterable):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _tensors(a)


@contextlib.contextmanager
def discovering(protect: set):
    """Inside the block, a Triton launch that would compile notes its configuration and launches
    nothing; yields {(fn, data): KernelConfig}, in discovery order. Every tensor a launch is
    given is zeroed first (whole storage), unless its storage's address is in `protect` (the
    weights). Triton's previous hook and every JITFunction's pre-run hooks are restored on
    exit, also after an exception."""
    from triton import knobs
    found: dict = {}

    def zero_args(*args, **kwargs):
        done = set()
        for t in _tensors((*args, *kwargs.values())):
            if type(t) is not torch.Tensor or t.device.type == "meta":
                continue
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr in protect or ptr in done or s.nbytes() == 0:
                continue
            done.add(ptr)
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                s, 0, (s.nbytes(),), (1,)).zero_()

    def hook(*, fn, compile, is_manual_warmup=False, **_):
        jf = getattr(fn, "jit_function", None)
        if is_manual_warmup or zero_args not in getattr(jf, "pre_run_hooks", ()):
            return False            # a warm-up wants its kernel; unzeroed args: run for real
        cfg = KernelConfig(f"{fn.module}:{fn.name}", compile["specialization_data"])
        found.setdefault((cfg.fn, cfg.data), cfg)
        return True

    hooked = []
    previous = knobs.runtime.jit_cache_hook
    try:
        for jf in _jit_functions():
            if zero_args not in jf.pre_run_hooks:
                jf.add_pre_run_hook(zero_args)
                hooked.append(jf)
        knobs.runtime.jit_cache_hook = hook
        yield found
    finally:
        knobs.runtime.jit_cache_hook = previous
        for jf in hooked:
            with contextlib.suppress(ValueError):
                jf.pre_run_hooks.remove(zero_args)


# --------------------------------------------------------------------------- the workers
def worker_count(requested: int, jobs: int, available: int | None = None,
                 cpus: int | None = None) -> int:
    """Worker processes for `jobs` compiles: `requested` (0 = one per core this process may
    run on), at most one per job and one per WORKER_BYTES of available host memory."""
    if requested < 0:
        raise ValueError(f"compile_workers must be >= 0, got {requested}")
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    if available is None:
        available = mem_available()
    by_memory = max(1, available // WORKER_BYTES)
    return max(1, min(requested or cpus, by_memory, jobs))


def mem_available() -> int:
    """Host memory available to new processes: /proc/meminfo's MemAvailable (Linux), else the
    free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return WORKER_BYTES


class _TargetDriver:
    """Triton's active driver in a worker: the build device's target and index, no device
    access (a compile needs neither a CUDA context nor a GPU); anything else Triton asks for
    goes to the real driver, created only then."""

    def __init__(self, target, device: int):
        self._target, self._device = target, device

    def get_current_target(self):
        return self._target

    def get_current_device(self):
        return self._device

    def get_current_stream(self, device=None):
        return 0

    def __getattr__(self, name):
        from triton.runtime.driver import driver
        return getattr(driver.default, name)


def _init_worker(cache_dir: str, target: dict, device: int, setup, order=()) -> None:
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.cache import FileCacheManager
    knobs.cache.dir = cache_dir
    knobs.cache.manager_class = FileCacheManager
    driver.set_active(_TargetDriver(GPUTarget(**target), device))
    if setup is not None:
        setup()
    # A JITFunction's cache key depends on the order this process first hashed the kernels in:
    # Triton (3.6, 3.7) merges a called helper's constexpr globals into its caller's key only
    # once that helper has been hashed (DependenciesFinder._update_hash), so the first kernel to
    # call a helper gets a different key than later ones (41 of 87 tiny-engine kernels missed
    # the workers' cache on the H100 without this). The recording run hashes them in launch
    # order, which is `order` (discovery order): hashing them in that order here first gives
    # every worker the keys the recording run will look up.
    for name in order:
        try:
            find_jit_function(name).cache_key
        except Exception:            # that kernel's compile fails or misses, and says so
            pass


def find_jit_function(name: str):
    """The JITFunction "module:qualname", its module imported."""
    from triton.runtime import jit
    module, _, qual = name.partition(":")
    mod = importlib.import_module(module)
    fn = getattr(jit, "_triton_jit_function_registry", {}).get(name)
    if fn is None:
        fn = mod
        for part in qual.split("."):
            fn = getattr(fn, part, None)
    while fn is not None and not isinstance(fn, jit.JITFunction) and hasattr(fn, "fn"):
        fn = fn.fn                  # an Autotuner / Heuristics wrapper
    if not isinstance(fn, jit.JITFunction):
        raise LookupError(f"no JITFunction {qual} in module {module}")
    return fn


def preload(fn: str, data: str) -> None:
    """Compile one configuration into Triton's cache (a hit if it is there already), and build
    its launcher module there too where this Triton builds one per signature (3.6: a C compile
    of ~0.7 s a kernel, most of what a cache hit cost the recording run on the H100)."""
    kernel = find_jit_function(fn).preload(data)
    try:
        from triton.runtime.driver import driver
        launcher_cls = driver.default.launcher_cls
    except Exception:           # no driver on this machine: the build process builds it
        return
    if kernel is not None:
        launcher_cls(kernel.src, kernel.metadata)


def _peak_rss() -> int:
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # kB on Linux
    except (ImportError, OSError):
        return 0


def _run_one(compile_one: Callable, fn: str, data: str) -> dict:
    t = time.perf_counter()
    try:
        compile_one(fn, data)
    except Exception as e:            # named by the parent; the record pass compiles it
        lines = str(e).strip().splitlines() or [""]
        return {"error": f"{type(e).__name__}: {lines[-1][:300]}", "rss": _peak_rss()}
    return {"seconds": time.perf_counter() - t, "rss": _peak_rss()}


def compile_configs(configs: list, workers: int, cache_dir: str, target: dict, device: int,
                    compile_one: Callable = preload, setup: Callable | None = None,
                    order: tuple = ()) -> PoolReport:
    """Compile `configs` ([KernelConfig]) in `workers` spawned processes into Triton's cache at
    `cache_dir` for `target` (a GPUTarget's fields). `compile_one(fn, data)` runs in a worker
    (default: `preload`), after `setup()` (a test's stand-in driver) and after hashing the
    JITFunctions `order` names in that order (the recording run's). Never raises for a
    worker's error or death: the report lists what was not compiled."""
    import multiprocessing
    rep = PoolReport(configs=len(configs), workers=workers)
    t = time.perf_counter()
    ex = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker,
                             initargs=(cache_dir, target, device, setup, tuple(order)))
    ok = False
    try:
        futures = {ex.submit(_run_one, compile_one, c.fn, c.data): c for c in configs}
        for fut in as_completed(futures):
            c = futures[fut]
            try:
                out = fut.result()
            except BrokenProcessPool:
                rep.crashed.append(c)
                continue
            rep.peak_rss = max(rep.peak_rss, out.get("rss", 0))
            if "error" in out:
                rep.failed.append((c, out["error"]))
            else:
                rep.compiled += 1
        ok = True
    finally:
        # an interrupt (or an error here) stops the workers now rather than after their
        # compiles
        procs = list((getattr(ex, "_processes", None) or {}).values())
        ex.shutdown(wait=ok, cancel_futures=True)
        if not ok:
            for p in procs:
                if p.is_alive():
                    p.kill()
    rep.seconds = time.perf_counter() - t
    return rep


# --------------------------------------------------------------------------- the build's use
def precompile(run: Callable[[], None], protect: set, workers: int, device: torch.device,
               log=print) -> PoolReport | None:
    """Discover the configurations `run()` would compile and compile them in worker processes
    into this process's Triton cache; None where it does not apply (a reason logged). `run`
    launches every program once, as the record pass will."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager
    from triton.runtime.driver import driver
    from dspark_compile.engine_dir.kernel_store import _PROC, StoreCacheManager
    why = supported()
    # None: Triton's default, the file cache (triton 3.6 leaves the knob unset)
    manager = knobs.cache.manager_class or FileCacheManager
    if manager is StoreCacheManager:
        manager = _PROC.fallback or FileCacheManager
    if why is None and manager is not FileCacheManager:
        why = (f"Triton's cache manager is {manager.__module__}.{manager.__qualname__}, not "
               "the file cache the workers write")
    if why is not None:
        log(f"[kernels] compiling in the build process: {why}")
        return None
    t = time.perf_counter()
    try:
        with discovering(protect) as found, torch.no_grad():
            run()
            torch.cuda.synchronize(device)
    except Exception as e:        # the record pass runs the programs as before and says more
        log(f"[kernels] compiling in the build process: finding the kernels failed "
            f"({type(e).__name__}: {str(e).strip()[:300]})")
        return None
    configs = list(found.values())
    n = worker_count(workers, len(configs))
    log(f"[kernels] {len(configs)} distinct kernel configurations found in "
        f"{time.perf_counter() - t:.1f}s")
    if n <= 1:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = vars(driver.active.get_current_target())
    order = tuple(dict.fromkeys(c.fn for c in configs))
    rep = compile_configs(configs, n, knobs.cache.dir, dict(target), index, order=order)
    for c, err in rep.failed:
        log(f"[kernels] compiling {c.describe()} failed in its worker ({err}); the build "
            f"process compiles it")
    if rep.crashed:
        log(f"[kernels] a compile worker died; {len(rep.crashed)} configurations (one of them "
            f"{rep.crashed[0].describe()}) compile in the build process")
    log(f"[kernels] {rep.compiled} of {rep.configs} configurations compiled in {rep.workers} "
        f"worker processes in {rep.seconds:.1f}s (peak {rep.peak_rss / 1e9:.2f} GB a worker)")
    return rep
