"""Load-time program variants: a bucket's step specialised for batches whose sampling the host
knows, sharing the program's weights.

The build exports one program per bucket with the Markov draft sampler in its general launch
plan (mode "full": per-row temperature, top-k, top-p). When every live row of a step is greedy,
the sampler can run its greedy plan instead (kernels/markov_sampler.py: one launch per Markov
step instead of ~8; 118.6 vs 183 us at B = 1 and 196 vs 360 us at B = 64 on the H200 at Flash
dims). The runtime keeps both variants of each bucket and picks one per step from the rows'
temperatures (dspark_compile/runtime.py). Rejection needs no variant: for greedy rows it never
reads the draft probabilities, which the greedy plan leaves unwritten.
"""
from __future__ import annotations

from typing import Optional

import torch

GREEDY = "greedy"
_MODE_ARG = 9        # dspark::markov_sample(base_logits, ..., start_pos, str mode="full")


def _markov_nodes(gm: torch.fx.GraphModule) -> list:
    op = torch.ops.dspark.markov_sample.default
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def sampler_mode_variant(program: torch.export.ExportedProgram,
                         mode: str = GREEDY) -> Optional[torch.fx.GraphModule]:
    """The program's module with every `dspark::markov_sample` call switched to `mode`; None when
    the program has no such call (a build without the fuse_sampler pass).

    `ExportedProgram.module()` builds a new module around a copy of the graph and the program's
    own weight tensors, so the variant costs a graph, not a second copy of the weights."""
    from .kernels.markov_sampler import MODES
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    gm = program.module()
    nodes = _markov_nodes(gm)
    if not nodes:
        return None
    for n in nodes:
        args = list(n.args[:_MODE_ARG]) + [mode]
        kwargs = {k: v for k, v in n.kwargs.items() if k != "mode"}
        n.args, n.kwargs = tuple(args), kwargs
    gm.recompile()
    return gm


def sampler_modes(gm: torch.fx.GraphModule) -> list[str]:
    """The launch mode of each `dspark::markov_sample` call in `gm` (inspection, tests)."""
    return [n.args[_MODE_ARG] if len(n.args) > _MODE_ARG else n.kwargs.get("mode", "full")
            for n in _markov_nodes(gm)]
