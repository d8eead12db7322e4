"""Weights stored once, shared by every program of an engine.

The step module's parameters and buffers are stored once, in weights.safetensors keyed by their
module FQN (the ExportedProgram's `state_dict` / `constants` key), and *not* beside each program:
each bucket's program would otherwise carry its own full copy of the model (N buckets = N copies
on disk and N in memory). A program's graph names them (engine_dir/graph_format.py) and
`load_engine` binds the loaded tensors, the same tensor objects in every program. Which entries
each program takes from the shared file is listed in the manifest
(`programs[B].shared_weights`). Tensors that are not module weights (constants export lifts out
of `forward`, e.g. `torch.tensor(...)` literals, which may differ per bucket under one name) are
the program's own constants file. State tensors (caches) are user inputs: the runtime allocates
them; they are not part of the engine. Dtypes safetensors cannot read back (float8_e8m0fnu) are
stored as a uint8 view and viewed back on load (the manifest records the real dtype).
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import torch

from dspark_compile.engine_dir.format import (
    WEIGHTS_FILE, ArtifactError, tensor_sha256)

_ALIGN = 64  # bytes; what torch's allocators give every fresh tensor
# Dtypes safetensors can write but not read back: stored as a same-size integer view.
_BYTE_VIEW = {getattr(torch, n): torch.uint8 for n in ("float8_e8m0fnu", "float4_e2m1fn_x2")
              if hasattr(torch, n)}


def _weight_entries(ep) -> dict:
    """FQN -> (tensor, is_parameter) for the module weights of one program."""
    from torch.export.graph_signature import InputKind

    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            out[spec.target] = (ep.state_dict[spec.target], True)
        elif spec.kind == InputKind.BUFFER:
            src = ep.state_dict if spec.target in ep.state_dict else ep.constants
            out[spec.target] = (src[spec.target], False)
    return out


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device == b.device and a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return torch.equal(a.detach().cpu(), b.detach().cpu())


def _plan_weights(programs: dict, weights: Optional[dict]):
    """`programs`: {ProgramKey: ExportedProgram}. Returns (weights to store, {ProgramKey:
    [shared names]}); checks the programs agree with it."""
    shared = {}
    collected = {} if weights is None else dict(weights)
    for b, ep in programs.items():
        names = []
        for name, (t, _) in _weight_entries(ep).items():
            if name not in collected:
                if weights is not None:
                    raise ArtifactError(f"program {b.label} uses weight '{name}', which is "
                                        "not in `weights`", field="weights")
                collected[name] = t
            elif not _same_tensor(collected[name], t):
                raise ArtifactError(
                    f"weight '{name}' of the program {b.label} differs from the one being "
                    f"stored ({tuple(t.shape)} {t.dtype} vs {tuple(collected[name].shape)} "
                    f"{collected[name].dtype} or different values)", field="weights")
            names.append(name)
        # constants (lifted literals, plain tensor attributes) are shared only when the caller
        # passed them explicitly and they are identical
        if weights is not None:
            for name, t in ep.constants.items():
                if name not in names and name in collected and isinstance(t, torch.Tensor) \
                        and _same_tensor(collected[name], t):
                    names.append(name)
        shared[b] = sorted(names)
    return collected, shared


def _save_weights(weights: dict, path: Path) -> dict:
    from safetensors.torch import save_file

    stored, summary, seen = {}, {}, set()
    for name in sorted(weights):
        t = weights[name]
        if not isinstance(t, torch.Tensor):
            raise ArtifactError(f"weight '{name}' is a {type(t).__name__}, not a tensor",
                                field="weights")
        c = t.detach().cpu().contiguous()
        if c.untyped_storage().data_ptr() in seen or c.numel() != c.untyped_storage().nbytes() \
                // max(c.element_size(), 1):
            c = c.clone()  # safetensors refuses shared or partial storages
        seen.add(c.untyped_storage().data_ptr())
        stored_dtype = _BYTE_VIEW.get(c.dtype)
        stored[name] = c.view(stored_dtype) if stored_dtype is not None else c
        summary[name] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                         "sha256": tensor_sha256(c)}
        if stored_dtype is not None:
            summary[name]["stored_as"] = str(stored_dtype).replace("torch.", "")
    save_file(stored, str(path))
    return summary


def _summary_dtype(name: str, info) -> torch.dtype:
    """The dtype the manifest's weights table gives weight `name` (a torch dtype's name and
    nothing else: the name is looked up on the torch module)."""
    dtype = getattr(torch, info.get("dtype"), None) \
        if isinstance(info, dict) and isinstance(info.get("dtype"), str) else None
    shape = info.get("shape") if isinstance(info, dict) else None
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ArtifactError(f"manifest field 'weights.tensors': '{name}' is not a dtype name "
                            f"and a shape of ints: {str(info)[:120]}", field="weights.tensors")
    return dtype


def _load_weights(path: Path, summary: dict, device) -> dict:
    from safetensors.torch import load_file

    wanted = {name: _summary_dtype(name, info) for name, info in summary.items()}
    try:
        # safetensors checks its header (offsets, dtypes, shapes against the file's bytes)
        raw = load_file(str(path), device=str(device))
    except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError, and torch's errors
        raise ArtifactError(f"{WEIGHTS_FILE} cannot be read: {type(e).__name__}: "
                            f"{str(e)[:300]}", path=WEIGHTS_FILE) from None
    if set(raw) != set(summary):
        missing, extra = sorted(set(summary) - set(raw)), sorted(set(raw) - set(summary))
        raise ArtifactError(f"{WEIGHTS_FILE} does not hold the tensors the manifest lists "
                            f"(missing {missing[:5]}, unexpected {extra[:5]})", path=WEIGHTS_FILE)
    out = {}
    for name, t in raw.items():
        want = wanted[name]
        if t.dtype != want:
            try:
                t = t.view(want)
            except RuntimeError as e:
                raise ArtifactError(f"weight '{name}' is {t.dtype} {list(t.shape)} in "
                                    f"{WEIGHTS_FILE}, which cannot be read as {want}: "
                                    f"{str(e)[:200]}", path=WEIGHTS_FILE) from None
        if list(t.shape) != summary[name]["shape"]:
            raise ArtifactError(f"weight '{name}' has shape {list(t.shape)}, manifest says "
                                f"{summary[name]['shape']}", path=WEIGHTS_FILE)
        if t.data_ptr() % _ALIGN:
            # safetensors places tensors at arbitrary byte offsets; BLAS and Triton pick other
            # (slower, differently rounded) kernels for misaligned pointers, so the engine
            # would not reproduce the build's numerics bit for bit.
            t = t.clone()
        out[name] = t
    return out


def _stand_in(t: torch.Tensor, is_param: bool):
    """A one-element tensor expanded (stride 0) to `t`'s shape and dtype: what torch.export.save
    writes for it is a single element, through the ordinary tensor path of every torch version
    (meta tensors would rely on how a version treats zero-byte records)."""
    s = torch.zeros((), dtype=t.dtype).expand(t.shape)
    return torch.nn.Parameter(s, requires_grad=False) if is_param else s


def _save_program(ep, path: Path, shared: list) -> None:
    """torch.export.save with the shared weights swapped for stand-ins and without the export's
    example inputs (restored after): the build's hand-over of a program to an Inductor compile
    worker (build/compile_workers.py; never an engine file, which is graph_format.py's)."""
    entries = _weight_entries(ep)
    saved = []
    example_inputs = ep.example_inputs
    try:
        ep.example_inputs = None
        for name in shared:
            table = ep.state_dict if name in ep.state_dict else ep.constants
            saved.append((table, name, table[name]))
            table[name] = _stand_in(table[name], entries.get(name, (None, False))[1])
        with warnings.catch_warnings():
            # the stand-ins do not cover their one-element storage; torch warns about that
            warnings.filterwarnings("ignore", message="No complete tensor found")
            torch.export.save(ep, str(path))
    finally:
        ep.example_inputs = example_inputs
        for table, name, t in saved:
            table[name] = t


def _attach_weights(ep, shared: list, weights: dict, key) -> None:
    """The engine's `weights` named in `shared` into program `key`'s (a ProgramKey) tables."""
    entries = _weight_entries(ep)
    for name in shared:
        if name in ep.state_dict:
            table = ep.state_dict
        elif name in ep.constants:
            table = ep.constants
        else:
            raise ArtifactError(f"program {key.label} has no weight '{name}' that the "
                                "manifest says it shares", path=key.path)
        w = weights[name]
        ref = table[name]
        if tuple(ref.shape) != tuple(w.shape) or ref.dtype != w.dtype:
            raise ArtifactError(f"weight '{name}': program {key.label} expects "
                                f"{tuple(ref.shape)} {ref.dtype}, {WEIGHTS_FILE} has "
                                f"{tuple(w.shape)} {w.dtype}", path=WEIGHTS_FILE)
        table[name] = torch.nn.Parameter(w, requires_grad=False) if entries.get(
            name, (None, False))[1] else w
    missing = [k for k in _weight_entries(ep) if k not in shared]
    if missing:  # every parameter/buffer is shared at build time; a stand-in must not survive
        raise ArtifactError(f"program {key.label} has weights {missing} that the "
                            "manifest does not list as shared", path=key.path)


def _programs_device(programs: dict):
    """The device of the programs' weights and constants (cpu when they hold none)."""
    for ep in programs.values():
        for t in list(ep.state_dict.values()) + list(ep.constants.values()):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                return t.device
    return torch.device("cpu")
