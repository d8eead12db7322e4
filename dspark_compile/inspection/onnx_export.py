"""`inspect --onnx OUT_DIR`: each bucket's optimized program as an ONNX file.

The program is the one stored in the engine (after the passes, before Inductor or CUDA graphs).
Per bucket B:

1. mutating `dspark::` calls become functional twins plus copies (onnx_functional.py), and
   `run_decompositions({})` functionalises the program without decomposing anything: every
   state tensor the step writes (caches, row state) gets an output holding its new value;
2. those mutation outputs become ordinary outputs (torch.onnx keeps only user outputs and would
   drop every node that only feeds a state update: the cache stores, the draft sampler);
3. `torch.onnx.export(..., dynamo=True)` with a custom translation per `dspark::` op (a node of
   the `dspark` domain, onnx_domain.py) and `optimize=False`, so the file shows the graph as the
   passes left it rather than as onnxscript's optimizer would fold it;
4. inputs are renamed to the engine's state keys (`rows`, `layers.3.swa_nope`, ...), the new
   state values to `<key>.updated`, the step's own outputs to `output.<i>`;
5. `step_b{B}.onnx` is written with its weights as external data (`step_b{B}.onnx.data`), and
   `onnx.checker.check_model` checks the file by path (the form that reads external data).

onnx and onnxscript are the `onnx` extra (`pip install 'dspark-compile[onnx]'`).
"""
from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path

import torch
from dspark_compile.engine_dir.weights import _load_weights
from dspark_compile.engine_dir.format import register_kernel_ops
from dspark_compile.engine_dir.load import load_program as load

EXTRA = "onnx"
_NEEDS = ("onnx", "onnxscript")


def check_onnx_available() -> None:
    """Raise a one-line ValueError naming the extra when onnx or onnxscript is missing."""
    missing = []
    for name in _NEEDS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ValueError(f"--onnx needs {' and '.join(missing)}: pip install "
                         f"'dspark-compile[{EXTRA}]'")


def onnx_path(bucket: int) -> str:
    return f"step_b{bucket}.onnx"


def input_names(ep) -> list:
    """The user inputs' names as the engine spells them: `rows`, then each state key."""
    from torch.utils import _pytree as pytree

    placeholders = list(ep.graph_signature.user_inputs)
    tree = pytree.tree_unflatten(list(range(len(placeholders))), ep.call_spec.in_spec)
    names = list(placeholders)
    for path, i in pytree.tree_flatten_with_path(tree)[0]:
        last = path[-1] if path else None
        if isinstance(last, pytree.MappingKey):
            names[i] = str(last.key)
    return names


def load_program(engine_dir, manifest: dict, bucket: int):
    """One bucket's program with the engine's weights attached (load_engine loads them all),
    as a torch.export program (GraphProgram.exported)."""
    engine_dir = Path(engine_dir)
    register_kernel_ops()
    weights = _load_weights(engine_dir / manifest["weights"]["file"],
                            manifest["weights"]["tensors"], "cpu")
    return load(engine_dir, manifest, bucket, weights).exported()


def functional_program(ep, specs: dict):
    """The program with every state write as an output; returns (program, {output position:
    the user input it updates})."""
    from torch.export.graph_signature import OutputKind
    from torch.utils import _pytree as pytree

    from dspark_compile.inspection.onnx_functional import functionalize_dspark_calls
    functionalize_dspark_calls(ep, specs)
    ep = ep.run_decompositions({})
    updates = {}
    for i, spec in enumerate(ep.graph_signature.output_specs):
        if spec.kind == OutputKind.USER_INPUT_MUTATION:
            updates[i] = spec.target
            spec.kind = OutputKind.USER_OUTPUT
    # the program now returns a flat tuple: its unlifted module unflattens by this spec
    n = len(ep.graph_signature.output_specs)
    ep.module_call_graph[0].signature.out_spec = pytree.tree_structure(tuple(range(n)))
    return ep, updates


def translation_table(specs: dict) -> dict:
    from dspark_compile.inspection.onnx_domain import translation
    from dspark_compile.inspection.onnx_functional import functional_twin
    table = {}
    for spec in specs.values():
        fn = translation(spec)
        table[functional_twin(spec) if spec.mutated else spec.overload] = fn
        table.setdefault(spec.overload, fn)
    return table


def _rename(model, names: list, updates: dict, placeholders: list) -> None:
    """Inputs to the engine's names, state updates to `<key>.updated`, the rest `output.<i>`."""
    if len(model.graph.inputs) != len(names):
        raise RuntimeError(f"the ONNX graph has {len(model.graph.inputs)} inputs, the program "
                           f"{len(names)} user inputs: their names cannot be matched")
    for value, name in zip(model.graph.inputs, names):
        value.name = name
    by_placeholder = dict(zip(placeholders, names))
    step_out = 0
    for i, value in enumerate(model.graph.outputs):
        if i in updates:
            key = by_placeholder[updates[i]]
            value.name = f"{key}.updated"
            value.metadata_props["dspark.updates"] = key
        else:
            value.name = f"output.{step_out}"
            step_out += 1


def export_bucket(ep, bucket: int, out_dir: Path, specs: dict) -> dict:
    """Write `out_dir/step_b{bucket}.onnx` (+ .data) from the loaded program; returns its
    summary: file, nodes, dspark nodes per op, inputs, state updates."""
    import onnx

    names, placeholders = input_names(ep), list(ep.graph_signature.user_inputs)
    fep, updates = functional_program(ep, specs)
    prog = torch.onnx.export(fep, (), dynamo=True, custom_translation_table=translation_table(specs),
                             optimize=False, verbose=False)
    _rename(prog.model, names, updates, placeholders)
    path = out_dir / onnx_path(bucket)
    prog.save(str(path), external_data=True)
    onnx.checker.check_model(str(path))
    model = onnx.load(str(path), load_external_data=False)
    return {"file": path.name, "data": f"{path.name}.data", "nodes": len(model.graph.node),
            "dspark_nodes": dict(sorted(Counter(n.op_type for n in model.graph.node
                                                if n.domain == "dspark").items())),
            "inputs": len(model.graph.input), "state_updates": len(updates)}


def export_engine(engine_dir, manifest: dict, out_dir, buckets=None, log=print) -> dict:
    """Export `buckets` (default: all) of the engine into `out_dir`; returns {bucket: summary}.
    With torch-tensorrt importable, each bucket's TensorRT subgraph report is written too."""
    from dspark_compile.inspection.onnx_domain import dspark_overloads
    check_onnx_available()
    buckets = sorted(buckets or manifest["buckets"])
    unknown = [b for b in buckets if b not in manifest["buckets"]]
    if unknown:
        raise ValueError(f"--bucket {unknown[0]}: the engine has buckets {manifest['buckets']}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from dspark_compile.inspection.tensorrt_report import report_program
    specs = dspark_overloads()
    done = {}
    for b in buckets:
        ep = load_program(engine_dir, manifest, b)
        report_program(ep, b, out_dir, log)     # on the program as stored: before the rewrite
        done[b] = export_bucket(ep, b, out_dir, specs)
        log(f"[onnx] bucket {b}: {out_dir / done[b]['file']} ({done[b]['nodes']} nodes, dspark "
            + ", ".join(f"{k} {v}" for k, v in done[b]["dspark_nodes"].items()) + ")")
    return done
