"""Whether the kernels' launch plans are batch invariant (the default, always in an engine).

Batch invariant: every reduction order a plan fixes (split-K, attention chunks) is a function
of the weight's or the cache's shape, never of how many rows or tokens share the launch (mHC
needs no such plan: its sums follow one tree over D at every tiling, kernels/mhc.py), so a
row's bits are the same alone, at any batch size and any position. Greedy speculative decoding then emits exactly the tokens of target-only decoding (the verify step
computes a row with 6 tokens a row and other rows beside it, the target-only step with one).

`batch_dependent_plans()` switches to the plans that choose their splits by the token count as
well: not lossless, and only for benchmarks/step.py to measure what invariance costs. It acts
where a launcher picks its plan, so it must wrap the engine's CUDA-graph capture.
"""
from __future__ import annotations

import contextlib

_INVARIANT = [True]


def batch_invariant() -> bool:
    return _INVARIANT[-1]


@contextlib.contextmanager
def batch_dependent_plans():
    """Plans that may depend on the batch (benchmark variant; see the module docstring)."""
    _INVARIANT.append(False)
    try:
        yield
    finally:
        _INVARIANT.pop()
