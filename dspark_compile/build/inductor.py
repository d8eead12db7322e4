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

from dspark_compile.engine_dir.format import VARIANTS, register_kernel_ops
from dspark_compile.runtime.inductor import _check_outputs, _state_keys, weight_inputs
from dspark_compile.runtime.variants import GREEDY, markov_nodes, switch_sampler_mode


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
    if ep.graph_signature.user_inputs[0] == "inputs":
        return ["full"]
    register_kernel_ops()        # markov_nodes names the sampler op
    return ["full", "greedy"] if markov_nodes(ep.graph_module) else ["full"]


def variant_graph(ep: torch.export.ExportedProgram, variant: str) -> torch.fx.GraphModule:
    """The lifted graph compiled for `variant`: the program's own, or a copy with the sampler
    calls switched to the greedy plan (variants.switch_sampler_mode)."""
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
