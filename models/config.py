"""DeepSeek-V4 (+ DSpark draft) configuration parsed from a Hugging Face `config.json`.

Field names are the checkpoint's own (docs/model.md, "Configuration"). `ModelConfig.from_dict`
accepts the Flash and Flash-0731 layouts: `compress_ratios` longer than `num_hidden_layers`
(the tail belongs to the MTP/DSpark layers) is truncated; RoPE may be flat
(`rope_theta`, `compress_rope_theta`, `rope_scaling`) or nested
(`rope_parameters: {"main": {...}, "compress": {...}}`). A value we do not support, or two
values that contradict each other, raise :class:`ConfigError` naming the field.

`Precision` is separate: it is how *we* run the model (compute dtype, which quantization points
are simulated), not a property of the checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


class ConfigError(ValueError):
    """A config.json value is missing, unsupported or contradicts another one."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"config field '{field_name}': {message}")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    # YaRN parameters; factor == 1 means plain RoPE.
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    rope_main: RopeSpec
    rope_compress: RopeSpec
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_hash_layers: int
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    expert_dtype: str  # "fp4" (MXFP4)
    fp8_block: tuple[int, int]  # weight_block_size of quantization_config
    # DSpark draft (absent in a target-only config: dspark_block_size == 0).
    dspark_block_size: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_noise_token_id: int = 0
    n_mtp_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1

    # ---- derived -------------------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def has_draft(self) -> bool:
        return self.dspark_block_size > 0

    @property
    def hc_mix(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def layer_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def to_json_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> str:
        """sha256 of the parsed config: what the engine manifest records as the model identity."""
        blob = json.dumps(self.to_json_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("config.json", f"file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError("config.json", f"{path} is not valid JSON ({e})") from None
        except UnicodeDecodeError as e:
            raise ConfigError("config.json", f"{path} is not UTF-8 text (byte {e.start}: "
                              f"{e.reason})") from None
        except IsADirectoryError:
            raise ConfigError("config.json", f"{path} is a directory, not a file") from None
        if not isinstance(raw, dict):
            raise ConfigError("config.json", f"{path} must hold a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """The config of a config.json object; the first unsupported or contradictory value
        raises ConfigError naming its field. The steps run in this order, so a config with
        several problems reports the first of them here."""
        r = _Reader(raw)
        _check_model_type(raw)
        L = r.int("num_hidden_layers", min_value=1)
        ratios = _compress_ratios(r, L)
        attention = _attention_fields(r)
        routing = _routing_fields(r, raw, L)
        expert_dtype, fp8_block = _quant_fields(raw)
        rope_main, rope_compress = _parse_rope(raw)
        vocab = r.int("vocab_size", min_value=2)
        draft = _draft_fields(r, raw, L, vocab)
        bos, eos = _special_tokens(raw, vocab)
        cfg = cls(
            vocab_size=vocab,
            hidden_size=r.int("hidden_size", min_value=1),
            num_hidden_layers=L,
            **attention,
            q_lora_rank=r.int("q_lora_rank", min_value=1),
            o_lora_rank=r.int("o_lora_rank", min_value=1),
            sliding_window=r.int("sliding_window", min_value=1),
            compress_ratios=ratios,
            rope_main=rope_main,
            rope_compress=rope_compress,
            max_position_embeddings=r.int("max_position_embeddings", min_value=1),
            index_n_heads=r.int("index_n_heads", min_value=1),
            index_topk=r.int("index_topk", min_value=1),
            **routing,
            moe_intermediate_size=r.int("moe_intermediate_size", min_value=1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=r.float("routed_scaling_factor", default=1.0),
            swiglu_limit=r.float("swiglu_limit", default=0.0),
            hc_mult=r.int("hc_mult", min_value=1),
            hc_sinkhorn_iters=r.int("hc_sinkhorn_iters", min_value=1),
            hc_eps=r.float("hc_eps"),
            rms_norm_eps=r.float("rms_norm_eps"),
            expert_dtype=expert_dtype,
            fp8_block=fp8_block,
            bos_token_id=bos,
            eos_token_id=eos,
            **draft,
        )
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(cfg, name) % 32:
                raise ConfigError(name, "MXFP4 experts need hidden_size and moe_intermediate_size "
                                  f"to be multiples of 32, got {getattr(cfg, name)}")
        return cfg


# ---- the steps of ModelConfig.from_dict, in its order ------------------------------------------

def _check_model_type(raw: dict) -> None:
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError("model_type", f"expected 'deepseek_v4', got {model_type!r} "
                          "(DeepSeek-V4.1 'deepseek_v41' is a different architecture)")


def _compress_ratios(r: _Reader, L: int) -> tuple[int, ...]:
    """The target layers' ratios: 0 (SWA only) or >= 4; the tail past num_hidden_layers belongs
    to the MTP / DSpark layers and is dropped."""
    ratios = r.get("compress_ratios")
    if not isinstance(ratios, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                               for x in ratios):
        raise ConfigError("compress_ratios", "must be a list of integers")
    if len(ratios) < L:
        raise ConfigError("compress_ratios", f"has {len(ratios)} entries, fewer than "
                          f"num_hidden_layers={L}")
    ratios = tuple(ratios[:L])
    for i, x in enumerate(ratios):
        if x != 0 and x < 4:
            raise ConfigError("compress_ratios", f"entry {i} = {x}; expected 0 (SWA only) or a "
                              "ratio >= 4")
    return ratios


def _attention_fields(r: _Reader) -> dict:
    """Heads and head dimensions, checked against each other (MQA: one latent KV head)."""
    H = r.int("num_attention_heads", min_value=1)
    if r.int("num_key_value_heads", default=1) != 1:
        raise ConfigError("num_key_value_heads", "DeepSeek-V4 attention is MQA with one latent "
                          "KV head; only 1 is supported")
    head_dim = r.int("head_dim", min_value=2)
    rope_dim = r.int("qk_rope_head_dim", default=64, min_value=2)
    if rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError("qk_rope_head_dim", f"{rope_dim} must be even and <= head_dim={head_dim}")
    o_groups = r.int("o_groups", min_value=1)
    if H % o_groups:
        raise ConfigError("o_groups", f"{o_groups} does not divide num_attention_heads={H}")
    idx_dim = r.int("index_head_dim", min_value=2)
    if idx_dim < rope_dim:
        raise ConfigError("index_head_dim", f"{idx_dim} < qk_rope_head_dim={rope_dim}")
    return dict(num_attention_heads=H, head_dim=head_dim, qk_rope_head_dim=rope_dim,
                o_groups=o_groups, index_head_dim=idx_dim)


def _routing_fields(r: _Reader, raw: dict, L: int) -> dict:
    """Experts per token and hash-routed layers; what DeepSeek-V4 does not use is refused
    (grouped routing, several shared experts, other scoring, tied embeddings, attention bias)."""
    E = r.int("n_routed_experts", min_value=1)
    k = r.int("num_experts_per_tok", min_value=1)
    if k > E:
        raise ConfigError("num_experts_per_tok", f"{k} > n_routed_experts={E}")
    if r.int("n_shared_experts", default=1) != 1:
        raise ConfigError("n_shared_experts", "only one shared expert is supported")
    for name, want in (("scoring_func", "sqrtsoftplus"), ("topk_method", "noaux_tc"),
                       ("hidden_act", "silu")):
        v = raw.get(name, want)
        if v != want:
            raise ConfigError(name, f"unsupported value {v!r} (DeepSeek-V4 uses {want!r})")
    for name in ("n_group", "topk_group"):
        if raw.get(name) not in (None, 1):
            raise ConfigError(name, "grouped routing is not part of DeepSeek-V4")
    if raw.get("tie_word_embeddings", False):
        raise ConfigError("tie_word_embeddings", "DeepSeek-V4 keeps embed and head separate")
    if raw.get("attention_bias", False):
        raise ConfigError("attention_bias", "DeepSeek-V4 attention has no bias")
    num_hash = r.int("num_hash_layers", default=0, min_value=0)
    if num_hash > L:
        raise ConfigError("num_hash_layers", f"{num_hash} > num_hidden_layers={L}")
    return dict(n_routed_experts=E, num_experts_per_tok=k, num_hash_layers=num_hash)


def _quant_fields(raw: dict) -> tuple[str, tuple[int, int]]:
    """The routed experts' dtype (MXFP4 only; top level and quantization_config must agree)
    and the FP8 weight block of the other linears."""
    expert_dtype = raw.get("expert_dtype", "fp4")
    qc = raw.get("quantization_config")
    if isinstance(qc, dict) and "expert_dtype" in qc:
        if expert_dtype != qc["expert_dtype"] and "expert_dtype" in raw:
            raise ConfigError("expert_dtype", f"{expert_dtype!r} contradicts "
                              f"quantization_config.expert_dtype={qc['expert_dtype']!r}")
        expert_dtype = qc["expert_dtype"]
    if expert_dtype != "fp4":
        raise ConfigError("expert_dtype", f"unsupported {expert_dtype!r}; routed experts are "
                          "read as MXFP4 ('fp4')")
    return expert_dtype, _parse_quant(qc)


def _draft_fields(r: _Reader, raw: dict, L: int, vocab: int) -> dict:
    """The DSpark draft's fields (none when dspark_block_size is 0 or absent: a target-only
    config, which then must not carry the draft's other fields)."""
    block = r.int("dspark_block_size", default=0, min_value=0)
    if not block:
        for name in ("dspark_target_layer_ids", "dspark_markov_rank"):
            if name in raw:
                raise ConfigError("dspark_block_size", f"missing or 0 while {name} is set")
        return {}
    ids = raw.get("dspark_target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError("dspark_target_layer_ids", "must be a non-empty list of layer ids")
    for i in ids:
        if not 0 <= i < L:
            raise ConfigError("dspark_target_layer_ids", f"layer {i} outside [0, {L})")
    noise = r.int("dspark_noise_token_id", min_value=0)
    if noise >= vocab:
        raise ConfigError("dspark_noise_token_id", f"{noise} >= vocab_size={vocab}")
    return dict(dspark_block_size=block, dspark_target_layer_ids=tuple(ids),
                dspark_markov_rank=r.int("dspark_markov_rank", min_value=1),
                dspark_noise_token_id=noise,
                n_mtp_layers=r.int("n_mtp_layers", default=3, min_value=1))


def _special_tokens(raw: dict, vocab: int) -> tuple[int, int]:
    """(bos, eos) token ids inside the vocabulary; a list of eos ids gives its first."""
    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        eos = eos[0] if eos else 1
    bos = raw.get("bos_token_id", 0) or 0
    for name, v in (("bos_token_id", bos), ("eos_token_id", eos)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab:
            raise ConfigError(name, f"expected a token id in [0, vocab_size={vocab}), got {v!r}")
    return int(bos), int(eos)


class _Reader:
    def __init__(self, raw: dict):
        self.raw = raw

    def get(self, name):
        if name not in self.raw:
            raise ConfigError(name, "missing")
        return self.raw[name]

    def int(self, name, default=None, min_value=None) -> int:
        v = self.raw.get(name, default)
        if v is None:
            raise ConfigError(name, "missing")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(name, f"expected an integer, got {v!r}")
        if min_value is not None and v < min_value:
            raise ConfigError(name, f"{v} < {min_value}")
        return v

    def float(self, name, default=None) -> float:
        v = self.raw.get(name, default)
        if v is None:
            raise ConfigError(name, "missing")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(name, f"expected a finite number, got {v!r}")
        return float(v)


def _parse_quant(qc) -> tuple[int, int]:
    if qc is None:
        raise ConfigError("quantization_config", "missing (non-expert linears are FP8 block-scaled)")
    if not isinstance(qc, dict):
        raise ConfigError("quantization_config", "must be an object")
    checks = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}
    for key, want in checks.items():
        v = qc.get(key, want)
        if v != want:
            raise ConfigError(f"quantization_config.{key}", f"unsupported {v!r}, expected {want!r}")
    blk = qc.get("weight_block_size", [128, 128])
    if (not isinstance(blk, list) or len(blk) != 2
            or not all(isinstance(b, int) and b > 0 for b in blk)):
        raise ConfigError("quantization_config.weight_block_size", f"expected [rows, cols], got {blk!r}")
    return (blk[0], blk[1])


def _yarn(d: dict, theta: float, field_name: str) -> RopeSpec:
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in ("default", None):
        return RopeSpec(theta=theta)
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(field_name, f"unsupported rope type {kind!r} (expected 'yarn' or 'default')")
    for key in ("mscale", "mscale_all_dim"):
        if d.get(key) not in (None, 0, 0.0):
            raise ConfigError(f"{field_name}.{key}", "YaRN magnitude scaling is not used by DeepSeek-V4")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in d:
            raise ConfigError(f"{field_name}.{key}", "missing for YaRN")
    orig = d["original_max_position_embeddings"]
    if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
        raise ConfigError(f"{field_name}.original_max_position_embeddings",
                          f"expected a positive integer, got {orig!r}")
    return RopeSpec(theta=theta, factor=_number(d["factor"], f"{field_name}.factor", positive=True),
                    original_max_position_embeddings=orig,
                    beta_fast=_number(d.get("beta_fast", 32), f"{field_name}.beta_fast"),
                    beta_slow=_number(d.get("beta_slow", 1), f"{field_name}.beta_slow"))


def _number(v, field_name: str, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(field_name, f"expected a finite number, got {v!r}")
    if positive and v <= 0:
        raise ConfigError(field_name, f"must be > 0, got {v!r}")
    return float(v)


def _parse_rope(raw: dict) -> tuple[RopeSpec, RopeSpec]:
    """Main (SWA-only layers: never YaRN) and compressed-layer RoPE (YaRN if configured)."""
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and ("main" in rp or "compress" in rp):
        if "main" not in rp or "compress" not in rp:
            raise ConfigError("rope_parameters", "nested form needs both 'main' and 'compress'")
        main, comp = rp["main"], rp["compress"]
        for key, part in (("main", main), ("compress", comp)):
            if not isinstance(part, dict):
                raise ConfigError(f"rope_parameters.{key}", "must be an object")
        if "rope_theta" not in main:
            raise ConfigError("rope_parameters.main.rope_theta", "missing")
        if "rope_theta" not in comp:
            raise ConfigError("rope_parameters.compress.rope_theta", "missing")
        main_spec = _yarn(main, _number(main["rope_theta"], "rope_parameters.main.rope_theta",
                                        positive=True), "rope_parameters.main")
        if main_spec.factor != 1.0:
            raise ConfigError("rope_parameters.main", "SWA-only layers never use YaRN")
        return main_spec, _yarn(comp, _number(comp["rope_theta"], "rope_parameters.compress.rope_theta",
                                              positive=True), "rope_parameters.compress")
    if rp is not None and not isinstance(rp, dict):
        raise ConfigError("rope_parameters", "must be an object")
    # Flat form. HF-normalised configs may carry the YaRN block as a flat `rope_parameters`.
    scaling = raw.get("rope_scaling") or (rp if rp else None)
    theta = raw.get("rope_theta", (rp or {}).get("rope_theta"))
    if theta is None:
        raise ConfigError("rope_theta", "missing")
    ctheta = raw.get("compress_rope_theta")
    if ctheta is None:
        raise ConfigError("compress_rope_theta", "missing")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError("rope_scaling", "must be an object or null")
    comp = _yarn(scaling or {}, _number(ctheta, "compress_rope_theta", positive=True), "rope_scaling")
    return RopeSpec(theta=_number(theta, "rope_theta", positive=True)), comp


@dataclass(frozen=True)
class Precision:
    """How the reference runs: compute dtype and which vLLM quantization points are simulated.

    - `dtype`: activations / residual stream dtype (bf16 in deployment; fp32/fp64 in exact tests).
    - `act_quant`: FP8 per-token 128-group quant of activations entering FP8 block-scaled GEMMs.
    - `kv_fp8`: SWA / compressed KV stored FP8 (fp8_ds_mla style); off = stored in `dtype`.
    """
    dtype: torch.dtype = torch.bfloat16
    act_quant: bool = True
    kv_fp8: bool = True

    @classmethod
    def exact(cls, dtype=torch.float64) -> "Precision":
        """No quantization simulation: what the HF comparison uses."""
        return cls(dtype=dtype, act_quant=False, kv_fp8=False)


def step_lookahead(block: int) -> int:
    """Positions past a request's prompt + max_new_tokens that its steps may touch.

    A request's last step starts before its budget is full and verifies the anchor plus `block`
    drafts (block + 1 positions) past its last committed token, writing their KV; the one more
    position is margin. Non-speculative decoding is block 0."""
    return block + 2


def request_positions(prompt_len: int, max_new_tokens: int, block: int) -> int:
    """Cache positions a request row needs (compare with CacheConfig.max_seq_len)."""
    return prompt_len + max_new_tokens + step_lookahead(block)


def rope_positions(max_seq_len: int, block: int) -> int:
    """RoPE table length for caches of `max_seq_len` positions: a step drafts `block` positions
    past the block it verified, so the tables reach one lookahead beyond the caches."""
    return max_seq_len + step_lookahead(block)


@dataclass(frozen=True)
class CacheConfig:
    """Per-row capacity of the decode state (fixed shapes: the step never reallocates)."""
    max_rows: int = 8           # concurrent request rows (the state has one extra trash row)
    max_seq_len: int = 512      # positions per request row (request_positions)
    max_step_tokens: int = 64   # tokens per row in one forward (prefill chunk; >= N + 1)
