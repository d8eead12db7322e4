"""Tensor / expert parallelism: which rank this process is, and the collectives the sharded model
calls (docs/model.md, "Tensor parallelism"; the split of each tensor is models/sharding.py's).

`ParallelConfig` names the rank, the rank count `tp` (a power of two that divides the split
shapes) and the torch.distributed process group. The collectives are functional
(`torch.distributed._functional_collectives`: a tensor in, a new tensor out, no in-place
`work.wait()`), so export traces them into each rank's program and they are capture-safe on
NCCL; gloo runs them on CPU processes.

Every reduction is an all-gather followed by a sum over the ranks in rank order 0, 1, ..., tp-1,
never the backend's all-reduce: NCCL picks ring or tree (and their chunking) by message size,
so its summation order could change with the batch bucket and break batch invariance, and a
reduction whose order depends on the algorithm is not reproducible across machines. Gathered,
every rank adds the same operands in the same order and holds the same bits. The cost at tp = 2
is the ring all-reduce's (each rank sends its S bytes and receives S); at tp > 2 each rank
receives (tp - 1) S instead of 2 (tp - 1) / tp S, fine at the few KB a decode row moves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class ParallelError(ValueError):
    """A rank count, rank or split that the model's shapes or the process group do not allow."""


@dataclass(frozen=True)
class ParallelConfig:
    """rank in [0, tp); tp a power of two; `group` the torch.distributed process group of the
    tp ranks (None: the default group; unused when tp == 1)."""
    rank: int = 0
    tp: int = 1
    group: Any = None

    def __post_init__(self):
        if type(self.tp) is not int or self.tp < 1 or self.tp & (self.tp - 1):
            raise ParallelError(f"ParallelConfig.tp={self.tp!r}: the rank count must be a power "
                                "of two (1, 2, 4, 8)")
        if type(self.rank) is not int or not 0 <= self.rank < self.tp:
            raise ParallelError(f"ParallelConfig.rank={self.rank!r}: must be in [0, tp={self.tp})")

    @classmethod
    def from_group(cls, group=None) -> "ParallelConfig":
        """This process's rank and the group's size, from an initialised torch.distributed."""
        import torch.distributed as dist
        if not dist.is_initialized():
            raise ParallelError("ParallelConfig.from_group: torch.distributed is not initialised "
                                "(init_process_group first)")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def span(self, n: int, what: str) -> tuple[int, int]:
        """[lo, hi) of this rank's equal share of n items (heads, experts, vocab rows)."""
        if n % self.tp:
            raise ParallelError(f"{what}: {n} does not split over tp={self.tp} ranks")
        k = n // self.tp
        return self.rank * k, (self.rank + 1) * k

    # ---- collectives -----------------------------------------------------------------------
    def _gather0(self, x: torch.Tensor) -> torch.Tensor:
        """[tp, *x.shape]: every rank's x, in rank order."""
        from torch.distributed import _functional_collectives as funcol
        g = funcol.all_gather_single(x.contiguous(), 0, self._group())
        # eager: a waitable wrapper, unwrapped here so no caller holds it; traced: funcol
        # already put the one wait_tensor node after the gather
        if isinstance(g, funcol.AsyncCollectiveTensor):
            g = g.wait()
        return g.view(self.tp, *x.shape)

    def _group(self):
        if self.group is not None:
            return self.group
        import torch.distributed as dist
        return dist.group.WORLD

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, added in rank order (module docstring): the same bits on
        every rank and for every batch size. Identity at tp = 1."""
        if self.tp == 1:
            return x
        g = self._gather0(x)
        out = g[0]
        for r in range(1, self.tp):
            out = out + g[r]
        return out

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., tp * n], rank r's block at [r n, (r + 1) n) (vocab-parallel
        logits). Identity at tp = 1."""
        if self.tp == 1:
            return x
        g = self._gather0(x)                                   # [tp, ..., n]
        # a concatenation, not movedim + reshape: the reshape of the permuted gather guards on
        # the row count being 1 (256 * B != 256) and fails a dynamic-batch export
        return torch.cat([g[r] for r in range(self.tp)], dim=-1)
