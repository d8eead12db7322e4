"""benchmarks/kernel_resources.py without a GPU: declared configurations compiled for sm_90."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "benchmarks", "kernel_resources.py")


def test_report_for_sm90_on_a_machine_without_a_gpu(tmp_path):
    # a fresh process without TRITON_INTERPRET, as a user runs it (interpreter-mode tests patch
    # Triton's language in this one)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, TOOL, "--capability", "90", "--ops", "act_quant",
                          "--out", str(out)], capture_output=True, text=True, timeout=600,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    from dspark_compile.kernels.registry import KERNELS
    from dspark_compile.kernels import act_quant  # noqa: F401  (registers its configurations)
    assert len(rows) == len(KERNELS["act_quant"].compile_configs) > 0
    for r in rows:
        assert r["op"] == "act_quant" and r["capability"] == 90
        assert 0 < r["registers"] <= 255 and r["instructions"] > 0 and r["local_bytes"] == 0
        assert 1 <= r["ctas_by_registers"] <= 32
    assert sum(line.startswith("act_quant ") for line in run.stdout.splitlines()) == len(rows)
    bad = subprocess.run([sys.executable, TOOL, "--ops", "no_such_op"], capture_output=True,
                         text=True, timeout=600, env=env)
    assert bad.returncode != 0 and "no_such_op" in bad.stderr
