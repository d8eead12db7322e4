"""Lint: the step graph must never synchronise with the host (docs/architecture.md,
"Capture-safe step").

A CUDA graph replays device work only: a value read on the host during capture is frozen into
the graph, a data-dependent shape cannot be captured at all, and torch's global RNG advances a
host-side offset, so a replay would redraw the same noise. Rejected, each with the node name
and the source line that produced it (node.meta["stack_trace"]):

- host reads: `item`, `_local_scalar_dense`, `equal`, `is_nonzero`, `allclose`;
- data-dependent output sizes: `nonzero`, `argwhere`, `masked_select`, `unique*`,
  `bincount`, `repeat_interleave` without `output_size`, and any node that introduces an
  unbacked SymInt in meta["val"] (e.g. boolean-mask indexing);
- torch RNG: any op tagged `nondeterministic_seeded` (`rand*`, `randn*`, `multinomial`,
  `bernoulli`, `normal`, `uniform_`, dropout with p > 0 ...); use Philox keyed by per-request
  seed/position tensors instead (kernels/philox.py);
- device transfers between CPU and an accelerator (`.cpu()`, `.to("cpu")`, `_to_copy`/`copy_`
  across devices, indexing a CUDA tensor with a CPU index tensor).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_compile.passes.base import PassError, PassResult, graph_module_of
from dspark_compile.passes.graph_utils import (
    arg_value, is_random, op_name, packet_name, source_location, vals_of)
from dspark_compile.passes.registry import register_pass

_HOST_READ = {"aten::item", "aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero",
              "aten::allclose"}
_DATA_DEPENDENT = {"aten::nonzero", "aten::argwhere", "aten::masked_select", "aten::bincount",
                   "aten::nonzero_numpy", "aten::_unique", "aten::_unique2", "aten::unique_dim",
                   "aten::unique_consecutive", "aten::unique_dim_consecutive"}


class HostSyncError(PassError):
    def __init__(self, findings: list):
        self.findings = findings
        lines = [f"  node '{f.node}' ({f.op}): {f.reason}\n      at {f.location}" for f in findings]
        super().__init__(f"{len(findings)} host-synchronising op(s) in the step graph "
                         "(not CUDA-graph capturable):\n" + "\n".join(lines))


@dataclass
class Finding:
    node: str
    op: str
    reason: str
    location: str


def _unbacked(value) -> set:
    try:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
        return set(free_unbacked_symbols(value))
    except Exception:  # pragma: no cover
        return set()


def _reason(node) -> str | None:
    p = packet_name(node)
    if p in _HOST_READ:
        return "reads a tensor value on the host"
    if p in _DATA_DEPENDENT or p.startswith("aten::unique"):
        return "output size depends on tensor data (host sync)"
    if p == "aten::repeat_interleave" and isinstance(arg_value(node, "repeats"), torch.fx.Node) \
            and arg_value(node, "output_size") is None:
        return "repeat_interleave with tensor repeats and no output_size (host sync)"
    if is_random(node):
        return ("draws from torch's global RNG (not replayable in a CUDA graph; use Philox "
                "keyed by seed/position tensors, kernels/philox.py)")
    out_devs = {v.device.type for v in vals_of(node)}
    in_devs = set()
    for a in node.all_input_nodes:
        for v in vals_of(a):
            if v.device.type == "cpu" and v.dim() == 0 and p != "aten::copy_" \
                    and not p.startswith("aten::to") and p != "aten::_to_copy":
                continue  # CPU scalars are wrapped numbers, not transfers
            in_devs.add(v.device.type)
    devs = in_devs | out_devs
    if out_devs and in_devs and "cpu" in devs and len(devs) > 1 and "meta" not in devs:
        return (f"moves data between {'/'.join(sorted(devs))} "
                "(device transfer: host sync, not capturable)")
    val = node.meta.get("val")
    introduced = _unbacked(val) - set().union(*[_unbacked(a.meta.get("val"))
                                                for a in node.all_input_nodes] or [set()])
    if introduced:
        syms = ", ".join(sorted(map(str, introduced)))
        return f"introduces a data-dependent size/value ({syms}): host sync"
    return None


def find_host_syncs(program) -> list[Finding]:
    gm = graph_module_of(program)
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        r = _reason(node)
        if r:
            out.append(Finding(node.name, op_name(node), r, source_location(node)))
    return out


def lint_host_sync(program) -> None:
    """Raise HostSyncError listing every host-synchronising node of `program`."""
    findings = find_host_syncs(program)
    if findings:
        raise HostSyncError(findings)


@register_pass(name="lint_host_sync", stage="lint")
def lint_host_sync_pass(gm, ctx) -> PassResult:
    """Reject host-synchronising ops (capture safety)."""
    lint_host_sync(gm)
    return PassResult(0, changed=False,
                      notes={"checked": sum(n.op == "call_function" for n in gm.graph.nodes)})
