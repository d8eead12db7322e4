"""Checkpoint names <-> model buffers.

The model's buffers carry the checkpoint's names with two mechanical renamings:
`hc_{attn,ffn,head}_{fn,base,scale}` live in `hc_{site}.{fn,base,scale}` modules, and the routed
experts `ffn.experts.E.w{1,2,3}.{weight,scale}` are stacked per layer into
`ffn.experts.w{1,2,3}_{weight,scale}[E]` so the MoE is one op over fixed-shape tensors.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from dspark_compile.models.schema import checkpoint_schema

_HC = re.compile(r"^(.*)hc_(attn|ffn|head)_(fn|base|scale)$")
_EXPERT = re.compile(r"^(.*ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")


def model_name(native: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (model buffer name, expert index or None)."""
    m = _EXPERT.match(native)
    if m:
        return f"{m.group(1)}.{m.group(3)}_{m.group(4)}", int(m.group(2))
    m = _HC.match(native)
    if m:
        return f"{m.group(1)}hc_{m.group(2)}.{m.group(3)}", None
    return native, None


@torch.no_grad()
def load_native(model: nn.Module, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy checkpoint tensors (already validated against the schema) into the model's buffers.

    Raises KeyError naming any model buffer left unfilled (a schema/model disagreement).
    """
    buffers = dict(model.named_buffers())
    filled: dict[str, set] = {}
    for native, t in tensors.items():
        name, idx = model_name(native)
        if name not in buffers:
            if native.startswith("mtp.") and getattr(model, "mtp", None) is None:
                continue  # target-only model
            raise KeyError(f"checkpoint tensor '{native}' has no model buffer '{name}'")
        buf = buffers[name]
        dst = buf if idx is None else buf[idx]
        if t.dtype == torch.float8_e8m0fnu and dst.dtype == torch.uint8:
            t = t.view(torch.uint8)  # scales are held as raw bytes (models/linear.py)
        if dst.shape != t.shape or dst.dtype != t.dtype:
            raise ValueError(f"checkpoint tensor '{native}': {tuple(t.shape)} {t.dtype} does not fit "
                             f"model buffer '{name}' {tuple(dst.shape)} {dst.dtype}")
        dst.copy_(t)
        filled.setdefault(name, set()).add(idx)
    if strict:
        schema = checkpoint_schema(model.cfg)
        optional = {model_name(n)[0] for n, s in schema.items() if s.optional}
        persistent = {n for n, _ in model.named_buffers() if _is_persistent(model, n)}
        missing = sorted(persistent - set(filled) - optional)
        if missing:
            raise KeyError(f"model buffers not filled by the checkpoint: {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}")


def _is_persistent(model: nn.Module, name: str) -> bool:
    mod_name, _, buf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    return buf not in mod._non_persistent_buffers_set
