"""What one forward needs to know about its rows, in fixed-shape tensors.

B rows of T tokens each (a bucket of the step: T = N + 1 verify tokens; prefill: one chunk).
`rows` maps batch row -> state row (padded rows -> the trash row); `pos` holds absolute
positions. Writes of padded rows use slot -1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_compile.kernels.ring_slots import ring_slots_reference
from dspark_compile.kernels.sampling.reference import fold_ids


@dataclass
class Batch:
    rows: torch.Tensor       # [B] int64 state row per batch row (trash row for padding)
    pos: torch.Tensor        # [B, T] int64 absolute positions
    tokens: torch.Tensor     # [B, T] int64 token ids (already bounded to [0, vocab))
    valid: torch.Tensor      # [B] bool: a live request row

    @classmethod
    def make(cls, rows, pos, tokens, trash: int, vocab: int) -> "Batch":
        valid = rows < trash
        tokens = fold_ids(tokens, vocab)
        return cls(rows=rows, pos=pos, tokens=tokens, valid=valid)

    @property
    def B(self) -> int:
        return self.pos.shape[0]

    @property
    def T(self) -> int:
        return self.pos.shape[1]

    def flat_pos(self) -> torch.Tensor:
        return self.pos.reshape(-1)

    def ring_slots(self, ring: int, write: torch.Tensor | None = None) -> torch.Tensor:
        """Flat slots [B*T] into a [rows, ring, ...] tensor at pos % ring; -1 where not written.

        A row writing more than `ring` positions at once (a prefill chunk of 64 tokens into the
        8-slot draft context) would name a slot twice, and a CUDA index_put_ with repeated
        indices has no defined winner (it even tears rows between writers); so only the newest
        `ring` written positions of each row keep their slot: each slot is named at most once,
        and it holds what a sequential write would have left in it. Assumes a row's positions
        are distinct (the step's and prefill's are consecutive)."""
        return ring_slots_reference(self.rows, self.pos, self.valid, write, ring)
