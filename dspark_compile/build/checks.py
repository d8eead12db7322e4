"""What a build can be refused for before any weight is loaded or any bucket exported.

Loading a checkpoint and exporting the step take seconds to minutes per bucket; the options,
the output directory and the checkpoint's config.json alone decide whether the build can
succeed, so they are checked first. Errors are ValueErrors naming the BuildConfig field
(`max_seq_len`, `disabled_passes`, ...); the CLI turns those names into its flags.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from dspark_compile.engine_dir.format import TOKENIZER_FILE
from dspark_compile.build.memory_plan import check_fits, device_memory, format_plan, memory_plan
from dspark_compile.kernels.sm12x import ARCHS
from dspark_compile.models.checkpoint import CheckpointError, missing_dir, read_config
from dspark_compile.models.config import request_positions
from dspark_compile.models.state import check_state_fits
from dspark_compile.passes import PassConfig, PassManager, PassPipelineError, REGISTRY


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and not p.is_symlink() and p.parent != p:
        p = p.parent
    return p


def _probe_dir(p: Path, field: str, path: Path) -> None:
    """Create and remove a directory inside `p`: os.access says yes to root on read-only and
    pseudo file systems (/proc), where the build failed only when it wrote, minutes later."""
    try:
        q = tempfile.mkdtemp(prefix=".dspark-probe-", dir=p)
    except OSError as e:
        raise ValueError(f"{field}: cannot write {path}: {p} is not writable "
                         f"({e.strerror or e})") from None
    with contextlib.suppress(OSError):
        os.rmdir(q)


def writable_dir(path, field: str) -> None:
    """`path` can be written as a directory: it is one already, or it can be created (its
    nearest existing ancestor is a directory this process can create entries in)."""
    path = Path(path)
    p = _nearest_existing(path)
    if p == path:
        if not path.is_dir():
            raise ValueError(f"{field}: {path} exists and is not a directory")
        _probe_dir(path, field, path)
        return
    if not p.is_dir():
        raise ValueError(f"{field}: cannot create {path}: {p} is not a directory")
    _probe_dir(p, field, path)


def writable_sibling(path, field: str) -> None:
    """A directory can be created next to `path` (an atomic writer's temporary, renamed to
    `path`): the nearest existing ancestor of its parent is a writable directory."""
    path = Path(path)
    p = _nearest_existing(path.parent)
    if not p.is_dir():
        raise ValueError(f"{field}: cannot create {path}: {p} is not a directory")
    _probe_dir(p, field, path)


def writable_file(path, field: str) -> None:
    """`path` can be written as a file: not a directory, and its directory exists or can be
    created."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{field}: {path} is a directory, not a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{field}: {path} is not writable")
    p = _nearest_existing(path.parent)
    if not p.is_dir():
        raise ValueError(f"{field}: cannot write {path}: {p} is not a directory")
    _probe_dir(p, field, path)


def check_passes(passes, disabled) -> None:

    known = REGISTRY.names()
    for field, names in (("passes", passes or ()), ("disabled_passes", disabled)):
        bad = [n for n in names if n not in known]
        if bad:
            raise ValueError(f"{field}: unknown pass {bad[0]!r}; known passes: {', '.join(known)}")
    try:
        PassManager(passes, PassConfig(disabled=frozenset(disabled)))
    except PassPipelineError as e:
        raise ValueError(f"disabled_passes: {e}") from None


def check_build(ckpt, out, bc, log=None, target=None):
    """Checks `bc`, the output directory `out` and the checkpoint's config.json; returns the
    checkpoint's ModelConfig. `log` (a print-like callable) gets the memory plan's table;
    `target` (memory_plan.DeviceMemory) is the device the engine must fit, default the CUDA
    device built on (none on a CPU build: the plan is printed, not checked)."""
    import torch


    out = Path(out)
    from dspark_compile.build.tp_build import replace_refusal   # (tp_build imports this module)
    why = replace_refusal(out)       # absent, empty, an engine or a tp engine (ranks.json)
    if why:
        raise ValueError(f"out_dir {out}: {why}; refusing to replace it")
    writable_sibling(out, "out_dir")
    root = Path(ckpt)
    if not root.is_dir():
        raise CheckpointError(missing_dir(root))
    cfg = read_config(root / "config.json")
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
    _check_positions(cfg, msl)
    if isinstance(bc.prefill_chunk, bool) or not isinstance(bc.prefill_chunk, int) \
            or bc.prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive int, got {bc.prefill_chunk!r}")
    check_passes(bc.passes, bc.disabled_passes)
    if bc.arch is not None:
        if bc.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(sorted(ARCHS))}, got {bc.arch!r}")
    if bc.dump_dir is not None:
        _check_dump_dir(Path(bc.dump_dir), out)
        writable_dir(Path(bc.dump_dir), "dump_dir")
    try:
        dev = torch.device(bc.device)
    except RuntimeError as e:
        raise ValueError(f"device {bc.device!r} is not a torch device ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {bc.device!r}: only cpu and cuda devices are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {bc.device!r}: CUDA is not available on this machine")
    _check_tokenizer(root)
    _check_state_fits(cfg, bc, dev)
    _check_memory_plan(cfg, bc, dev, log, target)
    return cfg


def _inside(path: Path, root: Path) -> bool:
    """`path` is `root` or below it, symbolic links and `..` resolved."""
    path, root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return path == root or root in path.parents


def _check_dump_dir(dump: Path, out: Path) -> None:
    """Graphs dumped into the engine directory made it a directory of other files, which the
    write at the end then refused to replace: minutes of export lost."""
    if _inside(dump, out):
        raise ValueError(f"dump_dir {dump} is inside out_dir {out}: the engine directory holds "
                         "only the engine's files; dump the graphs elsewhere")


def _check_positions(cfg, msl) -> None:
    """Positions past the model's max_position_embeddings are positions it was never built
    for (its RoPE scaling is defined up to there): the engine refuses them at build time."""
    if msl > cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len={msl} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings} (config.json)")


def _check_tokenizer(root: Path) -> None:
    """The checkpoint's tokenizer.json, copied into the engine: a file holding JSON."""
    tok = root / TOKENIZER_FILE
    if not tok.exists() and not tok.is_symlink():
        return
    if not tok.is_file():
        raise CheckpointError(f"{tok} is not a file", file=TOKENIZER_FILE)
    try:
        json.loads(tok.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{tok} is not a readable JSON file ({type(e).__name__}: {e})",
                              file=TOKENIZER_FILE) from None


def _check_state_fits(cfg, bc, dev) -> None:
    """The decode state (one per program exported, the largest part of a build's memory) is
    sized from the options alone: refuse one the device cannot hold before allocating it."""
    cache = bc.cache(cfg.dspark_block_size)
    check_state_fits(cfg, cache, bc.precision(), dev,
                     f"max_rows={bc.max_rows} rows (buckets up to {bc.buckets[-1]}), "
                     f"max_seq_len={bc.max_seq_len} positions and {cache.max_step_tokens} tokens "
                     "per forward (prefill_chunk, prefill_chunks, the draft block + 1)")


def _check_memory_plan(cfg, bc, dev, log, target) -> None:
    """Each rank's weights, RoPE tables, decode state, graph pool and workspace, from the
    config (build/memory_plan.py), printed, and refused when they exceed the target device's
    memory: a Flash engine that cannot fit fails here, not after minutes of loading 150 GB.
    The rank count is BuildConfig.tp (issue 53's `build --tp`; 1 where it has none)."""
    plan = memory_plan(cfg, bc, getattr(bc, "tp", 1))
    device = target if target is not None else device_memory(cuda_device=dev)
    if log is not None:
        log(format_plan(plan, device))
    if device is not None:
        check_fits(plan, device)
