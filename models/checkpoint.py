"""Strict loader for DeepSeek-native checkpoints (`config.json` + safetensors).

The checkpoint must match :func:`checkpoint_schema` exactly: every tensor present (optional
ones may be absent), nothing else, shapes and dtypes exact. Quantized tensors are returned as
stored (FP8 weights float8_e4m3fn, UE8M0/E8M0 scales float8_e8m0fnu, MXFP4 bytes int8); nothing
is numerically cast. Every problem is a :class:`CheckpointError` naming the tensor and file.

Layouts: one `*.safetensors` file, or shards listed by `model.safetensors.index.json`
(`weight_map`: tensor name -> shard file). Everything about the files is checked from the
safetensors headers before a byte of data is read, so a bad checkpoint fails fast; data is then
read tensor by tensor through `safe_open` (memory-mapped), each moved to `device` on its own.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from dspark_compile.models.config import ModelConfig
from dspark_compile.models.safetensors_writer import ST_DTYPES
from dspark_compile.models.schema import TensorSpec, checkpoint_schema

INDEX_NAME = "model.safetensors.index.json"
_DRAFT_PREFIX = "mtp."
_MAX_LISTED = 5
# A model's config.json is a few KB (the Flash config: 2.3 KB; Hugging Face configs with long
# quantization exclusion lists reach ~100 KB). A larger one is refused before it is read: a
# 1 GB file took seconds and gigabytes to parse, and compress_ratios (one entry a layer) then
# sized a decode-state check of millions of layers that ran for minutes.
MAX_CONFIG_BYTES = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint file, index or tensor is missing, malformed or does not match the schema."""

    def __init__(self, message: str, tensor: str | None = None, file: str | None = None):
        self.tensor = tensor
        self.file = file
        super().__init__(message)


def _listing(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_MAX_LISTED])
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return shown + more


# ---- files and headers -------------------------------------------------------------------

def read_config(path: str | Path) -> ModelConfig:
    """`config.json` as a ModelConfig (ModelConfig.from_file), refused as a CheckpointError
    naming the file when it is not a regular file (a FIFO blocked the read forever), larger
    than MAX_CONFIG_BYTES, or nested deeper than the JSON parser recurses (a RecursionError
    escaped as a traceback)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path} is not a regular file", file=path.name)
    if path.is_file() and path.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path} is {path.stat().st_size:,} bytes; a model's config.json "
                              f"is a few KB (at most {MAX_CONFIG_BYTES:,} bytes are read)",
                              file=path.name)
    try:
        return ModelConfig.from_file(path)
    except RecursionError:
        raise CheckpointError(f"{path} is not valid JSON (nested too deep to parse)",
                              file=path.name) from None


def missing_dir(root: Path) -> str:
    """Why `root` is not a checkpoint directory it could be read as (it is not one)."""
    if root.is_symlink():
        return (f"checkpoint {root} is a symbolic link to no directory (dangling, or a loop: "
                f"{root} -> {os.readlink(root)})")
    if root.exists():
        return f"checkpoint {root} is not a directory (config.json + safetensors)"
    return f"checkpoint directory not found: {root}"


def _read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype string, shape) from one file's header."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (sl.get_dtype(), tuple(sl.get_shape()))
            return out
    except Exception as e:  # SafetensorError, OSError, ...: one message naming the file
        raise CheckpointError(f"{file.name}: not a readable safetensors file "
                              f"(truncated or corrupt?): {e}", file=file.name) from None


def _read_index(index: Path) -> dict[str, str]:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index.name}: cannot read the shard index ({e})",
                              file=index.name) from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{index.name}: no 'weight_map' object (tensor name -> shard file)",
                              file=index.name)
    for name, shard in wm.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise CheckpointError(f"{index.name}: tensor '{name}' maps to {shard!r}, which is "
                                  "not a file name in the checkpoint directory",
                                  tensor=name, file=index.name)
    return wm


def _locate(root: Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Every tensor in the checkpoint: name -> (file name, dtype string, shape)."""
    index = root / INDEX_NAME
    if not index.exists():
        candidates = sorted(root.glob("*.safetensors.index.json"))
        index = candidates[0] if len(candidates) == 1 else index
    if index.exists():
        return _locate_sharded(root, index)
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors file and no {INDEX_NAME}")
    if len(files) > 1:
        raise CheckpointError(f"{root}: {len(files)} safetensors files ({_listing([f.name for f in files])}) "
                              f"but no {INDEX_NAME} saying which tensor is in which")
    return {n: (files[0].name, dt, shape) for n, (dt, shape) in _read_header(files[0]).items()}


def _locate_sharded(root: Path, index: Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    wm = _read_index(index)
    shards = sorted(set(wm.values()))
    for shard in shards:
        if not (root / shard).is_file():
            example = next(n for n, s in wm.items() if s == shard)
            raise CheckpointError(f"{index.name} names shard '{shard}' (e.g. for tensor "
                                  f"'{example}'), but {root / shard} does not exist",
                                  tensor=example, file=shard)
    found: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for shard in shards:
        for name, (dt, shape) in _read_header(root / shard).items():
            if name in found:
                raise CheckpointError(f"tensor '{name}' appears in two shards: "
                                      f"{found[name][0]} and {shard}", tensor=name, file=shard)
            found[name] = (shard, dt, shape)
    for name, (shard, _, _) in found.items():
        if name not in wm:
            raise CheckpointError(f"tensor '{name}' is in {shard}, but {index.name} lists it "
                                  "in no shard", tensor=name, file=shard)
        if wm[name] != shard:
            raise CheckpointError(f"{index.name} maps tensor '{name}' to {wm[name]}, but it is "
                                  f"in {shard}", tensor=name, file=shard)
    absent = sorted(n for n in wm if n not in found)
    if absent:
        n = absent[0]
        raise CheckpointError(f"{index.name} maps {len(absent)} tensor(s) to shards that do not "
                              f"contain them: '{n}' -> {wm[n]}"
                              + (f" (also {_listing(absent[1:])})" if len(absent) > 1 else ""),
                              tensor=n, file=wm[n])
    return found


# ---- schema check --------------------------------------------------------------------------

def _check_against_schema(found, schema: dict[str, TensorSpec], cfg: ModelConfig,
                          include_draft: bool, sharded: bool) -> None:
    unexpected = sorted(n for n in found if n not in schema)
    if unexpected:
        n = unexpected[0]
        hint = ""
        if n.startswith(_DRAFT_PREFIX) and not cfg.has_draft:
            hint = (" (config.json has no DSpark draft fields; load with include_draft=False "
                    "to read the target only)")
        raise CheckpointError(f"{len(unexpected)} unexpected tensor(s): '{n}' in {found[n][0]}"
                              + (f" (also {_listing(unexpected[1:])})" if len(unexpected) > 1 else "")
                              + hint, tensor=n, file=found[n][0])
    missing = [n for n, s in schema.items() if n not in found and not s.optional]
    if missing:
        if sharded:
            where = "any shard"
        else:
            where = next(iter(found.values()))[0] if found else "the checkpoint"
        hint = ""
        if include_draft and any(n.startswith(_DRAFT_PREFIX) for n in missing):
            hint = " (pass include_draft=False to load the target without its draft)"
        raise CheckpointError(f"{len(missing)} tensor(s) missing (not in {where}): {_listing(missing)}"
                              + hint, tensor=missing[0])
    for name, (file, dt, shape) in found.items():
        spec = schema[name]
        if shape != spec.shape:
            raise CheckpointError(f"tensor '{name}' in {file}: shape {list(shape)}, expected "
                                  f"{list(spec.shape)}", tensor=name, file=file)
        if dt != ST_DTYPES[spec.dtype]:
            raise CheckpointError(f"tensor '{name}' in {file}: dtype {dt}, expected "
                                  f"{ST_DTYPES[spec.dtype]} ({spec.dtype})", tensor=name, file=file)


def _check_tensor_count(cfg: ModelConfig, located: dict, include_draft: bool) -> None:
    """Each routed expert of each layer is six tensors (w1, w2, w3, each weight and scale):
    when config.json's counts need more tensors than the files hold, the schema cannot match,
    and building it would take minutes (340,000 layers in a 0.7 MB config.json built a schema of
    millions of names); refuse at once, naming the fields."""
    layers = cfg.num_hidden_layers + (cfg.n_mtp_layers if include_draft and cfg.has_draft else 0)
    least = 6 * layers * cfg.n_routed_experts
    found = len(located) if include_draft else \
        sum(not n.startswith(_DRAFT_PREFIX) for n in located)
    if least > found:
        raise CheckpointError(f"config.json's num_hidden_layers={cfg.num_hidden_layers}"
                              + (f" (+ {cfg.n_mtp_layers} draft layers)" if layers >
                                 cfg.num_hidden_layers else "")
                              + f" and n_routed_experts={cfg.n_routed_experts} need at least "
                              f"{least:,} tensors (6 an expert); the checkpoint's files hold "
                              f"{found:,}", file="config.json")


def validate_tid2eid(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Every hash-routing id is an expert id in [0, n_routed_experts)."""
    for name, spec in checkpoint_schema(cfg).items():
        if spec.kind == "tid2eid" and name in tensors:
            _check_tid2eid(name, tensors[name], cfg.n_routed_experts)


def _check_tid2eid(name: str, t: torch.Tensor, E: int, file: str | None = None) -> None:
    bad = (t < 0) | (t >= E)
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        where = f" in {file}" if file else ""
        raise CheckpointError(f"tensor '{name}'{where}: expert id {int(t[r, c])} at [{r}, {c}] is "
                              f"outside [0, n_routed_experts={E}) ({int(bad.sum())} bad entries)",
                              tensor=name, file=file)


# ---- load ----------------------------------------------------------------------------------

def checked_layout(root: Path, cfg: ModelConfig | dict | None = None, include_draft: bool = True):
    """(config, {name: (file, dtype, shape)}, schema) of a checkpoint directory, every header
    checked against the schema and no tensor data read: load_checkpoint's first half, shared
    with the per-rank loader (models/sharding.py), which then reads only its rank's bytes."""
    if not root.is_dir():
        raise CheckpointError(missing_dir(root))
    if cfg is None:
        cfg = read_config(root / "config.json")
    elif isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    located = _locate(root)
    _check_tensor_count(cfg, located, include_draft)
    schema = checkpoint_schema(cfg)
    keep = (lambda n: True) if include_draft else (lambda n: not n.startswith(_DRAFT_PREFIX))
    schema = {n: s for n, s in schema.items() if keep(n)}

    sharded = len({f for f, _, _ in located.values()}) > 1 or (root / INDEX_NAME).exists()
    found = {n: v for n, v in located.items() if keep(n)}
    _check_against_schema(found, schema, cfg, include_draft, sharded)
    return cfg, found, schema


def load_checkpoint(path: str | Path, cfg: ModelConfig | dict | None = None, device="cpu",
                    include_draft: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read and validate a checkpoint directory; returns (config, {name: tensor on `device`}).

    `cfg` overrides the directory's config.json (a ModelConfig or a config dict).
    `include_draft=False` ignores every `mtp.*` tensor (present or not): the target alone.
    """
    root = Path(path)
    cfg, found, schema = checked_layout(root, cfg, include_draft)
    dev = torch.device(device)
    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in found.items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in sorted(by_file.items()):
        try:
            with safe_open(str(root / file), framework="pt", device="cpu") as f:
                for name in names:
                    try:
                        t = f.get_tensor(name)
                    except Exception as e:
                        raise CheckpointError(f"tensor '{name}' in {file}: cannot read its data "
                                              f"({e})", tensor=name, file=file) from None
                    _check_loaded(name, file, t, schema[name], cfg)
                    tensors[name] = t.to(dev) if dev.type != "cpu" else t
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})", file=file) from None
    return cfg, {n: tensors[n] for n in schema if n in tensors}  # schema order


def _check_loaded(name: str, file: str, t: torch.Tensor, spec: TensorSpec, cfg: ModelConfig) -> None:
    """On the host copy, before it moves to the device (no device sync, any device works)."""
    # Defensive: what safetensors handed back must be what the header promised.
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise CheckpointError(f"tensor '{name}' in {file}: read as {tuple(t.shape)} {t.dtype}, "
                              f"expected {spec.shape} {spec.dtype}", tensor=name, file=file)
    if spec.kind == "tid2eid":
        _check_tid2eid(name, t, cfg.n_routed_experts, file)
