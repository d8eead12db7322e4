"""What the benchmark tests share: a benchmark's --dry-run in a fresh process."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def dry_run(tmp_path):
    """run(name, *flags) -> (the finished process, its --out directory): benchmarks/<name>.py
    --dry-run with --out and --work under tmp_path, in a fresh process (torch.compile, the
    SIGALRM budget and the profiler leave no state in this one); a non-zero exit fails the test
    with the tail of its output."""
    def run(name: str, *flags: str):
        out = tmp_path / "out"
        proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", f"{name}.py"),
                               "--dry-run", *flags, "--out", str(out),
                               "--work", str(tmp_path / "work")],
                              capture_output=True, text=True, timeout=900, cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc, out
    return run
