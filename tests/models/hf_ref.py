"""Hugging Face `transformers` DeepSeek-V4 as an independent reference for our target model.

Test-only (`transformers` is in the `test` extra, never a runtime dependency).

Loading. HF's `DeepseekV4ForCausalLM` is pure PyTorch and reads a DeepSeek-native checkpoint
through its own renaming table (`transformers/conversion_mapping.py`, "deepseek_v4":
`layers.N.attn.wq_a.weight` -> `model.layers.N.self_attn.q_a_proj.weight`,
`ffn.experts.E.w1|w3` -> stacked `gate_up_proj`, `hc_attn_fn` -> `attn_hc.fn`, ...), but only with
float weights (a `quantization_config` would send it to its FP8 quantizer). So
:func:`write_hf_checkpoint` dequantizes every FP8 (128x128 UE8M0) and MXFP4 (e2m1, E8M0 per 32)
weight to fp32 under its own native name and drops the `.scale` tensors; bf16 tensors are upcast
(exact), fp32 and the int64 `tid2eid` kept. HF (5.23, 5.24) then reports no missing and no
unexpected keys. `mtp.*` is left out: HF has no draft (it would ignore those keys through
`_keys_to_ignore_on_load_unexpected`). The config.json is ours minus `quantization_config` /
`expert_dtype` and the `dspark_*` fields; HF folds `compress_ratios` into `layer_types` and
`num_hash_layers` into `mlp_layer_types`, builds a plain "main" RoPE (rope_theta) and a YaRN
"compress" RoPE (compress_rope_theta, `attention_factor` forced to 1, i.e. no mscale).

Top-k ties. The lightning indexer's score is sum_h w_h relu(q_h . k_j) with weights of either
sign, so many entries score exactly 0 (every head's dot product negative) and the k-th and
(k+1)-th best are often an exact tie. torch.topk breaks such ties by an unspecified rule that
differs between our [.., max_seq_len/4] score rows and HF's [.., n_compressed] rows
(docs/model.md, "Indexer": tie-breaking among equal scores is implementation-defined), and
one different pick changes that token's attention output at O(0.1) in the logits.
:class:`IndexerSync` therefore checks that each of our selections is a valid top-k of HF's
*own* scores (right count, only visible entries, nothing left out that scores higher beyond a
tolerance) and then hands our selection to HF's attention, so the rest of the model is compared
under one and the same choice.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark_compile.models.quant_formats import fp8_block_dequant, mxfp4_dequant
from dspark_compile.models.schema import checkpoint_schema

# config.json keys HF must not see: the float checkpoint is not quantized.
_DROP_KEYS = ("quantization_config", "expert_dtype")


# ---- checkpoint ----------------------------------------------------------------------------

def dequantize_native(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Native checkpoint tensors -> same names, quantized weights as fp32, scales dropped."""
    schema = checkpoint_schema(cfg)
    out = {}
    for name, t in tensors.items():
        kind = schema[name].kind
        if kind in ("fp8_scale", "mxfp4_scale"):
            continue
        if kind in ("fp8_weight", "mxfp4_weight"):
            scale = tensors[name[: -len(".weight")] + ".scale"]
            out[name] = (fp8_block_dequant(t, scale, cfg.fp8_block, torch.float32) if kind == "fp8_weight"
                         else mxfp4_dequant(t, scale, torch.float32))
        elif t.is_floating_point():
            out[name] = t.to(torch.float32)  # bf16 -> fp32 is exact
        else:
            out[name] = t                      # tid2eid (int64)
    return out


def hf_config_dict(raw: dict) -> dict:
    """Our config.json dict -> one HF's DeepseekV4Config accepts for a float checkpoint."""
    out = {k: v for k, v in raw.items()
           if k not in _DROP_KEYS and k != "torch_dtype" and not k.startswith("dspark_")}
    out["dtype"] = "float32"
    return out


def write_hf_checkpoint(out_dir: str | Path, raw_config: dict, tensors: dict[str, torch.Tensor],
                        cfg) -> Path:
    """config.json + model.safetensors (dequantized fp32, native names, no draft) for HF."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = {n: t.contiguous() for n, t in dequantize_native(tensors, cfg).items()
            if not n.startswith("mtp.")}
    save_file(flat, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config_dict(raw_config), indent=2) + "\n")
    return out


def load_hf(path: str | Path):
    """(HF model in fp32 eval mode, loading info with missing / unexpected keys)."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging

    # The tiny preset's max_position_embeddings / original_max_position_embeddings is not its
    # YaRN factor, which HF warns about before using the explicit factor (what we do too).
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                            output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.eval(), info


# ---- our side: recorded indexer selections and per-layer outputs -----------------------------

class OurTrace:
    """Hooks on our DeepseekV4: each C4 layer's top-k per absolute position, each block's output."""

    def __init__(self, model):
        self.model = model
        self.selection: dict[tuple[int, int], list[int]] = {}   # (layer, position) -> entries
        self.layers: dict[int, list[torch.Tensor]] = {}          # layer -> [chunk [T, m, D]]
        self._handles = []

    def __enter__(self):
        for i, block in enumerate(self.model.layers):
            self._handles.append(block.register_forward_hook(
                lambda mod, args, out, i=i: self.layers.setdefault(i, []).append(out.detach().clone())))
            if getattr(block.attn, "indexer", None) is not None:
                self._handles.append(block.attn.indexer.register_forward_hook(
                    lambda mod, args, out, i=i: self._record(i, args[3], out)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _record(self, layer: int, batch, out) -> None:
        idx, ok = out
        if batch.B != 1:
            raise ValueError("OurTrace records single-row batches only")
        for t, pos in enumerate(batch.pos[0].tolist()):
            self.selection[(layer, pos)] = sorted(int(j) for j in idx[0, t][ok[0, t]])

    def layer_outputs(self) -> dict[int, torch.Tensor]:
        return {i: torch.cat(chunks) for i, chunks in self.layers.items()}


# ---- HF side: indexer synchronisation and per-layer outputs ---------------------------------

class IndexerSync:
    """Replace each HF C4 indexer's top-k by our selection after checking it against HF's scores.

    Our selection for query position t must hold exactly min(index_topk, n_c(t)) entries, all
    visible (j < (t+1)//ratio), and no visible entry left out may score higher than the lowest
    selected one by more than `tol` x max|score| (HF's scores, fp32). Counts of queries where
    the two sets differ (ties) are kept in `tied`.
    """

    def __init__(self, hf_model, selection: dict[tuple[int, int], list[int]], tol: float = 1e-4):
        self.hf, self.selection, self.tol = hf_model, selection, tol
        self.tied: list[tuple[int, int]] = []       # (layer, position) where the sets differ
        self.violations: list[str] = []              # selections of ours that are not a top-k
        self.checked = 0
        self._restore = []

    def __enter__(self):
        for i, layer in enumerate(self.hf.model.layers):
            comp = layer.self_attn.compressor
            indexer = getattr(comp, "indexer", None)
            if indexer is not None:
                self._restore.append((indexer, indexer.forward))
                indexer.forward = self._wrap(i, indexer, indexer.forward)
        return self

    def __exit__(self, *exc):
        for indexer, fwd in self._restore:
            indexer.forward = fwd
        self._restore.clear()

    def _wrap(self, layer: int, indexer, forward):
        def patched(hidden_states, q_residual, position_ids, cache, layer_idx):
            got = {}
            h = indexer.scorer.register_forward_hook(lambda m, a, o: got.__setitem__("s", o))
            try:
                hf_idx = forward(hidden_states, q_residual, position_ids, cache, layer_idx)
            finally:
                h.remove()
            return self._replace(layer, indexer, hf_idx, got["s"], position_ids)
        return patched

    def _replace(self, layer, indexer, hf_idx, scores, position_ids):
        if scores.shape[0] != 1:
            raise ValueError("IndexerSync handles single-row batches only")
        out = torch.full_like(hf_idx, -1)                      # [1, S, min(index_topk, n_comp)]
        scale = max(1.0, float(scores.abs().max())) if scores.numel() else 1.0
        for s, pos in enumerate(position_ids[0].tolist()):
            self.checked += 1
            ours = self.selection.get((layer, pos))
            if ours is None:
                raise KeyError(f"layer {layer}: no selection of ours recorded for position {pos}")
            visible = (pos + 1) // indexer.compress_rate
            want = min(indexer.index_topk, visible)
            where = f"layer {layer} position {pos}"
            hf_set = sorted(hf_idx[0, s][hf_idx[0, s] >= 0].tolist())
            if len(ours) != want or not all(0 <= j < visible for j in ours):
                self.violations.append(f"{where}: we selected {ours}; expected {want} entries in "
                                       f"[0, {visible}) (HF picked {hf_set})")
                continue
            if want:
                sc = scores[0, s, :visible]
                chosen = torch.zeros(visible, dtype=torch.bool)
                chosen[ours] = True
                gap = float(sc[~chosen].max() - sc[chosen].min()) if (~chosen).any() else 0.0
                if not gap <= self.tol * scale:  # NaN fails too
                    self.violations.append(
                        f"{where}: our top-{want} {ours} is not a top-k of HF's indexer scores: an entry "
                        f"left out scores {gap:.3g} above the lowest selected one (tol "
                        f"{self.tol * scale:.3g}); HF picked {hf_set}")
                if hf_set != ours:
                    self.tied.append((layer, pos))
                out[0, s, :want] = torch.tensor(ours, dtype=out.dtype)
        return out


@contextmanager
def hf_layer_trace(hf_model):
    """Yields {layer: [chunk [S, m, D]]}: every HF decoder layer's output, batch row 0."""
    outs: dict[int, list[torch.Tensor]] = {}
    handles = [layer.register_forward_hook(
        lambda mod, args, out, i=i: outs.setdefault(i, []).append(out[0].detach().clone()))
        for i, layer in enumerate(hf_model.model.layers)]
    try:
        yield outs
    finally:
        for h in handles:
            h.remove()


def first_divergence(ours: dict[int, torch.Tensor], theirs: dict[int, list[torch.Tensor]],
                     layer_types: list[str], rtol: float) -> str:
    """Name the first layer (and position) whose output differs beyond rtol x its scale."""
    lines = []
    for i in sorted(ours):
        a, b = ours[i], torch.cat(theirs[i])
        if a.shape != b.shape:
            return f"layer {i}: shapes differ, ours {tuple(a.shape)} vs HF {tuple(b.shape)}"
        d = (a.double() - b.double()).abs().flatten(1).max(-1).values
        worst = int(d.argmax())
        lines.append(f"layer {i} ({layer_types[i]}): max |diff| {float(d.max()):.3g} at token {worst}, "
                     f"scale {float(b.abs().max()):.3g}")
        if float(d.max()) > rtol * float(b.abs().max()):
            bad = (d > rtol * float(b.abs().max())).nonzero().flatten().tolist()
            lines.append(f"  -> first divergent layer; tokens {bad[:12]}{' ...' if len(bad) > 12 else ''}")
            break
    return "\n".join(lines)
