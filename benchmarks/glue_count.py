"""What is left between the `dspark::` ops of an engine's step programs: a count on any machine.

    python benchmarks/glue_count.py ENGINE [ENGINE ...] [--out FILE.json] [--top 25]

For each bucket's step program of each engine: the `dspark::` calls, and the aten calls that
compute (views, metadata checks and `getitem` excluded: they launch nothing), by op and by the
model source line they come from. On a GPU each aten compute node is one kernel launch or two
(`index_put_`, a `topk`); benchmarks/step.py counts the real launches of a captured replay
(`launches_aten`), which needs the GPU. This count needs only the engine, so a CPU build of a
preset shows how much glue a change removed, before the device run that times it.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import torch

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def _source(node) -> str:
    """The innermost frame of the node's stack trace inside the product's models / kernels."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    for path, line, fn in reversed(frames):
        if "/models/" in path or "/kernels/" in path:
            return f"{Path(path).parent.name}/{Path(path).name}:{line} {fn}"
    return "?"


def _launches(node, name: str) -> bool:
    """A view-annotated op that still copies: `to` another dtype, `contiguous` of a strided
    tensor (the schema says alias, the run allocates)."""
    from dspark_compile.passes.graph_utils import is_view, tensor_val
    if not is_view(node):
        return True
    src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    out, inp = tensor_val(node), tensor_val(src) if src is not None else None
    if out is None or inp is None:
        return False
    if name == "to":
        return out.dtype != inp.dtype or out.device != inp.device
    if name == "contiguous":
        return not inp.is_contiguous()
    return False


def count_program(ep) -> dict:
    from dspark_compile.passes.graph_utils import ASSERT_OPS
    dspark, aten, by_source = collections.Counter(), collections.Counter(), collections.Counter()
    for n in ep.graph_module.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        ns = n.target.namespace
        name = n.target._schema.name.split("::")[-1]
        if ns == "dspark":
            dspark[name] += 1
        elif ns == "aten" and n.target not in ASSERT_OPS and _launches(n, name):
            aten[name] += 1
            by_source[_source(n)] += 1
    return {"dspark_calls": sum(dspark.values()), "aten_compute_nodes": sum(aten.values()),
            "dspark": dict(dspark.most_common()), "aten": dict(aten.most_common()),
            "aten_by_source": dict(by_source.most_common())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engines", nargs="+", help="engine directories (dspark-compile build --out)")
    p.add_argument("--out", default=None, help="write the counts as JSON here")
    p.add_argument("--top", type=int, default=25, help="source lines printed per program")
    a = p.parse_args(argv)
    from dspark_compile.engine_dir.format import register_kernel_ops
    from dspark_compile.engine_dir.graph_read import read_program
    from dspark_compile.engine_dir.weights import _load_weights
    register_kernel_ops()              # programs call dspark:: ops
    result = {}
    for e in a.engines:
        # the programs and weights alone, without the engine's checks: an engine an older tree
        # built (other pass hashes) counts as well. The format keeps no source lines, so the
        # program is traced again (GraphProgram.exported) and its aten nodes attributed to "?"
        manifest = json.loads((Path(e) / "manifest.json").read_text())
        weights = _load_weights(Path(e) / manifest["weights"]["file"],
                                manifest["weights"]["tensors"], "cpu")
        programs = {}
        for b, entry in manifest["programs"].items():
            consts = entry.get("constants")
            program = read_program((Path(e) / entry["path"]).read_bytes(),
                                   (Path(e) / consts).read_bytes() if consts else None,
                                   entry["path"])
            programs[int(b)] = program.bind(weights).exported()
        rec = {"torch": manifest.get("torch_version"), "created_utc": manifest.get("created_utc"),
               "hidden_size": manifest.get("model_config", {}).get("hidden_size"), "buckets": {}}
        for b, ep in sorted(programs.items()):
            c = rec["buckets"][str(b)] = count_program(ep)
            print(f"{e} bucket {b}: {c['dspark_calls']} dspark:: calls, "
                  f"{c['aten_compute_nodes']} aten compute nodes")
            for src, k in list(c["aten_by_source"].items())[:a.top]:
                print(f"  {k:4d}  {src}")
        result[e] = rec
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
