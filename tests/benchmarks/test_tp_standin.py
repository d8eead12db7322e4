"""The measurement stand-in of benchmarks/tp_standin.py (issue 53 item 5): rank 0's engine
programs of a tp = 2 engine run in one process with no process group, each all-gather node
rewritten into rank 0's tensor then zeros and each wait into the identity; and
benchmarks/tp_step.py --dry-run, which runs the TP = 1 engine's step and that rank-0 program
untimed on the CPU.

One module fixture: the dry run itself (a fresh process) on the tp checkpoint cut to 3 target
layers, buckets 1 and 2, no prefill or target-only programs; it builds both engines under a
shared --work (the rank-0 engine under a "fake" process group, ~25 s each on the 2-core
machine), and the tests below load its rank-0 engine again.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import tp_program  # noqa: E402
import tp_standin  # noqa: E402

GATHER, WAIT = tp_standin.GATHER, tp_standin.WAIT


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """(the dry run's record, its --work): benchmarks/tp_step.py --dry-run, exit 0."""
    base = tmp_path_factory.mktemp("tp_standin")
    out, work = base / "out", base / "work"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "tp_step.py"),
                           "--dry-run", "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "tp_step.json").read_text()), work


@pytest.fixture(scope="module")
def rank0_dir(dry):
    d = dry[1] / "engine_ckpt_tp_wide3_tp2_rank0"
    assert (d / "manifest.json").is_file()
    return d


def _load(rank0_dir):
    return tp_standin.load_rank_standin(rank0_dir, device="cpu", use_graphs=False,
                                        greedy_variants=False, target=False, logprobs=False,
                                        prefill="eager")


def _program_ops(rank0_dir) -> list:
    """The op names of the step program's nodes, as the build wrote them (its JSON)."""
    m = json.loads((rank0_dir / "manifest.json").read_text())
    entry = m["programs"]["2"]
    rel = entry["path"] if isinstance(entry, dict) else entry
    return rel, [n["op"] for n in json.loads((rank0_dir / rel).read_bytes())["nodes"]]


def test_dry_run_reports_both_tps_with_the_collectives_replaced(dry):
    """--dry-run completes: per bucket a TP = 1 row with no collectives and a TP = 2 rank-0 row
    with the gathers it ran and their bytes (written = tp x sent), outputs checked, and the
    record says the collectives were replaced by local copies."""
    rec, _ = dry
    assert rec["complete"] and rec["mode"] == "dry-run"
    assert "collectives replaced by local copies" in rec["collectives"]
    rows = {(r["TP"], r["B"]): r for r in rec["rows"]}
    assert set(rows) == {(1, 1), (2, 1), (1, 2), (2, 2)}
    for B in (1, 2):
        assert rows[(1, B)]["collective_calls"] == 0
        r2 = rows[(2, B)]
        assert r2["collective_calls"] > 0 and r2["check"]["ids_in_range"]
        assert r2["collective_kb_written"] == pytest.approx(2 * r2["collective_kb"])
    # the larger batch moves more bytes per gather (rows x width), the same count
    assert rows[(2, 2)]["collective_calls"] == rows[(2, 1)]["collective_calls"]
    assert rows[(2, 2)]["collective_kb"] > rows[(2, 1)]["collective_kb"]


def test_rank0_program_runs_alone_finite_in_range_every_collective_rewritten(rank0_dir):
    """Rank 0's step program, loaded with no process group: every all-gather and wait node of
    the program as written is rewritten (counts equal the JSON's), none is left, one step's
    outputs are in range (ids in [0, V), counts in [1, block + 1]) with no NaN in the state,
    and the step runs each rewritten gather once."""
    import torch.distributed as dist
    from dspark_compile.engine_dir.format import STEP, ProgramKey
    from dspark_compile.models.random_requests import prefill_random_requests

    rel, ops = _program_ops(rank0_dir)
    eng = _load(rank0_dir)
    assert not dist.is_initialized()
    want = {GATHER: ops.count(GATHER), WAIT: ops.count(WAIT)}
    assert want[GATHER] > 0
    assert eng.rewritten[rel] == want
    for runner in eng._modules.values():
        assert tp_standin.count_collectives(runner._program) == {}
    B = 2
    with torch.no_grad():
        prefill_random_requests(eng.model, eng.state, range(B), 0, eng.cache.max_step_tokens,
                                max_prompt_len=12)
        eng.standin.reset()
        out = eng.program(ProgramKey(STEP, B)).fn(torch.arange(B), eng.state)
    tp_program.check_step(out, eng, B)
    assert eng.standin.calls == want[GATHER]


def test_the_stand_in_gather_keeps_reductions_finite():
    """The stand-in gather writes rank 0's tensor then zeros (tp x the bytes): the sharded
    model's all-reduce (a gather then a sum) gives rank 0's own partial sum, not tp x it, and
    the vocab-parallel logits are rank 0's block then zeros; tp_step.py --eager's shim too."""
    s = tp_standin.LocalCollectives()
    x = torch.randn(3, 4)
    g = s.gather(x, 2, "0")
    assert g.shape == (6, 4) and torch.equal(g[:3], x) and not g[3:].any()
    assert (s.calls, s.bytes_in, s.bytes_out) == (1, 48, 96)
    pc = tp_standin.LocalParallelConfig(rank=0, tp=2)
    assert torch.equal(pc.all_reduce(x), x)
    assert torch.equal(pc.all_gather_last(x), torch.cat([x, torch.zeros_like(x)], -1))
    # tp_step.py --eager's shim of ParallelConfig._gather0 writes the same
    import tp_step
    from dspark_compile.models.parallel import ParallelConfig
    shim = tp_step.CollectiveShim(local=True).install()
    try:
        assert torch.equal(ParallelConfig(rank=0, tp=2).all_reduce(x), x)
    finally:
        shim.uninstall()
    assert (shim.calls, shim.nbytes) == (1, 48)


def test_an_unexpected_collective_is_refused_naming_the_op(rank0_dir):
    """A program with a collective the stand-in does not know (an all_reduce node) or a gather
    over another rank count is refused with one error naming the node and the op, and the
    program is left as it was."""
    from dspark_compile.engine_dir.load import load_engine
    _, programs, _ = load_engine(rank0_dir, device="cpu")
    program = next(iter(programs.values()))
    i = next(k for k, n in enumerate(program.nodes) if tp_standin.op_name(n[1]) == GATHER)
    name, _, args, kwargs = program.nodes[i]
    before = list(program.nodes)
    program.nodes[i] = (name, torch.ops._c10d_functional.all_reduce.default,
                        (args[0], "sum", args[2]), kwargs)
    broken = list(program.nodes)
    with pytest.raises(tp_standin.StandinError,
                       match=rf"node '{name}' calls _c10d_functional\.all_reduce\.default"):
        tp_standin.rewrite_collectives(program, tp_standin.LocalCollectives(), 2)
    assert program.nodes == broken
    program.nodes = before
    with pytest.raises(tp_standin.StandinError, match=rf"node '{name}' gathers over 2 ranks, "
                                                      r"the engine has tp = 4"):
        tp_standin.rewrite_collectives(program, tp_standin.LocalCollectives(), 4)
