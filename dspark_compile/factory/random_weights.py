"""The tensors of a synthetic DeepSeek-V4 (+ DSpark draft) checkpoint: every tensor of the schema,
random but well-conditioned, in the native formats (FP8 block-scaled, MXFP4 experts, I64 tid2eid).

Values are drawn per *unit* (a plain tensor, or an FP8 / MXFP4 weight with its scale) from a
generator seeded by `sha256(seed, unit name)`, so a tensor's value does not depend on which
other tensors are generated, on the order, or on sharding: `synth_tensors(cfg, seed)` and the
files `synth_checkpoint` writes hold the same bytes (on the same device type; CPU and CUDA
generators draw different numbers).

Scales (:class:`SynthScales`) aim at a model that neither explodes nor saturates, with varied
logits: linears keep unit variance (std 1/sqrt(fan_in)); output projections into the residual
are damped (`branch_gain`); norms are 1 + noise; mHC mixing logits are O(0.5) so sigmoids stay
in their linear range while the Sinkhorn combination is clearly non-uniform (a transposed C is
detectable).

Embed, head and the Markov tables form a low-rank synthetic "language" (`lm_structure`, see
`_structured`): the head reads a rank-r subspace in which the embedding of token x encodes a
bigram prediction, and the Markov head holds that same bigram table. The draft (which shares
embed and head) then agrees with the target whenever the context moves the target's
prediction little: on the tiny preset, greedy speculative decoding accepts roughly
[0.5-0.7, 0.15-0.4, 0.07-0.25, 0-0.15, 0-0.12] drafts per position (every accepted length
occurs), which is what lossless tests need. With independent random tables the draft almost
never agrees (about 4% at the first position, none after).

Generation streams per unit: `iter_synth_tensors` holds at most one unit's float source at a
time, so a Flash slice (~24 GB) can be built directly in GPU memory (`synth_tensors(...,
device="cuda")`) or written to disk (`synth_checkpoint`) without a second copy.

`synth.py` writes these tensors as a checkpoint; `train.py` starts its training from them.
"""
from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from dspark_compile.factory.presets import preset
from dspark_compile.models.config import ModelConfig
from dspark_compile.models.quant_formats import fp8_block_quant, mxfp4_quant
from dspark_compile.models.safetensors_writer import nbytes
from dspark_compile.models.schema import TensorSpec, checkpoint_schema


@dataclass(frozen=True)
class SynthScales:
    embed_std: float = 1.0
    logit_std: float = 3.0        # std of head logits for a unit-RMS final hidden
    branch_gain: float = 0.4      # wo_b and expert w2 (everything written into the residual)
    norm_noise: float = 0.05      # norm weights = 1 + norm_noise * N(0, 1)
    hc_logit_std: float = 0.5     # std of the mHC mixing logits mu (fn std = this / sqrt(hc*D))
    hc_base_std: float = 0.5      # pre / post / head biases
    hc_comb_base_std: float = 1.0  # Sinkhorn logits bias: makes C clearly non-uniform
    hc_scale_noise: float = 0.1   # hc_*_scale = 1 + noise
    sink_std: float = 1.0
    ape_std: float = 0.05
    gate_bias_std: float = 0.02
    markov_bias_std: float = 0.5  # lm_structure == 0: std of W2 . W1[x] (plain random tables)
    # Synthetic "language": embed and head share a rank-r subspace (r = dspark_markov_rank) so
    # that head . embed[x] is a low-rank bigram table; the Markov head is that same table
    # (times markov_gain), so draft and target agree when the context moves the target little.
    lm_structure: float = 0.6     # share of the embedding in the head's subspace (0 = off)
    markov_gain: float = 2.0      # Markov bias = markov_gain * the bigram logits


# ---- units: a plain tensor, or a quantized weight with its scale ---------------------------

@dataclass(frozen=True)
class Unit:
    base: str                 # seed key: the tensor name, or the linear's name for a pair
    names: tuple[str, ...]    # tensors it produces, in order
    kind: str                 # plain | fp8 | mxfp4 | tid2eid

    def nbytes(self, schema: dict[str, TensorSpec]) -> int:
        return sum(nbytes(schema[n].shape, schema[n].dtype) for n in self.names)


def weight_units(schema: dict[str, TensorSpec]) -> list[Unit]:
    units = []
    for name, spec in schema.items():
        if spec.kind in ("fp8_weight", "mxfp4_weight"):
            base = name[: -len(".weight")]
            scale = f"{base}.scale"
            if scale not in schema:
                raise ValueError(f"schema: quantized weight '{name}' has no '{scale}'")
            units.append(Unit(base, (name, scale), spec.kind.split("_")[0]))
        elif spec.kind in ("fp8_scale", "mxfp4_scale"):
            continue  # produced with its weight
        else:
            units.append(Unit(name, (name,), "tid2eid" if spec.kind == "tid2eid" else "plain"))
    return units


def _seed(seed: int, key: str) -> int:
    h = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class _Draw:
    """Normal / uniform draws from one unit's generator on `device`."""

    def __init__(self, seed: int, key: str, device: torch.device):
        self.device = device
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(_seed(seed, key))

    def normal(self, shape, std=1.0, mean=0.0, dtype=torch.float32) -> torch.Tensor:
        # Drawn directly in the stored dtype where that is bf16: no fp32 copy of a 1 GB embedding.
        x = torch.randn(tuple(shape), generator=self.gen, device=self.device, dtype=dtype)
        return x.mul_(std).add_(mean) if (std != 1.0 or mean != 0.0) else x

    def uniform(self, shape) -> torch.Tensor:
        return torch.rand(tuple(shape), generator=self.gen, device=self.device, dtype=torch.float32)


def _is_output_proj(base: str) -> bool:
    return base.endswith(("attn.wo_b", "shared_experts.w2")) or (".experts." in base
                                                                 and base.endswith(".w2"))


def _lm_rank(cfg: ModelConfig) -> int:
    return min(cfg.dspark_markov_rank or 64, cfg.hidden_size)


def _latent(seed: int, key: str, rows: int, cfg: ModelConfig, device) -> torch.Tensor:
    """A factor of the synthetic language, drawn from its own seed: U / W [rows, r], or the
    shared subspace Q [r, D] (orthonormal rows)."""
    r = _lm_rank(cfg)
    d = _Draw(seed, f"latent/{key}", device)
    if key == "Q":
        q, _ = torch.linalg.qr(d.normal((cfg.hidden_size, r)))
        return q.T.contiguous()
    x = d.normal((rows, r))
    if key == "U" and cfg.has_draft:
        # The noise (mask) token says nothing about the next token: no bigram row. Draft
        # positions after the anchor then predict from context and the Markov head alone.
        x[cfg.dspark_noise_token_id] = 0
    return x


def _structured(name: str, spec: TensorSpec, d: _Draw, cfg: ModelConfig, sc: SynthScales,
                seed: int) -> torch.Tensor:
    """embed / head / Markov tables of the low-rank synthetic language (lm_structure > 0).

    With U, W [V, r] Gaussian and Q [r, D] orthonormal rows (r = dspark_markov_rank):

        embed = s sqrt(D/r) U Q + sqrt(1 - s^2) Z_perp   (unit per-element variance; Z_perp
                                                          is Gaussian with its Q part removed)
        head  = k W Q,  k = logit_std / (s sqrt(D))      (the head sees only the Q subspace)
        w1 = a U, w2 = a W,  a^2 = markov_gain logit_std / sqrt(r)

    so head . embed[x] = logit_std / sqrt(r) * W U[x] exactly (the "bigram" logits, std
    logit_std) and the Markov bias W2 . W1[x] is markov_gain times it: the draft's Markov head
    knows the target's bigram, and how often the two agree is set by how much the context
    (the residual branches, `branch_gain`) moves the target away from it. The noise token's
    U row is zero (see `_latent`).
    """
    V, D = spec.shape[0], cfg.hidden_size
    s, r = sc.lm_structure, _lm_rank(cfg)
    dev = d.device
    if name in ("embed.weight", "head.weight"):
        Q = _latent(seed, "Q", V, cfg, dev)
        F = _latent(seed, "U" if name == "embed.weight" else "W", V, cfg, dev)
        out = torch.empty(spec.shape, dtype=spec.dtype, device=dev)
        step = max(1, (64 << 20) // (4 * D))  # fp32 working set of ~64 MB per chunk
        for i in range(0, V, step):  # chunked: a 1 GB bf16 table never has an fp32 twin
            x = F[i:i + step] @ Q
            if name == "embed.weight":
                z = d.normal((x.shape[0], D), math.sqrt(1 - s * s) * sc.embed_std)
                z.sub_((z @ Q.T) @ Q)  # the rest of the embedding lies outside the head's subspace
                x.mul_(s * math.sqrt(D / r) * sc.embed_std).add_(z)
            else:
                x.mul_(sc.logit_std / (s * math.sqrt(D)))
            out[i:i + step] = x
        return out
    a = math.sqrt(sc.markov_gain * sc.logit_std / math.sqrt(r))
    x = _latent(seed, "U" if name.endswith("markov_w1.weight") else "W", V, cfg, dev) * a
    return x.to(spec.dtype)


_STRUCTURED_LEAVES = ("markov_w1", "markov_w2")


def _plain(name: str, spec: TensorSpec, d: _Draw, cfg: ModelConfig, sc: SynthScales,
           seed: int = 0) -> torch.Tensor:
    D, shape = cfg.hidden_size, spec.shape
    normal = functools.partial(d.normal, dtype=spec.dtype)  # plain tensors are bf16 or fp32
    stem = name[: -len(".weight")] if name.endswith(".weight") else name
    leaf = stem.rsplit(".", 1)[-1]  # e.g. attn_norm, hc_ffn_fn, bias, markov_w1, gate
    if sc.lm_structure > 0 and (name in ("embed.weight", "head.weight") or leaf in _STRUCTURED_LEAVES):
        if not 0 < sc.lm_structure < 1:
            raise ValueError(f"lm_structure must be in [0, 1), got {sc.lm_structure}")
        return _structured(name, spec, d, cfg, sc, seed)
    if name == "embed.weight":
        x = normal(shape, sc.embed_std)
    elif name == "head.weight":
        x = normal(shape, sc.logit_std / math.sqrt(D))
    elif leaf.endswith("norm"):  # attn_norm, ffn_norm, q_norm, kv_norm, compressor norm, main_norm, norm
        x = normal(shape, sc.norm_noise, 1.0)
    elif leaf in ("markov_w1", "markov_w2"):
        x = normal(shape, math.sqrt(sc.markov_bias_std / math.sqrt(cfg.dspark_markov_rank)))
    elif leaf.startswith("hc_") and leaf.endswith("_fn"):
        x = normal(shape, sc.hc_logit_std / math.sqrt(shape[1]))
    elif leaf.startswith("hc_") and leaf.endswith("_scale"):
        x = normal(shape, sc.hc_scale_noise, 1.0)
    elif leaf == "hc_head_base":
        x = normal(shape, sc.hc_base_std)
    elif leaf.startswith("hc_") and leaf.endswith("_base"):
        m = cfg.hc_mult
        x = torch.cat((normal((2 * m,), sc.hc_base_std), normal((m * m,), sc.hc_comb_base_std)))
    elif leaf == "attn_sink":
        x = normal(shape, sc.sink_std)
    elif leaf == "ape":
        x = normal(shape, sc.ape_std)
    elif leaf == "bias":  # ffn.gate.bias: selection only, small so scores drive selection
        x = normal(shape, sc.gate_bias_std)
    elif len(shape) == 2:  # gate, compressor wkv/wgate, indexer weights_proj, confidence proj
        x = normal(shape, 1.0 / math.sqrt(shape[1]))
    else:
        raise ValueError(f"synth: no value rule for tensor '{name}' {shape} {spec.dtype}")
    return x.to(spec.dtype)


def _gen_unit(u: Unit, schema: dict[str, TensorSpec], cfg: ModelConfig, seed: int,
              device: torch.device, sc: SynthScales) -> list[tuple[str, torch.Tensor]]:
    d = _Draw(seed, u.base, device)
    spec = schema[u.names[0]]
    if u.kind == "plain":
        return [(u.names[0], _plain(u.names[0], spec, d, cfg, sc, seed))]
    if u.kind == "tid2eid":
        # distinct expert ids per row: the k largest of E uniforms
        V, k = spec.shape
        return [(u.names[0], d.uniform((V, cfg.n_routed_experts)).topk(k, dim=-1).indices.to(torch.int64))]
    gain = sc.branch_gain if _is_output_proj(u.base) else 1.0
    if u.kind == "fp8":
        rows, cols = spec.shape
        w = d.normal((rows, cols), gain / math.sqrt(cols))
        q, s = fp8_block_quant(w, cfg.fp8_block)
    else:  # mxfp4: stored [rows, cols/2] bytes
        rows, cols = spec.shape[0], spec.shape[1] * 2
        w = d.normal((rows, cols), gain / math.sqrt(cols))
        q, s = mxfp4_quant(w)
    del w
    return [(u.names[0], q), (u.names[1], s)]


def _resolve_cfg(cfg) -> ModelConfig:
    if isinstance(cfg, ModelConfig):
        return cfg
    if isinstance(cfg, str):
        return ModelConfig.from_dict(preset(cfg))
    if isinstance(cfg, dict):
        return ModelConfig.from_dict(cfg)
    raise TypeError(f"expected a ModelConfig, preset name or config dict, got {type(cfg).__name__}")


def synth_schema(cfg: ModelConfig, include_draft: bool = True,
                 include_optional: bool = True) -> dict[str, TensorSpec]:
    schema = checkpoint_schema(cfg)
    return {n: s for n, s in schema.items()
            if (include_draft or not n.startswith("mtp.")) and (include_optional or not s.optional)}


def iter_synth_tensors(cfg, seed: int = 0, device="cpu", include_draft: bool = True,
                       scales: SynthScales | None = None, names=None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in schema order, one unit at a time. `names` restricts the output
    to those tensors (a quantized weight and its scale are generated together)."""
    cfg = _resolve_cfg(cfg)
    sc = scales or SynthScales()
    dev = torch.device(device)
    schema = synth_schema(cfg, include_draft)
    want = None if names is None else set(names)
    if want is not None and want - set(schema):
        raise KeyError(f"iter_synth_tensors: not in the schema: {sorted(want - set(schema))[:3]}")
    units = [u for u in weight_units(schema) if want is None or want.intersection(u.names)]
    for name, t in stream_units(units, schema, cfg, seed, dev, sc):
        if want is None or name in want:
            yield name, t


def stream_units(units, schema, cfg, seed, dev, sc) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each unit's tensors without keeping a reference: the consumer's copy is the only
    one, so generating the next unit never overlaps with a tensor the consumer has dropped."""
    for u in units:
        items = _gen_unit(u, schema, cfg, seed, dev, sc)
        while items:
            yield items.pop(0)


def synth_tensors(cfg, seed: int = 0, device="cpu", include_draft: bool = True,
                  scales: SynthScales | None = None) -> dict[str, torch.Tensor]:
    """Every schema tensor (the optional confidence head included) in memory on `device`."""
    return dict(iter_synth_tensors(cfg, seed, device, include_draft, scales))

