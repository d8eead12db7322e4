"""The flags the engine benchmarks share (step.py, prefill.py, host_overhead.py, speedup.py and
the smaller ones), each defined once, and the parsers of their values.

A script adds the shared flags it takes with the `add_*` functions, in the order its --help lists
them; a parser below turns a flag's text into its value, or stops the run with argparse's usage
error naming the flag (`argument --buckets: expected comma-separated positive integers, got
'1,x'`). Where scripts differ on a flag's default (--buckets, --backend) the default is a
parameter; where they differ on what --dry-run changes, so is that flag's help.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRESETS = ("tiny", "tiny-deep", "flash-slice")   # tiny-deep: tiny widths, Flash's 43 layers
DTYPES = ("bfloat16", "float32", "float64")
BACKENDS = ("inductor", "aten")
# flag -> (full run's default, --dry-run's): the dry run is the tiny preset on the CPU, where
# float32 is the reference precision and 64 positions hold its short prompts
DRY_RUN_DEFAULTS = {"dtype": ("bfloat16", "float32"), "max_seq_len": (256, 64)}


# ------------------------------------------------------------------------------------------------
# value parsers (argparse `type=`: argparse names the flag in the error)
# ------------------------------------------------------------------------------------------------

def ordered_ints(text: str) -> list[int]:
    """'4,1,4' -> [4, 1, 4]: positive integers in the order given (levels, probe rows)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}")
    return out


def ints(text: str) -> list[int]:
    """'64,1,16,1' -> [1, 16, 64]: distinct positive integers, ascending (buckets, batches,
    chunk lengths: sizes, each measured once)."""
    return sorted(set(ordered_ints(text)))


def names(choices, empty_ok: bool = False):
    """A parser of a comma-separated subset of `choices`, in the order given. `empty_ok`: an
    empty list is a valid value (step.py --variants '': the floors alone)."""
    def parse(text: str) -> list[str]:
        got = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in got if n not in choices]
        if bad or not (got or empty_ok):
            raise argparse.ArgumentTypeError(
                f"unknown {bad}; expected a comma-separated subset of {','.join(choices)}"
                if bad else f"expected a comma-separated subset of {','.join(choices)}")
        return got
    return parse


def at_least(low: int):
    """A parser of an integer >= low (--threads, --replays)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    return parse


# ------------------------------------------------------------------------------------------------
# the shared flags
# ------------------------------------------------------------------------------------------------

def add_preset(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=PRESETS)


def add_buckets(p: argparse.ArgumentParser, default: str,
                help: str = "batch sizes, each a bucket of the engine") -> None:
    """Defaults differ: step.py 1,4,16,64, host_overhead.py 1,64, load_time.py 1,2,...,64."""
    p.add_argument("--buckets", type=ints, default=default, help=help)


def add_dtype(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """Default None, resolved after parsing: `dry_run_defaults` (speedup.py: by device)."""
    full, dry = DRY_RUN_DEFAULTS["dtype"]
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help=help or f"compute dtype (default {full}; --dry-run {dry})")


def add_backend(p: argparse.ArgumentParser, default: str | None = None) -> None:
    """Default None: the build's (inductor on CUDA); prefill.py passes aten."""
    p.add_argument("--backend", default=default, choices=BACKENDS,
                   help="the engine's --backend (default: "
                        + (default or "the build's, inductor on CUDA") + ")")


def add_max_seq_len(p: argparse.ArgumentParser) -> None:
    full, dry = DRY_RUN_DEFAULTS["max_seq_len"]
    p.add_argument("--max-seq-len", type=at_least(1), default=None,
                   help=f"positions per request (default {full}; --dry-run {dry})")


def add_run_flags(p: argparse.ArgumentParser, kind: str, dry_run_help: str,
                  seed_help: str | None = None) -> None:
    """--seed, --work, --out, --dry-run, --threads, --git-commit, in that order."""
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--work", default=None,
                   help="directory for the checkpoint and engine, reused when they match "
                        "(default: a temporary directory, deleted at the end)")
    add_out(p, kind)
    p.add_argument("--dry-run", action="store_true", help=dry_run_help)
    add_threads(p)
    add_git_commit(p)


def add_out(p: argparse.ArgumentParser, kind: str) -> None:
    """`kind` names the default directory (`out_dir`)."""
    p.add_argument("--out", default=None,
                   help=f"output directory (default benchmarks/results/<device>_{kind}_<date>/)")


def add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=at_least(1), default=1, help="torch CPU threads")


def add_git_commit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--git-commit", default=None,
                   help="when the machine has no .git")


# ------------------------------------------------------------------------------------------------
# values that depend on --dry-run, --out and --work; the result file
# ------------------------------------------------------------------------------------------------

def dry_run_defaults(args, *flags: str) -> None:
    """Fills each of `flags` (attribute names) not given with its default from DRY_RUN_DEFAULTS:
    the full run's, or the --dry-run one."""
    for name in flags:
        if getattr(args, name) is None:
            full, dry = DRY_RUN_DEFAULTS[name]
            setattr(args, name, dry if args.dry_run else full)


def default_out(device_name: str, kind: str = "step") -> Path:
    slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_") or "device"
    day = datetime.date.today().isoformat()
    return REPO / "benchmarks" / "results" / f"{slug}_{kind}_{day}"


def out_dir(args, env: dict, kind: str) -> Path:
    """--out, or benchmarks/results/<device>_<kind>_<date>/; created."""
    out = Path(args.out) if args.out else default_out(env.get("device") or "cpu", kind)
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def work_dir(args, prefix: str):
    """--work (kept), or a temporary directory deleted when the block ends."""
    tmp = None if args.work else tempfile.mkdtemp(prefix=prefix)
    work = Path(args.work or tmp)
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def result_file(path: Path, rec: dict):
    """Yields write(): `rec` as JSON at `path`, replaced whole (a reader never sees half a file);
    written once more when the block ends, however it ends ("complete": false until the run
    sets it)."""
    def write():
        write_record(path, rec)
    try:
        yield write
    finally:
        write()


def write_record(path: Path, rec) -> None:
    """`rec` as JSON at `path` (its folder made), replaced whole: a reader never sees half a
    file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    os.replace(tmp, path)
