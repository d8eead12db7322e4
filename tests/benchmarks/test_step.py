"""benchmarks/step.py --dry-run on the CPU: the whole-step benchmark's JSON, every variant run
once (or skipped with a reason), the byte floor, the per-layer attribution."""
import csv
import json

VARIANTS = ("eager", "eager-graph", "compile-graph", "engine", "engine-greedy",
            "engine-batch-dependent")


def test_dry_run_writes_every_variant_floor_and_layers(dry_run):
    # The "greedy" case alone runs all six variants (engine-greedy needs it); a 1 s compile
    # budget exercises the budget's skip path instead of a CPU Inductor build (minutes).
    # Measured: 142 s on a 2-core machine (build of one bucket ~35 s, engine load ~15 s, the
    # per-layer runs ~45 s, the profiled eager steps the rest).
    run, out = dry_run("step", "--buckets", "2", "--cases", "greedy", "--compile-budget-s", "1")
    rec = json.loads((out / "step.json").read_text())
    assert rec["schema"] == "dspark-step-benchmark/1" and rec["complete"] and rec["dry_run"]
    env = rec["environment"]
    for k in ("device", "torch", "triton", "git_commit", "date_utc"):
        assert k in env
    assert rec["preset"] == "tiny" and rec["buckets"] == [2] and rec["dtype"] == "float32"
    assert rec["copy_bandwidth"]["bytes_per_s"] > 0
    assert len(rec["dspark_kernel_names"]) > 10 and "_act_quant_kernel" in rec["dspark_kernel_names"]

    floor = rec["floors"]["greedy/B2"]
    assert floor["bytes"] > 0 and floor["us"] > 0
    assert floor["bytes"] == (floor["weights_bytes"] + floor["state_read_bytes"]
                              + floor["state_written_bytes"] + floor["logits_written_bytes"])
    for k in ("weights_bytes", "state_read_bytes", "state_written_bytes", "logits_written_bytes"):
        assert floor[k] > 0, k
    # tiny: 8 routed experts per MoE; a 2-row step (12 tokens, top-2) touches 1..8 of them
    assert floor["experts_used_per_moe"] and all(
        1 <= n <= 8 for n in floor["experts_used_per_moe"].values())
    assert floor["state_fallback"] == [] and floor["sampled_rows"] == 0
    # the honest floor: the LM head read again, FLOP-bound ops at their FLOP time (a CPU has no
    # MMA peak in the table: no FLOP correction here, said in the record)
    hon = floor["honest"]
    assert hon["head_second_read_us"] > 0 and rec["mma_tflops"] is None
    assert floor["honest_us"] == hon["byte_floor_us"] + hon["head_second_read_us"] + hon["flop_excess_us"]
    assert hon["flop_excess_us"] == 0 and hon["byte_floor_us"] == floor["us"]
    assert {"dspark.fp8_linear", "dspark.linear", "dspark.moe_experts",
            "dspark.sparse_attention", "dspark.draft_attention"} <= set(hon["op_classes"])
    assert rec["predict"] == ["tiny-deep"] and rec["predictions"] == {}   # needs device µs

    rows = {r["variant"]: r for r in rec["rows"] if r["case"] == "greedy" and r["B"] == 2}
    assert set(rows) == set(VARIANTS)
    for v, r in rows.items():
        assert r["status"] in ("ok", "skipped"), v
        if r["status"] == "skipped":
            assert r["reason"], v
        else:
            assert r["launches_total"] > 0 and r["launches_aten"] > 0, v
            assert r["floor_bytes"] == floor["bytes"], v
    assert rows["compile-graph"]["status"] == "skipped" and "budget" in rows["compile-graph"]["reason"]
    for v in ("eager", "engine", "engine-greedy", "engine-batch-dependent"):
        assert rows[v]["status"] == "ok", rows[v]
    # on the CPU the ops run their references, which have one plan: the same launches
    assert rows["engine-batch-dependent"]["launches_total"] == rows["engine"]["launches_total"]
    # the engine runs the fused dspark:: ops, far fewer ops than the reference step
    assert rows["engine"]["launches_dspark"] > rows["eager"]["launches_dspark"] > 0
    assert rows["engine"]["launches_total"] < rows["eager"]["launches_total"]

    layers = rec["per_layer"]["greedy/B2"]
    assert set(layers) == {"reference", "engine", "engine-greedy"}
    for prog, parts in layers.items():
        assert "error" not in parts, (prog, parts)
        for label in ("layers.0", "layers.5", "mtp.0", "mtp.2", "head", "sampler"):
            assert parts.get(label, {}).get("total", 0) > 0, (prog, label)
        assert "unattributed" not in parts, prog
    # the engine's sampler: its two fused ops (markov_sample, rejection_sample) and the gathers
    # of their rows' sampling parameters
    assert layers["engine"]["sampler"]["dspark"] == 2

    with open(out / "step.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rec["rows"])
    assert "engine-greedy" in run.stdout     # the printed table
