"""Check: no op in the final step graph copies a whole state input (docs/architecture.md,
"In-place state" and "Toolchain facts").

KV caches, compressor state and draft context are user inputs the step updates in place. A
functionalised update (what `ep.run_decompositions()` produces) turns `cache.index_copy_(...)`
into `index_put(cache, ...) -> new cache` plus a copy back: two whole-cache copies per step,
which at real sizes costs more than the step itself. This check names every node that does it:

- the program's signature returns a state input as a *mutated output* (the runtime then copies
  the returned tensor back into the input after every call);
- a node reads a state (or a view of it) and produces a tensor of the state's full shape that
  is not the state itself (`index_put`, `clone`, `_to_copy`, `cache * 1`, a custom op returning
  a fresh cache ...), or reads the whole state and produces a tensor at least as large
  (`cat([cache, new_rows])`; not for `dspark::` kernels, which read the caches as stored);
- a copy op reads a full-shape view of the state (`clone`, `_to_copy`, `.to(dtype)`), or
  `copy_` overwrites / reads the whole state.

In-place updates (`index_copy_`, `index_put_`, `dspark::` ops with `mutates_args`) and views
pass: they return the state itself.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dspark_compile.passes.base import PassError, PassResult, graph_module_of
from dspark_compile.passes.graph_utils import (
    alias_root, is_inplace_alias, is_view, op_name, packet_name, same_shape, source_location,
    tensor_val, vals_of)
from dspark_compile.passes.registry import register_pass

_COPY_PACKETS = {"aten::clone", "aten::_to_copy", "aten::copy", "aten::lift_fresh_copy",
                 "aten::to", "aten::alias_copy", "aten::view_copy", "aten::contiguous"}


class WholeCacheCopyError(PassError):
    def __init__(self, findings: list[str]):
        self.findings = findings
        super().__init__("the step copies whole state tensors (in-place updates were lost):\n  "
                         + "\n  ".join(findings))


def _signature(program):
    return None if isinstance(program, torch.fx.GraphModule) else program.graph_signature


def _state_placeholders(program, gm, names: Sequence[str]) -> dict:
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    sig = _signature(program)
    allowed = placeholders if sig is None else {
        k: v for k, v in placeholders.items() if k in sig.user_inputs}
    missing = [n for n in names if n not in allowed]
    if missing:
        raise ValueError(f"state inputs {missing} are not user inputs of the program; "
                         f"user inputs: {sorted(allowed)}")
    return {n: allowed[n] for n in names}


def _is_real_view(node) -> bool:
    """A view that does not copy (`.to(dtype)` is schema-declared as a view but copies when
    the dtype or device changes)."""
    if not is_view(node):
        return False
    src = node.all_input_nodes[0] if node.all_input_nodes else None
    a, b = tensor_val(node), tensor_val(src) if src is not None else None
    if a is not None and b is not None and (a.dtype != b.dtype or a.device != b.device):
        return False
    return True


def _static_numel(t) -> int:
    """Element count when static, else -1 (symbolic sizes never count as a copy)."""
    n = 1
    for d in t.shape:
        if not isinstance(d, int):
            return -1
        n *= d
    return n


def find_whole_cache_copies(program, state_input_names: Sequence[str]) -> list[str]:
    gm = graph_module_of(program)
    states = _state_placeholders(program, gm, state_input_names)
    by_node = {ph: name for name, ph in states.items()}
    findings = []
    sig = _signature(program)
    if sig is not None:
        for out, inp in getattr(sig, "user_inputs_to_mutate", {}).items():
            if inp in states:
                findings.append(
                    f"state input '{inp}' is returned as a new tensor ('{out}') and copied back "
                    "whole after every call (functionalised update; run passes on the IR as "
                    "exported, not after run_decompositions())")
    for node in gm.graph.nodes:
        if node.op != "call_function" or _is_real_view(node):
            continue
        touched = []  # (state name, arg node) for inputs aliasing a state
        for a in node.all_input_nodes:
            root = alias_root(a)
            if root in by_node:
                touched.append((by_node[root], a))
        if not touched:
            continue
        p = packet_name(node)
        where = f"node '{node.name}' ({op_name(node)}) at {source_location(node)}"
        for name, a in touched:
            full = tensor_val(states[name]).shape
            av = tensor_val(a)
            arg_full = av is not None and same_shape(av.shape, full)
            if is_inplace_alias(node):
                if p == "aten::copy_" and arg_full:
                    findings.append(f"{where}: copy_ reads or overwrites all of state '{name}'")
                    break
                continue
            if any(same_shape(v.shape, full) for v in vals_of(node)):
                findings.append(f"{where}: produces a new tensor of state '{name}''s full shape "
                                f"{list(full)} from it")
                break
            if p in _COPY_PACKETS and arg_full:
                findings.append(f"{where}: copies all of state '{name}'")
                break
            # (`cat([cache, rows])`.) A dspark:: kernel reads caches in place by contract; its
            # output outgrows a small cache (an attention output vs a layer's scale bytes)
            # without copying it, and a fresh full-shape cache is caught above.
            if (arg_full and not p.startswith("dspark::")
                    and any(_static_numel(v) >= _static_numel(av) > 0 for v in vals_of(node))):
                findings.append(f"{where}: writes all of state '{name}' into a new tensor "
                                "at least as large")
                break
    return findings


def assert_no_whole_cache_copy(program, state_input_names: Sequence[str]) -> None:
    """Raise WholeCacheCopyError naming every node (or signature entry) that copies a whole
    state input of `program` (ExportedProgram or GraphModule)."""
    findings = find_whole_cache_copies(program, state_input_names)
    if findings:
        raise WholeCacheCopyError(findings)


@register_pass(name="check_state_in_place", stage="lint", after=("lint_host_sync",))
def check_state_in_place_pass(gm, ctx) -> PassResult:
    """Prove state inputs (ctx.state_input_names) are only updated in place."""
    if ctx.state_input_names:
        assert_no_whole_cache_copy(ctx.exported_program if ctx.exported_program is not None
                                   else gm, ctx.state_input_names)
    return PassResult(0, changed=False, notes={"states": list(ctx.state_input_names)})
