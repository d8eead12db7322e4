"""The engine directory's names and fingerprints: its file paths, `ArtifactError`, the hashes
and the manifest checksum, and the `dspark::` ops the programs call (registered before a load,
their schemas recorded at a build). The writer is dspark_compile/engine_dir/write.py, the validated load
dspark_compile/engine_dir/load.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import pkgutil
from dataclasses import dataclass
from typing import Optional

import torch

# 2: programs in the engine's own graph format (engine_dir/graph_format.py), greedy variants
# written at build; 1: torch.export .pt2 archives, refused at load with the rebuild to run
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"
PROGRAM_DIR = "programs"
KERNELS_DIR = "kernels"
COMPILED_DIR = "compiled"     # dspark_compile/build/inductor.py's artifacts
TOKENIZER_FILE = "tokenizer.json"   # the checkpoint's, copied by the build when it has one
# beside it when it is there (models/chat_format.py: the special tokens and the chat template),
# so the engine directory is a Hugging Face tokenizer directory
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
_EXTRA_DIRS = (KERNELS_DIR, COMPILED_DIR)
# the step's backends: "inductor" (the glue compiled at build time, dspark_compile/build/
# inductor.py) or "aten" (the exported program run op by op); a program's variants: the
# program as built, and the step with its Markov sampler switched to argmax (runtime/variants.py)
BACKENDS = ("inductor", "aten")
VARIANTS = ("full", "greedy")
_CHUNK = 8 << 20


class ArtifactError(RuntimeError):
    """An engine directory is missing, corrupted, stale or does not match expectations."""

    def __init__(self, message: str, field: Optional[str] = None, path: Optional[str] = None):
        self.field, self.path = field, path
        super().__init__(message)


STEP, TARGET, PREFILL = "step", "target", "prefill"
# kind -> (the manifest's table of its programs, the letter before its size in a file name)
_KINDS = {STEP: ("programs", "b"), TARGET: ("target_programs", "b"),
          PREFILL: ("prefill_programs", "c")}
PROGRAM_TABLES = tuple(table for table, _ in _KINDS.values())


@dataclass(frozen=True, order=True)
class ProgramKey:
    """One program of an engine, the one name the build, the manifest, the loader and the
    runtime use for it: its kind (STEP: draft + verify for a bucket of rows; TARGET: the
    bucket's target-only step, models/step.py TargetStep; PREFILL: a prompt chunk of `size`
    tokens, models/prefill_chunk.py), its size (the bucket, or the chunk length) and its
    variant ("full": the program as built; "greedy": a step with its Markov sampler on the
    greedy plan, written at build or compiled, runtime/variants.py)."""
    kind: str
    size: int
    variant: str = "full"

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"program kind must be one of {list(_KINDS)}, got {self.kind!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"a program's size must be an int >= 1, got {self.size!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {list(VARIANTS)}, got {self.variant!r}")

    @property
    def stem(self) -> str:
        """Its file name's stem: step_b16, target_b16, prefill_c64."""
        return f"{self.kind}_{_KINDS[self.kind][1]}{self.size}"

    @property
    def table(self) -> str:
        """The manifest's table of programs of its kind (keyed by str(size))."""
        return _KINDS[self.kind][0]

    @property
    def path(self) -> str:
        """Its graph file in the engine (engine_dir/graph_format.py), per variant:
        programs/step_b16.json, programs/step_b16_greedy.json."""
        suffix = "" if self.variant == "full" else f"_{self.variant}"
        return f"{PROGRAM_DIR}/{self.stem}{suffix}.json"

    @property
    def constants_path(self) -> str:
        """Its own constants (lifted tensors that are not weights), shared by its variants:
        programs/step_b16.constants.safetensors (absent when it has none)."""
        return f"{PROGRAM_DIR}/{self.stem}.constants.safetensors"

    @property
    def shared_path(self) -> str:
        """Its graph file when one program serves every size of its kind (exported with a
        dynamic batch or chunk size, build/pipeline.py): programs/step.json,
        programs/step_greedy.json."""
        suffix = "" if self.variant == "full" else f"_{self.variant}"
        return f"{PROGRAM_DIR}/{self.kind}{suffix}.json"

    @property
    def shared_constants_path(self) -> str:
        """The constants of the program serving every size of its kind."""
        return f"{PROGRAM_DIR}/{self.kind}.constants.safetensors"

    @property
    def compiled_path(self) -> str:
        """Its Inductor-compiled file (--backend inductor), per variant."""
        suffix = "" if self.variant == "full" else f"_{self.variant}"
        return f"{COMPILED_DIR}/{self.stem}{suffix}.bin"

    @property
    def listed(self) -> str:
        """Its key where programs of every kind are listed together (the manifest's pass
        statistics and `compiled` tables, compile jobs): the bucket for a step, else the stem."""
        return str(self.size) if self.kind == STEP else self.stem

    @classmethod
    def of_listed(cls, name: str, variant: str = "full") -> "ProgramKey":
        """The key `listed` gave (ValueError for another name)."""
        if name.isdigit():
            return cls(STEP, int(name), variant)
        for kind, (_, letter) in _KINDS.items():
            head = f"{kind}_{letter}"
            if name.startswith(head) and name[len(head):].isdigit():
                return cls(kind, int(name[len(head):]), variant)
        raise ValueError(f"{name!r} names no program (a bucket, target_bB or prefill_cC)")

    @property
    def label(self) -> str:
        """How messages name it: "for bucket 16" (a step), else its stem."""
        return f"for bucket {self.size}" if self.kind == STEP else self.stem

    def with_variant(self, variant: str) -> "ProgramKey":
        return dataclasses.replace(self, variant=variant)

    def __str__(self) -> str:                     # messages: "program step_b16" ...
        return self.stem + ("" if self.variant == "full" else f" ({self.variant})")


# --------------------------------------------------------------------------- JSON
def unique_keys(pairs: list) -> dict:
    """json object_pairs_hook refusing a key given twice in one object: json.loads would keep
    the last one silently, and another reader (a proxy, a logger, an older loader) may keep the
    first, so the two would see different documents. The key is clipped to 80 characters."""
    out = {}
    for k, v in pairs:
        if k in out:
            shown = k if len(k) <= 80 else k[:80] + "..."
            raise ValueError(f"the key {shown!r} is given twice")
        out[k] = v
    return out


# --------------------------------------------------------------------------- hashing
def sha256_file(path) -> tuple[str, int]:
    """(sha256, size) of a file the build wrote (a load reads through artifact_paths)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return sha256_stream(f), size


def sha256_stream(f) -> str:
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def check_digest(rel: str, info: dict, size: int, digest: Optional[str] = None) -> None:
    """Engine file `rel` of `size` bytes (and sha256 `digest`, once read) is the one its
    file-table entry `info` describes; ArtifactError naming the file otherwise."""
    if size < info["size"]:
        raise ArtifactError(f"engine file '{rel}' is truncated: {size} of {info['size']} bytes",
                            path=rel)
    if size != info["size"]:
        raise ArtifactError(f"engine file '{rel}' has the wrong size: {size} bytes, manifest "
                            f"says {info['size']}", path=rel)
    if digest is not None and digest != info["sha256"]:
        raise ArtifactError(f"engine file '{rel}' is corrupted: sha256 {digest[:12]}…, "
                            f"manifest says {info['sha256'][:12]}…", path=rel)


def tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _checksum(manifest: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "checksum"})
                          ).hexdigest()


def config_hash(config) -> str:
    """sha256 of a JSON-able model config (dict or object with `to_json_dict()`)."""
    if hasattr(config, "fingerprint"):
        return config.fingerprint()
    if hasattr(config, "to_json_dict"):
        config = config.to_json_dict()
    return hashlib.sha256(_canonical(config)).hexdigest()


# --------------------------------------------------------------------------- ops
def register_kernel_ops() -> list[str]:
    """Import every dspark_compile.kernels module so each `dspark::` op is registered (a program
    calling them cannot be deserialised otherwise)."""
    import dspark_compile.kernels as kernels

    names = []
    for info in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{info.name}")
        names.append(info.name)
    return names


def _dspark_ops(programs: dict) -> dict:
    ops = {}
    for ep in programs.values():
        for n in ep.graph_module.graph.nodes:
            t = n.target
            if n.op == "call_function" and isinstance(t, torch._ops.OpOverload) \
                    and t.namespace == "dspark":
                ops[f"{t._schema.name}.{t._overloadname}"] = str(t._schema)
    return dict(sorted(ops.items()))
