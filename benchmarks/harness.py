"""Shared GPU timing harness: cases, CUDA-graph replay timing, copy bandwidth, result records.

Method (see /work/.library/device/METHOD.md; benchmarks/README.md has the details):
- every variant is warmed up first (compilation, autotuning, allocator), eagerly on every input set;
- it is then captured into CUDA graphs of `calls_per_graph` back-to-back calls, each call on the
  next input set; each replay is timed with CUDA events and divided by its call count; the
  result is the median (and p10/p90) over many replays. Graph replay removes the host launch
  gaps, which is how the compiled step runs;
- enough distinct input sets are built that one round over them moves more than `rotate_factor`
  times the L2 size, and the graphs are replayed round-robin, so no call finds its inputs in L2;
- bandwidth is reported against a measured device-to-device copy (bytes read + bytes written).

Case protocol: a module `benchmarks/<anything>_cases.py` defines `cases(batches) -> list[Case]`;
`benchmarks/kernel_bench.py` discovers such modules and times every case they return.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Case:
    """One op at one size, timed in several variants.

    group: selection key for `--only` ("qkv", "act_quant", "sampler", ...);
    name: the op ("qkv_postprocess"); params: sizes shown in the results ({"B": 1, "T": 6});
    make_inputs(device, seed) -> dict: one fresh, seeded input set (never zeros; caches
        included: each set owns its caches, so in-place updates stay inside the set);
    reference(inputs) -> outputs: the plain PyTorch reference; timed eagerly ("eager") and through
        torch.compile ("compile", and "compile-max" = mode "max-autotune-no-cudagraphs");
    ours(inputs) -> outputs: the fused op (None: not timed);
    bytes_moved: the fewest bytes one call must move (every input read once, every output
        written once) -- the numerator of "% of copy bandwidth";
    check(device) -> str: optional one-time numerical comparison of ours vs reference on the
        device; its message lands in the results ("" = fine);
    extra: further named variants (inputs) -> outputs, e.g. an alternative kernel;
    compile: False to skip the torch.compile variants (a reference torch.compile cannot handle).
    """
    group: str
    name: str
    params: dict
    make_inputs: Callable[[torch.device, int], dict]
    reference: Callable[[dict], object]
    ours: Callable[[dict], object] | None
    bytes_moved: int
    check: Callable[[torch.device], str] | None = None
    extra: dict = field(default_factory=dict)
    compile: bool = True


@dataclass
class TimingConfig:
    calls_per_graph: int = 64      # calls captured back to back in one graph
    replays: int = 60              # timed graph replays (median over these)
    warmup: int = 3                # eager warm-up rounds over the input sets before capture
    rotate_factor: float = 2.0     # one round over the input sets moves this many L2s
    max_sets: int = 2048           # guard for tiny ops; rows record rotation_mb actually used
    variant_budget_s: float = 20.0  # slow variants get fewer calls/replays (rows record them)


# ------------------------------------------------------------------------------------------------
# environment
# ------------------------------------------------------------------------------------------------

def _run(cmd) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True,
                              cwd=REPO).stdout.strip()
    except Exception:
        return None


def _driver_version() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if out:
        return out.splitlines()[0].strip()
    try:
        import pynvml
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:
        return None


def environment(git_commit: str | None = None) -> dict:
    """Device, driver, versions, git commit and date for a result file."""
    import triton
    rec = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_runtime": torch.version.cuda,
        "git_commit": git_commit or _run(["git", "rev-parse", "HEAD"]) or "unknown",
        "git_dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"])),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        rec.update(device=p.name, capability=f"{p.major}.{p.minor}",
                   sm_count=p.multi_processor_count, l2_bytes=int(p.L2_cache_size),
                   memory_bytes=int(p.total_memory), driver=_driver_version())
    else:
        rec.update(device="cpu", driver=None)
    return rec


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

def quantiles(xs):
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
    return {"us_median": statistics.median(xs), "us_p10": at(0.1), "us_p90": at(0.9),
            "us_min": xs[0]}


def _median_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median seconds of fn() after 3 untimed calls: CUDA events on a GPU, the host clock on the
    CPU (dry runs: a smoke value)."""
    for _ in range(3):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> dict:
    """Device-to-device copy of a large buffer: (bytes read + bytes written) / median time."""
    n = nbytes // 4
    src = torch.rand(n, device="cuda")
    dst = torch.empty_like(src)
    t = _median_seconds(lambda: dst.copy_(src), reps, src.device)
    del src, dst
    torch.cuda.empty_cache()
    return {"copy_bytes": 2 * n * 4, "copy_s_median": t, "bytes_per_s": 2 * n * 4 / t}


def measure_mm_rate(device: torch.device, reps: int = 10) -> dict:
    """FLOP/s of a large bf16 torch.mm (CUDA: 8192^3, tensor cores): the compute side of a
    byte-and-FLOP floor (benchmarks/prefill.py). On the CPU a small fp32 one, for dry runs."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    t = _median_seconds(lambda: torch.mm(a, b), reps, device)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "mm_s_median": t,
            "flops_per_s": 2 * n ** 3 / t}


def num_input_sets(bytes_per_set: int, cfg: TimingConfig) -> int:
    """Distinct input sets so that one round over them moves rotate_factor x L2."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    need = math.ceil(cfg.rotate_factor * l2 / max(bytes_per_set, 1))
    return max(2, min(cfg.max_sets, need))


def time_variant(fn: Callable[[dict], object], sets: list[dict], cfg: TimingConfig) -> dict:
    """Per-call time of fn over the rotating input sets: CUDA-graph replay medians.

    Falls back to timing eager calls one by one (method "events") when capture fails, e.g. for
    an op that synchronises with the host; the record says which method was used."""
    for _ in range(cfg.warmup):
        for s in sets:
            fn(s)
    torch.cuda.synchronize()
    # a slow variant (an eager reference at B = 64 takes ~80 ms a call) gets fewer calls per
    # graph and fewer replays, so that it costs about `variant_budget_s` and the run finishes
    t = time.perf_counter()
    fn(sets[0])
    torch.cuda.synchronize()
    per_call = time.perf_counter() - t
    total = per_call * cfg.calls_per_graph * cfg.replays
    if total > cfg.variant_budget_s:
        calls = max(1, int(cfg.variant_budget_s / (per_call * cfg.replays)))
        replays = max(5, min(cfg.replays, int(cfg.variant_budget_s / (per_call * calls))))
        cfg = dataclasses.replace(cfg, calls_per_graph=calls, replays=replays)
    try:
        return _time_graphs(fn, sets, cfg)
    except Exception as e:  # noqa: BLE001 -- record why and keep the run going
        torch.cuda.synchronize()
        rec = _time_events(fn, sets, cfg)
        rec["note"] = f"graph capture failed: {type(e).__name__}: {str(e)[:200]}"
        return rec


def _time_graphs(fn, sets, cfg):
    per = min(cfg.calls_per_graph, len(sets))
    graphs = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # warm-up on a side stream before capture (torch docs)
        for s in sets[:per]:
            fn(s)
    torch.cuda.current_stream().wait_stream(side)
    pool = torch.cuda.graph_pool_handle()
    for start in range(0, len(sets), per):
        chunk = sets[start:start + per]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            for s in chunk:
                fn(s)
        graphs.append((g, len(chunk)))
    for g, _ in graphs:
        g.replay()
    torch.cuda.synchronize()
    times = []
    rounds = math.ceil(cfg.replays / len(graphs))   # every graph (input slice) equally often
    for i in range(rounds * len(graphs)):
        g, n = graphs[i % len(graphs)]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    del graphs
    rec = quantiles(times)
    rec.update(method="graph", calls_per_graph=per, graphs=math.ceil(len(sets) / per),
               replays=len(times))
    return rec


def _time_events(fn, sets, cfg):
    times = []
    for i in range(cfg.replays * 4):
        s = sets[i % len(sets)]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(s)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    rec = quantiles(times)
    rec.update(method="events")
    return rec


# ------------------------------------------------------------------------------------------------
# comparisons and outputs
# ------------------------------------------------------------------------------------------------

def compare(name: str, got: torch.Tensor, want: torch.Tensor, exact: bool = False,
            as_bytes: bool = False) -> str:
    """'' when equal enough, else a short description. 8-bit tensors, and any tensor with
    `as_bytes` (caches holding arbitrary bit patterns), compare as bytes."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    if as_bytes or got.element_size() == 1:
        got, want = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
        d = int((got != want).sum())
        return "" if d == 0 else f"{name}: {d}/{got.numel()} bytes differ"
    g, w = got.double(), want.double()
    if g.isnan().any():
        return f"{name}: NaN"
    if exact:
        return "" if torch.equal(got, want) else f"{name}: not bit-equal"
    rel = ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
    return "" if rel < 1e-2 else f"{name}: rel err {rel:.2e}"


def write_csv(path: str, rows: list[dict]) -> None:
    import csv
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def write_plot(path: str, rows: list[dict], x: str = "B", y: str = "us_median") -> str:
    """One panel per op: y vs x per variant (log-log). Needs matplotlib (the H200 image has it);
    without it the plot is skipped with a message rather than adding a dependency."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: plot skipped (JSON and CSV written)"
    ops = list(dict.fromkeys(r["name"] for r in rows if x in r))
    if not ops:
        return "nothing to plot"
    cols = min(3, len(ops))
    rows_n = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.6 * rows_n), squeeze=False)
    for ax, op in zip(axes.flat, ops):
        mine = [r for r in rows if r["name"] == op and r.get(y) is not None]
        for v in dict.fromkeys(r["variant"] for r in mine):
            pts = sorted((r[x], r[y]) for r in mine if r["variant"] == v)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel(x)
        ax.set_ylabel("µs per call (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written: {path}"


def format_table(rows: list[dict], cols: list[str]) -> str:
    cells = [[str(c) for c in cols]] + [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1e4 else f"{v:.3g}"
    return str(v)
