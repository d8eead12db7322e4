"""The glue between the fused ops, compiled by Inductor at build time (`--backend inductor`).

    build:  post-pass ExportedProgram ──lifted graph (variants_of: the full program, and the
              greedy sampler variant of a step, dspark_compile/runtime/variants.py)──►
              torch._inductor.standalone_compile ──► CompiledArtifact.save(format="binary")
              ──► engine/compiled/step_b{B}[_greedy].bin
    load:   CompiledArtifact.load ──► CompiledStep(rows, state) ──► captured in the bucket's graph

Everything the backend compiles is decided here (`compile_variant`: which graph, which example
inputs, the compile); dspark_compile/build/compile_workers.py only runs those compiles side by side in
processes, and dspark_compile/runtime/variants.py only rewrites graphs.

What is compiled is the program's *lifted* graph: its inputs are the weights (parameters,
buffers, lifted constants), then `rows`, then the state tensors, all flat. Weights stay inputs,
never constants: Inductor would otherwise fold the FP8 dequantisation of every weight into an
fp32 copy stored in the artifact. The state tensors are inputs the graph updates in place;
Inductor functionalises those updates and turns them back into in-place writes (its reinplace
pass), which tests/runtime/test_gpu_engine.py checks on the memory one call allocates. The
`dspark::` ops are opaque custom ops (kernels/registry.py): the compiled program calls our
launchers as they are.

Why a saved Inductor artifact and not an AOTInductor package: on the H200 machine
(torch 2.11.0+cu130) `aoti_load_package` segfaults inside `_load_aoti` even for a two-op toy
module (`aoti_compile_and_package` itself succeeds); `standalone_compile`'s artifact loads in a
fresh process with no recompilation and no Dynamo, and runs the same generated code. The
artifact holds the generated Python wrapper and the compiled Triton kernels; loading it needs
the same torch and triton (the manifest's toolchain check) and the `dspark::` ops registered.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from dspark_compile.engine_dir.write import COMPILED_DIR

BACKENDS = ("inductor", "aten")
VARIANTS = ("full", "greedy")


def compiled_path(bucket, variant: str) -> str:
    """A bucket's (int) compiled step, or a named program's (str: "prefill_c64")."""
    suffix = "" if variant == "full" else f"_{variant}"
    name = bucket if isinstance(bucket, str) else f"step_b{bucket}"
    return f"{COMPILED_DIR}/{name}{suffix}.bin"


def weight_inputs(ep: torch.export.ExportedProgram) -> list[torch.Tensor]:
    """The lifted graph's leading inputs, in its order: parameters, buffers, constants."""
    from torch.export.graph_signature import InputKind
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
    from torch.export.graph_signature import OutputKind
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


def lifted_graph(ep: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """A copy of the program's lifted graph (flat inputs), for compiling or for a variant."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(ep.graph_module.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(ep.graph_module, graph)


def compile_program(gm: torch.fx.GraphModule, ep: torch.export.ExportedProgram,
                    rows: torch.Tensor, state: dict) -> tuple[bytes, float]:
    """Compile `gm` (ep's lifted graph or a variant of it) for these inputs' shapes, dtypes and
    device; returns (the saved artifact's bytes, compile seconds). The example inputs' values
    are never read (Inductor tunes its own kernels on inputs it generates)."""
    _check_outputs(ep)
    keys = _state_keys(ep, rows, state)
    args = weight_inputs(ep) + [rows] + [state[k] for k in keys]
    t = time.perf_counter()
    with torch.no_grad():
        art = torch._inductor.standalone_compile(gm, args, dynamic_shapes="from_example_inputs")
    seconds = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "step.bin"
        art.save(path=str(path), format="binary")
        return path.read_bytes(), seconds


def variants_of(ep: torch.export.ExportedProgram) -> list[str]:
    """The variants the runtime loads for this program (dspark_compile/runtime/variants.py). A prefill
    program (models/prefill_chunk.py: first input `inputs`) has none: its one draft block is a
    small part of a chunk's forward."""
    from dspark_compile.engine_dir.write import register_kernel_ops
    from dspark_compile.runtime.variants import markov_nodes
    if ep.graph_signature.user_inputs[0] == "inputs":
        return ["full"]
    register_kernel_ops()        # markov_nodes names the sampler op
    return ["full", "greedy"] if markov_nodes(ep.graph_module) else ["full"]


def variant_graph(ep: torch.export.ExportedProgram, variant: str) -> torch.fx.GraphModule:
    """The lifted graph compiled for `variant`: the program's own, or a copy with the sampler
    calls switched to the greedy plan (variants.switch_sampler_mode)."""
    from dspark_compile.runtime.variants import GREEDY, markov_nodes, switch_sampler_mode
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    gm = lifted_graph(ep)
    if variant == "full":
        return gm
    if not markov_nodes(ep.graph_module):
        raise ValueError("the program has no dspark::markov_sample call: no greedy variant")
    return switch_sampler_mode(gm, GREEDY)


def example_input(ep: torch.export.ExportedProgram, device) -> torch.Tensor:
    """A tensor of the program's first user input's shape and dtype (a step's rows [B]: 0..B-1;
    a prefill chunk's packed inputs [C + 3]); the compile never reads its values."""
    name = ep.graph_signature.user_inputs[0]
    val = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == name).meta["val"]
    return torch.arange(val.numel(), device=device).to(val.dtype).view(tuple(val.shape))


def compile_variant(ep: torch.export.ExportedProgram, variant: str,
                    state: dict) -> tuple[bytes, float]:
    """One variant of one program compiled for `state`'s shapes and device: (the saved
    artifact's bytes, compile seconds). What a build worker runs."""
    device = next(iter(state.values())).device
    return compile_program(variant_graph(ep, variant), ep, example_input(ep, device), state)


class CompiledStep:
    """A bucket's compiled step as the runtime calls it: `step(rows, state) -> (tokens, num)`.

    The weight inputs are bound once; `state` must be the dict the step was loaded for (its
    tensors are passed by key order, checked at load)."""

    def __init__(self, path: Path, ep: torch.export.ExportedProgram, rows: torch.Tensor,
                 state: dict):
        from torch._inductor import CompiledArtifact
        _check_outputs(ep)
        self.keys = _state_keys(ep, rows, state)
        self.weights = weight_inputs(ep)
        self.out_spec = ep.call_spec.out_spec
        from dspark_compile.engine_dir.write import ArtifactError
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
    from dspark_compile.engine_dir.write import ArtifactError
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
