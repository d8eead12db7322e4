"""benchmarks/speedup.py --dry-run on the CPU: every (mode, batch, variant) row runs, the baseline
is named as the engine's own non-speculative decoding (its target-only programs), speed-ups are
against it, acceptance is in range, greedy speculation reproduces the baseline's tokens; the
JSON and CSV."""
import csv
import json


def test_dry_run_times_every_variant_against_the_engine_target_baseline(dry_run):
    # the build (one bucket of 2 serving B = 1 and 2: one export, and a prefill program of
    # 8 tokens: a 12-token prompt in two calls, as a real run's prompts go through the
    # engine's prefill programs) is most of it
    run, out = dry_run("speedup", "--prefill-chunks", "8")
    assert "baseline: the engine's own non-speculative decoding" in run.stdout
    rec = json.loads((out / "speedup.json").read_text())
    assert rec["schema"] == "dspark-speedup-benchmark/1" and rec["complete"] and rec["dry_run"]
    assert rec["baseline"] == "engine-target-only" and rec["prefill_chunks"] == [8]
    for k in ("device", "torch", "triton", "git_commit", "date_utc"):
        assert k in rec["environment"], k
    rows = {(r["mode"], r["B"], r["variant"], r.get("verify")): r for r in rec["rows"]}
    # a sampled speculative variant runs once per verification rule (block, token); greedy rows
    # and the target-only variants have no drafts to verify
    want = {(m, b, v, ver) for m in ("greedy", "sampled") for b in (1, 2)
            for v in ("engine-speculative", "engine-target-only", "reference-target-only",
                      "reference-speculative")
            for ver in (("block", "token") if m == "sampled" and v.endswith("speculative")
                        else (None,))}
    assert set(rows) == want and rec["verify"] == ["block", "token"]
    N = 5
    for (mode, B, variant, _), r in rows.items():
        assert r["tokens"] == B * rec["new_tokens"], (mode, B, variant)
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
        assert r["seconds_each"] == [r["seconds"]] and rec["repeats"] == 1    # the dry run's
        base = rows[(mode, B, "engine-target-only", None)]
        assert abs(r["speedup"] - r["tokens_per_s"] / base["tokens_per_s"]) < 1e-2
        # the decoding alone: the call's time past its prefill (max_new_tokens=1 calls)
        assert 0 < r["prefill_s"] and r["prefill_steps"] == 0, r
        if "decode_tokens_per_s" in r:
            rate = (r["tokens"] - B) / (r["seconds"] - r["prefill_s"])
            assert abs(r["decode_tokens_per_s"] / rate - 1) < 1e-2, r
            if "decode_tokens_per_s" in base:
                assert abs(r["decode_speedup"] - r["decode_tokens_per_s"]
                           / base["decode_tokens_per_s"]) < 1e-2
        if variant.endswith("target-only"):
            assert "mean_accepted_length" not in r
            assert variant != "engine-target-only" or r["speedup"] == 1.0
            if mode == "greedy" and variant == "reference-target-only":
                assert r["greedy_match"] == 1.0, r
            continue
        acc = r["acceptance_per_position"]
        assert len(acc) == N and all(0 <= a <= 1 for a in acc)
        assert all(a >= b for a, b in zip(acc, acc[1:]))       # accepted prefixes
        assert abs(r["mean_accepted_length"] - (1 + sum(acc))) < 1e-3
        if mode == "greedy":
            # float32 with FP8 simulation: a near-tie may flip, so not asserted exact; the
            # dry run's few tokens from the trained pair agree
            assert r["greedy_match"] == 1.0, r
    with open(out / "speedup.csv") as f:
        assert len(list(csv.DictReader(f))) == len(want)
