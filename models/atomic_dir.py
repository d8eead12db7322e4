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
    when `dest` is missing, empty, or holds the file `required` and otherwise only files its
    writer writes).

    The whole tree is checked, not only the top level: every file must be `required`, a
    relative path in `allowed` ("programs/step_b1.pt2", '/'-separated) or, at the top level,
    a name matching one of `patterns` (regular expressions for the whole name). A symbolic
    link, a special file or an empty directory is never what a writer leaves, so it is
    refused too (a user's file below the top level, `ENGINE/programs/mine.txt`, was deleted
    when only the top level was compared)."""
    dest = Path(dest)
    if not dest.exists():
        return None
    if not dest.is_dir():
        return "it is not a directory"
    if not any(dest.iterdir()):
        return None
    if not (dest / required).is_file() or (dest / required).is_symlink():
        return f"it is not {what} directory (no {required})"
    other = []
    for root, dirs, files in os.walk(dest):    # does not follow symbolic links
        base = Path(root)
        for name in sorted(dirs):
            p = base / name
            rel = p.relative_to(dest).as_posix()
            if p.is_symlink():
                other.append(f"{rel} (a symbolic link)")
            elif not any(p.iterdir()):
                other.append(f"{rel}/ (an empty directory)")
        for name in sorted(files):
            p = base / name
            rel = p.relative_to(dest).as_posix()
            if p.is_symlink():
                other.append(f"{rel} (a symbolic link)")
            elif not p.is_file():
                other.append(f"{rel} (not a regular file)")
            elif not (rel == required or rel in allowed or (
                    "/" not in rel and any(re.fullmatch(r, rel) for r in patterns))):
                other.append(rel)
        dirs[:] = [d for d in dirs if not (base / d).is_symlink()]
    if other:
        other.sort()
        return (f"it holds more than {what}: {other[:5]}"
                f"{f' and {len(other) - 5} more' if len(other) > 5 else ''}, which replacing "
                "it would delete")
    return None
