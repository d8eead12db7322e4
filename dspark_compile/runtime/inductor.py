"""An Inductor-backend engine's compiled programs as the runtime calls them (`--backend
inductor`; how they are compiled and why an Inductor artifact: dspark_compile/build/inductor.py).

    load:   CompiledArtifact.load ──► CompiledStep(rows, state) ──► captured in the bucket's graph

A compiled program's inputs are the program's weights (parameters, buffers, lifted constants,
bound once here), then `rows`, then the state tensors, all flat.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch._inductor import CompiledArtifact
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from dspark_compile.engine_dir.format import PREFILL, VARIANTS, ArtifactError, ProgramKey


def weight_inputs(ep: torch.export.ExportedProgram) -> list[torch.Tensor]:
    """The lifted graph's leading inputs, in its order: parameters, buffers, constants."""
    out = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            raise ValueError(f"program input '{spec.arg.name}' is a {spec.kind.name}: only "
                             "weights, constants and user inputs can be compiled")
        table = ep.state_dict if spec.target in ep.state_dict else ep.constants
        t = table[spec.target]
        if not t.is_contiguous():
            # the engine stores weights contiguous and the compiled code asserts its inputs'
            # strides: a weight compiled with other strides would fail at its first call
            raise ValueError(f"weight '{spec.target}' is not contiguous (strides {t.stride()}): "
                             "the compiled step would not accept the stored copy")
        out.append(t)
    return out


def _check_outputs(ep: torch.export.ExportedProgram) -> None:
    bad = [s.arg.name for s in ep.graph_signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if bad:
        # the compiled call would return them and the runtime would drop the update
        raise ValueError(f"program outputs {bad} are buffer or input mutations, not user "
                         "outputs: the step must update its state in place")


def _state_keys(ep: torch.export.ExportedProgram, rows: torch.Tensor, state: dict) -> list[str]:
    """The state's keys in the program's flat input order; checks `state` has the program's
    input structure (same keys)."""
    _, spec = pytree.tree_flatten(((rows, state), {}))
    if spec != ep.call_spec.in_spec:
        raise ValueError("the state's keys or their order differ from the program's state "
                         f"inputs: {list(state)} vs {ep.graph_signature.user_inputs[1:]}")
    return list(state)


class CompiledStep:
    """A bucket's compiled step as the runtime calls it: `step(rows, state) -> (tokens, num)`.

    `program`: the step's GraphProgram as loaded, bound to the engine's weights
    (engine_dir/load.py): its lifted tensors, in its input order, are the compiled program's
    leading inputs, bound once here; `state` must be the dict the step was loaded for (its
    tensors are passed by key order, checked here)."""

    def __init__(self, path: Path, program, rows: torch.Tensor, state: dict):
        bad = [target for kind, target, _ in program.outputs if kind != "user"]
        if bad:
            # the compiled call would return them and the runtime would drop the update
            raise ArtifactError(f"program '{program.rel}' outputs mutations of {bad[:3]}, not "
                                "user outputs: the step must update its state in place",
                                path=program.rel)
        _, spec = pytree.tree_flatten(((rows, state), {}))
        if spec != program.in_spec:
            raise ValueError("the state's keys or their order differ from the program's state "
                             f"inputs: {list(state)} vs {program.state_keys}")
        self.keys = list(state)
        self.weights = program.lifted()
        for t, i in zip(self.weights, (i for i in program.inputs if i.kind != "user")):
            if not t.is_contiguous():
                # the compiled code asserts its inputs' strides (weight_inputs)
                raise ArtifactError(f"weight '{i.target}' is not contiguous: the compiled step "
                                    "would not accept it", path=program.rel)
        self.out_spec = program.out_spec
        t = time.perf_counter()
        try:
            self.artifact = CompiledArtifact.load(path=str(path), format="binary")
        except Exception as e:
            raise ArtifactError(f"cannot load compiled program '{path.name}': "
                                f"{type(e).__name__}: {e}", path=str(path)) from e
        self.load_seconds = time.perf_counter() - t

    def __call__(self, rows: torch.Tensor, state: dict):
        outs = self.artifact(*self.weights, rows, *[state[k] for k in self.keys])
        return pytree.tree_unflatten(list(outs), self.out_spec)


def compiled_entries(manifest: dict) -> dict:
    """{bucket: {variant: engine path}} of an Inductor-backend manifest: every bucket has its
    full program, every path is in the checked file table; an ArtifactError names the field."""
    table = manifest.get("compiled", {}).get("programs") if isinstance(
        manifest.get("compiled"), dict) else None
    if not isinstance(table, dict):
        raise ArtifactError("manifest field 'compiled.programs' is missing: an engine built "
                            "with --backend inductor lists its compiled programs — rebuild",
                            field="compiled.programs")
    out = {}
    for b in manifest["buckets"]:
        entry = table.get(str(b))
        if not isinstance(entry, dict) or "full" not in entry:
            raise ArtifactError(f"manifest field 'compiled.programs': bucket {b} has no compiled "
                                "program — rebuild", field=f"compiled.programs.{b}")
        for variant, path in entry.items():
            if variant not in VARIANTS or path not in manifest.get("files", {}):
                raise ArtifactError(f"manifest field 'compiled.programs.{b}': {variant} -> "
                                    f"{path!r} is not a compiled program in the file table",
                                    field=f"compiled.programs.{b}")
        out[b] = dict(entry)
    return out


def compiled_table_paths(manifest: dict, kind: str, sizes) -> dict:
    """{size: engine path of its compiled full variant} of the Inductor manifest's programs of
    `kind` (target or prefill: `compiled.<its table>`, keyed as ProgramKey.listed);
    ArtifactError naming the field when one is missing."""
    table = ProgramKey(kind, 1).table
    entries = (manifest.get("compiled") or {}).get(table)
    out = {}
    for k in sizes:
        entry = entries.get(ProgramKey(kind, k).listed) if isinstance(entries, dict) else None
        path = entry.get("full") if isinstance(entry, dict) else None
        if path not in manifest.get("files", {}):
            what = "chunk" if kind == PREFILL else "bucket"
            raise ArtifactError(f"manifest field 'compiled.{table}': {what} {k} has no "
                                "compiled program in the file table — rebuild",
                                field=f"compiled.{table}")
        out[k] = path
    return out
