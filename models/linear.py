"""Linears that keep checkpoint formats and dequantize in the reference forward.

`FP8Linear`: float8_e4m3fn weight [out, in] + UE8M0 scale per 128x128 block. With
`Precision.act_quant` the input is quantized per token in 128-groups (UE8M0) first, as vLLM's
FP8 block GEMM does; the product accumulates in fp32 (fp64 in exact mode).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels.act_quant import ACT_QUANT_GROUP, act_quant_reference
from dspark_compile.kernels.common import fp8_group_dequant

from dspark_compile.models.config import Precision
from dspark_compile.models.quant_formats import fp8_block_dequant

# E8M0 scales are held as their raw bytes (uint8, exponent + 127), never numerically cast: the
# checkpoint's float8_e8m0fnu tensors are `.view(torch.uint8)`-ed on load. torch 2.11's export
# serializer has no float8_e8m0fnu, so an exported step holding e8m0 buffers could not be saved on
# the GPU machine (KeyError in serialize_tensor_meta); uint8 serializes everywhere.
E8M0_STORAGE = torch.uint8


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
        acc = acc_dtype(self.prec.dtype)
        y = x.to(acc) @ self.weight.to(acc).T
        return y.to(out_dtype or self.prec.dtype)


class FP8Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int, prec: Precision,
                 block: tuple[int, int] = (128, 128)):
        super().__init__()
        self.prec, self.block = prec, block
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.zeros(-(-out_features // block[0]), -(-in_features // block[1]),
                                                  dtype=E8M0_STORAGE))

    def dequant_weight(self) -> torch.Tensor:
        return fp8_block_dequant(self.weight, self.scale, self.block, acc_dtype(self.prec.dtype))

    def quantize_input(self, x: torch.Tensor):
        return act_quant_reference(x)

    def forward(self, x: torch.Tensor, xq: tuple | None = None) -> torch.Tensor:
        """y = x W^T. `xq` = (fp8, scale) of x when the caller already quantized it (fused norm)."""
        acc = acc_dtype(self.prec.dtype)
        if self.prec.act_quant:
            q, s = xq if xq is not None else act_quant_reference(x)
            x = fp8_group_dequant(q, s, ACT_QUANT_GROUP)
        return (x.to(acc) @ self.dequant_weight().T).to(self.prec.dtype)
