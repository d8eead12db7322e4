"""benchmarks/bench_args.py: the flags the engine benchmarks share keep each script's defaults,
and a bad value stops the run with argparse's usage error naming the flag, never a traceback."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import bench_args  # noqa: E402
import host_overhead  # noqa: E402
import prefill  # noqa: E402
import serve_load  # noqa: E402
import speedup  # noqa: E402
import step  # noqa: E402


def test_each_benchmark_keeps_its_own_defaults():
    s = step._args([])
    assert (s.preset, s.buckets, s.dtype, s.max_seq_len, s.backend, s.seed, s.threads) == \
        ("tiny", [1, 4, 16, 64], "bfloat16", 256, None, 0, 1)
    assert s.variants == list(step.VARIANTS) and s.cases == ["mixed", "greedy"]
    d = step._args(["--dry-run", "--buckets", "16,2"])
    assert (d.buckets, d.dtype, d.max_seq_len, d.max_prompt_len) == ([2], "float32", 64, 12)
    h = host_overhead._args([])
    assert (h.buckets, h.modes, h.dtype, h.max_seq_len, h.backend) == \
        ([1, 64], ["overlap", "serial"], "bfloat16", 256, None)
    p = prefill._args([])
    assert (p.chunks, p.dtype, p.backend, p.prompt_len, p.buckets) == \
        ([512], "bfloat16", "aten", 1024, [1])
    assert prefill._args(["--dry-run"]).chunks == [16]
    u = speedup._args(["--device", "cpu"])
    assert (u.batches, u.modes, u.dtype, u.variants, u.verify) == \
        ([1, 16, 64], ["greedy", "sampled"], "float32", list(speedup.VARIANTS), ["block", "token"])
    assert serve_load._args(["--engine", "e", "--concurrency", "4,1"]).concurrency == [4, 1]


def test_size_lists_are_distinct_positive_and_ascending():
    assert step._args(["--buckets", "64, 1,16,1"]).buckets == [1, 16, 64]
    assert prefill._args(["--chunks", "512,64"]).chunks == [64, 512]
    # levels and probe rows keep the order given
    assert bench_args.ordered_ints("64,1,64") == [64, 1, 64]


# script -> (flag, bad value): malformed, non-positive, empty, unknown names
BAD = {step: [("--buckets", "1,x"), ("--buckets", "0,4"), ("--buckets", ""),
              ("--variants", "eager,nope"), ("--cases", "mixed,huge"), ("--max-seq-len", "0")],
       host_overhead: [("--modes", "sideways"), ("--buckets", "-1")],
       prefill: [("--chunks", "16,abc")],
       speedup: [("--batches", "1.5"), ("--modes", ""), ("--threads", "0"),
                 ("--verify", "rejection"), ("--verify", "")],
       serve_load: [("--concurrency", "2,0")]}
REQUIRED = {serve_load: ["--engine", "e"]}


@pytest.mark.parametrize("script, flag, value",
                         [(m, f, v) for m, bad in BAD.items() for f, v in bad],
                         ids=lambda x: getattr(x, "__name__", x))
def test_a_bad_value_is_a_usage_error_naming_the_flag(script, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        script._args(REQUIRED.get(script, []) + [flag, value])
    assert e.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_an_empty_variant_list_stays_allowed_where_it_was():
    # step.py --variants '': the floors and the per-layer reference alone
    assert step._args(["--variants", ""]).variants == []


def test_the_result_file_is_written_whole_and_once_more_at_the_end(tmp_path):
    rec = {"complete": False, "rows": []}
    path = tmp_path / "out" / "r.json"      # its folder made
    with pytest.raises(RuntimeError):
        with bench_args.result_file(path, rec) as write:
            rec["rows"].append(1)
            write()
            rec["rows"].append(2)
            raise RuntimeError("a run that fails part-way")
    assert json.loads(path.read_text()) == {"complete": False, "rows": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]     # no temporary left


def test_a_temporary_work_dir_is_removed_and_a_given_one_kept(tmp_path):
    class A:
        work = None
    with bench_args.work_dir(A, "t_") as work:
        assert work.is_dir()
    assert not work.exists()
    A.work = str(tmp_path / "w")
    with bench_args.work_dir(A, "t_") as work:
        (work / "ckpt").mkdir()
    assert (tmp_path / "w" / "ckpt").is_dir()
