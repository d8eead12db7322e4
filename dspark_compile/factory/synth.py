"""Synthetic DeepSeek-V4 (+ DSpark draft) checkpoints: every tensor of the schema, random but
well-conditioned, in the native formats (FP8 block-scaled, MXFP4 experts, I64 tid2eid).

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

Every checkpoint `synth_checkpoint` writes holds a `tokenizer.json` (dspark_compile/factory/tokenizer.py): a
byte-level BPE of the config's vocabulary trained on a built-in text (random weights say nothing
about text, but a server can then be tested on text end to end). Vocabularies above
MAX_BUILTIN_TOKENIZER_VOCAB (flash-slice's 129280) get none: the built-in text holds too few
merges, and the padding would be a 10 MB file of unused tokens.

The `tiny-trained` preset is not random: `synth_checkpoint("tiny-trained", out)` copies the
trained checkpoint committed in dspark_compile/factory/data/tiny-trained (dspark_compile/factory/train.py makes it), or trains
one for a seed other than the committed one.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from dspark_compile.atomic_dir import (
    canonical, check_free_space, disk_errors, move_into_place, needed_bytes, output_lock,
    remove_stale_temps, replace_refusal, temp_dir)
from dspark_compile.models.config import ModelConfig
from dspark_compile.factory.presets import preset
from dspark_compile.models.quant_formats import fp8_block_quant, mxfp4_quant
from dspark_compile.models.safetensors_writer import nbytes, write_safetensors
from dspark_compile.models.schema import TensorSpec, checkpoint_schema

# A checkpoint larger than this is sharded even without an explicit shard size.
DEFAULT_SHARD_BYTES = 4 << 30
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"
TRAIN_REPORT_NAME = "train_report.json"
MAX_BUILTIN_TOKENIZER_VOCAB = 4096
# Bytes beside the tensors' data: a safetensors header's entry (name, dtype, shape, offsets as
# JSON) is ~100 bytes; config.json ~2 KB; the built-in tokenizer of the tiny vocabulary
# (512) 21 KB, so one of 4096 at most ~170 KB.
HEADER_BYTES_PER_TENSOR = 256
SMALL_FILES_BYTES = 256 << 10
TRAINED_PRESETS = ("tiny-trained",)


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
class _Unit:
    base: str                 # seed key: the tensor name, or the linear's name for a pair
    names: tuple[str, ...]    # tensors it produces, in order
    kind: str                 # plain | fp8 | mxfp4 | tid2eid

    def nbytes(self, schema: dict[str, TensorSpec]) -> int:
        return sum(nbytes(schema[n].shape, schema[n].dtype) for n in self.names)


def _units(schema: dict[str, TensorSpec]) -> list[_Unit]:
    units = []
    for name, spec in schema.items():
        if spec.kind in ("fp8_weight", "mxfp4_weight"):
            base = name[: -len(".weight")]
            scale = f"{base}.scale"
            if scale not in schema:
                raise ValueError(f"schema: quantized weight '{name}' has no '{scale}'")
            units.append(_Unit(base, (name, scale), spec.kind.split("_")[0]))
        elif spec.kind in ("fp8_scale", "mxfp4_scale"):
            continue  # produced with its weight
        else:
            units.append(_Unit(name, (name,), "tid2eid" if spec.kind == "tid2eid" else "plain"))
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


def _gen_unit(u: _Unit, schema: dict[str, TensorSpec], cfg: ModelConfig, seed: int,
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
    units = [u for u in _units(schema) if want is None or want.intersection(u.names)]
    for name, t in _stream(units, schema, cfg, seed, dev, sc):
        if want is None or name in want:
            yield name, t


def _stream(units, schema, cfg, seed, dev, sc) -> Iterator[tuple[str, torch.Tensor]]:
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


# ---- writing ------------------------------------------------------------------------------

def _plan_shards(units: list[_Unit], schema, shard_bytes: int | None) -> list[list[_Unit]]:
    total = sum(u.nbytes(schema) for u in units)
    if shard_bytes is None:
        if total <= DEFAULT_SHARD_BYTES:
            return [units]
        shard_bytes = DEFAULT_SHARD_BYTES
    shards, cur, size = [], [], 0
    for u in units:  # greedy in schema order; a unit larger than a shard gets its own shard
        n = u.nbytes(schema)
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(u)
        size += n
    if cur:
        shards.append(cur)
    return shards


def synth_checkpoint(preset_or_config: str | dict, out_dir: str | Path, seed: int = 0,
                     shard_size_bytes: int | None = None, device="cpu", include_draft: bool = True,
                     overwrite: bool = False, scales: SynthScales | None = None,
                     free_bytes: Callable[[Path], int] | None = None) -> Path:
    """Write config.json + safetensors for a preset name or a config.json-style dict.

    One `model.safetensors` unless `shard_size_bytes` is given or the checkpoint exceeds
    DEFAULT_SHARD_BYTES; then `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`.
    Written into a temporary sibling directory and renamed into place when complete, so
    `out_dir` never holds a partial checkpoint; the write holds `out_dir`'s lock (a concurrent
    writer of it: OutputLocked, naming it) and is refused up front when the file system lacks
    the checkpoint's bytes (`free_bytes`, default shutil.disk_usage's free: the tests' seam),
    or fails as one NoSpaceError when it runs out of space anyway (dspark_compile/atomic_dir.py).
    Returns `out_dir`.
    """
    if isinstance(preset_or_config, str) and preset_or_config in TRAINED_PRESETS:
        from dspark_compile.factory.train import DATA_DIR, trained_checkpoint
        if shard_size_bytes is not None or not include_draft or scales is not None:
            raise ValueError(f"synth: preset {preset_or_config!r} is a trained checkpoint; "
                             "shard size, include_draft and scales do not apply to it")
        # the committed checkpoint's files (a retrained one has the same tensors)
        need = needed_bytes(sum(f.stat().st_size for f in DATA_DIR.iterdir()), 4)
        with _locked(out_dir, need) as out:
            _check_out(out, overwrite)
            check_free_space(out, need, "the checkpoint", free_bytes)
            return trained_checkpoint(out_dir, seed=seed, overwrite=overwrite)
    if isinstance(preset_or_config, str):
        raw = preset(preset_or_config)
    elif isinstance(preset_or_config, dict):
        raw = json.loads(json.dumps(preset_or_config))  # private copy, and proof it is JSON
    else:
        raise TypeError("synth_checkpoint: expected a preset name or a config dict, got "
                        f"{type(preset_or_config).__name__}")
    if shard_size_bytes is not None and shard_size_bytes <= 0:
        raise ValueError(f"shard size must be positive, got {shard_size_bytes} bytes")
    cfg = ModelConfig.from_dict(raw)
    if not include_draft:  # same target weights as the full checkpoint, no draft fields
        raw = {k: v for k, v in raw.items() if not k.startswith("dspark_")}
    schema = synth_schema(cfg, include_draft)
    units = _units(schema)
    shards = _plan_shards(units, schema, shard_size_bytes)
    sc = scales or SynthScales()
    dev = torch.device(device)
    need = needed_bytes(sum(nbytes(sp.shape, sp.dtype) for sp in schema.values())
                        + HEADER_BYTES_PER_TENSOR * len(schema) + SMALL_FILES_BYTES,
                        len(shards) + 3)

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = SINGLE_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            specs = [(n, schema[n].shape, schema[n].dtype) for u in shard for n in u.names]
            total += write_safetensors(tmp / fname, specs, _stream(shard, schema, cfg, seed, dev, sc))
            weight_map.update({n: fname for n, _, _ in specs})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        if cfg.vocab_size <= MAX_BUILTIN_TOKENIZER_VOCAB:
            from dspark_compile.factory.tokenizer import builtin_text, train_bpe, write_tokenizer
            write_tokenizer(train_bpe(builtin_text(), cfg), tmp)

    _write_atomically(Path(out_dir), overwrite, need, free_bytes, fill)
    return Path(out_dir)


def write_checkpoint(raw: dict, tensors: dict[str, torch.Tensor], out_dir: str | Path,
                     overwrite: bool = False, files: dict[str, str] | None = None,
                     free_bytes: Callable[[Path], int] | None = None) -> Path:
    """config.json (`raw`), one model.safetensors of `tensors` (validated against the schema)
    and the text `files` (name -> content: tokenizer.json, train_report.json), written into a
    temporary sibling directory renamed into place, as synth_checkpoint writes. Returns
    `out_dir`."""
    cfg = ModelConfig.from_dict(raw)
    schema = synth_schema(cfg)
    missing = [n for n, sp in schema.items() if n not in tensors and not sp.optional]
    extra = [n for n in tensors if n not in schema]
    if missing or extra:
        raise ValueError(f"write_checkpoint: tensors do not match the schema (missing "
                         f"{missing[:3]}, unexpected {extra[:3]})")
    for n, t in tensors.items():
        if tuple(t.shape) != schema[n].shape or t.dtype != schema[n].dtype:
            raise ValueError(f"write_checkpoint: tensor '{n}' is {tuple(t.shape)} {t.dtype}, the "
                             f"schema says {schema[n].shape} {schema[n].dtype}")
    allowed = {TOKENIZER_NAME, TRAIN_REPORT_NAME}
    if set(files or {}) - allowed:
        raise ValueError(f"write_checkpoint: files {sorted(set(files) - allowed)} are not "
                         f"checkpoint files ({sorted(allowed)})")
    names = [n for n in schema if n in tensors]
    need = needed_bytes(sum(nbytes(schema[n].shape, schema[n].dtype) for n in names)
                        + HEADER_BYTES_PER_TENSOR * len(names) + SMALL_FILES_BYTES
                        + sum(len(t.encode()) for t in (files or {}).values()),
                        2 + len(files or {}))

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        write_safetensors(tmp / SINGLE_NAME, [(n, schema[n].shape, schema[n].dtype) for n in names],
                          {n: tensors[n] for n in names})
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")

    _write_atomically(Path(out_dir), overwrite, need, free_bytes, fill)
    return Path(out_dir)


@contextlib.contextmanager
def _locked(out_dir, need: int):
    """`out_dir`'s lock held (canonical `out_dir` yielded), and a write that runs out of space
    reported as one NoSpaceError naming it and the `need`ed bytes (dspark_compile/atomic_dir.py)."""
    out = canonical(Path(out_dir).absolute())
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, "synth"), disk_errors(out, "the checkpoint", need):
        yield out


def _write_atomically(out_dir: Path, overwrite: bool, need: int, free_bytes,
                      fill: Callable[[Path], None]) -> None:
    """`fill(tmp)` writes the checkpoint into a temporary sibling of `out_dir`, renamed into
    place when complete (never over a directory that appeared meanwhile unless `overwrite`),
    all under `out_dir`'s lock, once its file system has `need` bytes free; the temporary is
    removed on any failure."""
    with _locked(out_dir, need) as out:
        tmp = checkpoint_temp_dir(out, overwrite)
        try:
            check_free_space(out, need, "the checkpoint", free_bytes)
            fill(tmp)
            move_into_place(tmp, out, replace=overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def checkpoint_temp_dir(out: Path, overwrite: bool) -> Path:
    """The temporary directory a checkpoint for `out` is written into (moved into place when
    complete), once `out` may be written: absent, empty, or (overwrite) a checkpoint."""
    _check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    return temp_dir(out)


def _check_out(out: Path, overwrite: bool) -> None:
    """`out` may be written: absent, empty, or (overwrite) a checkpoint."""
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output directory {out} exists and is not empty (pass "
                              "overwrite=True to replace it)")
    why = _not_a_checkpoint(out)
    if why:
        raise FileExistsError(f"refusing to replace {out}: {why}")


def _not_a_checkpoint(out: Path) -> str | None:
    """Why replacing `out` could delete files that are not a checkpoint: it must hold a
    config.json and otherwise only safetensors, their index, the tokenizer and the training
    report."""
    return replace_refusal(out, "a checkpoint", "config.json",
                           {INDEX_NAME, TOKENIZER_NAME, TRAIN_REPORT_NAME}, (r".+\.safetensors",))


