"""Tensor-parallel engines on CPU processes (issue 53 items 2-3): `build --tp 2` writes each
rank's programs (their functional collectives in the engine's program format) and weight shard
into one directory; each rank's programs, read back, equal its eager sharded model bit for bit;
`run --tp 2` starts the ranks and decodes losslessly, with TP = 1's tokens.

The checkpoint is the tiny one widened to whole FP8 blocks at tp = 2 (dspark_compile/factory/
tp_checkpoint.py; the tiny preset itself is refused at tp = 2) and cut to 3 target layers (a hash
layer, a compressed and an indexed one). One engine, built once for the module, serves every
test, with the least that still shows the invariants: buckets 1 and 2 of the build's default
dynamic batch (the one program of each kind that every bucket runs: its export at tp = 2 once
needed a model fix, docs/model.md) and no prefill programs (the runtime prefills through each
rank's eager sharded model), so each rank exports two programs, the step and the target-only
step. On the shared 2-core machine (load ~4) one static bucket built in 90 s; buckets 1-2 of
dynamic batch with one prefill program took 162 s (step export 78 s dynamic vs 52 s static,
prefill program 35 s). Every rank sets one intra-op thread.
"""
import json
import shutil

import pytest
import torch

from dspark_compile.build.pipeline import build_engine
from dspark_compile.engine_dir.tp_format import RANKS_FILE, check_tp, read_ranks
from dspark_compile.factory.tp_checkpoint import tp_checkpoint
from dspark_compile.cli.main import main
from dspark_compile.engine_dir.build_config import BuildConfig
from dspark_compile.engine_dir.format import ArtifactError
from dspark_compile.engine_dir.graph_read import read_program
from dspark_compile.models.config import Precision
from dspark_compile.models.generate import generate
from dspark_compile.models.loading import load_model
from dspark_compile.runtime.rank_check import exit_on_rank, run_program_check
from dspark_compile.models.request import SamplingParams
from dspark_compile.runtime.engine import Engine
from dspark_compile.runtime.ranks import RanksFailed, join_ranks, load_rank, run_ranks

TP, BUCKET = 2, 2
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]


@pytest.fixture(scope="module")
def tp_ckpt(tiny_ckpt, tmp_path_factory):
    return tp_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("tp") / "tiny-wide3", (0, 3, 4))


@pytest.fixture(scope="module")
def tp_engine(tp_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_engine") / "engine"
    bc = BuildConfig(tp=TP, buckets=(1, BUCKET), max_seq_len=64,
                     prefill_chunks=(), target_programs=True)
    build_engine(tp_ckpt, out, bc, log=lambda s: None)
    return out


@pytest.fixture(scope="module")
def tp_ref(tp_ckpt):
    """The unsharded model's (TP = 1) greedy tokens on PROMPTS, 8 each."""
    model = load_model(tp_ckpt, Precision(dtype=torch.float32), max_positions=128)
    return generate(model, PROMPTS, [SamplingParams(max_new_tokens=8)] * len(PROMPTS),
                    speculative=False).tokens


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.dtype.is_floating_point:
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_engine_holds_each_rank_and_its_shard_hash(tp_engine):
    """One directory: ranks.json (tp, each rank's manifest and shard sha256) and rank0/,
    rank1/, each an engine whose manifest records build_config.tp = 2 and its rank; the
    shards differ (each rank holds its own heads, experts and vocabulary rows)."""
    doc = read_ranks(tp_engine)
    assert doc["tp"] == TP and doc["build_config"]["tp"] == TP
    assert {p.name for p in tp_engine.iterdir()} == {RANKS_FILE, "rank0", "rank1"}
    for r, entry in enumerate(doc["ranks"]):
        m = json.loads((tp_engine / f"rank{r}" / "manifest.json").read_text())
        assert m["build_config"]["tp"] == TP and m["tp_rank"] == r
        assert m["files"]["weights.safetensors"]["sha256"] == entry["weights_sha256"]
    assert doc["ranks"][0]["weights_sha256"] != doc["ranks"][1]["weights_sha256"]


def test_programs_hold_the_collectives_in_the_format(tp_engine):
    """Each rank's step program calls the functional all-gather and its wait, its process
    group named by a string literal; the reader refuses a group name that is not a plain name
    and a collective whose tensor argument is a literal."""
    manifest = json.loads((tp_engine / "rank0" / "manifest.json").read_text())
    rel = manifest["programs"]["2"]["path"] if isinstance(manifest["programs"]["2"], dict) \
        else manifest["programs"]["2"]
    data = (tp_engine / "rank0" / rel).read_bytes()
    doc = json.loads(data)
    ops = [n["op"] for n in doc["nodes"]]
    gathers = [n for n in doc["nodes"] if n["op"].endswith("all_gather_into_tensor.default")]
    assert gathers and ops.count("_c10d_functional.wait_tensor.default") == len(gathers)
    assert all(n["args"][1] == TP and isinstance(n["args"][2], str) for n in gathers)
    read_program(data, None, rel)       # reads as is (its constants are not needed to check)
    for bad, why in (("0; import os", "names the process group"),
                     ({"node": "nope"}, "refers to")):
        g = dict(gathers[0], args=[gathers[0]["args"][0], TP, bad])
        broken = dict(doc, nodes=[g if n is gathers[0] else n for n in doc["nodes"]])
        with pytest.raises(ArtifactError, match=why):
            read_program(json.dumps(broken).encode(), None, rel)
    g = dict(gathers[0], args=[1.5, TP, gathers[0]["args"][2]])
    broken = dict(doc, nodes=[g if n is gathers[0] else n for n in doc["nodes"]])
    with pytest.raises(ArtifactError, match="as a literal, not a node"):
        read_program(json.dumps(broken).encode(), None, rel)


def test_each_rank_program_equals_its_eager_sharded_model(tp_engine, tp_ckpt, tmp_path):
    """On the same prefilled state, every rank's step and target-only step program, written
    by the build and read back, give the eager sharded model's outputs and whole decode state
    bit for bit (fusions and collectives included); both ranks hold the same bits."""
    ranks = run_program_check(tp_engine, tp_ckpt, TP, tmp_path, BUCKET, None)
    for r, out in enumerate(ranks):
        assert {k.split(":")[0] for k in out} == {"step", "target"}
        for kind in ("step", "target"):
            (o1, s1), (o2, s2) = out[f"{kind}:program"], out[f"{kind}:eager"]
            assert _same(o1, o2), (r, kind, o1, o2)
            bad = [k for k in s1 if not _same(s1[k], s2[k])]
            assert not bad, (r, kind, bad[:5])
    assert _same(ranks[0], ranks[1])


def test_run_tp2_is_lossless_and_equals_tp1(tp_engine, tp_ref, capfd):
    """run --tp 2 --check-lossless: the greedy speculative tokens equal TP = 2's own
    target-only decoding (exit 0, 'lossless: ... identical'), and equal the unsharded
    model's greedy tokens (TP = 1) on the prompts."""
    args = ["run", str(tp_engine), "--tp", "2", "--max-new-tokens", "8", "--check-lossless"]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    assert main(args) == 0
    out = capfd.readouterr().out
    got = [[int(t) for t in line.split(": ")[1].split(",")]
           for line in out.splitlines() if line.startswith("tokens[")]
    assert len(got) == len(PROMPTS) and "lossless:" in out
    assert got == tp_ref


def test_rank_count_mismatch_is_one_clear_error(tp_engine, tmp_path, capfd):
    """An engine runs only on the rank count it was built for: --tp 1 (or no --tp), --tp 4,
    Engine.load of the whole directory and a one-device engine at --tp 2 are each one line
    naming the counts (or load_rank); a rank whose manifest is not the one ranks.json pins is
    refused by load_rank."""
    with pytest.raises(ValueError, match=r"built for 2 ranks \(build --tp 2\): pass --tp 2; "
                                         r"--tp 1 given"):
        check_tp(tp_engine, 1)
    assert main(["run", str(tp_engine), "--prompt-ids", "1,2", "--tp", "4"]) != 0
    assert "--tp 4 given" in capfd.readouterr().err
    with pytest.raises(ValueError, match="built for several ranks.*load_rank"):
        Engine.load(tp_engine)
    one = tmp_path / "one"
    (one).mkdir()
    with pytest.raises(ValueError, match="built for one device: leave --tp out"):
        check_tp(one, 2)
    bad = tmp_path / "bad"
    shutil.copytree(tp_engine, bad)
    doc = json.loads((bad / RANKS_FILE).read_text())
    doc["ranks"][1]["manifest_sha256"] = "0" * 64
    (bad / RANKS_FILE).write_text(json.dumps(doc))
    # load_rank checks the directory before it needs a process group: no ranks spawned here
    with pytest.raises(ArtifactError, match="is not the manifest ranks.json lists for rank 1"):
        load_rank(bad, 1, TP)


def test_links_out_of_a_tp_engine_are_refused_not_followed(tp_engine, tmp_path):
    """ranks.json or a rank directory that is a symbolic link (here: to a copy outside the
    engine) is refused by name before anything behind the link is read."""
    outside = tmp_path / "outside"
    shutil.copytree(tp_engine, outside)
    linked = tmp_path / "linked_ranks"
    shutil.copytree(tp_engine, linked)
    (linked / RANKS_FILE).unlink()
    (linked / RANKS_FILE).symlink_to(outside / RANKS_FILE)
    with pytest.raises(ArtifactError, match="ranks.json.*symbolic link"):
        read_ranks(linked)
    linked = tmp_path / "linked_rank"
    shutil.copytree(tp_engine, linked)
    shutil.rmtree(linked / "rank1")
    (linked / "rank1").symlink_to(outside / "rank1")
    with pytest.raises(ArtifactError, match="rank1/manifest.json.*symbolic link"):
        load_rank(linked, 1, TP)


def test_a_rank_that_raises_is_one_line_naming_it():
    """A rank's exception (torch.multiprocessing's ProcessRaisedException, the rank's whole
    traceback) becomes one RanksFailed line: the command, the rank and its error line."""
    import torch.multiprocessing as mp

    class Ctx:
        def join(self):
            raise mp.ProcessRaisedException(
                "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent "
                "call last):\n  File \"x.py\", line 1, in f\ndspark_compile.engine_dir.format."
                "ArtifactError: ENGINE/rank1/manifest.json is not the manifest ranks.json lists "
                "for rank 1\n", 1, 1234)
    with pytest.raises(RanksFailed) as e:
        join_ranks(Ctx(), "run")
    assert str(e.value) == ("run --tp: rank 1 failed: dspark_compile.engine_dir.format."
                            "ArtifactError: ENGINE/rank1/manifest.json is not the manifest "
                            "ranks.json lists for rank 1")


def test_a_dead_rank_ends_the_others(tp_engine):
    """Rank 1 exits while rank 0 decodes (blocked in a collective on its dead peer): the run
    ends, rank 0 terminated, with one error naming rank 1 and its exit code."""
    with pytest.raises(RanksFailed, match=r"run --tp: rank 1 died \(exit code 7\); the other "
                                          r"ranks were ended"):
        run_ranks(tp_engine, TP, exit_on_rank, (1, 7))


def test_bad_tp_flags_are_named(tiny_ckpt, tmp_path, capfd):
    """build --tp 3 (not a power of two) and the tiny preset at --tp 2 (a split that cuts an
    FP8 scale block) are one line each, before any rank starts."""
    assert main(["build", str(tiny_ckpt), "--out", str(tmp_path / "e"), "--tp", "3"]) == 1
    assert "--tp must be a power of two" in capfd.readouterr().err
    assert main(["build", str(tiny_ckpt), "--out", str(tmp_path / "e"), "--tp", "2",
                 "--device", "cpu"]) == 1
    assert "'layers.0.attn.wo_a.weight'" in capfd.readouterr().err


def _spawned_ranks(pid: int) -> list[int]:
    """The rank processes (torch.multiprocessing spawn's children) of process `pid`, in
    start order (rank 0 first)."""
    from pathlib import Path
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return sorted(k for k in kids
                  if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes())


def test_serve_tp2_answers_with_run_tp2_tokens_and_a_dead_rank_ends_it(tp_engine, tp_ref):
    """`serve ENGINE --tp 2` in its own process starts both ranks; rank 0's server answers a
    greedy completion with the tokens run --tp 2 decodes (the TP = 1 model's, which
    test_run_tp2_is_lossless_and_equals_tp1 holds run --tp 2 to); when rank 1 is killed,
    the command ends rank 0 and exits 1 with one line naming rank 1."""
    import re
    import signal
    import subprocess
    import sys
    import urllib.request

    cmd = [sys.executable, "-m", "dspark_compile.cli.main", "serve", str(tp_engine), "--tp",
           "2", "--port", "0", "--no-access-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"serving engine on (http://127\.0\.0\.1:\d+) ", line):
                break
        assert m, "".join(lines)
        url = m.group(1)
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"model": "engine", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
             "ignore_eos": True}).encode(), headers={"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert out["choices"][0]["token_ids"] == tp_ref[0]
        ranks = _spawned_ranks(proc.pid)
        assert len(ranks) == TP, ranks
        import os
        os.kill(ranks[1], signal.SIGKILL)
        rest = proc.communicate(timeout=90)[0]
        assert proc.returncode == 1, "".join(lines) + rest
        assert re.search(r"^dspark-compile serve: error: serve --tp: rank 1 died \(exit code "
                         r"-9\); the other ranks were ended$", rest, re.M), rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_rank_count_mismatch_is_one_line_before_listening(tp_engine, capfd):
    """serve at a rank count the engine was not built for (no --tp, --tp 4) exits 1 with one
    line naming the counts, before any rank starts or a port is bound."""
    assert main(["serve", str(tp_engine), "--port", "0"]) == 1
    err = capfd.readouterr().err
    assert "is built for 2 ranks (build --tp 2): pass --tp 2; --tp 1 given" in err, err
    assert len(err.strip().splitlines()) == 1
    assert main(["serve", str(tp_engine), "--port", "0", "--tp", "4"]) == 1
    assert "--tp 4 given" in capfd.readouterr().err
