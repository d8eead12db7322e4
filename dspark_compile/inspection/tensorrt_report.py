"""With torch-tensorrt installed, `inspect --onnx` also reports which dense subgraphs of each
bucket's program TensorRT could take (`OUT_DIR/tensorrt_b{B}.json` and one line per bucket).

A *dense subgraph* is a maximal connected set of the program's aten calls that TensorRT has a
converter for (torch-tensorrt's dynamo converter registry decides, node by node, as its own
partitioner does), leaving out the `dspark::` ops (the engine's own kernels) and every call
with a side effect (the in-place state writes stay where they are). Sets smaller than
TensorRT's default `min_block_size` (5 nodes) are counted but not listed: torch-tensorrt would
leave them to PyTorch.

torch-tensorrt is only on NVIDIA's package index: the optional extra
`pip install 'dspark-compile[tensorrt]'`. Without it this report is skipped with a line saying so.
"""
from __future__ import annotations

import json
import operator
from collections import Counter
from pathlib import Path
from typing import Callable
from dspark_compile.passes.graph_utils import has_side_effects

MIN_BLOCK_SIZE = 5        # torch_tensorrt.dynamo.compile's default


def tensorrt_version():
    """torch-tensorrt's version, or None when it cannot be imported here."""
    try:
        import torch_tensorrt
    except Exception:  # noqa: BLE001 -- an install without its CUDA libraries fails anyhow
        return None
    return getattr(torch_tensorrt, "__version__", "unknown")


def tensorrt_supports() -> Callable:
    """`node -> bool`: whether torch-tensorrt has a converter for this call."""
    from torch_tensorrt.dynamo.conversion._ConverterRegistry import DYNAMO_CONVERTERS
    return lambda node: node in DYNAMO_CONVERTERS


def _op(node) -> str:
    t = node.target
    return str(t.name()) if hasattr(t, "name") else getattr(t, "__name__", str(t))


def _candidate(node, supported: Callable) -> bool:
    import torch

    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload) and t.namespace == "dspark":
        return False
    if t is operator.getitem:      # an output of a call that is itself taken
        return _candidate(node.args[0], supported)
    return not has_side_effects(node) and bool(supported(node))


def dense_subgraphs(graph, supported: Callable) -> tuple:
    """(maximal connected sets of candidate nodes, largest first; {op: calls} of the call
    nodes left out)."""
    nodes = [n for n in graph.nodes if _candidate(n, supported)]
    parent = {n: n for n in nodes}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for a in n.all_input_nodes:
            if a in parent:
                parent[root(a)] = root(n)
    groups: dict = {}
    for n in nodes:
        groups.setdefault(root(n), []).append(n)
    left = Counter(_op(n) for n in graph.nodes
                   if n.op == "call_function" and n not in parent and n.target is not
                   operator.getitem)
    return sorted(groups.values(), key=len, reverse=True), dict(left.most_common())


def subgraph_report(graph, supported: Callable, min_block_size: int = MIN_BLOCK_SIZE) -> dict:
    groups, left = dense_subgraphs(graph, supported)
    big = [g for g in groups if len(g) >= min_block_size]
    return {"min_block_size": min_block_size,
            "subgraphs": [{"nodes": len(g), "first": g[0].name, "last": g[-1].name,
                           "ops": dict(Counter(_op(n) for n in g).most_common())}
                          for g in big],
            "nodes_in_subgraphs": sum(len(g) for g in big),
            "small_sets": len(groups) - len(big),
            "left_to_pytorch": left}


def report_program(ep, bucket: int, out_dir, log=print) -> dict | None:
    """Write `tensorrt_b{bucket}.json` when torch-tensorrt is importable; None otherwise."""
    version = tensorrt_version()
    if version is None:
        log(f"[tensorrt] bucket {bucket}: skipped (torch-tensorrt is not installed: "
            "pip install 'dspark-compile[tensorrt]', from NVIDIA's package index)")
        return None
    rep = {"torch_tensorrt": version, "bucket": bucket,
           **subgraph_report(ep.graph_module.graph, tensorrt_supports())}
    path = Path(out_dir) / f"tensorrt_b{bucket}.json"
    path.write_text(json.dumps(rep, indent=1) + "\n")
    largest = rep["subgraphs"][0]["nodes"] if rep["subgraphs"] else 0
    log(f"[tensorrt] bucket {bucket}: {len(rep['subgraphs'])} dense subgraphs TensorRT could "
        f"take ({rep['nodes_in_subgraphs']} nodes, largest {largest}) -> {path}")
    return rep
