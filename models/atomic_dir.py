"""Directories written atomically: a temporary sibling renamed into place, and what to do with
the temporaries a killed writer leaves behind.

A writer (save_engine, synth_checkpoint) builds `.<name>.tmp-<host>-<pid>-<random>` next to
the destination and parks a replaced directory as `.<name>.old-<host>-<pid>-<random>` until
the rename is done. SIGKILL (or SIGTERM without the CLI's handler) skips the writer's cleanup,
and with a real model such a directory holds gigabytes, so the next write of the same
destination removes the ones whose process is gone. The host tag and pid in the name say
whose it is: a temporary of a live process (a concurrent build of the same output) or of
another host (a shared file system, where this host cannot see that pid) is left alone.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

KINDS = ("tmp", "old")
PARKED = "previous"     # the replaced directory, inside its `.old-` temporary


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temp_dir(dest: Path, kind: str = "tmp") -> Path:
    """A new empty directory next to `dest`, named for this host and process."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    dest = Path(dest)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.{kind}-{_host_tag()}-{os.getpid()}-",
                                 dir=dest.parent))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists, owned by another user
        return True
    return True


def stale_temps(dest: Path) -> list[Path]:
    """This host's temporaries of `dest` whose writing process has exited."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.(?:{'|'.join(KINDS)})-"
                         rf"{_host_tag()}-(\d+)-[a-z0-9_]+")
    out = []
    for p in sorted(dest.parent.iterdir()):
        m = pattern.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and not _alive(int(m.group(1))):
            out.append(p)
    return out


def remove_stale_temps(dest: Path) -> list[Path]:
    """Remove :func:`stale_temps` of `dest`; returns what was removed. A writer killed between
    parking the previous `dest` and renaming its own into place left no `dest`: the parked
    directory goes back first."""
    dest = Path(dest)
    removed = stale_temps(dest)
    if not dest.exists():
        for p in removed:
            if p.name.startswith(f".{dest.name}.old-") and (p / PARKED).is_dir():
                os.rename(p / PARKED, dest)
                break
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def fsync_dir(path) -> None:
    """Make a rename inside directory `path` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_into_place(tmp: Path, dest: Path) -> None:
    """Rename the finished `tmp` to `dest`. An existing `dest` (the caller has checked that it
    may go) is parked in an `.old-` temporary first, put back if the rename fails, and removed
    once it succeeded; an empty one is simply removed."""
    dest = Path(dest)
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        dest.rmdir()
    if not dest.exists():
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
        return
    parked = temp_dir(dest, "old")
    os.rename(dest, parked / PARKED)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(parked / PARKED, dest)
        raise
    fsync_dir(dest.parent)
    shutil.rmtree(parked, ignore_errors=True)


def replace_refusal(dest: Path, what: str, required: str, allowed: set[str],
                    patterns=()) -> str | None:
    """Why replacing the existing `dest` could delete something that is not a `what` (None
    when `dest` is missing, empty, or holds `required` and otherwise only names in `allowed`
    or matching one of `patterns`, regular expressions for the whole name)."""
    dest = Path(dest)
    if not dest.exists():
        return None
    if not dest.is_dir():
        return "it is not a directory"
    names = sorted(p.name for p in dest.iterdir())
    if not names:
        return None
    if required not in names:
        return f"it is not {what} directory (no {required})"
    other = [n for n in names if n not in allowed and n != required
             and not any(re.fullmatch(r, n) for r in patterns)]
    if other:
        return (f"it holds more than {what}: {other[:5]}"
                f"{f' and {len(other) - 5} more' if len(other) > 5 else ''}, which replacing "
                "it would delete")
    return None
