"""The trained tiny pair committed with the factory, in data/tiny-trained: where it lies, which
seed trained it, and its copy into a checkpoint directory.

train.py writes it (`python -m dspark_compile.factory.train --out ...`); `synth --preset
tiny-trained` copies it when asked for its seed, and trains afresh for any other (synth.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from dspark_compile.atomic_dir import move_into_place
from dspark_compile.factory.checkpoint_dir import TRAIN_REPORT_NAME, checkpoint_temp_dir

PRESET = "tiny-trained"
DATA_DIR = Path(__file__).resolve().parent / "data" / PRESET


def committed_seed() -> int | None:
    """The seed the committed checkpoint was trained with (its train_report.json), or None when
    there is none."""
    report = DATA_DIR / TRAIN_REPORT_NAME
    return json.loads(report.read_text())["train_config"]["seed"] if report.is_file() else None


def committed_bytes() -> int:
    """The committed checkpoint's size on disk (a copy needs this much free space)."""
    return sum(f.stat().st_size for f in DATA_DIR.iterdir())


def copy_committed(out_dir: str | Path, overwrite: bool = False) -> Path:
    """The committed checkpoint's files copied into `out_dir`, atomically (a temporary sibling
    renamed into place). Returns `out_dir`."""
    out = Path(out_dir)
    tmp = checkpoint_temp_dir(out, overwrite)
    try:
        for f in sorted(DATA_DIR.iterdir()):
            shutil.copyfile(f, tmp / f.name)
        move_into_place(tmp, out, replace=overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
