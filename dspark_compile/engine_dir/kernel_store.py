"""The engine's compiled Triton kernels: compiled at build time for the build's SM, stored in
the engine, used at load, so a load on a fresh machine compiles nothing.

Triton finds a compiled kernel by a hash of its source, its specialisation, the compile options,
the target (SM, ptxas) and Triton's own sources (`triton.compiler.compile`), through the cache
manager class in `triton.knobs.cache.manager_class`; a hit reads a cubin and a metadata JSON
and loads the module (well under a millisecond), a miss compiles (0.5-3 s a kernel on the H200
machine: 224 of the 262 s the tiny engine's first load took there). So the store keeps Triton's
own cache entries, one folder per cache key:

    kernels/triton/sm{XY}-triton{version}/{key}/{name}.cubin, {name}.json, ..., __grp__{name}.json

(group files list their members by name, not by the build machine's paths), and a load lets
Triton's lookup see them: `install` puts `StoreCacheManager` in front of whatever cache manager
was configured, reading the engine's entries first and the user's own cache (where every miss is
written, as before) otherwise. A cache key covers everything the binary depends on, so a stored
entry is only ever used where Triton itself would have produced the same one; an SM or Triton
version other than the store's just misses, compiles and says so in one line (or, with
`policy="require"`, is refused).

What the store holds is GPU code and data only: the kernels' cubins and their metadata JSON.
Triton's host-side launcher module (`cuda_utils*.so`, built by Triton 3.7 from its own
driver.c, triton/backends/nvidia/driver.py; Triton 3.6 builds one a kernel signature) is native
code a cache hit would import, so the store never holds one: a load on a machine whose Triton
cache lacks it builds it there with the C compiler (once per machine and Triton version for
3.7), into Triton's own cache directory. The store's manager
hands Triton only the files of the engine's checked file table, only cubins and JSON, and a
group file's members only by plain name inside its entry; artifact_paths.check_tree refuses any
other file in the store before the load reads anything, and `use_store` a metadata JSON with
tensor-descriptor entries (`_check_metadata`).

Build side: `record()` around a warm-up run of every program (dspark_compile/build/pipeline.py) notes
every entry Triton read or wrote, and `collect()` adds the kernels already compiled in this
process (a `--verify-passes` run before the warm-up launches kernels that never reach the
cache manager again), then returns the files to store.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark_compile.engine_dir.paths import STORE_ROOT, STORE_SUFFIXES, check_rel, check_tree
from dspark_compile.engine_dir.format import ArtifactError

GROUP_PREFIX = "__grp__"
POLICIES = ("use", "require", "ignore")
# what a cache hit reads that is not host code: the binary and its metadata (never a launcher
# module, .so / .pyd)
_KEPT = STORE_SUFFIXES


def toolchain(device: torch.device) -> dict:
    """What a stored kernel binary depends on, beyond what its cache key already checks: the
    device's SM and the Triton version (which carries its ptxas)."""
    import triton
    major, minor = torch.cuda.get_device_capability(device)
    return {"sm": f"{major}{minor}", "triton": triton.__version__,
            "cuda": torch.version.cuda or ""}


def store_dir(tc: dict) -> str:
    return f"{STORE_ROOT}/sm{tc['sm']}-triton{tc['triton']}"


# --------------------------------------------------------------------------- the cache manager
@dataclass
class _Process:
    """This process's view: the stores installed, the cache manager they front, and what was
    read, written and compiled through it."""
    stores: dict = field(default_factory=dict)        # Path of an installed store -> its files
    fallback: type | None = None                     # the manager configured before install
    recording: dict | None = None                    # key -> {filename: path}, inside record()
    compiles: int = 0                                # kernels compiled
    launcher_builds: int = 0                         # launcher modules built (C compiler)
    store_hits: int = 0
    store_files: list = field(default_factory=list)  # the names the stores answered with


_PROC = _Process()


class StoreCacheManager:
    """A Triton `CacheManager`: the installed engine stores first, then the fallback manager
    (Triton's `FileCacheManager` unless another was configured) for lookups and every write."""

    def __init__(self, key, override=False, dump=False):
        from triton.runtime.cache import FileCacheManager
        self.key, self._plain = key, override or dump
        self._fallback = (_PROC.fallback or FileCacheManager)(key, override=override, dump=dump)

    def _record(self, filename: str, path) -> None:
        if _PROC.recording is not None and path is not None:
            _PROC.recording.setdefault(self.key, {})[filename] = str(path)

    def _stored(self, filename: str):
        """The store's file for this key, only if the engine's file table lists it and it is a
        cubin or metadata JSON (a launcher module is never taken from an engine)."""
        if self._plain or not filename.endswith(STORE_SUFFIXES) or "/" in filename:
            return None
        for root, files in _PROC.stores.items():
            if f"{self.key}/{filename}" in files:
                return root / self.key / filename
        return None

    def get_file(self, filename):
        p = self._stored(filename)
        if p is not None:
            _PROC.store_hits += 1
            _PROC.store_files.append(filename)
            self._record(filename, p)
            return str(p)
        path = self._fallback.get_file(filename)
        self._record(filename, path)
        return path

    def get_group(self, filename):
        grp = GROUP_PREFIX + filename
        p = self._stored(grp)
        if p is not None:
            try:
                names = json.loads(p.read_text())["child_paths"]
            except (OSError, ValueError, KeyError, TypeError):
                names = None
            if isinstance(names, dict):
                # members by their own plain name inside this entry, each one the store holds
                found = {c: self._stored(c) for c, n in names.items()
                         if isinstance(c, str) and c == n}
                if names and len(found) == len(names) and None not in found.values():
                    _PROC.store_hits += 1
                    _PROC.store_files.extend(found)
                    self._record(grp, p)
                    for c, q in found.items():
                        self._record(c, q)
                    return {c: str(q) for c, q in found.items()}
        group = self._fallback.get_group(filename)
        if group is not None and _PROC.recording is not None:
            for c, q in group.items():
                self._record(c, q)
        return group

    def put(self, data, filename, binary=True):
        path = self._fallback.put(data, filename, binary=binary)
        if filename.endswith((".so", ".pyd")):
            _PROC.launcher_builds += 1   # Triton's launcher module, built with the C compiler
        self._record(filename, path)
        return path

    def put_group(self, filename, group):
        _PROC.compiles += 1              # one compiled kernel
        for c, q in group.items():
            self._record(c, q)
        path = self._fallback.put_group(filename, group)
        if _PROC.recording is not None:     # collect() writes the store's own group file
            _PROC.recording.setdefault(self.key, {})[GROUP_PREFIX + filename] = path
        return path


def _activate() -> None:
    from triton import knobs
    if knobs.cache.manager_class is not StoreCacheManager:
        _PROC.fallback = knobs.cache.manager_class
        knobs.cache.manager_class = StoreCacheManager


def store_hits() -> int:
    """Cache lookups in this process that an installed engine store answered."""
    return _PROC.store_hits


def activate() -> None:
    """Route Triton's cache lookups through the store's manager from now on (install does it;
    a caller that only wants `compiles()` counted, with no store, calls it first)."""
    _activate()


def compiles() -> int:
    """Kernels compiled in this process through the store's manager since it was first
    activated: what a load on a machine that matches the store must keep at zero."""
    return _PROC.compiles


def launcher_builds() -> int:
    """Triton launcher modules (host code, `.so`) built in this process with the C compiler:
    one per machine and Triton version, on the first load whose Triton cache lacks it (the
    store never carries one)."""
    return _PROC.launcher_builds


def store_files() -> list:
    """The file names the installed stores answered Triton's lookups with (cubins and JSON)."""
    return list(_PROC.store_files)


# --------------------------------------------------------------------------- load side
def check(manifest: dict, tc: dict | None) -> str | None:
    """Why the engine's stored kernels cannot serve this machine (one line), or None."""
    entry = manifest.get("kernel_store")
    if not entry:
        return "the engine carries no compiled kernels (built for the CPU, or before the store)"
    if tc is None:
        return "no CUDA device"
    wrong = [f"{k} {entry.get(k)} (this machine: {tc[k]})" for k in ("sm", "triton")
             if str(entry.get(k)) != str(tc[k])]
    if wrong:
        return "its kernels were compiled for " + ", ".join(wrong)
    return None


def install(engine_dir: Path, manifest: dict, device: torch.device, policy: str = "use") -> bool:
    """Let Triton's lookups see the engine's stored kernels (True), or say in one line why it
    cannot and go on compiling at first use (`policy="use"`), refuse (`"require"`: ArtifactError
    naming the field), or not look (`"ignore"`)."""
    if policy not in POLICIES:
        raise ValueError(f"kernels policy must be one of {list(POLICIES)}, got {policy!r}")
    if policy == "ignore" or device.type != "cuda":
        return False
    why = check(manifest, toolchain(device))
    if why is None:
        rel = check_rel(manifest["kernel_store"].get("path"), "kernel_store.path")
        root = Path(engine_dir) / rel
        if root.is_symlink() or not root.is_dir():
            why = f"its kernel store {rel} is missing"
    if why is not None:
        if policy == "require":
            raise ArtifactError(f"engine {engine_dir}: {why}; rebuild it on this machine, or "
                                f"load without requiring the engine's kernels",
                                field="kernel_store")
        warnings.warn(f"engine {engine_dir}: {why}: Triton compiles the kernels at first use",
                      stacklevel=2)
        return False
    prefix = rel + "/"
    use_store(root, {f[len(prefix):] for f in manifest.get("files", {}) if f.startswith(prefix)})
    return True


def use_store(root: Path, files: set | None = None) -> None:
    """Triton's lookups in this process read the store at `root` first (install, once the
    engine is checked): its cubins and metadata JSON listed in `files` ("{key}/{name}", the
    engine's file table, whose paths, tree and sha256s load_manifest checked: the store is not
    walked again; None: every such file under `root`, after refusing anything else in the
    store (a link, a launcher module), naming it)."""
    _activate()
    root = Path(root).absolute()
    if files is None:
        check_tree(root)                       # no link, no special file below it
        files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
        other = sorted(f for f in files if not f.endswith(STORE_SUFFIXES))
        if other:
            raise ArtifactError(f"kernel store {root}: '{other[0]}' is not a cubin or metadata "
                                "JSON (a launcher module is built on this machine, never taken "
                                "from an engine)", path=other[0])
    usable = {f for f in files if f.count("/") == 1 and f.endswith(STORE_SUFFIXES)}
    for f in sorted(usable):
        if f.endswith(".json") and not f.split("/")[1].startswith(GROUP_PREFIX):
            _check_metadata(root, f)
    _PROC.stores[root] = usable


_METADATA_LIMIT = 1 << 20       # a kernel's metadata JSON is ~2 kB


def _check_metadata(root: Path, rel: str) -> None:
    """A stored kernel's metadata: a JSON object without tensor-descriptor entries. Our kernels
    take no tensor descriptor, and Triton versions that generate a launcher's C source per
    signature write a descriptor's metadata fields into it: an engine's JSON must not reach
    that C compiler."""
    try:
        with open(root / rel, "rb") as fh:
            data = fh.read(_METADATA_LIMIT + 1)
        if len(data) > _METADATA_LIMIT:
            raise ValueError(f"larger than {_METADATA_LIMIT} bytes")
        meta = json.loads(data)
    except (OSError, ValueError, RecursionError) as e:
        raise ArtifactError(f"kernel store {root}: '{rel}' is not readable JSON "
                            f"({type(e).__name__})", path=rel) from None
    if not isinstance(meta, dict) or meta.get("tensordesc_meta"):
        raise ArtifactError(f"kernel store {root}: '{rel}' is not a kernel's metadata without "
                            "tensor descriptors", path=rel)
