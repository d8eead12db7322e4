"""Directories written atomically: a temporary sibling renamed into place, and what to do with
the temporaries a killed writer leaves behind.

A writer (save_engine, synth_checkpoint) builds `.<name>.tmp-<host>-<pid>-<random>` next to
the destination and parks a replaced directory as `.<name>.old-<host>-<pid>-<random>` until
the rename is done. SIGKILL (or SIGTERM without the CLI's handler) skips the writer's cleanup,
and with a real model such a directory holds gigabytes, so the next write of the same
destination removes the ones whose process is gone. The host tag and pid in the name say
whose it is: a temporary of a live process (a concurrent build of the same output) or of
another host (a shared file system, where this host cannot see that pid) is left alone.

One writer a destination: :func:`output_lock` holds an exclusive `flock` on `.<name>.lock`
beside the destination for the whole write, so a second writer of the same destination is
refused at once, naming the first (pid, host, start time: the lock file's content, which is
only informative). The kernel drops the lock when its holder dies, so the file a SIGKILL
leaves behind never blocks the next writer. A destination that appears while the lock is held
(a writer that does not take it) is never replaced unless the caller allows replacing
(:func:`move_into_place`).

A full disk: :func:`check_free_space` refuses a write the destination's file system cannot
hold before it begins, and :func:`disk_errors` turns ENOSPC / EDQUOT / EFBIG / EROFS during
the write into one :class:`NoSpaceError` naming the destination and the bytes it needs.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

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


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it process-wide)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def move_into_place(tmp: Path, dest: Path, replace: bool = True) -> None:
    """Rename the finished `tmp` to `dest`. An existing `dest` (the caller has checked that it
    may go) is parked in an `.old-` temporary first, put back if the rename fails, and removed
    once it succeeded; an empty one is simply removed. With `replace=False` a non-empty `dest`
    (one that appeared after the caller's check: a writer that took no lock) is refused with
    FileExistsError, never replaced: the plain rename of a directory fails on a non-empty
    directory or a file, so nothing can slip in between that check and the rename."""
    dest = Path(dest)
    # mkdtemp made it 0700; the destination gets a new directory's mode (0755 under the usual
    # umask), or an engine built by one user could not be served by another
    os.chmod(tmp, 0o777 & ~_umask())
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        dest.rmdir()
    if not replace or not (dest.exists() or dest.is_symlink()):
        try:
            os.rename(tmp, dest)
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise FileExistsError(f"refusing to replace {dest}: it appeared while this write "
                                      "ran (another writer?); pass overwrite=True to replace "
                                      "it") from None
            raise
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


# --------------------------------------------------------------------------- one writer
class OutputLocked(OSError):
    """Another writer holds the destination's lock."""


_HELD: dict[str, list] = {}     # lock path -> [fd, thread id, depth] of this process's locks
_HELD_GUARD = threading.Lock()
# a holder writes its line just after taking the lock; a reader that finds it empty waits this
# long (5 x 20 ms) before saying the holder is unknown
_READ_TRIES, _READ_WAIT_S = 5, 0.02


def canonical(dest) -> Path:
    """`dest` with its parent's symbolic links and `..` resolved (as the kernel resolves them),
    so two spellings of one destination share one lock and one temporary's directory."""
    dest = Path(dest)
    if dest.name in ("", ".."):
        return Path(os.path.realpath(dest))
    return Path(os.path.realpath(dest.parent)) / dest.name


def lock_path(dest) -> Path:
    dest = canonical(dest)
    return dest.parent / f".{dest.name}.lock"


def _holder(fd: int) -> str:
    for _ in range(_READ_TRIES):
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            return (f"pid {info['pid']} on host {info['host']}, a {info['what']} started "
                    f"{info['started_utc']}")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            time.sleep(_READ_WAIT_S)
    return "a process whose lock file does not say who"


def _acquire(path: Path, dest: Path, what: str) -> int | None:
    """An fd holding LOCK_EX on `path`, or None where the file system has no locks."""
    for _ in range(100):
        # O_NOFOLLOW: a link planted at the lock's name (in a shared directory such as /tmp)
        # must not make this process truncate and write the file it points to
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise OutputLocked(f"{dest}: its lock file {path} is a symbolic link; remove it") \
                from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OutputLocked(f"{dest}: its lock file {path} is not a regular file; "
                                   "remove it")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(fd)
            os.close(fd)
            raise OutputLocked(f"{dest} is being written by another process ({who}); wait "
                               f"for it to finish or choose another output (lock: {path})") \
                from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return None     # no locks here: move_into_place's no-replace rule still holds
            raise
        except BaseException:
            os.close(fd)
            raise
        # a holder releasing its lock unlinks the file first: the inode locked here may be
        # one nobody else will open again; lock the file the path names now instead
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            info = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
                    "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
            return fd
        os.close(fd)
    raise OutputLocked(f"{dest}: could not lock {path} (it kept being replaced)")


@contextlib.contextmanager
def output_lock(dest, what: str = "writer"):
    """Hold the exclusive lock of `dest` (a `.<name>.lock` file beside it) for the block.

    Another process holding it: OutputLocked naming that process. Re-entrant within one thread
    (build_engine holds it while save_engine takes it again); another thread of this process
    is refused like another process. On leaving, the lock file is removed, then released."""
    dest = canonical(dest)
    path = lock_path(dest)
    key = str(path)
    with _HELD_GUARD:
        held = _HELD.get(key)
        if held is not None and held[1] != threading.get_ident():
            raise OutputLocked(f"{dest} is being written by another thread of this process "
                               f"(pid {os.getpid()})")
        if held is not None:
            held[2] += 1
    if held is not None:
        try:
            yield path
        finally:
            with _HELD_GUARD:
                held[2] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _acquire(path, dest, what)
    with _HELD_GUARD:
        _HELD[key] = [fd, threading.get_ident(), 1]
    try:
        yield path
    finally:
        with _HELD_GUARD:
            del _HELD[key]
        if fd is not None:
            with contextlib.suppress(OSError):
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    os.unlink(path)
            os.close(fd)


# --------------------------------------------------------------------------- a full disk
class NoSpaceError(OSError):
    """The destination's file system cannot hold what is being written."""


# a full file system, a quota, a file-size limit, a file system remounted read-only
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
# what a file system spends beyond the bytes written: each file rounded up to its block size
# (4 KiB on ext4 / xfs / tmpfs) plus directory entries; a megabyte covers hundreds of files
FS_BLOCK = 4096
MARGIN_BYTES = 1 << 20


def free_bytes(path) -> int:
    """Bytes this process may still write on the file system holding `path` (or its nearest
    existing ancestor)."""
    p = Path(path)
    while not p.exists() and p.parent != p:
        p = p.parent
    return shutil.disk_usage(p).free


def needed_bytes(file_bytes, n_files: int) -> int:
    """What writing `n_files` files of `file_bytes` bytes in all takes on disk, with the
    margin above."""
    return int(file_bytes) + FS_BLOCK * int(n_files) + MARGIN_BYTES


def check_free_space(dest, need: int, what: str,
                     free: Callable[[Path], int] | None = None) -> int:
    """Refuse to write `need` bytes next to `dest` when its file system has fewer free: one
    NoSpaceError naming `dest` and both numbers. `free` (default free_bytes) is the seam the
    tests pass a full disk through. Returns the free bytes."""
    dest = Path(dest)
    have = (free or free_bytes)(dest.parent)
    if need > have:
        e = NoSpaceError(f"cannot write {what} {dest}: it needs about {need:,} bytes and its file "
                         f"system has {have:,} bytes free")
        e.errno = errno.ENOSPC
        raise e
    return have


def _disk_errno(e: BaseException) -> int | None:
    if isinstance(e, OSError) and not isinstance(e, NoSpaceError):
        return e.errno if e.errno in DISK_ERRNOS else None
    # safetensors' writer raises its own SafetensorError carrying the OS error's text and code,
    # e.g. "Error while serializing: I/O error: No space left on device (os error 28)"
    m = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" \
        else None
    return int(m.group(1)) if m and int(m.group(1)) in DISK_ERRNOS else None


@contextlib.contextmanager
def disk_errors(dest, what: str, need: int):
    """A write that fails for want of space (or of a writable file system) inside the block
    becomes one NoSpaceError naming `dest` and the `need`ed bytes; the caller's own cleanup
    (its temporary removed) has run by then, inside the block."""
    try:
        yield
    except Exception as e:
        code = _disk_errno(e)
        if code is None:
            raise
        try:
            free = f"; {free_bytes(Path(dest).parent):,} bytes are free without its temporary"
        except OSError:
            free = ""
        err = NoSpaceError(f"cannot write {what} {dest}: {os.strerror(code)} (it needs about "
                           f"{need:,} bytes{free})")
        err.errno = code
        raise err from None
