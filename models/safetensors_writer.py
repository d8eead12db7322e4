"""Streaming safetensors writer: the header is built from the tensor specs first, then each
tensor's bytes are written as it is produced, so at most one tensor is in host memory.

`safetensors.torch.save_file` needs the whole dict (and copies each tensor to bytes), i.e.
twice a shard's size in RAM; a Flash slice is ~24 GB. Files written here are ordinary
safetensors files (read back with `safe_open`; the tests do exactly that).

Format: 8-byte little-endian header length N, N bytes of JSON header (padded with spaces to a
multiple of 8), then the tensors' raw little-endian bytes back to back. The header maps each
name to {dtype, shape, data_offsets: [begin, end)} relative to the data start.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterable, Iterator

import torch

# torch dtype -> safetensors dtype string
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def layout(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]):
    """Order tensors as they will be written (widest dtype first, then name, so every tensor
    stays aligned to its itemsize) and return [(name, shape, dtype, begin, end)]."""
    items = sorted(specs, key=lambda s: (-s[2].itemsize, s[0]))
    out, off = [], 0
    for name, shape, dtype in items:
        if dtype not in ST_DTYPES:
            raise ValueError(f"tensor '{name}': dtype {dtype} has no safetensors encoding")
        n = nbytes(shape, dtype)
        out.append((name, tuple(shape), dtype, off, off + n))
        off += n
    return out


def write_safetensors(path: str | Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                      tensors: Iterator[tuple[str, torch.Tensor]] | dict,
                      metadata: dict[str, str] | None = None) -> int:
    """Write `specs` to `path`, pulling each tensor from `tensors` (a dict, or an iterator of
    (name, tensor) in any order that yields each spec'd name exactly once). Returns data bytes.

    Tensors may live on any device; each is copied to the host only while it is written.
    """
    plan = layout(specs)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    for name, shape, dtype, begin, end in plan:
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    wanted = {p[0]: p for p in plan}
    get = tensors.get if isinstance(tensors, dict) else None
    it = None if get else iter(tensors)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        data_start = f.tell()
        written = set()
        for planned in plan:
            if get is not None:
                name = planned[0]
                t = get(name)
                if t is None:
                    raise KeyError(f"write_safetensors: no tensor '{name}'")
            else:
                # Iterator order may differ from the file order: seek to the planned offset.
                try:
                    name, t = next(it)
                except StopIteration:
                    break
                if name not in wanted or name in written:
                    raise KeyError(f"write_safetensors: unexpected or repeated tensor '{name}'")
            _, shape, dtype, begin, _ = wanted[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"write_safetensors: tensor '{name}' is {tuple(t.shape)} {t.dtype}, "
                                 f"spec says {shape} {dtype}")
            f.seek(data_start + begin)
            _write_bytes(f, t)
            del t  # the producer keeps no reference: the next tensor never overlaps this one
            written.add(name)
        extra = next(it, None) if it is not None else None
        if extra is not None:
            raise KeyError(f"write_safetensors: unexpected or repeated tensor '{extra[0]}'")
        if len(written) != len(plan):
            missing = sorted(set(wanted) - written)
            raise KeyError(f"write_safetensors: {len(missing)} tensors never produced, e.g. "
                           f"'{missing[0]}'")
        f.seek(data_start + (plan[-1][4] if plan else 0))
        f.truncate()
    return plan[-1][4] if plan else 0


def _write_bytes(f, t: torch.Tensor) -> None:
    b = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    f.write(memoryview(b))
