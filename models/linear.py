"""Linears that keep checkpoint formats: every weight is read in its stored dtype.

`FP8Linear`: float8_e4m3fn weight [out, in] + UE8M0 scale per 128x128 block. With
`Precision.act_quant` the input is quantized per token in 128-groups (UE8M0) first, as vLLM's
FP8 block GEMM does; the product is one `dspark::fp8_linear` call (kernels/fp8_linear.py: the
reference there dequantizes and accumulates in fp32, fp64 in exact mode; on CUDA the Triton
GEMM reads the fp8 bytes and scales directly).

`BF16Linear` and the LM head (`bf16_linear`): one `dspark::linear` call (kernels/linear.py): in
bf16 compute, bf16 operands with fp32 accumulation, never an up-cast copy of the weight on a
GPU; fp32 / fp64 compute (tests, exact mode) multiply in that dtype.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels import fp8_linear as _fp8_linear  # noqa: F401  (registers the op)
from dspark_compile.kernels import linear as _linear  # noqa: F401  (registers the op)
from dspark_compile.kernels.act_quant import act_quant_reference

from dspark_compile.models.config import Precision

# E8M0 scales are held as their raw bytes (uint8, exponent + 127), never numerically cast: the
# checkpoint's float8_e8m0fnu tensors are `.view(torch.uint8)`-ed on load. torch 2.11's export
# serializer has no float8_e8m0fnu, so an exported step holding e8m0 buffers could not be saved on
# the GPU machine (KeyError in serialize_tensor_meta); uint8 serializes everywhere.
E8M0_STORAGE = torch.uint8
FP8_BLOCK = 128   # weight block edge = activation group (kernels/fp8_linear.GROUP)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for a compute dtype: fp32 for 16-bit types, itself otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class RMSNormWeight(nn.Module):
    """Holds `<name>.weight` (bf16); the math is kernels.common.rmsnorm."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.ones(dim, dtype=torch.bfloat16))


class BF16Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int, prec: Precision):
        super().__init__()
        self.prec = prec
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return bf16_linear(x, self.weight, self.prec.dtype, out_dtype or self.prec.dtype)


def bf16_linear(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
                out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T for compute dtype `dtype`, result in `out_dtype`: one
    `dspark::linear` call (kernels/linear.py). 16-bit compute: x in w's dtype, the exact
    products accumulated in fp32 and rounded once (an fp32 result, the LM head's logits that
    the samplers read and the compressor's and indexer's scores, is not rounded to 8 bits);
    fp32 / fp64 compute: both operands in that dtype. Our GEMM, not cuBLAS, so that a row's
    result does not depend on how many rows share the call."""
    return torch.ops.dspark.linear(x, w, dtype, out_dtype)


class FP8Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int, prec: Precision,
                 block: tuple[int, int] = (128, 128)):
        super().__init__()
        if tuple(block) != (FP8_BLOCK, FP8_BLOCK):
            raise ValueError(f"FP8Linear: dspark::fp8_linear takes {FP8_BLOCK} x {FP8_BLOCK} "
                             f"weight blocks (DeepSeek-V4's), got {tuple(block)}")
        self.prec, self.block = prec, block
        # the result's dtype; None: the compute dtype. A row-parallel rank (models/sharding.py)
        # asks for the accumulation dtype, so its partial is summed across ranks before the one
        # rounding to the compute dtype that the unsharded product has
        self.out_dtype: torch.dtype | None = None
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.zeros(-(-out_features // block[0]), -(-in_features // block[1]),
                                                  dtype=E8M0_STORAGE))

    def forward(self, x: torch.Tensor, xq: tuple | None = None, groups: int = 1) -> torch.Tensor:
        """y = x W^T. `xq` = (fp8, scale) of x when the caller already quantized it (fused norm).
        `groups` G > 1: Attention.output's grouped wo_a, x [M, G*K] with W [N, K]: group g's K
        columns of x times W rows [g*N/G, (g+1)*N/G)."""
        if self.prec.act_quant:
            q, s = xq if xq is not None else act_quant_reference(x)
            return torch.ops.dspark.fp8_linear(q, s, self.weight, self.scale, groups,
                                               self.out_dtype or self.prec.dtype)
        return torch.ops.dspark.fp8_linear(x, None, self.weight, self.scale, groups,
                                           self.out_dtype or self.prec.dtype)
