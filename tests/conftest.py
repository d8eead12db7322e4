"""Test-wide setup.

Triton reads TRITON_INTERPRET when kernels are decorated, so it must be set before any
dspark_compile.kernels module is imported: on a machine without CUDA every Triton kernel test
runs the kernel itself in Triton's CPU interpreter.
"""
import os
import random
import sys
from pathlib import Path

import pytest

# `python -m pytest` puts the working directory first on sys.path. From the checkout that makes
# its source folders `kernels/`, `models/` and `passes/` importable as top-level packages: they
# shadow installed packages of the same names (transformers >= 5.25 imports Hugging Face's
# `kernels`) and would let a test import the sources under names the installed product lacks.
_REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO]

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
                          "build_config.DEFAULT_BUCKETS); fewer fit a short device run")
    parser.addoption("--gpu-engine-backend", default="aten", choices=("inductor", "aten"),
                     help="--backend of the engine the GPU engine tests build (default aten, "
                          "the build's default on every device)")
    parser.addoption("--gpu-lossless-engine", default="", metavar="DIR",
                     help="a bf16 CUDA engine of the tiny-trained pair with target programs, built "
                          "on this machine (`dspark-compile build`), for "
                          "tests/runtime/test_gpu_lossless.py; its buckets are the ones tested "
                          "(default: the test builds one)")
    parser.addoption("--gpu-kernel-store-engine", default="", metavar="DIR",
                     help="a CUDA engine built on this machine for the kernel-store GPU test "
                          "(tests/runtime/test_gpu_kernel_store.py); default: it builds one")
    parser.addoption("--shuffle-seed", type=int, default=None, metavar="N",
                     help="run the collected tests in an order shuffled by random.Random(N) "
                          "(the same N gives the same order), to find tests that depend on "
                          "what ran before them in the process")


_WORKER_TIMINGS: dict[str, float] = {}      # the engine tests' timings, from an xdist worker


@pytest.hookimpl(trylast=True)     # after pytest's own reordering (by fixture scope)
def pytest_collection_modifyitems(config, items):
    seed = config.getoption("shuffle_seed")
    if seed is not None:
        # Every xdist worker collects and shuffles with the same seed, so all report the same
        # order, as xdist requires; the scheduler below then still sends tests/runtime/ to one
        # worker as one unit (in the shuffled order within it), the other tests one by one.
        random.Random(seed).shuffle(items)
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# `make test` runs the tests in two processes (pytest-xdist, -n 2). The engine tests
# (tests/runtime) share session fixtures that build engines, minutes each on 2 cores, so they go
# to one process as one unit, which builds each engine once; so do the tests of a file with a
# module-scoped fixture; every other test is a unit of its own. (xdist's own `--dist loadgroup`
# marks do not group on pytest 9.2 with xdist 3.8: the group goes into a node-id attribute
# pytest no longer reads.)
ENGINE_TESTS = "tests/runtime/"
_MODULE_FIXTURES: dict = {}


def _has_module_fixture(path: str) -> bool:
    """Whether a test file defines a module-scoped fixture: its tests then go to one process
    as one unit, so the fixture (an engine build, a server, an export: 45-100 s each) is made
    once, not once in each process its tests land on (the CI log of 802e71c showed
    test_dynamic_batch's 90 s and test_dynamic_prefill's 46 s set-ups twice)."""
    if path not in _MODULE_FIXTURES:
        try:
            text = (Path(__file__).resolve().parent.parent / path).read_text()
        except OSError:
            text = ""
        _MODULE_FIXTURES[path] = 'scope="module"' in text
    return _MODULE_FIXTURES[path]


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None                     # another --dist mode asked for: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class EngineTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(ENGINE_TESTS):
                return "engine tests"
            path = nodeid.split("::", 1)[0]
            return path if _has_module_fixture(path) else nodeid

    return EngineTestsTogether(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist, in the controlling process: a worker's engine timings."""
    _WORKER_TIMINGS.update(getattr(node, "workeroutput", {}).get("engine_timings", {}))


def pytest_report_header(config):
    seed = config.getoption("shuffle_seed")
    return None if seed is None else f"test order shuffled: --shuffle-seed {seed}"


def pytest_terminal_summary(terminalreporter, config):
    """The engine tests' build and load times (tests/runtime/conftest.py measures them), from
    this process or, under pytest-xdist, from the worker that ran them."""
    timings = {**getattr(config, "engine_timings", {}), **_WORKER_TIMINGS}
    if timings:
        terminalreporter.write_line("engine timings (tests/runtime): " + ", ".join(
            f"{k} {v:.1f}s" for k, v in timings.items()))
