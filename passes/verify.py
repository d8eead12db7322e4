"""Numeric verification: run a graph on fresh random inputs and compare two runs.

The step graph mutates its state inputs in place, so every run gets its own clones and the
comparison covers the outputs *and* every user input / buffer after the run (a pass that drops
a cache update changes no output, only the cache). Tolerances are per dtype; NaN never passes,
not even NaN against NaN, because a NaN in a verification run means the inputs or the graph are
broken and the comparison proved nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

# (rtol, atol) per dtype. Float tolerances are torch.testing's defaults; fp8 allows one unit
# in the last place (e4m3 has 3 mantissa bits, e5m2 has 2) and its smallest subnormal.
DEFAULT_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float8_e4m3fn: (0.125, 2.0 ** -9),
    torch.float8_e5m2: (0.25, 2.0 ** -16),
}


def tolerance_for(dtype: torch.dtype, overrides: Optional[dict] = None) -> tuple[float, float]:
    if overrides:
        key = str(dtype).replace("torch.", "")
        if key in overrides:
            return tuple(overrides[key])
    if dtype in DEFAULT_TOLERANCES:
        return DEFAULT_TOLERANCES[dtype]
    if dtype.is_floating_point:
        return (0.25, 2.0 ** -16)  # other narrow floats (e8m0, fnuz variants)
    return (0.0, 0.0)  # integers, bool: exact


def compare_tensors(what: str, ref, got, overrides: Optional[dict] = None) -> Optional[str]:
    """None when `got` matches `ref`, else a one-line description of the mismatch."""
    if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor):
        if isinstance(ref, torch.Tensor) or isinstance(got, torch.Tensor):
            other = got if isinstance(ref, torch.Tensor) else ref
            return f"{what}: tensor vs {type(other).__name__}"
        return None if ref == got else f"{what}: {ref!r} != {got!r}"
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return (f"{what}: shape/dtype {tuple(got.shape)}/{got.dtype}, "
                f"expected {tuple(ref.shape)}/{ref.dtype}")
    if not ref.dtype.is_floating_point:
        if torch.equal(ref, got):
            return None
        bad = (ref != got).sum().item()
        return f"{what}: {bad} of {ref.numel()} elements differ ({ref.dtype}, exact)"
    r, g = ref.detach().double(), got.detach().double()
    for name, t in (("reference", r), ("result", g)):
        if torch.isnan(t).any():
            return f"{what}: NaN in the {name} run ({int(torch.isnan(t).sum())} elements)"
    rtol, atol = tolerance_for(ref.dtype, overrides)
    close = torch.isclose(g, r, rtol=rtol, atol=atol)
    if bool(close.all()):
        return None
    err = (g - r).abs()
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
    i = int(err.flatten().argmax())
    return (f"{what}: {int((~close).sum())} of {ref.numel()} elements differ "
            f"(max abs err {err.flatten()[i].item():.3g} at flat index {i}: "
            f"{g.flatten()[i].item():.6g} vs {r.flatten()[i].item():.6g}; "
            f"{ref.dtype} rtol={rtol}, atol={atol})")


@dataclass
class GraphInputs:
    """How to call a graph: placeholder order, which slots take user inputs, fixed tensors."""

    names: list                 # placeholder names, in order
    user_slots: list            # indices of user inputs
    fixed: dict                 # slot -> tensor (parameters, constants, buffers)
    cloned_fixed: set           # slots cloned per run (buffers may be mutated)


def graph_inputs(program, gm: torch.fx.GraphModule) -> GraphInputs:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if program is None or isinstance(program, torch.fx.GraphModule):
        return GraphInputs(names, list(range(len(names))), {}, set())
    from torch.export.graph_signature import InputKind

    sig = program.graph_signature
    fixed, cloned, user = {}, set(), []
    for i, spec in enumerate(sig.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            user.append(i)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            # non-persistent buffers live in ep.constants
            src = program.state_dict if spec.target in program.state_dict else program.constants
            fixed[i] = src[spec.target]
            if spec.kind == InputKind.BUFFER:
                cloned.add(i)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            fixed[i] = program.constants[spec.target]
        else:
            raise TypeError(f"cannot verify a program with a {spec.kind} input ('{names[i]}')")
    return GraphInputs(names, user, fixed, cloned)


def make_args(gi: GraphInputs, user_inputs: Sequence) -> list:
    if len(user_inputs) != len(gi.user_slots):
        expected = [gi.names[i] for i in gi.user_slots]
        raise ValueError(f"input_factory returned {len(user_inputs)} inputs, "
                         f"the graph takes {len(expected)}: {expected}")
    args = [None] * len(gi.names)
    for slot, t in gi.fixed.items():
        args[slot] = t.clone() if slot in gi.cloned_fixed else t
    for slot, t in zip(gi.user_slots, user_inputs):
        args[slot] = t.clone() if isinstance(t, torch.Tensor) else t
    return args


@dataclass
class RunRecord:
    outputs: list
    state: dict        # placeholder name -> tensor after the run (user inputs and buffers)


def run_graph(gm: torch.fx.GraphModule, gi: GraphInputs, user_inputs: Sequence,
              seed: int) -> RunRecord:
    args = make_args(gi, user_inputs)
    torch.manual_seed(seed)  # graphs that still draw from torch's RNG compare like for like
    with torch.no_grad():
        out = gm(*args)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    outs = [o.detach().clone() if isinstance(o, torch.Tensor) else o for o in outs]
    watched = list(gi.user_slots) + sorted(gi.cloned_fixed)
    state = {gi.names[i]: args[i] for i in watched if isinstance(args[i], torch.Tensor)}
    return RunRecord(outs, state)


def compare_runs(ref: RunRecord, got: RunRecord, overrides: Optional[dict] = None) -> list[str]:
    problems = []
    if len(ref.outputs) != len(got.outputs):
        return [f"{len(got.outputs)} outputs, expected {len(ref.outputs)}"]
    for i, (a, b) in enumerate(zip(ref.outputs, got.outputs)):
        msg = compare_tensors(f"output {i}", a, b, overrides)
        if msg:
            problems.append(msg)
    for name, a in ref.state.items():
        msg = compare_tensors(f"input '{name}' after the run", a, got.state.get(name), overrides)
        if msg:
            problems.append(msg)
    return problems


def fresh_inputs(input_factory: Callable, seed: int) -> tuple:
    inputs = input_factory(seed)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return tuple(inputs)
