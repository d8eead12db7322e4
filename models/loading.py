"""The reference model built from a DeepSeek-native checkpoint directory (or given tensors)."""
from __future__ import annotations

from pathlib import Path

import torch

from dspark_compile.models.checkpoint import load_checkpoint
from dspark_compile.models.config import Precision
from dspark_compile.models.target import DeepseekV4
from dspark_compile.models.weights import load_native


def load_model(ckpt: str | Path, prec=None, max_positions: int = 4096, with_draft: bool = True,
               device="cpu", tensors: dict | None = None, cfg=None):
    """Build the reference model from a DeepSeek-native checkpoint directory (or given tensors)."""
    prec = prec or Precision()
    if tensors is None:
        cfg, tensors = load_checkpoint(ckpt, device=device, include_draft=with_draft)
    with torch.device(device):
        model = DeepseekV4(cfg, prec, max_positions, with_draft=with_draft)
    load_native(model, tensors)
    return model.eval()
