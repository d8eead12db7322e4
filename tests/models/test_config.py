"""ModelConfig parsing: the Flash and Flash-0731 layouts, and malformed configs.

Every malformed case must raise ConfigError naming the offending field (`.field`), never a bare
KeyError / TypeError / ValueError from deep inside the parser.
"""
import copy
import json

import pytest

from dspark_compile.models.config import ConfigError, ModelConfig, RopeSpec
from dspark_compile.factory.presets import preset
from dspark_compile.models.schema import checkpoint_schema


def flash_base() -> dict:
    """deepseek-ai/DeepSeek-V4-Flash config.json (docs/model.md, "Configuration"): target only,
    44 compress_ratios (the last one is the nextn-MTP slot), no dspark_* fields."""
    raw = preset("flash-0731")
    for k in [k for k in raw if k.startswith("dspark_")]:
        del raw[k]
    raw["compress_ratios"] = [0, 0] + [4, 128] * 20 + [4] + [0]
    return raw


def parse(raw: dict) -> ModelConfig:
    return ModelConfig.from_dict(raw)


def expect_error(raw: dict, field: str) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        parse(raw)
    assert ei.value.field == field, f"expected field {field!r}, got {ei.value.field!r}: {ei.value}"
    assert field in str(ei.value)
    return ei.value


# ---- good layouts ----------------------------------------------------------------------------

def test_flash_base_layout():
    cfg = parse(flash_base())
    assert not cfg.has_draft and cfg.dspark_block_size == 0 and cfg.n_mtp_layers == 0
    assert cfg.num_hidden_layers == 43 and len(cfg.compress_ratios) == 43  # 44 -> 43
    assert cfg.compress_ratios[:4] == (0, 0, 4, 128) and cfg.compress_ratios[-1] == 4
    assert cfg.rope_main == RopeSpec(theta=10000.0)
    assert cfg.rope_compress == RopeSpec(theta=160000.0, factor=16.0,
                                         original_max_position_embeddings=65536,
                                         beta_fast=32.0, beta_slow=1.0)
    assert cfg.fp8_block == (128, 128) and cfg.expert_dtype == "fp4"
    assert (cfg.nope_dim, cfg.hc_mix) == (448, 24)
    assert not any(n.startswith("mtp.") for n in checkpoint_schema(cfg))


def test_flash_0731_layout():
    cfg = parse(preset("flash-0731"))
    assert len(cfg.compress_ratios) == 43                      # 46 entries, draft tail dropped
    assert cfg.compress_ratios == tuple([0, 0] + [4, 128] * 20 + [4])
    assert cfg.has_draft
    assert (cfg.dspark_block_size, cfg.dspark_target_layer_ids, cfg.dspark_markov_rank,
            cfg.dspark_noise_token_id, cfg.n_mtp_layers) == (5, (40, 41, 42), 256, 128799, 3)
    assert (cfg.num_hash_layers, cfg.routed_scaling_factor, cfg.swiglu_limit) == (3, 1.5, 10.0)
    assert cfg.bos_token_id == 0 and cfg.eos_token_id == 1


def test_nested_rope_parameters_equal_flat():
    flat = preset("flash-0731")
    nested = copy.deepcopy(flat)
    for k in ("rope_theta", "compress_rope_theta", "rope_scaling"):
        del nested[k]
    nested["rope_parameters"] = {
        "main": {"rope_theta": 10000, "rope_type": "default"},
        "compress": {"rope_theta": 160000, "rope_type": "yarn", "factor": 16,
                     "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    }
    a, b = parse(flat), parse(nested)
    assert (a.rope_main, a.rope_compress) == (b.rope_main, b.rope_compress)
    assert a.fingerprint() == b.fingerprint()


def test_flat_rope_parameters_hf_normalised():
    raw = preset("flash-0731")
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = {**scaling, "rope_type": "yarn"}
    del scaling["type"]
    assert parse(raw).rope_compress.factor == 16.0


def test_no_yarn_means_plain_rope():
    raw = preset("flash-0731")
    raw["rope_scaling"] = None
    assert parse(raw).rope_compress == RopeSpec(theta=160000.0)


def test_expert_dtype_from_quantization_config_only():
    raw = preset("flash-0731")
    del raw["expert_dtype"]
    raw["quantization_config"]["expert_dtype"] = "fp4"
    assert parse(raw).expert_dtype == "fp4"
    raw["expert_dtype"] = "fp4"  # both, agreeing
    assert parse(raw).expert_dtype == "fp4"


def test_weight_block_size_drives_scale_shapes():
    raw = preset("tiny")
    raw["quantization_config"]["weight_block_size"] = [64, 128]
    cfg = parse(raw)
    assert cfg.fp8_block == (64, 128)
    spec = checkpoint_schema(cfg)["layers.0.attn.wq_b.scale"]  # weight [H*d=512, q_lora=128]
    assert spec.shape == (8, 1)


def test_eos_list_and_fingerprint():
    raw = preset("tiny")
    raw["eos_token_id"] = [7, 1]
    cfg = parse(raw)
    assert cfg.eos_token_id == 7
    assert cfg.fingerprint() == parse(copy.deepcopy(raw)).fingerprint()
    raw["sliding_window"] = 9
    assert parse(raw).fingerprint() != cfg.fingerprint()


def test_presets_parse():
    for name in ("tiny", "flash-slice", "flash-0731"):
        cfg = parse(preset(name))
        assert len(cfg.compress_ratios) == cfg.num_hidden_layers
    tiny = parse(preset("tiny"))
    assert tiny.compress_ratios == (0, 0, 4, 128, 4, 128) and tiny.num_hash_layers == 3
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")


def test_from_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(preset("tiny")))
    assert ModelConfig.from_file(p) == parse(preset("tiny"))


# ---- malformed -------------------------------------------------------------------------------

def _mut(fn):
    raw = preset("flash-0731")
    fn(raw)
    return raw


MALFORMED = [
    # (id, mutation, field)
    ("missing hidden_size", lambda r: r.pop("hidden_size"), "hidden_size"),
    ("missing vocab_size", lambda r: r.pop("vocab_size"), "vocab_size"),
    ("missing compress_ratios", lambda r: r.pop("compress_ratios"), "compress_ratios"),
    ("missing compress_rope_theta", lambda r: r.pop("compress_rope_theta"), "compress_rope_theta"),
    ("hidden_size string", lambda r: r.update(hidden_size="4096"), "hidden_size"),
    ("heads float", lambda r: r.update(num_attention_heads=64.0), "num_attention_heads"),
    ("layers bool", lambda r: r.update(num_hidden_layers=True), "num_hidden_layers"),
    ("hc_eps string", lambda r: r.update(hc_eps="1e-6"), "hc_eps"),
    ("rms eps nan", lambda r: r.update(rms_norm_eps=float("nan")), "rms_norm_eps"),
    ("scoring softmax", lambda r: r.update(scoring_func="softmax"), "scoring_func"),
    ("topk_method", lambda r: r.update(topk_method="greedy"), "topk_method"),
    ("hidden_act gelu", lambda r: r.update(hidden_act="gelu"), "hidden_act"),
    ("kv heads 8", lambda r: r.update(num_key_value_heads=8), "num_key_value_heads"),
    ("o_groups 7", lambda r: r.update(o_groups=7), "o_groups"),
    ("ratios too short", lambda r: r.update(compress_ratios=[0] * 42), "compress_ratios"),
    ("ratios not list", lambda r: r.update(compress_ratios="0,4"), "compress_ratios"),
    ("ratio 2", lambda r: r["compress_ratios"].__setitem__(5, 2), "compress_ratios"),
    ("ratio 3", lambda r: r["compress_ratios"].__setitem__(5, 3), "compress_ratios"),
    ("ratio negative", lambda r: r["compress_ratios"].__setitem__(5, -4), "compress_ratios"),
    ("target layer 43", lambda r: r.update(dspark_target_layer_ids=[40, 41, 43]),
     "dspark_target_layer_ids"),
    ("target layer -1", lambda r: r.update(dspark_target_layer_ids=[-1]), "dspark_target_layer_ids"),
    ("target layers empty", lambda r: r.update(dspark_target_layer_ids=[]), "dspark_target_layer_ids"),
    ("target layer bool", lambda r: r.update(dspark_target_layer_ids=[True]),
     "dspark_target_layer_ids"),
    ("noise id == vocab", lambda r: r.update(dspark_noise_token_id=129280), "dspark_noise_token_id"),
    ("markov rank 0", lambda r: r.update(dspark_markov_rank=0), "dspark_markov_rank"),
    ("draft fields without block", lambda r: r.pop("dspark_block_size"), "dspark_block_size"),
    ("expert_dtype contradicts qc", lambda r: r["quantization_config"].update(expert_dtype="fp8"),
     "expert_dtype"),
    ("expert_dtype fp8", lambda r: r.update(expert_dtype="fp8"), "expert_dtype"),
    ("qc missing", lambda r: r.pop("quantization_config"), "quantization_config"),
    ("qc not object", lambda r: r.update(quantization_config="fp8"), "quantization_config"),
    ("qc fmt e5m2", lambda r: r["quantization_config"].update(fmt="e5m2"),
     "quantization_config.fmt"),
    ("qc scale_fmt", lambda r: r["quantization_config"].update(scale_fmt="float32"),
     "quantization_config.scale_fmt"),
    ("qc method", lambda r: r["quantization_config"].update(quant_method="awq"),
     "quantization_config.quant_method"),
    ("qc static", lambda r: r["quantization_config"].update(activation_scheme="static"),
     "quantization_config.activation_scheme"),
    ("qc block 1-d", lambda r: r["quantization_config"].update(weight_block_size=[128]),
     "quantization_config.weight_block_size"),
    ("qc block zero", lambda r: r["quantization_config"].update(weight_block_size=[128, 0]),
     "quantization_config.weight_block_size"),
    ("yarn no factor", lambda r: r["rope_scaling"].pop("factor"), "rope_scaling.factor"),
    ("yarn factor string", lambda r: r["rope_scaling"].update(factor="16"), "rope_scaling.factor"),
    ("yarn factor null", lambda r: r["rope_scaling"].update(factor=None), "rope_scaling.factor"),
    ("yarn factor negative", lambda r: r["rope_scaling"].update(factor=-16), "rope_scaling.factor"),
    ("yarn no original max", lambda r: r["rope_scaling"].pop("original_max_position_embeddings"),
     "rope_scaling.original_max_position_embeddings"),
    ("yarn original max float", lambda r: r["rope_scaling"].update(
        original_max_position_embeddings=65536.5), "rope_scaling.original_max_position_embeddings"),
    ("yarn beta string", lambda r: r["rope_scaling"].update(beta_fast="32"), "rope_scaling.beta_fast"),
    ("yarn mscale", lambda r: r["rope_scaling"].update(mscale=0.707), "rope_scaling.mscale"),
    ("rope type linear", lambda r: r["rope_scaling"].update(type="linear"), "rope_scaling"),
    ("rope_scaling list", lambda r: r.update(rope_scaling=[16]), "rope_scaling"),
    ("rope_theta string", lambda r: r.update(rope_theta="10000"), "rope_theta"),
    ("compress theta zero", lambda r: r.update(compress_rope_theta=0), "compress_rope_theta"),
    ("nested only main", lambda r: r.update(rope_parameters={"main": {"rope_theta": 1e4}}),
     "rope_parameters"),
    ("nested main not object", lambda r: r.update(rope_parameters={"main": 5, "compress": {}}),
     "rope_parameters.main"),
    ("nested main yarn", lambda r: r.update(rope_parameters={
        "main": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4,
                 "original_max_position_embeddings": 64},
        "compress": {"rope_theta": 1.6e5}}), "rope_parameters.main"),
    ("nested compress no theta", lambda r: r.update(rope_parameters={
        "main": {"rope_theta": 1e4}, "compress": {"rope_type": "default"}}),
     "rope_parameters.compress.rope_theta"),
    ("model_type v41", lambda r: r.update(model_type="deepseek_v41"), "model_type"),
    ("grouped routing", lambda r: r.update(n_group=8), "n_group"),
    ("tied embeddings", lambda r: r.update(tie_word_embeddings=True), "tie_word_embeddings"),
    ("two shared experts", lambda r: r.update(n_shared_experts=2), "n_shared_experts"),
    ("topk > experts", lambda r: r.update(num_experts_per_tok=300), "num_experts_per_tok"),
    ("hash layers > layers", lambda r: r.update(num_hash_layers=44), "num_hash_layers"),
    ("rope dim odd", lambda r: r.update(qk_rope_head_dim=63), "qk_rope_head_dim"),
    ("index dim < rope", lambda r: r.update(index_head_dim=32), "index_head_dim"),
    ("moe size not /32", lambda r: r.update(moe_intermediate_size=2040), "moe_intermediate_size"),
    ("hidden not /32", lambda r: r.update(hidden_size=4080), "hidden_size"),
    ("eos >= vocab", lambda r: r.update(eos_token_id=129280), "eos_token_id"),
    ("bos string", lambda r: r.update(bos_token_id="0"), "bos_token_id"),
]


@pytest.mark.parametrize("mutate,field", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_names_field(mutate, field):
    expect_error(_mut(mutate), field)


def test_invalid_json_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"vocab_size": 512,')
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_file(p)
    assert ei.value.field == "config.json" and "not valid JSON" in str(ei.value)


def test_config_that_is_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b'{"model_type": "deepseek_v4", "note": "\xff\xfe"}')
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_file(p)
    assert ei.value.field == "config.json"
    assert f"{p} is not UTF-8 text (byte 39: invalid start byte)" in str(ei.value)


def test_config_not_an_object(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("[1, 2, 3]")
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_file(p)
    assert ei.value.field == "config.json" and "object" in str(ei.value)


def test_config_file_missing(tmp_path):
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_file(tmp_path / "config.json")
    assert ei.value.field == "config.json" and "not found" in str(ei.value)
