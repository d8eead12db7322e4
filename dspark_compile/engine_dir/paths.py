"""Every path an engine's manifest names stays inside the engine directory, checked before any
file but the manifest is opened.

An engine directory may come from somewhere else, and its manifest's checksum is one its author
can recompute, so the paths in it are input like any other:

- a manifest path is '/'-separated and relative, with no empty, '.' or '..' component, no NUL,
  no backslash, and is valid UTF-8 (`check_rel`); a violation names the manifest field;
- nothing inside the engine directory is a symbolic link, a FIFO, a socket or a device
  (`check_tree`): the build never writes one, a link is the one way a relative path leaves the
  directory, and a FIFO would block the reader forever;
- the kernel store (dspark_compile/engine_dir/kernel_store.py) holds Triton's cubins and metadata JSON and
  nothing else: a launcher module (`.so`) there is native code a load would import;
- the load opens only files of the manifest's file table, each through `open_file`, which
  refuses a link or anything but a regular file at the moment it is opened; a tokenizer.json
  outside the table (which `serve` would read unchecked) is refused.

A hard link is a regular file and is read as one: creating one to a file needs the right to
read that file (Linux's fs.protected_hardlinks, on by default), so it reveals nothing.

The engine directory itself may be a symbolic link (a user's `engines/latest`): it is what the
user named, and everything is checked below it.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from dspark_compile.engine_dir.format import PROGRAM_TABLES, TOKENIZER_FILES, ArtifactError

MAX_PATH_BYTES = 4096
STORE_ROOT = "kernels/triton"          # dspark_compile/engine_dir/kernel_store.py's STORE_ROOT
STORE_SUFFIXES = (".cubin", ".json")   # what a Triton cache hit reads that is not host code
_REBUILD = " — an engine built before the store left launchers out holds one: rebuild it"


def check_rel(rel, field: str) -> str:
    """`rel` as a path inside the engine directory, or an ArtifactError naming `field`."""
    def bad(why: str) -> ArtifactError:
        shown = field.encode("utf-8", "backslashreplace").decode("utf-8")
        return ArtifactError(f"manifest field '{shown}': path {rel!r} {why} — an engine names "
                             "only files inside its directory", field=shown)

    if not isinstance(rel, str) or not rel:
        raise bad("is not a non-empty string")
    if "\x00" in rel:
        raise bad("holds a NUL character")
    if "\\" in rel:
        raise bad("holds a backslash")
    try:
        size = len(rel.encode("utf-8"))
    except UnicodeEncodeError:
        raise bad("is not valid UTF-8") from None
    if size > MAX_PATH_BYTES:
        raise bad(f"is {size} bytes long (at most {MAX_PATH_BYTES})")
    if rel.startswith("/"):
        raise bad("is absolute")
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise bad("has an empty, '.' or '..' component")
    return rel


def manifest_paths(manifest: dict):
    """(field, path, kind) of every path the manifest names, kind "file" or "dir". Tables of
    the wrong type are skipped here: artifact_load's structure check names them."""
    files = manifest.get("files")
    if isinstance(files, dict):
        for rel in files:
            yield f"files.{rel}", rel, "file"
    for table in PROGRAM_TABLES:
        entries = manifest.get(table)
        if isinstance(entries, dict):
            for k, entry in entries.items():
                if isinstance(entry, dict) and "path" in entry:
                    yield f"{table}.{k}.path", entry["path"], "file"
                if isinstance(entry, dict) and isinstance(entry.get("constants"), str):
                    yield f"{table}.{k}.constants", entry["constants"], "file"
                variants = entry.get("variants") if isinstance(entry, dict) else None
                for v, rel in variants.items() if isinstance(variants, dict) else ():
                    yield f"{table}.{k}.variants.{v}", rel, "file"
    weights = manifest.get("weights")
    if isinstance(weights, dict) and "file" in weights:
        yield "weights.file", weights["file"], "file"
    store = manifest.get("kernel_store")
    if isinstance(store, dict) and "path" in store:
        yield "kernel_store.path", store["path"], "dir"
    compiled = manifest.get("compiled")
    for table in PROGRAM_TABLES:
        entries = compiled.get(table) if isinstance(compiled, dict) else None
        for k, variants in entries.items() if isinstance(entries, dict) else ():
            for v, rel in variants.items() if isinstance(variants, dict) else ():
                yield f"compiled.{table}.{k}.{v}", rel, "file"


def check_manifest_paths(manifest: dict) -> None:
    """Every path the manifest names is a relative path inside the engine (check_rel), and
    the kernel store's files are cubins and metadata JSON only."""
    for field, rel, _ in manifest_paths(manifest):
        check_rel(rel, field)
    store = manifest.get("kernel_store")
    if isinstance(store, dict) and isinstance(store.get("path"), str):
        root = store["path"]
        if root != STORE_ROOT and not root.startswith(STORE_ROOT + "/"):
            raise ArtifactError(f"manifest field 'kernel_store.path': {root!r} is not under "
                                f"{STORE_ROOT}/", field="kernel_store.path")
    files = manifest.get("files")
    for rel in files if isinstance(files, dict) else ():
        if rel.startswith(STORE_ROOT + "/") and not rel.endswith(STORE_SUFFIXES):
            raise ArtifactError(f"engine file '{rel}': the kernel store holds only "
                                f"{' and '.join(STORE_SUFFIXES)} files; a Triton launcher module "
                                "or any other file there is refused (it would be loaded as "
                                f"code){_REBUILD}", field="files", path=rel)


def check_tree(engine_dir: Path) -> None:
    """No symbolic link, FIFO, socket or device anywhere inside the engine directory, and
    only cubins and metadata JSON in its kernel store; each refusal names the file."""
    engine_dir = Path(engine_dir)
    stack = [(engine_dir, "")]
    while stack:
        here, prefix = stack.pop()
        try:
            entries = list(os.scandir(here))
        except OSError as e:
            raise ArtifactError(f"engine directory '{prefix or '.'}' cannot be listed "
                                f"({e.strerror or e})", path=prefix or ".") from e
        for entry in entries:
            rel = prefix + entry.name
            shown = ascii(rel)[1:-1] if not _utf8(rel) else rel
            if entry.is_symlink():
                raise ArtifactError(f"engine file '{shown}' is a symbolic link: an engine holds "
                                    "none (the build writes none), so nothing in it can point "
                                    "outside it", path=shown)
            if entry.is_dir(follow_symlinks=False):
                stack.append((Path(entry.path), rel + "/"))
                continue
            if not entry.is_file(follow_symlinks=False):
                raise ArtifactError(f"engine file '{shown}' is not a regular file (a FIFO, "
                                    "socket or device): an engine holds only files and "
                                    "directories", path=shown)
            if rel.startswith(STORE_ROOT + "/") and not rel.endswith(STORE_SUFFIXES):
                raise ArtifactError(f"engine file '{shown}': the kernel store holds only "
                                    f"{' and '.join(STORE_SUFFIXES)} files; a Triton launcher "
                                    "module or any other file there is refused (it would be "
                                    f"loaded as code){_REBUILD}", path=shown)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_engine(engine_dir: Path, manifest: dict) -> None:
    """The manifest's paths and the directory's contents, before any file is opened; a
    tokenizer.json (which `serve` reads) must be one of the checksummed files."""
    check_manifest_paths(manifest)
    check_tree(engine_dir)
    files = manifest.get("files")
    for name in TOKENIZER_FILES:        # serve reads them (the chat template is engine data)
        if (Path(engine_dir) / name).exists() and not (isinstance(files, dict)
                                                       and name in files):
            raise ArtifactError(f"engine file '{name}' is not in the manifest's file table, so "
                                "it is not checked: the build writes it and checksums it — "
                                "rebuild, or remove the file", path=name)


def open_file(engine_dir: Path, rel: str, field: str = "files"):
    """A binary file object of the engine file `rel` (a manifest path): each component opened
    below the one before it without following a link, the file without blocking, and refused
    unless it is a regular file -- so what is read is what was checked, whatever changes in the
    directory meanwhile."""
    check_rel(rel, field)
    nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    parts = rel.split("/")
    fds = []
    try:
        try:
            fds.append(os.open(engine_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                               | getattr(os, "O_CLOEXEC", 0)))
            for part in parts[:-1]:
                fds.append(os.open(part, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow,
                                   dir_fd=fds[-1]))
            fd = os.open(parts[-1], os.O_RDONLY | nofollow | getattr(os, "O_NONBLOCK", 0),
                         dir_fd=fds[-1])
        except FileNotFoundError:
            raise ArtifactError(f"engine file '{rel}' is missing", path=rel) from None
        except OSError as e:
            raise ArtifactError(f"engine file '{rel}' cannot be opened ({e.strerror or e}; "
                                "a symbolic link or not a file?)", path=rel) from None
    finally:
        for d in fds:
            os.close(d)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArtifactError(f"engine file '{rel}' is not a file", path=rel)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_file(engine_dir: Path, rel: str, limit: int, field: str = "files") -> bytes:
    """The bytes of the engine file `rel` (open_file), refused beyond `limit` bytes."""
    with open_file(engine_dir, rel, field) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ArtifactError(f"engine file '{rel}' is larger than {limit} bytes", path=rel)
    return data
