"""`dspark::sample`: plain target sampling (reference.sample_reference is the contract), fused.

The rejection plan with no drafts (rejection.py): the statistics pass, the threshold search of
each request's one row, and resample drawing its single 'bonus' token with STREAM_TARGET at
`position`. Bytes: each row's logits read once by the statistics pass (4 V bytes), a searched
row ~3 times more.
"""
from __future__ import annotations

import torch

from dspark_compile.kernels.philox import STREAM_TARGET
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.sampling.plan import PLAN, SamplerPlan
from dspark_compile.kernels.sampling.reference import sample_reference
from dspark_compile.kernels.sampling.rejection import _parallel_configs, launch_rejection

# Reference: reference.sample_reference; kernels: rejection_kernels.py.


def sample_launch(logits, temperature, top_k, top_p, seed, position,
                  plan: SamplerPlan = PLAN) -> torch.Tensor:
    """Fused plain target sampling under `plan` (mode "full"): tokens [B] int64."""
    if plan.mode != "full":
        raise ValueError(f"plain sampling has mode 'full' only, got plan.mode={plan.mode!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be a float [B, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    B, V = logits.shape
    tokens, _ = launch_rejection(
        plan, STREAM_TARGET, logits[:, None],
        torch.zeros((B, 0), dtype=torch.int64, device=logits.device),
        torch.zeros((B, 0, V), dtype=torch.float32, device=logits.device), temperature, top_k,
        top_p, seed, position)
    return tokens[:, 0]


def _sample_fake(logits, temperature, top_k, top_p, seed, position):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@dspark_op("sample", reference=sample_reference, fake=_sample_fake)
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return sample_launch(logits, temperature, top_k, top_p, seed, position)


add_compile_configs("sample", _parallel_configs(STREAM_TARGET))
