"""Program variants: a bucket's step specialised for batches whose sampling the host knows,
sharing the program's weights. The build writes each variant's graph beside its program
(`variant_graph`, engine_dir/write.py); the runtime loads both.

The build exports one program per bucket with the Markov draft sampler in its general launch
plan (mode "full": per-row temperature, top-k, top-p). When every live row of a step is greedy,
the sampler can run its greedy plan instead (kernels/sampling/markov.py: one launch per Markov
step instead of ~7; 90 vs 170 us at B = 1 and 139 vs 391 us at B = 64 on the H200 at Flash
dims, benchmarks/results/README.md, "Sampler"). The runtime keeps both variants of each
bucket and picks one per step from the rows' temperatures (dspark_compile/runtime/engine.py); the
Inductor backend compiles the same switch on the lifted graph (dspark_compile/build/inductor.py).
Rejection switches too: its greedy plan (kernels/sampling/rejection.py) reads each target row
once for its argmax, where the general plan runs the top-k/top-p passes over every row, and it
never reads the draft logits, which the Markov greedy plan neither computes nor stores.

The logprobs variants are not written here: the runtime derives them at load from each loaded
step and prefill program (dspark_compile/runtime/logprobs.py), full and greedy alike, so no
engine needs a rebuild for them.
"""
from __future__ import annotations

from typing import Optional

import torch

GREEDY = "greedy"


def _mode_arg(op) -> int:
    """Position of `mode` in a dspark op's schema."""
    return next(i for i, a in enumerate(op._schema.arguments) if a.name == "mode")


def _op_nodes(gm: torch.fx.GraphModule, op) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def markov_nodes(gm: torch.fx.GraphModule) -> list:
    """The `dspark::markov_sample` calls of a graph."""
    return _op_nodes(gm, torch.ops.dspark.markov_sample.default)


def rejection_nodes(gm: torch.fx.GraphModule) -> list:
    """The `dspark::rejection_sample` calls of a graph."""
    return _op_nodes(gm, torch.ops.dspark.rejection_sample.default)


def _check_mode(mode: str) -> None:
    from dspark_compile.kernels.sampling.plan import MODES
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")


def _set_mode(node: torch.fx.Node, i: int, mode: str) -> None:
    if len(node.args) < i:
        raise ValueError(f"unexpected {node.target} call {node.format_node()}: "
                         f"{len(node.args)} positional arguments, expected >= {i}")
    node.args = tuple(node.args[:i]) + (mode,)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "mode"}


def sampler_mode_variant(program: torch.export.ExportedProgram,
                         mode: str = GREEDY) -> Optional[torch.fx.GraphModule]:
    """The program's module with every `dspark::markov_sample` call switched to `mode` (and, for
    mode "greedy", every `dspark::rejection_sample` call too); None when the program has no
    Markov sampler call (a build without the fuse_sampler pass).

    In mode "greedy" the op leaves its draft logits unwritten, so the variant also drops the
    step's in-place copy of them into the state (`index_put_` of B x N x V floats: ~330 MB of
    traffic per step at B = 64, Flash dims): a greedy request's `row.draft_logits` rows then
    keep what admission (NaN, models/generate.py set_row_sampling) or an earlier full step
    wrote, and rejection never reads a greedy request's draft logits.

    `ExportedProgram.module()` builds a new module around a copy of the graph and the program's
    own weight tensors, so the variant costs a graph, not a second copy of the weights."""
    _check_mode(mode)
    if not markov_nodes(program.graph_module):     # nothing to switch: build no module
        return None
    return switch_sampler_mode(program.module(), mode)


def variant_graph(program: torch.export.ExportedProgram,
                  mode: str = GREEDY) -> Optional[torch.fx.Graph]:
    """A copy of the program's graph with its sampler calls switched to `mode` (what
    sampler_mode_variant runs), for the build to write beside the program
    (engine_dir/write.py `variant_graphs`): same placeholders and outputs, the program's own
    graph untouched. None when the program has no Markov sampler call."""
    _check_mode(mode)
    if not markov_nodes(program.graph_module):
        return None
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    return switch_sampler_mode(torch.fx.GraphModule(program.graph_module, graph), mode).graph


def switch_sampler_mode(gm: torch.fx.GraphModule, mode: str) -> torch.fx.GraphModule:
    """Switch `gm`'s sampler calls to `mode` in place (sampler_mode_variant says what changes);
    returns gm."""
    _check_mode(mode)
    i = _mode_arg(torch.ops.dspark.markov_sample.default)
    for n in markov_nodes(gm):
        _set_mode(n, i, mode)
        if mode == GREEDY:
            _drop_draft_logits_writes(gm, n)
    if mode == GREEDY:
        j = _mode_arg(torch.ops.dspark.rejection_sample.default)
        for n in rejection_nodes(gm):
            _set_mode(n, j, GREEDY)
    gm.graph.lint()
    gm.recompile()
    return gm


def _drop_draft_logits_writes(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Erase the in-place state writes of `node`'s draft logits (output 1), when those are all
    its uses; anything else reading them keeps them (and the writes) as they are."""
    import operator
    outs = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
    for g in outs:
        writes = [u for u in g.users if u.target is torch.ops.aten.index_put_.default
                  and u.args[2] is g and not u.users]
        if len(writes) != len(g.users):
            continue
        for w in writes:
            gm.graph.erase_node(w)
        gm.graph.erase_node(g)
