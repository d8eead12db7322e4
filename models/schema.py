"""The checkpoint contract: every tensor name, shape and dtype a DeepSeek-native checkpoint holds.

Names are DeepSeek's own (docs/model.md, "Checkpoint layout"): no
`model.` prefix, FP8 weights as `<linear>.weight` (float8_e4m3fn) + `<linear>.scale`
(float8_e8m0fnu, one per 128x128 block), MXFP4 experts as `ffn.experts.E.w{1,2,3}.weight`
(int8 bytes, two e2m1 per byte) + `.scale` (e8m0 per 32), the draft under `mtp.{0,1,2}.*`.

The loader checks a checkpoint against this table (missing / unexpected / shape / dtype), the
synthetic writer generates exactly this table, and the models read tensors by these names.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_compile.models.config import ModelConfig

BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64
F8, E8M0, I8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "plain"  # plain | fp8_weight | fp8_scale | mxfp4_weight | mxfp4_scale | tid2eid
    optional: bool = False  # may be absent from a checkpoint (loaded when present)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8_linear(out: dict, name: str, rows: int, cols: int, cfg: ModelConfig) -> None:
    br, bc = cfg.fp8_block
    out[f"{name}.weight"] = TensorSpec((rows, cols), F8, "fp8_weight")
    out[f"{name}.scale"] = TensorSpec((_cdiv(rows, br), _cdiv(cols, bc)), E8M0, "fp8_scale")


def _bf16(out: dict, name: str, *shape: int) -> None:
    out[name] = TensorSpec(tuple(shape), BF16)


def _f32(out: dict, name: str, *shape: int) -> None:
    out[name] = TensorSpec(tuple(shape), F32)


def _mhc(out: dict, p: str, cfg: ModelConfig) -> None:
    hc_dim = cfg.hc_mult * cfg.hidden_size
    for site in ("attn", "ffn"):
        _f32(out, f"{p}hc_{site}_fn", cfg.hc_mix, hc_dim)
        _f32(out, f"{p}hc_{site}_base", cfg.hc_mix)
        _f32(out, f"{p}hc_{site}_scale", 3)


def _compressor(out: dict, p: str, ratio: int, d_c: int, cfg: ModelConfig) -> None:
    coff = 2 if ratio == 4 else 1
    _f32(out, f"{p}ape", ratio, coff * d_c)
    _bf16(out, f"{p}norm.weight", d_c)
    _bf16(out, f"{p}wkv.weight", coff * d_c, cfg.hidden_size)
    _bf16(out, f"{p}wgate.weight", coff * d_c, cfg.hidden_size)


def _attention(out: dict, p: str, ratio: int, cfg: ModelConfig) -> None:
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    _f32(out, f"{p}attn_sink", H)
    _bf16(out, f"{p}q_norm.weight", cfg.q_lora_rank)
    _bf16(out, f"{p}kv_norm.weight", d)
    _fp8_linear(out, f"{p}wq_a", cfg.q_lora_rank, D, cfg)
    _fp8_linear(out, f"{p}wq_b", H * d, cfg.q_lora_rank, cfg)
    _fp8_linear(out, f"{p}wkv", d, D, cfg)
    _fp8_linear(out, f"{p}wo_a", cfg.o_groups * cfg.o_lora_rank, (H // cfg.o_groups) * d, cfg)
    _fp8_linear(out, f"{p}wo_b", D, cfg.o_groups * cfg.o_lora_rank, cfg)
    if ratio:
        _compressor(out, f"{p}compressor.", ratio, d, cfg)
    if ratio == 4:
        _fp8_linear(out, f"{p}indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim,
                    cfg.q_lora_rank, cfg)
        _bf16(out, f"{p}indexer.weights_proj.weight", cfg.index_n_heads, D)
        _compressor(out, f"{p}indexer.compressor.", ratio, cfg.index_head_dim, cfg)


def _moe(out: dict, p: str, hash_layer: bool, cfg: ModelConfig) -> None:
    D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    _bf16(out, f"{p}gate.weight", E, D)
    if hash_layer:
        out[f"{p}gate.tid2eid"] = TensorSpec((cfg.vocab_size, cfg.num_experts_per_tok), I64, "tid2eid")
    else:
        _f32(out, f"{p}gate.bias", E)
    _fp8_linear(out, f"{p}shared_experts.w1", I, D, cfg)
    _fp8_linear(out, f"{p}shared_experts.w3", I, D, cfg)
    _fp8_linear(out, f"{p}shared_experts.w2", D, I, cfg)
    for e in range(E):
        for w, (rows, cols) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            out[f"{p}experts.{e}.{w}.weight"] = TensorSpec((rows, cols // 2), I8, "mxfp4_weight")
            out[f"{p}experts.{e}.{w}.scale"] = TensorSpec((rows, cols // 32), E8M0, "mxfp4_scale")


def _block(out: dict, p: str, ratio: int, hash_layer: bool, cfg: ModelConfig) -> None:
    _bf16(out, f"{p}attn_norm.weight", cfg.hidden_size)
    _bf16(out, f"{p}ffn_norm.weight", cfg.hidden_size)
    _mhc(out, p, cfg)
    _attention(out, f"{p}attn.", ratio, cfg)
    _moe(out, f"{p}ffn.", hash_layer, cfg)


def _head(out: dict, p: str, cfg: ModelConfig) -> None:
    _bf16(out, f"{p}norm.weight", cfg.hidden_size)
    _f32(out, f"{p}hc_head_fn", cfg.hc_mult, cfg.hc_mult * cfg.hidden_size)
    _f32(out, f"{p}hc_head_base", cfg.hc_mult)
    _f32(out, f"{p}hc_head_scale", 1)


def target_schema(cfg: ModelConfig) -> dict[str, TensorSpec]:
    out: dict[str, TensorSpec] = {}
    _bf16(out, "embed.weight", cfg.vocab_size, cfg.hidden_size)
    _bf16(out, "head.weight", cfg.vocab_size, cfg.hidden_size)
    _head(out, "", cfg)
    for i in range(cfg.num_hidden_layers):
        _block(out, f"layers.{i}.", cfg.compress_ratios[i], i < cfg.num_hash_layers, cfg)
    return out


def draft_schema(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """The DSpark draft (`mtp.{i}.*`); empty for a target-only config."""
    out: dict[str, TensorSpec] = {}
    if not cfg.has_draft:
        return out
    D = cfg.hidden_size
    for i in range(cfg.n_mtp_layers):
        _block(out, f"mtp.{i}.", 0, False, cfg)  # draft layers: SWA only, never hash-routed
    _fp8_linear(out, "mtp.0.main_proj", D, len(cfg.dspark_target_layer_ids) * D, cfg)
    _bf16(out, "mtp.0.main_norm.weight", D)
    last = f"mtp.{cfg.n_mtp_layers - 1}."
    _head(out, last, cfg)
    _bf16(out, f"{last}markov_head.markov_w1.weight", cfg.vocab_size, cfg.dspark_markov_rank)
    _bf16(out, f"{last}markov_head.markov_w2.weight", cfg.vocab_size, cfg.dspark_markov_rank)
    # Optional: bf16 [1, D + r] in the published DSpark checkpoint (its index total_size matches
    # this schema to the byte only with it); used for adaptive verification, not by the step.
    out[f"{last}confidence_head.proj.weight"] = TensorSpec((1, D + cfg.dspark_markov_rank), BF16,
                                                           optional=True)
    return out


def checkpoint_schema(cfg: ModelConfig) -> dict[str, TensorSpec]:
    return {**target_schema(cfg), **draft_schema(cfg)}
