"""benchmarks/host_overhead.py --dry-run on the CPU, in-process on the session's small engine (no
build, no load): the JSON's rows per bucket and mode, the loop's steady steps, the replay time
beside them. CPU numbers are no claim; the GPU run is the measurement."""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dry_run_reports_loop_and_replay_per_bucket(small_loaded, tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import host_overhead
    out = tmp_path / "out"
    rc = host_overhead.main(["--dry-run", "--buckets", "2", "--prompt-len", "3",
                             "--max-new-tokens", "10", "--replays", "1", "--modes", "overlap",
                             "--out", str(out)],
                            engine=small_loaded)
    assert rc == 0
    rec = json.loads((out / "host_overhead.json").read_text())
    assert rec["schema"] == "dspark-host-overhead/1" and rec["complete"] and rec["dry_run"]
    rows = {(r["B"], r["mode"]): r for r in rec["rows"]}
    assert set(rows) == {(2, "overlap")}
    for (b, mode), r in rows.items():
        assert r["replay_us"] > 0 and r["replay_method"] == "program/perf_counter"
        assert r["greedy_variant"], "an all-greedy batch times the greedy variant"
        assert r["steady_steps"] >= 1 and r["wall_us"] > 0, (b, mode, r)
        assert r["overhead_pct"] == 100 * (r["wall_us"] - r["replay_us"]) / r["replay_us"]
        assert r["generate_tokens"] == 10 * b and r["generate_steps"] >= 1
        assert r["device_us"] is None          # no CUDA events on the CPU
    assert (out / "host_overhead.csv").exists()
    open_stream = small_loaded._stream and small_loaded._stream()
    assert open_stream is None or open_stream.closed, "the benchmark left a stream open"
