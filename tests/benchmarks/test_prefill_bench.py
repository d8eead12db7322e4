"""benchmarks/prefill.py --dry-run on the CPU: both prefill variants run once and agree with the
reference's first token; the floor's bytes, FLOPs and bound; the JSON and CSV."""
import csv
import json


def test_dry_run_runs_both_variants_and_names_the_floor(dry_run):
    # Measured on a 2-core machine: ~90 s, of which the build (the bucket-1 step and the
    # chunk-16 prefill program, an export of ~29 s each) ~75 s and the load ~13 s; the prefill
    # runs and the floor take seconds.
    run, out = dry_run("prefill")
    rec = json.loads((out / "prefill.json").read_text())
    assert rec["schema"] == "dspark-prefill-benchmark/1" and rec["complete"] and rec["dry_run"]
    for k in ("device", "driver", "torch", "triton", "git_commit", "date_utc"):
        assert k in rec["environment"], k
    assert (rec["preset"], rec["prompt_len"], rec["chunks"], rec["dtype"]) == \
        ("tiny", 40, [16], "float32")
    # the programs' schedule: two full chunks, then one padded to 16 holding 8 tokens
    assert rec["schedule"] == [[0, 16, 16], [16, 16, 16], [32, 8, 16]]
    assert rec["copy_bandwidth"]["bytes_per_s"] > 0 and rec["mm_rate"]["flops_per_s"] > 0

    floor = rec["floor"]
    assert floor["chunk_tokens"] == [16, 16, 8]
    assert floor["bound"] in ("bytes", "flops") and floor["us"] > 0
    assert floor["us"] == max(floor["bytes_us"], floor["flops_us"])
    assert (floor["bound"] == "bytes") == (floor["bytes_us"] >= floor["flops_us"])
    assert floor["bytes"] == (floor["weights_bytes"] + floor["state_written_bytes"]
                              + floor["logits_written_bytes"])
    assert floor["flops"] == floor["weight_flops"] + floor["attention_flops"]
    assert floor["weights_bytes"] == sum(floor["weights_bytes_per_chunk"])
    for b in floor["weights_bytes_per_chunk"]:
        assert 0 < b <= floor["model_weights_bytes"]
    # the target's head and the draft block are read in the last chunk only
    per = floor["weights_bytes_per_chunk"]
    assert per[2] > per[0] and per[2] > per[1]
    for part, f in floor["weight_flops_by_part"].items():
        assert f > 0, part
    # counted independently from the config: the head multiplies one token by the LM head
    # [V, D] and hc_head's fn [m, m D] (the norm is a vector)
    from dspark_compile.factory.presets import preset
    c = preset("tiny")
    V, D, m = c["vocab_size"], c["hidden_size"], c["hc_mult"]
    assert floor["weight_flops_by_part"]["head"] == 2 * (V * D + m * m * D)
    assert floor["attention_flops"] > 0 and floor["state_written_bytes"] > 0
    assert {"head.weight", "embed.weight", "mtp.0.main_proj.weight"} <= set(floor["weights_read"])
    # tiny: 8 routed experts, top-2. Target MoEs route every chunk, the draft's only the last
    experts = floor["experts_used_per_moe_per_chunk"]
    for moe, by_chunk in experts.items():
        want = ["2"] if moe.startswith("mtp.") else ["0", "1", "2"]
        assert sorted(by_chunk) == want, moe
        assert all(1 <= n <= 8 for n in by_chunk.values()), moe
    assert any(m.startswith("layers.") for m in experts) and any(m.startswith("mtp.") for m in experts)

    ref = rec["reference"]["first_token"]
    rows = {r["variant"]: r for r in rec["rows"]}
    assert set(rows) == {"eager", "engine"}
    for v, r in rows.items():
        assert r["status"] == "ok", r
        assert r["first_token"] == ref and r["agrees"] and "reference" in r["check"], r
        assert r["floor_us"] == floor["us"] and r["floor_bound"] == floor["bound"], v
        assert r["us_median"] is None, v        # a dry run times nothing

    with open(out / "prefill.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    assert "engine" in run.stdout and "floor:" in run.stdout     # the printed table
