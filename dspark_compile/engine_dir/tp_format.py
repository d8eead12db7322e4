"""A tensor-parallel engine directory (`build --tp N`): its names and ranks.json.

    ENGINE/ranks.json          {"format": "dspark-tp-engine", "version": 1, "tp": N,
                                "build_config": {...}, "ranks": [{"dir": "rank0",
                                "manifest_sha256", "weights_sha256", "weights_bytes"}, ...]}
    ENGINE/rank0/ ... rank{N-1}/
                               each a whole engine (manifest.json, programs/,
                               weights.safetensors: that rank's shard, tokenizer), its manifest
                               recording build_config.tp = N and tp_rank = r

Each rank's manifest lists every file of its directory with its sha256, so ranks.json's
manifest hashes pin every shard. The writer is dspark_compile/build/tp_build.py, the loader
dspark_compile/runtime/ranks.py.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from dspark_compile.engine_dir.format import MANIFEST, WEIGHTS_FILE, ArtifactError
from dspark_compile.engine_dir.paths import read_file

RANKS_FILE = "ranks.json"
TP_FORMAT, TP_VERSION = "dspark-tp-engine", 1
_SHA = re.compile(r"[0-9a-f]{64}")


def rank_dir(rank: int) -> str:
    return f"rank{rank}"


def describe_ranks(root: Path, tp: int) -> list:
    """ranks.json's "ranks": each rank directory's manifest sha256, its weight shard's sha256
    (as its manifest lists it) and the shard's bytes."""
    out = []
    for r in range(tp):
        data = (Path(root) / rank_dir(r) / MANIFEST).read_bytes()
        files = json.loads(data)["files"]
        out.append({"dir": rank_dir(r), "manifest_sha256": hashlib.sha256(data).hexdigest(),
                    "weights_sha256": files[WEIGHTS_FILE]["sha256"],
                    "weights_bytes": files[WEIGHTS_FILE]["size"]})
    return out


def read_ranks(engine_dir) -> dict | None:
    """ranks.json of a tensor-parallel engine, checked (format, tp a power of two, one
    rank{r} directory entry per rank with its manifest's hash); None for a one-device engine."""
    root = Path(engine_dir)
    path = root / RANKS_FILE
    if not path.exists() and not path.is_symlink():
        return None
    where = f"{root}/{RANKS_FILE}"
    try:
        # the engine's checked reader: no link followed, no FIFO, at most 1 MiB read
        doc = json.loads(read_file(root, RANKS_FILE, 1 << 20))
    except ArtifactError as e:
        raise ArtifactError(f"{where}: {e}", path=str(path)) from None
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{where} is not readable JSON ({type(e).__name__})",
                            path=str(path)) from None
    tp = doc.get("tp") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("format") != TP_FORMAT \
            or doc.get("version") != TP_VERSION:
        raise ArtifactError(f"{where} is not a {TP_FORMAT} version {TP_VERSION} file — "
                            "rebuild", path=str(path))
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2 or tp & (tp - 1):
        raise ArtifactError(f"{where}: field 'tp' = {str(tp)[:20]} is not a power of two >= 2",
                            path=str(path))
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != tp or not all(
            isinstance(e, dict) and e.get("dir") == rank_dir(r)
            and isinstance(e.get("manifest_sha256"), str) and _SHA.fullmatch(e["manifest_sha256"])
            for r, e in enumerate(ranks)):
        raise ArtifactError(f"{where}: field 'ranks' is not one entry per rank (rank0 ... "
                            f"rank{tp - 1}, each with its manifest's sha256)", path=str(path))
    return doc


def engine_tp(engine_dir) -> int:
    """The rank count an engine directory was built for (1: a one-device engine)."""
    doc = read_ranks(engine_dir)
    return 1 if doc is None else doc["tp"]


def check_tp(engine_dir, tp: int, flag: str = "--tp") -> int:
    """ValueError when `tp` ranks cannot run the engine (it was built for another count);
    returns the engine's count."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{flag} must be a rank count >= 1, got {tp!r}")
    have = engine_tp(engine_dir)
    if tp != have:
        built = (f"built for {have} ranks (build --tp {have}): pass {flag} {have}" if have > 1
                 else f"built for one device: leave {flag} out (or rebuild with build --tp {tp})")
        raise ValueError(f"engine {engine_dir} is {built}; {flag} {tp} given")
    return have
