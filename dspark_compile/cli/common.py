"""What every `dspark-compile` subcommand module shares: the subcommand table, the errors that
are reported as one line, and the helpers that turn library names into CLI flags.

cli.py builds the parser from :data:`COMMANDS` and imports the subcommand modules
(cli_engine.py); those import only this module, so there is no import cycle.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import signal
import threading
from dataclasses import dataclass, field
from typing import Callable
from dspark_compile.engine_dir.format import ArtifactError

PROG = "dspark-compile"


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # library parameter name (as a message spells it) -> the flag that sets it
    flags: dict = field(default_factory=dict)


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
            flags: dict | None = None):
    """Register the decorated `fn(args) -> exit status` as subcommand `name`. `flags` maps the
    library's parameter names to this command's flags, for messages that reach the CLI."""

    def deco(fn: Callable[[argparse.Namespace], int]):
        if name in COMMANDS:
            raise RuntimeError(f"subcommand {name!r} registered twice")
        COMMANDS[name] = Command(name, help, add_arguments, fn, dict(flags or {}))
        return fn

    return deco


# Bad input, reported as one line. ConfigError and CheckpointError are ValueErrors; OSError
# covers paths that cannot be read or written. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def to_flags(message: str, flags: dict) -> str:
    """`message` with each library parameter name in `flags` replaced by its CLI flag. Names
    inside quotes ("config field 'top_k'") are a file's own field names and stay, and so do
    parts of paths and file names (`/data/seed/ckpt`, `buckets.json`)."""
    for name in sorted(flags, key=len, reverse=True):
        message = re.sub(rf"(?<![\w'\"./\\-]){re.escape(name)}(?![\w'\"./\\])", flags[name],
                         message)
    return message


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that `finally` / `except BaseException` blocks
    (the atomic writers' temporary-directory cleanup) run before the process exits."""


@contextlib.contextmanager
def sigterm_raises():
    """While active, SIGTERM raises :class:`Terminated` (a no-op outside the main thread,
    where Python cannot install signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"terminated by signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def device(name: str):
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a torch device ({e})") from None
    if dev.type not in DEVICE_TYPES:
        # meta, mps, xpu ...: the models, kernels and engines are written for these two; a
        # meta synth failed deep in the generator, a meta build ran minutes of export first
        raise ValueError(f"--device {name!r}: only {' and '.join(DEVICE_TYPES)} devices are "
                         "supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA "
                         "device(s)")
    return dev


DEVICE_TYPES = ("cpu", "cuda")


def int_arg(low: int, high: int | None = None, expected: str | None = None):
    """An argparse type: an int in [low, high] (no upper bound when high is None); the usage
    error says what was expected and the bound."""
    what = expected or f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if n < low or (high is not None and n > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {n}")
        return n
    return parse


def engine_load_args(p: argparse.ArgumentParser) -> None:
    """The flags of a command that loads an engine (run, serve): where, with graphs or not,
    and whether its programs may be code."""
    p.add_argument("--device", default=None,
                   help="device to run on (default: the device the engine was built for)")
    p.add_argument("--no-graphs", action="store_true", help="run the programs without CUDA graphs")
    p.add_argument("--trust-engine-code", action="store_true",
                   help="load an engine whose programs are code (--backend inductor: the Python "
                        "in its compiled/ directory runs); only for an engine you built or "
                        "trust. An aten engine needs no flag: its load executes nothing from "
                        "the directory")


def prefill_chunks_arg(text: str):
    """--prefill-chunks: comma-separated chunk lengths, "auto" (BuildConfig's rule:
    default_prefill_chunks) or "none" / "0" (no prefill programs)."""
    low = text.strip().lower()
    if low == "auto":
        return "auto"
    if low in ("none", "0"):
        return ()
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated chunk lengths, 'auto' or "
                                         f"'none', got {text!r}") from None


def path_arg(text: str) -> str:
    """A path argument: an empty one is refused (it meant the current directory, and `synth
    --out ''` then said the current directory was not empty)."""
    if not text.strip():
        import argparse
        raise argparse.ArgumentTypeError("empty path")
    return text


@contextlib.contextmanager
def engine_errors():
    """An engine directory that is missing, not an engine, stale or corrupted is bad input:
    one line naming the file or field (cli.main reports ValueErrors that way), no traceback."""
    try:
        yield
    except ArtifactError as e:
        raise ValueError(str(e)) from e
