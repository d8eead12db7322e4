"""Routed experts of one MoE layer as a single `dspark::moe_experts` op.

An exported layer then holds one node instead of n_routed_experts' worth of nodes. The CPU
reference loops over experts with fixed shapes (every expert runs on every token, weighted by
its routing weight, zero when unrouted), which is capture-safe: no nonzero, no data-dependent
shapes. A fused MXFP4 Triton kernel will later sit behind the same op.

Weights are MXFP4 exactly as stored: packed e2m1 pairs (int8 bytes, low nibble = even element)
with one E8M0 scale per 32 consecutive K elements. Activations are not quantized (W4A16, as
vLLM runs MXFP4 experts on Hopper).
"""
from __future__ import annotations

import torch

from dspark_compile.kernels.act_quant import swiglu
from dspark_compile.kernels.registry import dspark_op

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit) -> fp32 E2M1_VALUES, by arithmetic.

    No lookup table: a table built with torch.tensor(...) would be a host-to-device copy, which is
    illegal inside CUDA-graph capture (the step's MoE op runs this on every replay).
    """
    e = (codes >> 1) & 3
    m = (codes & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2((e - 1).to(torch.float32)))
    return torch.where((codes & 8) != 0, -mag, mag)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """packed [..., K/2] int8/uint8, scale [..., K/32] e8m0 -> [..., K] in `dtype`."""
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)        # even element = low nibble
    vals = e2m1_decode(codes)
    exp = scale.view(torch.uint8).to(torch.float32) - 127.0           # never a numeric cast
    vals = vals.unflatten(-1, (-1, MXFP4_BLOCK)) * torch.exp2(exp).unsqueeze(-1)
    return vals.flatten(-2).to(dtype)


def moe_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                          w2: torch.Tensor, s2: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * W2_e (swiglu(W1_e x, W3_e x)), e = topk_ids[t,k].

    Output is fp32 (fp64 when x is fp64, so exact-precision runs stay exact).

    x [T, D]; topk_ids [T, k] int64 in [0, E); topk_weights [T, k] fp32;
    w1/w3 [E, I, D/2], s1/s3 [E, I, D/32]; w2 [E, D, I/2], s2 [E, D, I/32].
    """
    E = w1.shape[0]
    acc = _out_dtype(x)
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=acc, device=x.device)
    for e in range(E):
        # routing weight of expert e per token (0 when not selected): fixed shape [T]
        we = (topk_weights.to(acc) * (topk_ids == e)).sum(-1)
        W1 = mxfp4_dequant(w1[e], s1[e], x.dtype)
        W3 = mxfp4_dequant(w3[e], s3[e], x.dtype)
        W2 = mxfp4_dequant(w2[e], s2[e], x.dtype)
        h = swiglu(x @ W1.T, x @ W3.T, swiglu_limit)
        # the reference weights h before W2 (same result in exact arithmetic as after)
        h = (h.to(acc) * we[:, None]).to(x.dtype)
        y = y + (h @ W2.T).to(acc)
    return y


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _moe_fake(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, swiglu_limit):
    return x.new_empty(x.shape[0], w2.shape[1], dtype=_out_dtype(x))


@dspark_op("moe_experts", reference=moe_experts_reference, fake=_moe_fake)
def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                w2: torch.Tensor, s2: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    # No fused MXFP4 kernel yet: CUDA runs the same fixed-shape reference.
    return moe_experts_reference(x, topk_ids, topk_weights, w1, s1, w3, s3, w2, s2, swiglu_limit)
