"""The training corpus of the trained tiny checkpoint: Python's standard-library sources.

The corpus is every top-level module file (`<stdlib>/*.py`, sorted by name) of the Python that
runs the training (`sysconfig.get_paths()["stdlib"]`). Every module whose file name starts with
f, g or h is held out: never trained on (neither the tokenizer nor the models see it), it
supplies the prompts the acceptance is measured on. Files are joined with `<|eos|>` between
them.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

HELD_OUT_INITIALS = ("f", "g", "h")


@dataclass(frozen=True)
class Corpus:
    train: tuple[Path, ...]
    held_out: tuple[Path, ...]

    @classmethod
    def stdlib(cls, root: str | Path | None = None) -> "Corpus":
        root = Path(root or sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.glob("*.py") if p.is_file())
        if not files:
            raise FileNotFoundError(f"corpus: no *.py files in {root} (the standard library's "
                                    "sources)")
        held = tuple(p for p in files if p.name[0].lower() in HELD_OUT_INITIALS)
        train = tuple(p for p in files if p not in held)
        if not train or not held:
            raise FileNotFoundError(f"corpus: {root} has {len(train)} training and {len(held)} "
                                    "held-out files; both sets must be non-empty")
        return cls(train, held)

    @staticmethod
    def read(paths) -> list[str]:
        return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def encode_stream(tok, texts: list[str], eos: int) -> torch.Tensor:
    """Every text's ids, `eos` after each: one int64 stream."""
    out: list[int] = []
    for enc in tok.encode_batch(texts):
        out.extend(enc.ids)
        out.append(eos)
    return torch.tensor(out, dtype=torch.int64)


def windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """n windows [n, length] starting at uniform random offsets of `stream`."""
    if stream.numel() < length + 1:
        raise ValueError(f"corpus: {stream.numel()} tokens, fewer than one window of {length}")
    start = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return stream[start[:, None] + torch.arange(length)]


def spaced_windows(stream: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """n windows [n, length] at evenly spaced offsets (the evaluation prompts: no randomness)."""
    if stream.numel() < length + 1:
        raise ValueError(f"corpus: {stream.numel()} tokens, fewer than one window of {length}")
    start = torch.linspace(0, stream.numel() - length - 1, n).long()
    return stream[start[:, None] + torch.arange(length)]
