"""What a build can be refused for before any weight is loaded or any bucket exported.

Loading a checkpoint and exporting the step take seconds to minutes per bucket; the options,
the output directory and the checkpoint's config.json alone decide whether the build can
succeed, so they are checked first. Errors are ValueErrors naming the BuildConfig field
(`max_seq_len`, `disabled_passes`, ...); the CLI turns those names into its flags.
"""
from __future__ import annotations

import os
from pathlib import Path


def _writable_place(path: Path, field: str) -> None:
    """`path` can be created: it is a directory already, or its nearest existing ancestor is a
    writable directory."""
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if p == path:
        if not path.is_dir():
            raise ValueError(f"{field}: {path} exists and is not a directory")
        return
    if not p.is_dir():
        raise ValueError(f"{field}: cannot create {path}: {p} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"{field}: cannot create {path}: {p} is not writable")


def check_passes(passes, disabled) -> None:
    from dspark_compile.passes import REGISTRY, PassConfig, PassManager, PassPipelineError

    known = REGISTRY.names()
    for field, names in (("passes", passes or ()), ("disabled_passes", disabled)):
        bad = [n for n in names if n not in known]
        if bad:
            raise ValueError(f"{field}: unknown pass {bad[0]!r}; known passes: {', '.join(known)}")
    try:
        PassManager(passes, PassConfig(disabled=frozenset(disabled)))
    except PassPipelineError as e:
        raise ValueError(f"disabled_passes: {e}") from None


def check_build(ckpt, out, bc):
    """Checks `bc`, the output directory `out` and the checkpoint's config.json; returns the
    checkpoint's ModelConfig."""
    import torch

    from dspark_compile.artifact import not_an_engine
    from dspark_compile.models.checkpoint import CheckpointError
    from dspark_compile.models.config import ModelConfig, request_positions

    out = Path(out)
    why = not_an_engine(out)
    if why:
        raise ValueError(f"out_dir {out}: {why}; refusing to replace it")
    _writable_place(out.parent, "out_dir")
    root = Path(ckpt)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {root}")
    cfg = ModelConfig.from_file(root / "config.json")
    if not cfg.has_draft:
        raise ValueError("config field 'dspark_block_size': the checkpoint has no DSpark draft; "
                         "the engine compiles the draft-plus-verify step")
    # the smallest request: one prompt token and one new token, plus the step's lookahead
    least = request_positions(1, 1, cfg.dspark_block_size)
    msl = bc.max_seq_len
    if isinstance(msl, bool) or not isinstance(msl, int) or msl < least:
        raise ValueError(f"max_seq_len must be an int >= {least} (a 1-token prompt, 1 new token "
                         f"and the draft block of {cfg.dspark_block_size} with its lookahead), "
                         f"got {msl!r}")
    if isinstance(bc.prefill_chunk, bool) or not isinstance(bc.prefill_chunk, int) \
            or bc.prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive int, got {bc.prefill_chunk!r}")
    check_passes(bc.passes, bc.disabled_passes)
    if bc.arch is not None:
        from dspark_compile.kernels.sm12x import ARCHS
        if bc.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(sorted(ARCHS))}, got {bc.arch!r}")
    if bc.dump_dir is not None:
        _writable_place(Path(bc.dump_dir), "dump_dir")
    try:
        dev = torch.device(bc.device)
    except RuntimeError as e:
        raise ValueError(f"device {bc.device!r} is not a torch device ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {bc.device!r}: CUDA is not available on this machine")
    return cfg
