"""MoE FFN (docs/model.md, "MoE"): router, routed MXFP4 experts (one dspark op), shared
FP8 expert, SwiGLU clamp on both.

Router: fp32 logits, score sqrt(softplus); selection by `tid2eid[token]` on hash layers, else
top-k of score + bias (bias only selects); weights = unbiased scores, renormalised, x routed
scaling factor.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_compile.kernels import moe as moe_kernel  # noqa: F401  (registers dspark::moe_experts)
from dspark_compile.kernels import moe_gate as _moe_gate  # noqa: F401  (registers dspark::moe_gate)
from dspark_compile.kernels import moe_layout
from dspark_compile.kernels.act_quant import swiglu, swiglu_quant_reference

from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.linear import E8M0_STORAGE, FP8Linear


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, hash_layer: bool):
        super().__init__()
        self.cfg, self.hash_layer = cfg, hash_layer
        self.register_buffer("weight", torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.bfloat16))
        if hash_layer:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok,
                                                        dtype=torch.int64))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor):
        cfg = self.cfg
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        logits = torch.ops.dspark.linear(x, self.weight, x.dtype, acc)   # exact bf16 products
        # scores, selection and weights in one op (kernels/moe_gate.py)
        return torch.ops.dspark.moe_gate(
            logits, None if self.hash_layer else self.bias,
            self.tid2eid if self.hash_layer else None, tokens, cfg.num_experts_per_tok,
            bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor))


class Experts(nn.Module):
    """All routed experts of a layer, stacked: w{1,3} [E, I, D/2], w2 [E, D, I/2] (MXFP4 bytes),
    in the checkpoint's layout until `use_kernel_layout` re-lays them out for the kernel; `layout`
    names the one the buffers hold (the op's `layout` argument)."""

    NAMES = ("w1_weight", "w1_scale", "w3_weight", "w3_scale", "w2_weight", "w2_scale")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        for w, (rows, cols) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            self.register_buffer(f"{w}_weight", torch.zeros(E, rows, cols // 2, dtype=torch.int8))
            # E8M0 scales held as their raw bytes (see models/linear.py: E8M0_STORAGE)
            self.register_buffer(f"{w}_scale", torch.zeros(E, rows, cols // 32, dtype=E8M0_STORAGE))
        self.layout = moe_layout.CHECKPOINT

    def tensors(self) -> tuple:
        return tuple(getattr(self, n) for n in self.NAMES)

    def use_kernel_layout(self, dtype: torch.dtype) -> str:
        """Replace the buffers by the kernel's tiled layout (kernels/moe_layout.py) for
        activations of `dtype` (its K tile); an exact permutation, done once at build time.
        Returns the layout's name. The eager model keeps the checkpoint's layout, and so do
        experts whose shapes have no kernel layout (moe_layout.tileable)."""
        if self.layout == moe_layout.CHECKPOINT and moe_layout.tileable(
                self.w1_weight.shape[1], 2 * self.w1_weight.shape[2]):
            tensors, self.layout = moe_layout.experts_to_kernel(
                *self.tensors(), max_bk=moe_kernel.max_bk(dtype, tiled=True))
            for name, t in zip(self.NAMES, tensors):
                setattr(self, name, t)
        return self.layout


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, prec: Precision):
        super().__init__()
        I, D, blk = cfg.moe_intermediate_size, cfg.hidden_size, cfg.fp8_block
        self.prec, self.limit = prec, cfg.swiglu_limit
        self.w1 = FP8Linear(I, D, prec, blk)
        self.w3 = FP8Linear(I, D, prec, blk)
        self.w2 = FP8Linear(D, I, prec, blk)

    def forward(self, x, xq):
        g, u = self.w1(x, xq), self.w3(x, xq)
        if self.prec.act_quant:
            q, s = swiglu_quant_reference(g, u, self.limit)
            return self.w2(None, (q, s))
        return self.w2(swiglu(g, u, self.limit))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hash_layer: bool, prec: Precision):
        super().__init__()
        self.cfg, self.prec = cfg, prec
        self.gate = Gate(cfg, hash_layer)
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg, prec)
        # None, or a tensor-parallel rank's sum across ranks (models/sharding.py), applied to
        # this rank's routed + shared partial before the rounding to the compute dtype
        self.reduce = None

    def forward(self, x: torch.Tensor, xq, tokens: torch.Tensor, valid=None) -> torch.Tensor:
        """valid [T] bool (None: every row): a padded row's pairs read no expert weights."""
        idx, w = self.gate(x, tokens)
        e = self.experts
        routed = torch.ops.dspark.moe_experts(x, idx, w, *e.tensors(), float(self.cfg.swiglu_limit),
                                              e.layout, valid)
        # the routed sum is fp32 (fp64 in exact mode), the shared expert's output the compute
        # dtype: added in the routed dtype (the shared values exactly), then rounded to the
        # compute dtype, the residual stream's, which mHC's post takes
        y = routed + self.shared_experts(x, xq)
        if self.reduce is not None:
            y = self.reduce(y)
        return y.to(self.prec.dtype)


def use_kernel_layouts(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Every MoE layer's experts of `model` in the kernel's weight layout (the engine build,
    dspark_compile/build/pipeline.py); the layout names, one per layer."""
    return [m.use_kernel_layout(dtype) for m in model.modules() if isinstance(m, Experts)]


def sync_kernel_layouts(model: nn.Module) -> list[str]:
    """Each MoE layer's `layout` named from the tensors its buffers hold now (kernels/
    moe_layout.py layout_of): after loading an engine's tiled weights into a model whose buffers
    were shaped by use_kernel_layouts on other data (the name's `wide` flag follows the loaded
    scale bytes, so the model's calls read them as the engine's programs do)."""
    out = []
    for m in model.modules():
        if isinstance(m, Experts):
            m.layout = moe_layout.layout_of(*m.tensors())
            out.append(m.layout)
    return out
