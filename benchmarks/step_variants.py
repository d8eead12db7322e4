"""The ways benchmarks/step.py runs one step (eager, eager in a graph, torch.compile in a graph,
the engine's captured programs), the compile budget, and the replay timing."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
from dspark_compile.engine_dir.format import STEP, ProgramKey  # noqa: E402
from step_launches import _sync  # noqa: E402


# ------------------------------------------------------------------------------------------------
# variants
# ------------------------------------------------------------------------------------------------

class Skipped(Exception):
    pass


class CompileBudgetExceeded(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise CompileBudgetExceeded in the main thread after `seconds` (SIGALRM). Elsewhere (a
    thread, or no SIGALRM) nothing is enforced and the caller checks the time after the fact."""
    usable = hasattr(signal, "setitimer") and \
        __import__("threading").current_thread() is __import__("threading").main_thread()
    if not usable:
        yield
        return

    def fire(signum, frame):
        raise CompileBudgetExceeded(f"torch.compile exceeded the budget of {seconds:g} s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _budget_hit(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, CompileBudgetExceeded) or "CompileBudgetExceeded" in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _new_graph():
    """(graph, kept): keep_graph=True keeps the cudaGraph_t so the driver can count its nodes;
    such a graph is instantiated by an explicit instantiate() (else by its first replay)."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:
        return torch.cuda.CUDAGraph(), False


class Runner:
    """One variant at one bucket: `call()` runs one step (a replay for graph variants);
    `graph`: the torch CUDAGraph when we captured it ourselves (node counting)."""

    def __init__(self, call, graph=None, info=None):
        self.call, self.graph, self.info = call, graph, info or {}


def capture(fn, device, restore) -> Runner:
    """Warm fn up on a side stream, capture it into one CUDA graph; state restored after."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            restore()
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    restore()
    g, kept = _new_graph()
    with torch.no_grad(), torch.cuda.graph(g, stream=stream):
        fn()
    if kept:
        g.instantiate()
    torch.cuda.synchronize(device)
    restore()
    return Runner(g.replay, g)


def make_runner(variant: str, B: int, ctx: dict) -> Runner:
    eng, step, state, device = ctx["engine"], ctx["step"], ctx["state"], ctx["device"]
    rows, restore = ctx["rows"][B], ctx["restore"]
    cuda = device.type == "cuda"
    if variant == "eager":
        return Runner(lambda: step(rows, state))
    if variant == "eager-graph":
        if not cuda:
            return Runner(lambda: step(rows, state), info={"note": "CPU: run without a graph"})
        return capture(lambda: step(rows, state), device, restore)
    if variant == "compile-graph":
        compiled = torch.compile(step, dynamic=False)
        t = time.perf_counter()
        try:
            with deadline(ctx["compile_budget_s"]), torch.no_grad():
                restore()
                compiled(rows, state)    # the first call compiles
                _sync(device)
        except Exception as e:  # noqa: BLE001 -- a failed compile is a result, not a crash
            torch._dynamo.reset()
            if _budget_hit(e):   # dynamo re-raises our alarm wrapped in its own errors
                raise Skipped(f"torch.compile exceeded the budget of {ctx['compile_budget_s']:g} s "
                              f"(interrupted after {time.perf_counter() - t:.1f} s)") from None
            raise Skipped(f"torch.compile failed after {time.perf_counter() - t:.1f} s: "
                          f"{type(e).__name__}: {str(e)[:300]}") from None
        seconds = time.perf_counter() - t
        if seconds > ctx["compile_budget_s"]:     # where SIGALRM could not interrupt
            raise Skipped(f"torch.compile took {seconds:.1f} s, over the budget of "
                          f"{ctx['compile_budget_s']:g} s")
        info = {"compile_s": round(seconds, 2)}
        if not cuda:
            r = Runner(lambda: compiled(rows, state), info=info)
            r.info["note"] = "CPU: run without a graph"
            return r
        r = capture(lambda: compiled(rows, state), device, restore)
        r.info.update(info)
        return r
    if variant in ("engine", "engine-greedy"):
        greedy = variant == "engine-greedy"
        key = ProgramKey(STEP, B, "greedy" if greedy else "full")
        if not eng.has(key):
            raise Skipped(f"the engine has no {'greedy variant' if greedy else 'program'} for "
                          f"bucket {B}")
        program = eng.program(key)
        if cuda:
            if program.graph is None:
                raise Skipped(f"bucket {B}: the engine captured no graph for this variant")
            g = program.graph
            g.rows.copy_(rows)
            return Runner(g.graph.replay, g.graph)
        return Runner(lambda: program.fn(rows, state), info={"note": "CPU: program, no graph"})
    if variant == "engine-batch-dependent":
        # the bucket's program captured with the plans that may split by the token count:
        # what batch invariance costs (kernels/invariance.py); plans are picked while capturing
        from dspark_compile.kernels.invariance import batch_dependent_plans
        if not eng.has(ProgramKey(STEP, B)):
            raise Skipped(f"the engine has no program for bucket {B}")
        fn = lambda: eng.program(ProgramKey(STEP, B)).fn(rows, state)  # noqa: E731
        if not cuda:
            def run():
                with batch_dependent_plans():
                    return fn()
            return Runner(run, info={"note": "CPU: program, no graph (references: one plan)"})
        with batch_dependent_plans():
            return capture(fn, device, restore)
    raise ValueError(variant)


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

def time_runner(r: Runner, ctx: dict, replays: int, warmup: int) -> dict:
    """Per replay: restore the state, flush L2 (both outside the timed region), sync, then CUDA
    events around the call alone (an eager call's time includes its host launch gaps)."""
    device, restore, flush = ctx["device"], ctx["restore"], ctx["flush"]
    times = []
    for i in range(warmup + replays):
        restore()
        flush()
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        with torch.no_grad():
            r.call()
        b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b) * 1e3)
    rec = harness.quantiles(times)
    rec.update(replays=len(times), method="cuda-events")
    return rec


def _cpu_copy_bandwidth(nbytes: int = 64 << 20, reps: int = 5) -> dict:
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    t = harness._median_seconds(lambda: dst.copy_(src), reps, src.device)
    return {"copy_bytes": 2 * nbytes, "copy_s_median": t, "bytes_per_s": 2 * nbytes / t,
            "note": "CPU memcpy (dry run): the floor in µs is only a smoke value"}


def _l2_flusher(device: torch.device):
    """Writes 2x L2 of scratch, so a replay does not find the restored state in L2 (the tiny
    model's state and weights are tens of MB, the H200's L2 is 60 MB)."""
    if device.type != "cuda":
        return lambda: None
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    buf = torch.empty(max(2 * l2, 1 << 20) // 4, dtype=torch.float32, device=device)
    return lambda: buf.fill_(0.0)
