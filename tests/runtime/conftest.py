"""Session fixtures for the engine tests: the tiny checkpoint, two engines built once, loaded once.

Building is the expensive part on a 2-core CPU (torch.export of the whole step per bucket, then
torch.export.save/load of a ~10k-node graph), so every engine is built once per session:

- `default_engine`: every default bucket (1..64), float64, max_rows 64 -- build checks and the
  generate-vs-reference tests;
- `small_engine`: buckets (1, 2), max_rows 5, built through the CLI (`dspark-compile build`), so
  its captured output is the CLI build test -- batches larger than the largest bucket, the
  waiting queue, the fresh-process round trip and the CLI run/inspect tests.

float64 on CPU: the compiled step and the eager reference then agree exactly (the FP8 KV /
activation rounding decisions come out the same), so outputs are compared token for token.
Measured times are printed in pytest's terminal summary.
"""
from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass, field

import pytest

SEQ = 160          # max_seq_len of both engines: prompts + outputs used here stay below it
TIMINGS: dict[str, float] = {}


@dataclass
class Built:
    path: object
    manifest: dict
    seconds: float
    log: list = field(default_factory=list)


def pytest_sessionfinish(session):
    # tests/conftest.py's summary prints them; under pytest-xdist it runs in the controlling
    # process (a worker's summary is never shown), so they travel in the worker's output
    if TIMINGS:
        out = getattr(session.config, "workeroutput", None)
        if out is not None:
            out["engine_timings"] = dict(TIMINGS)
        else:
            session.config.engine_timings = dict(TIMINGS)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from dspark_compile.factory.synth import synth_checkpoint
    out = tmp_path_factory.mktemp("rt_ckpt") / "tiny"
    synth_checkpoint("tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def default_engine(tiny_ckpt, tmp_path_factory) -> Built:
    from dspark_compile.engine_dir.build_config import DEFAULT_BUCKETS, BuildConfig
    from dspark_compile.build.pipeline import build_engine
    out = tmp_path_factory.mktemp("rt_default") / "engine"
    lines: list[str] = []
    t = time.perf_counter()
    manifest = build_engine(tiny_ckpt, out, BuildConfig(buckets=DEFAULT_BUCKETS, max_rows=64,
                                                        max_seq_len=SEQ, dtype="float64"),
                            log=lines.append)
    TIMINGS["build default buckets"] = time.perf_counter() - t
    return Built(out, manifest, TIMINGS["build default buckets"], lines)


@pytest.fixture(scope="session")
def default_loaded(default_engine):
    from dspark_compile.runtime.engine import Engine
    t = time.perf_counter()
    eng = Engine.load(default_engine.path, device="cpu")
    TIMINGS["load default buckets"] = time.perf_counter() - t
    return eng


@pytest.fixture(scope="session")
def small_engine(tiny_ckpt, tmp_path_factory) -> Built:
    """Built by `dspark-compile build` in-process; `log` holds (exit status, stdout, stderr)."""
    from dspark_compile.engine_dir.load import load_manifest
    from dspark_compile.cli.main import main
    out = tmp_path_factory.mktemp("rt_small") / "engine"
    stdout, stderr = io.StringIO(), io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        # a CPU engine on any machine; no prefill programs (the CLI's default builds two at
        # this --max-seq-len, each an export as long as a bucket's: tested elsewhere)
        rc = main(["build", str(tiny_ckpt), "--out", str(out), "--buckets", "2,1",
                   "--max-rows", "5", "--max-seq-len", str(SEQ), "--dtype", "float64",
                   "--device", "cpu", "--prefill-chunks", "none"])
    TIMINGS["build (1,2) via CLI"] = time.perf_counter() - t
    if rc != 0:
        pytest.fail(f"dspark-compile build failed ({rc}): {stderr.getvalue()[-2000:]}")
    return Built(out, load_manifest(out), TIMINGS["build (1,2) via CLI"],
                 [rc, stdout.getvalue(), stderr.getvalue()])


@pytest.fixture(scope="session")
def small_loaded(small_engine):
    from dspark_compile.runtime.engine import Engine
    t = time.perf_counter()
    eng = Engine.load(small_engine.path, device="cpu")
    TIMINGS["load (1,2)"] = time.perf_counter() - t
    return eng


@pytest.fixture(scope="session")
def ref_model(tiny_ckpt):
    """The eager reference, loaded independently from the checkpoint with the engines'
    precision (float64, FP8 activation quant and KV simulated)."""
    from dspark_compile.models import load_model
    from dspark_compile.models.config import Precision
    from dspark_compile.engine_dir.build_config import DTYPES
    prec = Precision(dtype=DTYPES["float64"], act_quant=True, kv_fp8=True)
    return load_model(tiny_ckpt, prec, max_positions=SEQ + 16, with_draft=True)
