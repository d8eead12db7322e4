"""Test-wide setup.

Triton reads TRITON_INTERPRET when kernels are decorated, so it must be set before any
dspark_compile.kernels module is imported: on a machine without CUDA every Triton kernel test
runs the kernel itself in Triton's CPU interpreter.
"""
import os
import sys
from pathlib import Path

import pytest

# shared test helpers (tests/stats_utils.py) importable from every test module
sys.path.insert(0, str(Path(__file__).parent))

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # CI has 2 cores: torch's intra-op threads only fight each other over tiny CPU matmuls
    # (a tiny-model linear takes ~40 ms with the default pool vs ~0.5 ms single-threaded).
    torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--gpu-engine-buckets", default="",
                     help="comma-separated buckets the GPU engine tests build (default: all of "
                          "trace.DEFAULT_BUCKETS); fewer fit a short device run")


ENGINE_TESTS = Path(__file__).parent / "runtime"


def pytest_collection_modifyitems(config, items):
    # `make test` spreads the tests over two processes (pytest-xdist, --dist loadgroup): the
    # engine tests share session fixtures that build engines (minutes each on 2 cores), so
    # they stay together in one process, which builds each engine once
    engine = pytest.mark.xdist_group("engine")
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the borrowed H200; none here)")
    for item in items:
        if ENGINE_TESTS in Path(str(item.path)).parents:
            item.add_marker(engine)
        if not _HAS_CUDA and "gpu" in item.keywords:
            item.add_marker(skip)
