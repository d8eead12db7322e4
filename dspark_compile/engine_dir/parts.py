"""The model part each node of a program belongs to (layers.N, mtp.N, head, embed, draft,
draft.context, sampler, step), written with the program (engine_dir/graph_format.py "parts")
so tools that attribute a step's launches per layer (benchmarks/step_launches.py per_layer)
work on a loaded engine, whose graph keeps no other node meta. Decided at build from the
export's node meta: the fused region, the module stack, the source line.
"""
from __future__ import annotations

import re

_PATH = re.compile(r"(?:^|\.)((?:layers|mtp)\.\d+)(?:\.|$)")
_SAMPLERS = ("markov_sample", "rejection_sample", "sample")


# the innermost stack-trace line export records is the one in a module's forward (or the
# step's): these calls there name the model part their nodes belong to
_CALL_LABELS = (("self.logits(", "head"), ("self.embed_streams(", "embed"),
                ("draft_block(", "draft"), ("store_context(", "draft.context"),
                ("rejection_sample_reference(", "sampler"), ("sampling_of(", "sampler"))


def node_part(node) -> str:
    """The model part a graph node belongs to: sampler (the sampler ops, their reference
    regions and arguments), head (the target's hc_head, norm and LM head), embed, layers.N /
    mtp.N (from nn_module_stack), draft (the draft's embedding, its hc_head and LM head
    outside mtp.N blocks), draft.context (the context store), step (the step's own code: batch
    set-up, state updates)."""
    custom = node.meta.get("custom") or {}
    region = custom.get("dspark_region") or custom.get("dspark_fused")
    target = str(node.target)
    if region in _SAMPLERS or any(f"dspark.{s}." in target or target == f"dspark.{s}"
                                  for s in _SAMPLERS):
        return "sampler"
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]
    deepest = paths[-1] if paths else ""
    if re.search(r"(?:^|\.)hc_head(?:\.|$)", deepest):
        return "draft" if ".mtp." in f".{deepest}" else "head"
    for path in reversed(paths):
        m = _PATH.search(path)
        if m:
            return m.group(1)
    if deepest in ("model.norm", "norm"):
        return "head"
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    code = lines[-1] if lines else ""
    for call, label in _CALL_LABELS:
        if call in code:
            return label
    return "step"
