"""The tiny checkpoint widened for tensor parallelism at tp = 2 (the tiny preset itself is refused:
its o_lora_rank 64 would cut a 128 x 128 FP8 scale block), optionally cut to fewer target
layers: the sharded tests' checkpoint (tests/models/test_parallel.py,
tests/runtime/test_tp_engine.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from dspark_compile.factory.checkpoint_dir import write_checkpoint
from dspark_compile.models.checkpoint import load_checkpoint

# the axis each widened tensor doubles along, by its name inside the layer (tp_checkpoint)
_WIDEN = ((re.compile(r"attn\.wo_a\.|ffn\.shared_experts\.w[13]\.|ffn\.experts\.\d+\.w[13]\."), 0),
          (re.compile(r"attn\.wo_b\.|ffn\.shared_experts\.w2\.|ffn\.experts\.\d+\.w2\."), 1))
_IN_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.(.*)$")


def tp_checkpoint(tiny: str | Path, out: str | Path, layers: tuple | None = None) -> Path:
    """The tiny checkpoint at `tiny` widened so every split holds whole 128 x 128 FP8 blocks
    at tp = 2 (the tiny preset itself is refused: o_lora_rank 64), written to `out`:
    o_lora_rank 64 -> 128 and moe_intermediate_size 128 -> 256, each widened tensor two of the
    tiny checkpoint's laid side by side along the widened axis (the next layer's as the second
    half), which keeps every FP8 block and MXFP4 group whole and the values the synthetic ones,
    without a second synth (~15 s). `layers`: the target layers kept, in order (default all),
    with the compress ratios, the hash layers (a prefix) and the draft's target layer ids
    following them; the tokenizer is copied when there is one."""
    tiny, out = Path(tiny), Path(out)
    raw = json.loads((tiny / "config.json").read_text())
    cfg, tensors = load_checkpoint(tiny)
    L = raw["num_hidden_layers"]
    counts = {"layers": L, "mtp": cfg.n_mtp_layers}

    def widen(name: str) -> torch.Tensor:
        m = _IN_LAYER.match(name)
        for pat, dim in _WIDEN if m else ():
            if pat.match(m.group(3)):
                partner = (f"{m.group(1)}.{(int(m.group(2)) + 1) % counts[m.group(1)]}."
                           f"{m.group(3)}")
                return torch.cat([tensors[name], tensors[partner]], dim)
        return tensors[name]

    wide = {n: widen(n) for n in tensors}
    raw.update(o_lora_rank=2 * raw["o_lora_rank"],
               moe_intermediate_size=2 * raw["moe_intermediate_size"])
    if layers is not None:
        layers = list(layers)
        if layers != sorted(set(layers)) or not layers or layers[-1] >= L:
            raise ValueError(f"layers {layers}: distinct target layers in [0, {L}) in order")
        hashed = [i for i in layers if i < raw.get("num_hash_layers", 0)]
        if hashed != layers[:len(hashed)]:
            raise ValueError(f"layers {layers}: the hash layers must stay a prefix")
        ratios = raw["compress_ratios"]
        raw.update(num_hidden_layers=len(layers), num_hash_layers=len(hashed),
                   compress_ratios=[ratios[i] for i in layers] + ratios[L:],
                   dspark_target_layer_ids=list(range(len(layers)))[
                       -len(raw["dspark_target_layer_ids"]):])
        keep = {}
        for n, t in wide.items():
            m = _IN_LAYER.match(n)
            if m and m.group(1) == "layers":
                if int(m.group(2)) in layers:
                    keep[f"layers.{layers.index(int(m.group(2)))}.{m.group(3)}"] = t
            else:
                keep[n] = t
        wide = keep
    path = write_checkpoint(raw, wide, out)
    tok = tiny / "tokenizer.json"
    if tok.is_file():
        (Path(path) / "tokenizer.json").write_bytes(tok.read_bytes())
    return Path(path)
