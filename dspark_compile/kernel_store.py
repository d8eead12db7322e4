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

Build side: `record()` around a warm-up run of every program (dspark_compile/trace.py) notes
every entry Triton read or wrote, and `collect()` adds the kernels already compiled in this
process (a `--verify-passes` run before the warm-up launches kernels that never reach the
cache manager again), then returns the files to store.
"""
from __future__ import annotations

import contextlib
import json
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

STORE_ROOT = "kernels/triton"
GROUP_PREFIX = "__grp__"
POLICIES = ("use", "require", "ignore")
_KEPT = (".json", ".cubin", ".hsaco", ".so", ".pyd")    # what a cache hit reads


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
    stores: list = field(default_factory=list)        # Paths of installed stores
    fallback: type | None = None                     # the manager configured before install
    recording: dict | None = None                    # key -> {filename: path}, inside record()
    compiles: int = 0                                # kernels (and launcher modules) compiled
    store_hits: int = 0


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
        if self._plain:
            return None
        for root in _PROC.stores:
            p = root / self.key / filename
            if p.is_file():
                return p
        return None

    def get_file(self, filename):
        p = self._stored(filename)
        if p is not None:
            _PROC.store_hits += 1
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
                found = {c: p.parent / n for c, n in names.items() if (p.parent / n).is_file()}
                if len(found) == len(names):
                    _PROC.store_hits += 1
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
            _PROC.compiles += 1          # Triton's launcher module, built with the C compiler
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
    """Kernels (and launcher modules) compiled in this process through the store's manager
    since it was first activated: what a load on a machine that matches the store must keep
    at zero."""
    return _PROC.compiles


# --------------------------------------------------------------------------- build side
@contextlib.contextmanager
def record():
    """Note every cache entry Triton reads or writes inside the block (the build's warm-up
    runs): `collect()` turns them into the engine's files."""
    _activate()
    outer, _PROC.recording = _PROC.recording, {}
    try:
        yield _PROC.recording
    finally:
        inner, _PROC.recording = _PROC.recording, outer
        if outer is not None:
            for k, files in inner.items():
                outer.setdefault(k, {}).update(files)


def _compiled_in_process() -> dict:
    """{cache key: {filename: path}} of every kernel of dspark_compile.kernels compiled in this
    process (JITFunction.device_caches), its group file marked for collect() to write."""
    from triton.runtime.jit import JITFunction
    try:
        from triton.runtime.cache import _base32 as cache_key
    except ImportError:            # a Triton whose cache keys are the hash itself
        def cache_key(h):
            return h
    out: dict = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("dspark_compile.kernels") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if not isinstance(obj, JITFunction):
                continue
            for caches in getattr(obj, "device_caches", {}).values():
                for kernel in caches[0].values():
                    group = getattr(kernel, "metadata_group", None)
                    meta = next((c for c in group or {} if c.endswith(".json")), None)
                    if meta is None:
                        continue
                    files = out.setdefault(cache_key(kernel.hash), {})
                    files.update(group)
                    files[GROUP_PREFIX + meta] = None     # written by collect()
    return out


def collect(recorded: dict, tc: dict) -> tuple[dict, dict]:
    """The store's files {engine path: bytes} and its manifest entry, from what `record()`
    noted plus the kernels compiled earlier in this process."""
    entries: dict = {}
    for source in (recorded, _compiled_in_process()):
        for key, files in source.items():
            have = entries.setdefault(key, {})
            for f, p in files.items():
                if p is not None or f not in have:   # a known path is never replaced by None
                    have[f] = p
    root = store_dir(tc)
    out: dict = {}
    kernels = 0
    for key, files in sorted(entries.items()):
        # a load reads the binary and the metadata (and launcher modules); the IRs Triton also
        # caches (ttir, ttgir, llir, ptx) are 85 % of the bytes and never read back
        members = {f: p for f, p in files.items() if p and not f.startswith(GROUP_PREFIX)
                   and f.endswith(_KEPT)}
        data = {}
        for f, p in members.items():
            try:
                data[f] = Path(p).read_bytes()
            except OSError:
                data = None          # an entry another process evicted: it compiles at load
                break
        if not data:
            continue
        for f, b in data.items():
            out[f"{root}/{key}/{f}"] = b
        for g in (f for f in files if f.startswith(GROUP_PREFIX)):
            kernels += 1
            names = {c: c for c in data}
            out[f"{root}/{key}/{g}"] = json.dumps({"child_paths": names}, sort_keys=True)
    entry = {**tc, "path": root, "entries": len({k.split("/")[-2] for k in out}),
             "kernels": kernels, "bytes": int(sum(len(b) if isinstance(b, bytes) else len(b.encode())
                                               for b in out.values()))}
    return out, entry


def compile_engine_kernels(programs: dict, prefill_programs: dict, cfg, cache, prec,
                           device: torch.device, log=print,
                           target_programs: dict | None = None) -> tuple[dict, dict]:
    """Run every program of the engine once, as a load warms it up before capture (each
    bucket's step, its greedy variant and its target-only program on padded rows, each prefill
    program on the trash row, on a fresh decode state), so every kernel it launches is compiled
    for this device; returns the store's files and manifest entry (`collect`)."""
    import time
    from dspark_compile.models.prefill_chunk import chunk_inputs
    from dspark_compile.models.state import allocate_state
    from dspark_compile.variants import sampler_mode_variant
    t = time.perf_counter()
    trash = cache.max_rows
    state = allocate_state(cfg, cache, prec, device)
    before = compiles()
    with record() as seen, torch.no_grad():
        for b, ep in sorted(programs.items()):
            rows = torch.full((b,), trash, dtype=torch.int64, device=device)
            for module in (ep.module(), sampler_mode_variant(ep)):
                if module is not None:
                    module(rows, state)
        for b, ep in sorted((target_programs or {}).items()):
            ep.module()(torch.full((b,), trash, dtype=torch.int64, device=device), state)
        for c, ep in sorted(prefill_programs.items()):
            ep.module()(chunk_inputs(trash, 0, [0], c).to(device), state)
        torch.cuda.synchronize(device)
    del state
    files, entry = collect(seen, toolchain(device))
    log(f"[kernels] {entry['kernels']} Triton kernels for sm_{entry['sm']} (triton "
        f"{entry['triton']}, {compiles() - before} compiled now), {entry['bytes'] / 1e6:.1f} MB "
        f"in {time.perf_counter() - t:.1f}s")
    return files, entry


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
    from dspark_compile.artifact_format import ArtifactError
    if policy not in POLICIES:
        raise ValueError(f"kernels policy must be one of {list(POLICIES)}, got {policy!r}")
    if policy == "ignore" or device.type != "cuda":
        return False
    why = check(manifest, toolchain(device))
    if why is None:
        root = (Path(engine_dir) / manifest["kernel_store"]["path"]).resolve()
        if not root.is_dir():
            why = f"its kernel store {manifest['kernel_store']['path']} is missing"
    if why is not None:
        if policy == "require":
            raise ArtifactError(f"engine {engine_dir}: {why}; rebuild it on this machine, or "
                                f"load without requiring the engine's kernels",
                                field="kernel_store")
        warnings.warn(f"engine {engine_dir}: {why}: Triton compiles the kernels at first use",
                      stacklevel=2)
        return False
    use_store(root)
    return True


def use_store(root: Path) -> None:
    """Triton's lookups in this process read the store at `root` first (install, once checked)."""
    _activate()
    root = Path(root).resolve()
    if root not in _PROC.stores:
        _PROC.stores.append(root)
