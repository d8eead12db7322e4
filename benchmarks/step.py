"""The whole draft-plus-verify step, every way we can run it, side by side in one run:

    python benchmarks/step.py --preset tiny --buckets 1,4,16,64 --out DIR
    python benchmarks/step.py --dry-run --out DIR        # CPU: tiny, one bucket, no timing

synth checkpoint (or reuse --work) -> build_engine for the buckets -> Engine.load (its CUDA
graphs) -> per case ("mixed": random greedy and sampled rows; "greedy": every row greedy), every
state row prefilled with a random request, the state snapshotted -> per bucket B (rows 0..B-1,
all live):
  - the router's top-k ids of one eager reference step -> the byte floor (step_floor.py);
  - variants: `eager` (models/step.py DraftVerifyStep called eagerly), `eager-graph` (the same
    captured in one CUDA graph), `compile-graph` (torch.compile of it, captured in one graph;
    compile seconds recorded, skipped past --compile-budget-s), `engine` (the bucket's captured
    program), `engine-greedy` (its greedy variant; "greedy" case only);
  - per variant: median / p10 / p90 µs over --replays replays, the state restored (and L2
    flushed) before each one outside the timed region; kernel launches of one replay from
    torch.profiler (CUPTI), split into dspark:: / Inductor / library / aten kernels, plus the
    graph's kernel-node count from the driver where the graph is ours; ratio to the floor;
  - per layer (layers.N, mtp.N, head, sampler, ...): the engine's program and the exported
    reference step run uncaptured through an fx Interpreter that wraps each node in
    record_function(<its layer>), each kernel attributed to its range.
-> JSON (rewritten after every row, "complete": false until the end), CSV, plot, a table.

`--dry-run` runs the same code on the CPU without timing: every variant once, launches
replaced by the aten / dspark ops the profiler sees, the floor, the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pkgutil
import re
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import step_floor  # noqa: E402

VARIANTS = ("eager", "eager-graph", "compile-graph", "engine", "engine-greedy")
CASES = {"mixed": "random", "greedy": "greedy"}   # case -> prefill_random_requests mix
SCHEMA = "dspark-step-benchmark/1"
LABEL = "layer::"


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=("tiny", "flash-slice"))
    p.add_argument("--buckets", default="1,4,16,64",
                   help="batch buckets (all rows live); --dry-run uses the first")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--cases", default="mixed,greedy", help="comma-separated subset of mixed,greedy")
    p.add_argument("--replays", type=int, default=30, help="timed replays per variant and bucket")
    p.add_argument("--warmup", type=int, default=3, help="untimed replays before them")
    p.add_argument("--compile-budget-s", type=float, default=900.0,
                   help="seconds one bucket's torch.compile may take (enforced with SIGALRM in "
                        "the main thread); over it the variant is skipped with the reason")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="positions per request (default 256; --dry-run 64)")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="random prompt lengths 1..this (default 64; --dry-run 12)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float64"),
                   help="compute dtype (default bfloat16; --dry-run float32)")
    p.add_argument("--per-layer", default="all", choices=("all", "smallest", "none"),
                   help="buckets that get the per-layer attribution (an export of the reference "
                        "step each: ~10-30 s)")
    p.add_argument("--backend", default=None, choices=("inductor", "aten"),
                   help="the engine's --backend (default: the build's, inductor on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None,
                   help="directory for the checkpoint and engine, reused when they match "
                        "(default: a temporary directory, deleted at the end)")
    p.add_argument("--out", default=None,
                   help="output directory (default benchmarks/results/<device>_step_<date>/)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny, one bucket, no timing")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--git-commit", default=None, help="when the machine has no .git")
    a = p.parse_args(argv)
    a.buckets = sorted({int(b) for b in a.buckets.split(",") if b.strip()})
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    a.cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [v for v in a.variants if v not in VARIANTS] + [c for c in a.cases if c not in CASES]
    if bad or not a.buckets or a.buckets[0] < 1:
        p.error(f"unknown variants/cases {bad} or bad buckets {a.buckets}")
    if a.dry_run:
        a.preset, a.buckets = "tiny", a.buckets[:1]
    a.dtype = a.dtype or ("float32" if a.dry_run else "bfloat16")
    a.max_seq_len = a.max_seq_len or (64 if a.dry_run else 256)
    # prompts up to 64 tokens put the SWA rings (window 128 at Flash dims, 8 tiny) and the C4 /
    # C128 compressed caches part-way full; the dry run keeps its prefill short
    a.max_prompt_len = a.max_prompt_len or (12 if a.dry_run else 64)
    return a


# ------------------------------------------------------------------------------------------------
# kernel names and classification
# ------------------------------------------------------------------------------------------------

def dspark_kernel_names() -> list[str]:
    """Names of every Triton jit function in dspark_compile.kernels (walked, so a kernel added
    later is picked up), plus the kernels declared through registry.add_compile_configs. The
    names include device helpers that are never launched: harmless in a name match."""
    import importlib

    import dspark_compile.kernels as pkg
    from dspark_compile.kernels.registry import KERNELS
    names = set()
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            kind = type(obj).__name__
            if kind in ("JITFunction", "InterpretedFunction") or (
                    kind.endswith("JITFunction") and hasattr(obj, "fn")):
                fn = getattr(obj, "fn", None)
                names.add(getattr(fn, "__name__", None) or getattr(obj, "__name__", str(obj)))
    for spec in KERNELS.values():
        for entry in spec.compile_configs:
            fn = getattr(entry[0], "fn", entry[0])
            names.add(getattr(fn, "__name__", str(fn)))
    return sorted(n for n in names if n)


_LIBRARY = re.compile(r"gemm|gemv|xmma|cutlass|cublas|cudnn|nvjet|splitk|sm90_|sm80_|cutensor",
                      re.IGNORECASE)
CLASSES = ("dspark", "inductor", "library", "aten", "copies")


def classify(name: str, dspark: set[str]) -> str:
    """dspark (one of our Triton kernels), inductor (triton_poi_/red_/per_/tem_/...: generated
    by torch.compile), library (cuBLAS / cuDNN / CUTLASS), copies (memcpy / memset nodes, not
    kernels), aten (everything else: PyTorch's own kernels). On CPU (dry run) the names are ops:
    dspark::* -> dspark, aten::* -> aten."""
    base = name.split("(")[0].strip()
    if name.startswith("dspark::") or base in dspark:
        return "dspark"
    if base.startswith("triton_"):
        return "inductor"
    if name.startswith(("Memcpy", "Memset", "memcpy", "memset")):
        return "copies"
    if _LIBRARY.search(name):
        return "library"
    return "aten"


def _counts(names: list[str], dspark: set[str]) -> dict:
    out = {c: 0 for c in CLASSES}
    for n in names:
        out[classify(n, dspark)] += 1
    out["total"] = sum(out[c] for c in CLASSES if c != "copies")
    return out


def _is_op(name: str) -> bool:
    return name.startswith(("aten::", "dspark::"))


def _top_level_ops(events) -> list:
    """CPU op events not nested in another aten/dspark op: the ops the program dispatched."""
    out = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or not _is_op(e.name):
            continue
        p = e.cpu_parent
        while p is not None and not _is_op(p.name):
            p = p.cpu_parent
        if p is None:
            out.append(e)
    return out


def profile_launches(fn, device: torch.device) -> list[str]:
    """Names of what one call of fn runs: on CUDA the kernels (and memcpy / memset) CUPTI
    records, which includes those of a graph replay; on CPU the top-level aten / dspark ops."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    events = prof.events()
    if device.type == "cuda":
        return [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name for e in _top_level_ops(events)]


def graph_kernel_nodes(graph) -> dict | None:
    """Node counts of a captured graph from the driver (cuGraphGetNodes / cuGraphNodeGetType):
    a check on the profiler's count. None where torch does not keep the cudaGraph_t (graphs
    made without keep_graph=True, e.g. the runtime's) or the driver library is not found."""
    import ctypes
    try:
        handle = graph.raw_cuda_graph()
        lib = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_size_t(0)
        if lib.cuGraphGetNodes(ctypes.c_void_p(handle), None, ctypes.byref(n)) != 0:
            return None
        nodes = (ctypes.c_void_p * n.value)()
        if lib.cuGraphGetNodes(ctypes.c_void_p(handle), nodes, ctypes.byref(n)) != 0:
            return None
        kinds = {0: "kernel", 1: "memcpy", 2: "memset"}
        out = {"nodes": int(n.value), "kernel": 0, "memcpy": 0, "memset": 0, "other": 0}
        t = ctypes.c_int(0)
        for node in nodes[:n.value]:
            lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
            out[kinds.get(t.value, "other")] += 1
        return out
    except Exception:  # noqa: BLE001 -- an optional cross-check
        return None


# ------------------------------------------------------------------------------------------------
# per-layer attribution
# ------------------------------------------------------------------------------------------------

_PATH = re.compile(r"(?:^|\.)((?:layers|mtp)\.\d+)(?:\.|$)")
_SAMPLERS = ("markov_sample", "rejection_sample", "sample")


# the innermost stack-trace line export records is the one in a module's forward (or the
# step's): these calls there name the model part their nodes belong to
_CALL_LABELS = (("self.logits(", "head"), ("self.embed_streams(", "embed"),
                ("draft_block(", "draft"), ("store_context(", "draft.context"),
                ("rejection_sample_reference(", "sampler"), ("sampling_of(", "sampler"))


def node_label(node) -> str:
    """The model part a graph node belongs to: sampler (the sampler ops, their reference
    regions and arguments), head (the target's hc_head, norm and LM head), embed, layers.N /
    mtp.N (from nn_module_stack), draft (the draft's embedding, its hc_head and LM head
    outside mtp.N blocks), draft.context (the context store), step (the step's own code: batch
    set-up, state updates)."""
    custom = node.meta.get("custom") or {}
    region = custom.get("dspark_region") or custom.get("dspark_fused")
    target = str(node.target)
    if region in _SAMPLERS or any(f"dspark.{s}." in target or target == f"dspark.{s}"
                                  for s in _SAMPLERS):
        return "sampler"
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]
    deepest = paths[-1] if paths else ""
    if re.search(r"(?:^|\.)hc_head(?:\.|$)", deepest):
        return "draft" if ".mtp." in f".{deepest}" else "head"
    for path in reversed(paths):
        m = _PATH.search(path)
        if m:
            return m.group(1)
    if deepest in ("model.norm", "norm"):
        return "head"
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    code = lines[-1] if lines else ""
    for call, label in _CALL_LABELS:
        if call in code:
            return label
    return "step"


class _Labelled(torch.fx.Interpreter):
    """Runs a GraphModule node by node, each op inside record_function(layer::<label>)."""

    def run_node(self, n):
        if n.op in ("call_function", "call_method", "call_module"):
            with torch.profiler.record_function(LABEL + node_label(n)):
                return super().run_node(n)
        return super().run_node(n)


def _label_of(e) -> str | None:
    while e is not None:
        if e.name.startswith(LABEL):
            return e.name[len(LABEL):]
        e = e.cpu_parent
    return None


def per_layer(gm, rows: torch.Tensor, state: dict, device: torch.device, dspark: set[str]) -> dict:
    """Launches per model part of one uncaptured run of `gm(rows, state)` (the state is
    mutated: the caller restores it). CUDA: every kernel the profiler attaches to a CPU event
    under a layer:: range; kernels it attaches nowhere are "unattributed". CPU: the top-level
    aten / dspark ops under each range."""
    from torch.fx._pytree import tree_flatten_spec
    from torch.profiler import ProfilerActivity, profile
    flat = tree_flatten_spec(((rows, state), {}), gm._in_spec)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=acts) as prof:
        _Labelled(gm).run(*flat)
        _sync(device)
    events = prof.events()
    names: dict[str, list] = {}
    if device.type == "cuda":
        attributed = 0
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.kernels:
                lab = _label_of(e) or "unattributed"
                for k in e.kernels:
                    names.setdefault(lab, []).append(k.name)
                    attributed += 1
        total = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        if total > attributed:
            names.setdefault("unattributed", []).extend(["?"] * (total - attributed))
    else:
        for e in _top_level_ops(events):
            names.setdefault(_label_of(e) or "unattributed", []).append(e.name)
    return {lab: _counts(ns, dspark) for lab, ns in sorted(names.items())}


# ------------------------------------------------------------------------------------------------
# variants
# ------------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        graphs = eng.greedy_graphs if greedy else eng.graphs
        modules = eng.greedy_modules if greedy else eng.modules
        if B not in modules:
            raise Skipped(f"the engine has no {'greedy variant' if greedy else 'program'} for "
                          f"bucket {B}")
        if cuda:
            if B not in graphs:
                raise Skipped(f"bucket {B}: the engine captured no graph for this variant")
            g = graphs[B]
            g.rows.copy_(rows)
            return Runner(g.graph.replay, g.graph)
        return Runner(lambda: modules[B](rows, state), info={"note": "CPU: program, no graph"})
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


# ------------------------------------------------------------------------------------------------
# setup
# ------------------------------------------------------------------------------------------------

def _engine_matches(engine_dir: Path, args, prefill_chunks: tuple = ()) -> bool:
    try:
        m = json.loads((engine_dir / "manifest.json").read_text())
        bc = m["build_config"]
        # prefill chunks decide a prompt's chunk schedule: a prefill run needs exactly its own
        return (set(args.buckets) <= {int(b) for b in m["buckets"]}
                and (not prefill_chunks
                     or tuple(bc.get("prefill_chunks") or ()) == tuple(prefill_chunks))
                and bc["dtype"] == args.dtype and int(bc["max_seq_len"]) == args.max_seq_len
                and torch.device(bc["device"]).type == args.device.type
                and int(bc["max_rows"]) >= max(args.buckets)
                and bc.get("backend") == _backend(args)
                and m.get("model_config", {}).get("hidden_size") == _preset_hidden(args.preset))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _backend(args) -> str:
    from dspark_compile.build_config import BuildConfig
    return BuildConfig(device=args.device.type, backend=args.backend or "").backend


def _preset_hidden(name: str) -> int:
    from dspark_compile.models.presets import preset
    return preset(name)["hidden_size"]


def setup_engine(args, work: Path, log, prefill_chunks: tuple = ()) -> tuple[object, dict]:
    """The checkpoint and engine under `work` (reused when they fit), loaded. `prefill_chunks`
    (benchmarks/prefill.py): the build's prefill programs, loaded with the engine; such an
    engine has a directory of its own."""
    from dspark_compile.build_config import BuildConfig
    from dspark_compile.models.synth import synth_checkpoint
    from dspark_compile.runtime import Engine
    from dspark_compile.trace import build_engine

    times = {}
    ckpt = work / f"ckpt_{args.preset}"
    if not (ckpt / "config.json").exists():
        t = time.perf_counter()
        log(f"[synth] {args.preset} -> {ckpt}")
        synth_checkpoint(args.preset, ckpt, seed=0, device=args.device.type, overwrite=True)
        times["synth_s"] = time.perf_counter() - t
    engine_dir = work / (f"engine_{args.preset}" + "".join(f"_p{c}" for c in prefill_chunks))
    if not _engine_matches(engine_dir, args, prefill_chunks):
        if engine_dir.exists():
            # it lives under --work, made by an earlier run of this script for other options
            import shutil
            log(f"[build] {engine_dir} does not fit this run: rebuilding")
            shutil.rmtree(engine_dir)
        t = time.perf_counter()
        build_engine(ckpt, engine_dir, BuildConfig(
            buckets=tuple(args.buckets), max_rows=max(args.buckets), max_seq_len=args.max_seq_len,
            dtype=args.dtype, device=args.device.type, backend=_backend(args),
            prefill_chunks=tuple(prefill_chunks)), log=log)
        times["build_s"] = time.perf_counter() - t
        if args.device.type == "cuda":    # the build's model (24 GB at flash-slice) is gone
            torch.cuda.empty_cache()
    else:
        log(f"[build] reusing {engine_dir}")
    t = time.perf_counter()
    graphs = args.device.type == "cuda" and any(v.startswith("engine") for v in args.variants)
    eng = Engine.load(engine_dir, device=args.device, use_graphs=graphs, record_graph_memory=False,
                      prefill="programs" if prefill_chunks else None)
    times["load_s"] = time.perf_counter() - t
    times["engine_dir"] = str(engine_dir)
    log(f"[load] {engine_dir} in {times['load_s']:.1f}s (graphs: {graphs})")
    return eng, times


def prefill_case(eng, case: str, args) -> dict:
    """Every state row holds a fresh random request of the case's mix; returns the snapshot."""
    from dspark_compile.models.random_requests import prefill_random_requests
    from dspark_compile.models.state import snapshot_state
    for t in eng.state.values():      # as allocated: no entry left from the other case
        t.zero_()
    with torch.no_grad():
        prefill_random_requests(eng.model, eng.state, range(eng.cache.max_rows), args.seed,
                                eng.cache.max_step_tokens, max_prompt_len=args.max_prompt_len,
                                mix=CASES[case])
    _sync(eng.device)
    return snapshot_state(eng.state)


def _default_out(device_name: str, kind: str = "step") -> Path:
    slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_") or "device"
    day = datetime.date.today().isoformat()
    return Path(harness.REPO) / "benchmarks" / "results" / f"{slug}_{kind}_{day}"


TABLE = ["case", "B", "variant", "status", "us_median", "us_p10", "us_p90", "launches_total",
         "launches_dspark", "launches_inductor", "launches_library", "launches_aten",
         "floor_us", "ratio_to_floor", "compile_s"]


def bench_device(args) -> torch.device | None:
    """The device a run works on (the CPU for --dry-run, else the current CUDA device), after
    setting --threads; None, with a message, when a timed run finds no CUDA device."""
    torch.set_num_threads(args.threads)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run for the CPU smoke run", file=sys.stderr)
        return None
    return torch.device("cpu") if args.dry_run else torch.device("cuda", torch.cuda.current_device())


def main(argv=None) -> int:
    args = _args(argv)
    args.device = bench_device(args)
    if args.device is None:
        return 1
    log = lambda s: print(s, flush=True)  # noqa: E731
    from dspark_compile.models.state import restore_state
    from dspark_compile.models.step import DraftVerifyStep
    from dspark_compile.trace import export_step

    env = harness.environment(args.git_commit)
    out = Path(args.out) if args.out else _default_out(env.get("device") or "cpu")
    out.mkdir(parents=True, exist_ok=True)
    rec = {"schema": SCHEMA, "complete": False, "dry_run": args.dry_run, "environment": env,
           "preset": args.preset, "dtype": args.dtype, "buckets": args.buckets,
           "max_seq_len": args.max_seq_len, "max_prompt_len": args.max_prompt_len,
           "variants": args.variants, "cases": args.cases, "replays": args.replays,
           "warmup": args.warmup, "compile_budget_s": args.compile_budget_s,
           "launch_counting": ("ops: top-level aten/dspark ops in torch.profiler (CPU)"
                               if args.dry_run else
                               "kernels: CUDA events torch.profiler (CUPTI) records over one call"),
           "rows": [], "floors": {}, "per_layer": {}, "kernel_names": {}}

    def write():
        (out / "step.json").write_text(json.dumps(rec, indent=1, default=str) + "\n")

    tmp = None
    work = Path(args.work) if args.work else Path(tmp := tempfile.mkdtemp(prefix="step_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        dspark = set(dspark_kernel_names())
        rec["dspark_kernel_names"] = sorted(dspark)
        eng, rec["setup"] = setup_engine(args, work, log)
        dev = eng.device
        rec["max_rows"] = eng.cache.max_rows
        rec["backend"] = eng.backend
        rec["compile_seconds"] = eng.manifest.get("compiled", {}).get("compile_seconds")
        rec["copy_bandwidth"] = (harness.measure_copy_bandwidth() if dev.type == "cuda"
                                 else _cpu_copy_bandwidth())
        bw = rec["copy_bandwidth"]["bytes_per_s"]
        step = DraftVerifyStep(eng.model).eval()
        ctx = {"engine": eng, "step": step, "state": eng.state, "device": dev,
               "compile_budget_s": args.compile_budget_s, "flush": _l2_flusher(dev),
               "rows": {B: torch.arange(B, device=dev) for B in args.buckets}}
        runners: dict = {}
        ref_programs: dict = {}   # bucket -> the exported reference step's module (per layer)
        layer_buckets = {"all": args.buckets, "smallest": args.buckets[:1], "none": []}[args.per_layer]
        compile_over = None     # once one bucket's compile is skipped, larger ones are too
        write()
        for case in args.cases:
            t = time.perf_counter()
            snap = prefill_case(eng, case, args)
            log(f"[prefill] case {case}: {eng.cache.max_rows} rows in {time.perf_counter() - t:.1f}s")
            ctx["restore"] = restore = lambda snap=snap: restore_state(eng.state, snap)
            for B in args.buckets:
                key = f"{case}/B{B}"
                rows_list = list(range(B))
                restore()
                with torch.no_grad(), step_floor.record_routing(eng.model) as routing:
                    _, num = step(ctx["rows"][B], eng.state)
                tokens_per_row = float(num.double().mean())
                restore()
                log(f"[eager] {key}: routing recorded")
                floor = step_floor.byte_floor(eng.model, eng.state, rows_list, routing)
                floor["us"] = floor["bytes"] / bw * 1e6
                rec["floors"][key] = floor
                log(f"[floor] {key}: {floor['bytes'] / 1e6:.2f} MB -> {floor['us']:.2f} us")
                for v in args.variants:
                    if v == "engine-greedy" and case != "greedy":
                        continue
                    row = {"name": f"{args.preset} {case}", "case": case, "B": B, "variant": v,
                           "tokens_per_row_step": tokens_per_row, "floor_bytes": floor["bytes"],
                           "floor_us": floor["us"]}
                    try:
                        if v == "compile-graph" and compile_over:
                            raise Skipped(compile_over)
                        if (v, B) not in runners:
                            t = time.perf_counter()
                            runners[(v, B)] = make_runner(v, B, ctx)
                            row["setup_s"] = round(time.perf_counter() - t, 2)
                        r = runners[(v, B)]
                        row.update(r.info)
                        restore()
                        with torch.no_grad():
                            names = profile_launches(r.call, dev)
                        restore()
                        row.update({f"launches_{k}": n for k, n in _counts(names, dspark).items()})
                        rec["kernel_names"][f"{key}/{v}"] = dict(sorted(
                            {n: names.count(n) for n in set(names)}.items()))
                        if r.graph is not None:
                            row["graph_nodes"] = graph_kernel_nodes(r.graph)
                        if dev.type == "cuda":
                            row.update(time_runner(r, ctx, args.replays, args.warmup))
                            row["ratio_to_floor"] = row["us_median"] / floor["us"]
                        else:
                            row["us_median"] = None     # dry run: no timing
                        row["status"] = "ok"
                    except Skipped as e:
                        row.update(status="skipped", reason=str(e))
                        if v == "compile-graph":
                            compile_over = f"bucket {B}: {e}"
                    except Exception as e:  # noqa: BLE001 -- one variant's failure is a result
                        traceback.print_exc()
                        row.update(status="skipped", reason=f"{type(e).__name__}: {str(e)[:300]}")
                        _sync(dev)
                    restore()
                    rec["rows"].append(row)
                    write()
                    log(f"[{key}] {v}: {row['status']} "
                        + (f"{row['us_median']:.1f} us " if row.get("us_median") else "")
                        + (f"launches {row.get('launches_total')}" if row["status"] == "ok"
                           else row.get("reason", "")))
                if B in layer_buckets:
                    layers = {}
                    t = time.perf_counter()
                    if B not in ref_programs:   # the same program for both cases
                        ep = export_step(eng.model, eng.state, B)
                        ep.example_inputs = None
                        ref_programs[B] = ep.module()
                        del ep
                    progs = {"reference": ref_programs[B]}
                    if any(v.startswith("engine") for v in args.variants):
                        progs["engine"] = eng.modules[B]
                        if case == "greedy" and B in eng.greedy_modules:
                            progs["engine-greedy"] = eng.greedy_modules[B]
                    for name, gm in progs.items():
                        restore()
                        try:
                            layers[name] = per_layer(gm, ctx["rows"][B], eng.state, dev, dspark)
                        except Exception as e:  # noqa: BLE001
                            traceback.print_exc()
                            layers[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    restore()
                    del progs
                    rec["per_layer"][key] = layers
                    log(f"[per-layer] {key} in {time.perf_counter() - t:.1f}s: "
                        + ", ".join(f"{n} {sum(c.get('total', 0) for c in d.values() if isinstance(c, dict))}"
                                    for n, d in layers.items()))
                    write()
            # graphs of the last case are kept (they are valid for the next case: same state
            # tensors, restored in place)
        rec["complete"] = True
    finally:
        write()
        if tmp:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)

    harness.write_csv(str(out / "step.csv"), rec["rows"])
    msg = harness.write_plot(str(out / "step.png"), [r for r in rec["rows"] if r.get("us_median")],
                             x="B", y="us_median") if not args.dry_run else "dry run: no plot"
    print(f"\n{env.get('device')}  torch {env['torch']}  triton {env['triton']}  "
          f"commit {env['git_commit'][:12]}  {env['date_utc']}  copy "
          f"{rec['copy_bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s")
    print(harness.format_table(rec["rows"], TABLE))
    print(msg)
    print(f"written: {out / 'step.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
