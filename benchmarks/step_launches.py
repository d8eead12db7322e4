"""What one step launches (benchmarks/step.py): the dspark:: kernel names, the class of every
kernel the profiler records (dspark / inductor / library / aten / copies), the node count of a
captured graph from the driver, and the per-layer attribution (each graph node run inside a
record_function range naming its model part)."""
from __future__ import annotations

import pkgutil
import re

import torch

from dspark_compile.engine_dir.parts import node_part  # noqa: E402

LABEL = "layer::"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def profile_launches(fn, device: torch.device, times: dict | None = None) -> list[str]:
    """Names of what one call of fn runs: on CUDA the kernels (and memcpy / memset) CUPTI
    records, which includes those of a graph replay; on CPU the top-level aten / dspark ops.
    On CUDA `times`, when given, gets each name's summed device µs in that call (the step's
    per-kernel breakdown: its shares, not its total, which the profiler lengthens)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        if times is not None:
            for e in kernels:
                times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us()
        return [e.name for e in kernels]
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

def node_label(node) -> str:
    """The model part a graph node belongs to: the one a loaded engine's program recorded
    (node.meta["dspark_part"], engine_dir/graph_read.py), else decided from the export's node
    meta (engine_dir/parts.py node_part)."""
    return node.meta.get("dspark_part") or node_part(node)


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
    under a layer:: range, with their summed device µs ("us"); kernels it attaches nowhere are
    "unattributed". CPU: the top-level aten / dspark ops under each range."""
    from torch.fx._pytree import tree_flatten_spec
    from torch.profiler import ProfilerActivity, profile
    flat = tree_flatten_spec(((rows, state), {}), gm._in_spec)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=acts) as prof:
        _Labelled(gm).run(*flat)
        _sync(device)
    events = prof.events()
    names: dict[str, list] = {}
    us: dict[str, float] = {}       # device µs of the part's kernels (CUDA)
    if device.type == "cuda":
        attributed = 0
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.kernels:
                lab = _label_of(e) or "unattributed"
                for k in e.kernels:
                    names.setdefault(lab, []).append(k.name)
                    us[lab] = us.get(lab, 0.0) + float(k.duration)
                    attributed += 1
        total = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        if total > attributed:
            names.setdefault("unattributed", []).extend(["?"] * (total - attributed))
    else:
        for e in _top_level_ops(events):
            names.setdefault(_label_of(e) or "unattributed", []).append(e.name)
    out = {lab: _counts(ns, dspark) for lab, ns in sorted(names.items())}
    for lab, t in us.items():
        out[lab]["us"] = round(t, 2)
    return out
