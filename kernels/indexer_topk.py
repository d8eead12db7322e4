"""`dspark::indexer_topk`: the C4 lightning indexer's scores and top-k selection in one op.

Per query token t of row b at absolute position P, over the entries j of the row's indexer key
cache k_cache [R, NE, d_i] (compute dtype):

    I(t, j) = sum_h w[t, h] * relu(q[t, h] . k_j)         for visible j < (P + 1) // ratio

and the k = min(topk, NE) entries of highest score, ties broken by the lowest entry index (a
composite key (score desc, index asc): torch.topk promises no order among ties, and exact zero
scores tie often). NaN scores rank above every number (torch's sort order); entries that are
not visible (or of a row outside [0, R): inert) are never selected. The result lists the chosen
entries in ascending index order, -1 in the slots left over when fewer than k are visible:
idx [B, T, k] int64, a fixed shape (capture safe).

Numerics (the reference is the definition): q and k_cache up-cast to the accumulation dtype
(fp32; fp64 for fp64 q), the head sum in it. The kernel's fp32 dot sums in a different order,
so two entries whose scores differ by rounding may swap places at the k-th boundary; exact
arithmetic (integer-valued inputs) gives the reference's selection.

Bytes one call must move (Flash: 64 indexer heads x 128, bf16 keys 256 B per entry): the visible
keys of each row once (its T tokens read the same entries) + q (16 KB per token) + w + the list
(8 B per selected entry). At B = 64 and 8k context: 64 x 2048 x 256 B = 33.6 MB, 7 us at
4.8 TB/s; 32k context: 134 MB, 28 us.

Kernels (two launches): `_index_scores_kernel`, grid (token, entry chunk), writes the scores of
a chunk of visible entries (dots of all heads against BLOCK_E keys at a time) into an fp32
scratch [B*T, NE] (-inf where not visible; chunks past the visible range exit without reading);
`_topk_select_kernel`, one program per token, finds the k-th largest composite key of the
token's scores by a radix select (4 passes of 8 bits over a monotone 32-bit image of the score)
and writes the selected indices in ascending order (one prefix-sum pass).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import upcast
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.tl_helpers import compile_config, interpreting, launch, next_pow2


def index_scores_reference(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                           rows: torch.Tensor, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """I(t, j) [B, T, NE] in the accumulation dtype; -inf where not visible."""
    B = q.shape[0]
    R, NE = k_cache.shape[:2]
    acc = upcast(q)
    keys = k_cache[rows.clamp(0, R - 1)].to(acc.dtype)                        # [B, NE, d_i]
    logits = torch.relu(torch.einsum("bthd,bnd->bthn", acc, keys))
    score = (logits * weights.to(acc.dtype)[..., None]).sum(2)               # [B, T, NE]
    visible = torch.div(pos + 1, ratio, rounding_mode="floor")[..., None]
    ok = (torch.arange(NE, device=q.device) < visible) & ((rows >= 0) & (rows < R)).view(B, 1, 1)
    return score.masked_fill(~ok, float("-inf"))


def select_topk_reference(score: torch.Tensor, k: int) -> torch.Tensor:
    """The k best entries of score [..., NE] (score desc, index asc; NaN first; -inf never),
    listed in ascending index order, -1 for the slots left over."""
    NE = score.shape[-1]
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = score.gather(-1, order) != float("-inf")
    picked = torch.sort(torch.where(chosen, order, torch.full_like(order, NE)), dim=-1).values
    return torch.where(picked < NE, picked, torch.full_like(picked, -1))


def indexer_topk_reference(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                           rows: torch.Tensor, pos: torch.Tensor, topk: int,
                           ratio: int) -> torch.Tensor:
    """q [B, T, H_i, d_i], weights [B, T, H_i] -> idx [B, T, min(topk, NE)] int64."""
    score = index_scores_reference(q, weights, k_cache, rows, pos, ratio)
    return select_topk_reference(score, min(topk, k_cache.shape[1]))


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

def indexer_topk_launch(q, weights, k_cache, rows, pos, topk, ratio, plan=None):
    return indexer_topk_reference(q, weights, k_cache, rows, pos, topk, ratio)


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _indexer_topk_fake(q, weights, k_cache, rows, pos, topk, ratio):
    return q.new_empty((*q.shape[:2], min(topk, k_cache.shape[1])), dtype=torch.int64)


@dspark_op("indexer_topk", reference=indexer_topk_reference, fake=_indexer_topk_fake)
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                 rows: torch.Tensor, pos: torch.Tensor, topk: int, ratio: int) -> torch.Tensor:
    return indexer_topk_launch(q, weights, k_cache, rows, pos, topk, ratio)
