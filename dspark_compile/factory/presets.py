"""Built-in configs for synthetic checkpoints: `tiny` (CPU tests), `tiny-trained` (the tiny shapes,
trained: dspark_compile/factory/train.py; the demo model), `tiny-deep` (the tiny widths at
Flash-0731's depth) and `flash-slice`.

All are written in the real `config.json` layout of DeepSeek-V4-Flash-0731 (compress_ratios
with the draft's trailing zeros, flat YaRN rope_scaling, dspark_* fields, quantization_config).
"""
from __future__ import annotations

import copy

_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
          "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

FLASH_0731 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0, 0, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 3,
    "swiglu_limit": 10.0, "hidden_act": "silu", "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "expert_dtype": "fp4", "quantization_config": _QUANT,
    "torch_dtype": "bfloat16", "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
    "dspark_block_size": 5, "dspark_target_layer_ids": [40, 41, 42], "dspark_markov_rank": 256,
    "dspark_noise_token_id": 128799,
}

# Every layer type at toy size (docs/model.md, "Presets"): SWA-only with hash routing,
# C4 (overlap + indexer) with hash routing, C128, and bias-routed C4/C128.
TINY = {
    **copy.deepcopy(FLASH_0731),
    "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 6,
    "num_attention_heads": 4, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128,
    "o_lora_rank": 64, "o_groups": 2, "sliding_window": 8,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 0, 0, 0],
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 4096, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 4,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "dspark_target_layer_ids": [3, 4, 5], "dspark_markov_rank": 16,
    "dspark_noise_token_id": 500, "eos_token_id": 1,
}

# The tiny shapes with the tokenizer's special tokens: <|bos|> 0, <|eos|> 1, <|noise|> 2 (the
# draft's mask token is then a token no text encodes to; dspark_compile/factory/tokenizer.py).
TINY_TRAINED = {**copy.deepcopy(TINY), "dspark_noise_token_id": 2}

# Real Flash dimensions, one layer of each type (SWA hash-routed, C4, C128), full 3-layer draft.
FLASH_SLICE = {
    **copy.deepcopy(FLASH_0731),
    "num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0, 0, 0], "num_hash_layers": 1,
    "dspark_target_layer_ids": [0, 1, 2],
}

# The tiny widths at Flash-0731's depth, so the cost of depth (build, load, step) is measured on
# any machine without 150 GB of weights: its 43 target layers with their layer types (2 SWA-only,
# then C4 / C128 alternating, 21 C4 and 20 C128), its 3 hash-routed layers, and the 3-layer
# draft reading layers 40-42 (docs/model.md, "Presets").
TINY_DEEP = {
    **copy.deepcopy(TINY),
    **{k: copy.deepcopy(FLASH_0731[k]) for k in ("num_hidden_layers", "compress_ratios",
                                                 "num_hash_layers", "dspark_target_layer_ids")},
}

PRESETS = {"tiny": TINY, "tiny-trained": TINY_TRAINED, "tiny-deep": TINY_DEEP,
           "flash-slice": FLASH_SLICE, "flash-0731": FLASH_0731}


def preset(name: str) -> dict:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])
