"""A checkpoint directory as the factory writes it: config.json, the safetensors (one file, or
shards and their index), tokenizer.json and, for a trained checkpoint, train_report.json.

Every write goes into a temporary sibling directory renamed into place when complete, under the
directory's lock, once its file system has the bytes (dspark_compile/atomic_dir.py); a directory
is replaced only when it holds a checkpoint and nothing else (`not_a_checkpoint`).
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from dspark_compile.atomic_dir import (
    canonical, check_free_space, disk_errors, move_into_place, needed_bytes, output_lock,
    remove_stale_temps, replace_refusal, temp_dir)
from dspark_compile.factory.tokenizer import TOKENIZER_NAME
from dspark_compile.models.checkpoint import INDEX_NAME
from dspark_compile.models.config import ModelConfig
from dspark_compile.models.safetensors_writer import nbytes, write_safetensors
from dspark_compile.models.schema import checkpoint_schema

SINGLE_NAME = "model.safetensors"
TRAIN_REPORT_NAME = "train_report.json"
# Bytes beside the tensors' data: a safetensors header's entry (name, dtype, shape, offsets as
# JSON) is ~100 bytes; config.json ~2 KB; the built-in tokenizer of the tiny vocabulary
# (512) 21 KB, so one of 4096 at most ~170 KB.
HEADER_BYTES_PER_TENSOR = 256
SMALL_FILES_BYTES = 256 << 10


def write_checkpoint(raw: dict, tensors: dict[str, torch.Tensor], out_dir: str | Path,
                     overwrite: bool = False, files: dict[str, str] | None = None,
                     free_bytes: Callable[[Path], int] | None = None) -> Path:
    """config.json (`raw`), one model.safetensors of `tensors` (validated against the schema)
    and the text `files` (name -> content: tokenizer.json, train_report.json), written into a
    temporary sibling directory renamed into place, as synth_checkpoint writes. Returns
    `out_dir`."""
    cfg = ModelConfig.from_dict(raw)
    schema = checkpoint_schema(cfg)
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

    write_atomically(Path(out_dir), overwrite, need, free_bytes, fill)
    return Path(out_dir)


@contextlib.contextmanager
def locked(out_dir, need: int):
    """`out_dir`'s lock held (canonical `out_dir` yielded), and a write that runs out of space
    reported as one NoSpaceError naming it and the `need`ed bytes (dspark_compile/atomic_dir.py)."""
    out = canonical(Path(out_dir).absolute())
    out.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out, "synth"), disk_errors(out, "the checkpoint", need):
        yield out


def write_atomically(out_dir: Path, overwrite: bool, need: int, free_bytes,
                     fill: Callable[[Path], None]) -> None:
    """`fill(tmp)` writes the checkpoint into a temporary sibling of `out_dir`, renamed into
    place when complete (never over a directory that appeared meanwhile unless `overwrite`),
    all under `out_dir`'s lock, once its file system has `need` bytes free; the temporary is
    removed on any failure."""
    with locked(out_dir, need) as out:
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
    check_out(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    return temp_dir(out)


def check_out(out: Path, overwrite: bool) -> None:
    """`out` may be written: absent, empty, or (overwrite) a checkpoint."""
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output directory {out} exists and is not empty (pass "
                              "overwrite=True to replace it)")
    why = not_a_checkpoint(out)
    if why:
        raise FileExistsError(f"refusing to replace {out}: {why}")


def not_a_checkpoint(out: Path) -> str | None:
    """Why replacing `out` could delete files that are not a checkpoint: it must hold a
    config.json and otherwise only safetensors, their index, the tokenizer and the training
    report."""
    return replace_refusal(out, "a checkpoint", "config.json",
                           {INDEX_NAME, TOKENIZER_NAME, TRAIN_REPORT_NAME}, (r".+\.safetensors",))


