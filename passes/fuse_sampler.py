"""Fuse the samplers: the Markov draft sampler, rejection sampling and plain sampling regions
become one `dspark::` op call each (kernels/sampling/: markov.py, rejection.py, sample.py).

Unfused, `markov_sample_reference` over N = 5 steps (~650 aten nodes in the tiny step):

    for k in 0..N-1:
        bias = W1[prev] @ W2^T                       # [B, V] fp32, materialised
        z = process(base[:, k] + bias, T, top_k, top_p)   # full-vocab sort for top-k/top-p
        x = argmax(z + gumbel(philox(seed, V, pos + k)))   # [B, V] noise
        draft_logits[:, k] = base[:, k] + bias; prev = x

`rejection_sample_reference`: process + softmax + log_softmax of all B*(N+1) target rows and
of the B*N draft rows (q), the acceptance test of every draft, cumprod, residual max(p - q, 0)
and a Gumbel-max over it.

Fused:

    drafts, draft_logits = dspark.markov_sample(base, anchor, w1, w2, temperature, top_k, top_p,
                                                seed, start_pos)      # mode "full"
    tokens, num_sampled = dspark.rejection_sample(target_logits, draft_tokens, draft_logits,
                                                  temperature, top_k, top_p, seed, start_pos)
    tokens              = dspark.sample(logits, temperature, top_k, top_p, seed, position)

Memory traffic at Flash dims (V = 129280, r = 256): the unfused Markov sampler writes and reads
several [B, V] fp32 tensors per step (bias, z, noise, the sort for top-k/top-p, probs: ~10
passes of 0.5 MB per request and step) and reads W2 once per step anyway; the fused op reads W2
once per step for all rows (331 MB per call, the floor) plus the base logits, and writes the
draft logits; it searches a top-p threshold only for the rows whose Gumbel candidate falls
outside the kept set. Rejection: the unfused graph processes every target and draft row
(several full passes each); the fused op reads each row's statistics once and searches the
thresholds of the few rows its acceptance tests still need. Both ops draw Philox noise
bit-exactly like the references, so fusing changes no token.
"""
from __future__ import annotations

from dspark_compile.kernels import sampling as _sampling  # noqa: F401  (registers the ops)

from dspark_compile.passes.base import PassResult
from dspark_compile.passes.regions import fuse_regions
from dspark_compile.passes.registry import register_pass

OPS = ("markov_sample", "rejection_sample", "sample")


@register_pass(name="fuse_sampler", stage="fusion", expect_match=True)
def fuse_sampler_pass(gm, ctx) -> PassResult:
    """Replace markov_sample / rejection_sample / sample regions by their dspark:: ops."""
    return fuse_regions(gm, OPS, ctx)
