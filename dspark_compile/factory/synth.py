"""`synth`: the checkpoint of a preset (or of a config.json-style dict) written to a directory.

A random preset's tensors come from random_weights.py (its docstring says how the values are
chosen: the same bytes whatever the sharding); they are written one unit at a time into one
model.safetensors, or shards and their index past DEFAULT_SHARD_BYTES, atomically
(checkpoint_dir.py).

Every checkpoint `synth_checkpoint` writes holds a `tokenizer.json` (tokenizer.py): a
byte-level BPE of the config's vocabulary trained on a built-in text (random weights say nothing
about text, but a server can then be tested on text end to end). Vocabularies above
MAX_BUILTIN_TOKENIZER_VOCAB (flash-slice's 129280) get none: the built-in text holds too few
merges, and the padding would be a 10 MB file of unused tokens.

The `tiny-trained` preset is not random: `synth_checkpoint("tiny-trained", out)` copies the
trained checkpoint committed in data/tiny-trained (committed.py), or trains one for a seed other
than the committed one (train.py; minutes).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from dspark_compile.atomic_dir import check_free_space, needed_bytes
from dspark_compile.factory.checkpoint_dir import (
    HEADER_BYTES_PER_TENSOR, INDEX_NAME, SINGLE_NAME, SMALL_FILES_BYTES, check_out, locked,
    write_atomically)
from dspark_compile.factory.committed import (
    PRESET as TRAINED_PRESET, committed_bytes, committed_seed, copy_committed)
from dspark_compile.factory.presets import preset
from dspark_compile.factory.random_weights import (
    SynthScales, Unit, stream_units, synth_schema, weight_units)
from dspark_compile.factory.tokenizer import builtin_text, train_bpe, write_tokenizer
from dspark_compile.factory.train import TrainConfig, train_tiny
from dspark_compile.models.config import ModelConfig
from dspark_compile.models.safetensors_writer import nbytes, write_safetensors

# Read under synth's name by tests/runtime/test_build_output.py and tests/test_misuse.py.
from dspark_compile.factory.checkpoint_dir import not_a_checkpoint as _not_a_checkpoint  # noqa: F401
from dspark_compile.factory.random_weights import _resolve_cfg  # noqa: F401

# A checkpoint larger than this is sharded even without an explicit shard size.
DEFAULT_SHARD_BYTES = 4 << 30
MAX_BUILTIN_TOKENIZER_VOCAB = 4096


def _plan_shards(units: list[Unit], schema, shard_bytes: int | None) -> list[list[Unit]]:
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
    if preset_or_config == TRAINED_PRESET:
        if shard_size_bytes is not None or not include_draft or scales is not None:
            raise ValueError(f"synth: preset {preset_or_config!r} is a trained checkpoint; "
                             "shard size, include_draft and scales do not apply to it")
        return _trained_checkpoint(out_dir, seed, overwrite, free_bytes)
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
    units = weight_units(schema)
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
            total += write_safetensors(tmp / fname, specs, stream_units(shard, schema, cfg, seed, dev, sc))
            weight_map.update({n: fname for n, _, _ in specs})
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        if cfg.vocab_size <= MAX_BUILTIN_TOKENIZER_VOCAB:
            write_tokenizer(train_bpe(builtin_text(), cfg), tmp)

    write_atomically(Path(out_dir), overwrite, need, free_bytes, fill)
    return Path(out_dir)


def _trained_checkpoint(out_dir: str | Path, seed: int, overwrite: bool,
                        free_bytes: Callable[[Path], int] | None) -> Path:
    """`synth --preset tiny-trained`, under `out_dir`'s lock once the committed checkpoint's
    bytes fit (a retrained one has the same tensors): a copy of the committed checkpoint when it
    was trained with `seed`, else a fresh training run (minutes) with that seed."""
    need = needed_bytes(committed_bytes(), 4)
    with locked(out_dir, need) as out:
        check_out(out, overwrite)
        check_free_space(out, need, "the checkpoint", free_bytes)
        if committed_seed() == seed:
            return copy_committed(out_dir, overwrite)
        train_tiny(out_dir, replace(TrainConfig(), seed=seed), overwrite=overwrite)
        return Path(out_dir)
