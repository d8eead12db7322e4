"""benchmarks/step_roofline.py and step_predict.py: the honest floor's op ledger on a real tiny
step (the FLOPs of the ops whose counts follow from the config alone), the floor's arithmetic,
and the per-layer-type prediction's arithmetic."""
import os
import sys

import pytest
import torch

from dspark_compile.factory.presets import preset
from dspark_compile.factory.synth import synth_checkpoint
from dspark_compile.models.config import CacheConfig, ModelConfig
from dspark_compile.models.loading import load_model
from dspark_compile.models.random_requests import prefilled_state
from dspark_compile.models.state import restore_state, snapshot_state
from dspark_compile.models.step import DraftVerifyStep

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import step_floor  # noqa: E402
import step_predict  # noqa: E402
import step_roofline as R  # noqa: E402


@pytest.fixture(scope="module")
def tiny_step(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("roof") / "tiny"
    synth_checkpoint("tiny", ckpt, seed=0)
    model = load_model(ckpt)
    B = 3
    rows, state = prefilled_state(model, CacheConfig(max_rows=4, max_seq_len=128), B, 0)
    snap = snapshot_state(state)
    step = DraftVerifyStep(model).eval()
    with torch.no_grad(), step_floor.record_routing(model) as routing:
        step(rows, state)
    restore_state(state, snap)
    floor = step_floor.byte_floor(model, state, list(range(B)), routing)
    with torch.no_grad(), R.ledger(model, state, floor) as led:
        step(rows, state)
    return model, floor, led.ops, B


def test_ledger_counts_the_head_twice_and_the_moe_by_its_routed_pairs(tiny_step):
    model, floor, ops, B = tiny_step
    cfg = model.cfg
    N, V, D = cfg.dspark_block_size, cfg.vocab_size, cfg.hidden_size
    head = [o for o in ops if o["part"] == "head"]
    # verification's logits over B x (N + 1) tokens, then the draft's base logits over B x N
    assert sorted(o["flops"] for o in head) == sorted([2 * B * (N + 1) * V * D, 2 * B * N * V * D])
    head_bytes = model.head.weight.numel() * model.head.weight.element_size()
    assert all(o["weight_bytes"] == head_bytes for o in head)
    moe = [o for o in ops if o["op"] == "dspark.moe_experts"]
    target_moe = [o for o in moe if o["part"].startswith("layers.")]
    assert len(target_moe) == cfg.num_hidden_layers and len(moe) == cfg.num_hidden_layers + 3
    per_pair = 2 * 3 * D * cfg.moe_intermediate_size
    for o in target_moe:      # every verified token routed to top-k experts
        assert o["flops"] == B * (N + 1) * cfg.num_experts_per_tok * per_pair
        assert 0 < o["weight_bytes"]
    # each op is attributed to the layer it runs in: every layer has its linears
    parts = {o["part"] for o in ops}
    assert {f"layers.{i}" for i in range(cfg.num_hidden_layers)} | {"mtp.0", "mtp.2"} <= parts
    assert all(o["flops"] > 0 for o in ops)
    attn = [o for o in ops if o["op"] == "dspark.sparse_attention"]
    assert len(attn) == cfg.num_hidden_layers and all(o["state_bytes"] > 0 for o in attn)


def _excess(ops, bw, rates):
    """Each op's FLOP time over its bytes' time, where its MMA dtype has a rate."""
    return sum(max(0.0, o["flops"] / (rates[o["mma"]] * 1e12) * 1e6
                   - (o["weight_bytes"] + o["state_bytes"]) / bw * 1e6)
               for o in ops if o["mma"] in rates)


def test_honest_floor_adds_the_head_and_only_flop_bound_excess(tiny_step):
    model, floor, ops, _ = tiny_step
    bw = 1e12
    # the default precision: bf16 ops, FP8 linears fed FP8 activations, mHC's fp32 matmuls
    assert {o["mma"] for o in ops} == {"bf16", "fp8", "torch.float32"}
    peak = R.peak_tflops("NVIDIA H100 80GB HBM3")
    h = R.honest_floor(floor, ops, 1000, bw, peak)
    assert h["no_peak_for"] == ["torch.float32"]     # no MMA peak: no FLOP correction
    assert h["flop_excess_us"] == pytest.approx(_excess(ops, bw, peak), abs=1e-9)
    assert h["honest_us"] == pytest.approx(
        floor["bytes"] / bw * 1e6 + 1000 / bw * 1e6 + h["flop_excess_us"])
    # a tiny peak makes every op FLOP-bound: the excess is each op's FLOP time over its bytes
    slow = {"bf16": 1e-6, "fp8": 1e-6, "torch.float32": 1e-6}
    h = R.honest_floor(floor, ops, 0, bw, slow)
    want = _excess(ops, bw, slow)
    assert h["flop_excess_us"] == pytest.approx(want) and want > 0 and h["no_peak_for"] == []
    assert sum(c["calls"] for c in h["op_classes"].values()) == len(ops)
    assert sum(c["flop_excess_us"] for c in h["op_parts"].values()) == pytest.approx(want)
    # without a peak at all: the byte floor and the head's second read
    h = R.honest_floor(floor, ops, 1000, bw, None)
    assert h["flop_excess_us"] == 0
    assert h["honest_us"] == pytest.approx(floor["bytes"] / bw * 1e6 + 1000 / bw * 1e6)


def test_bytes_by_part_sum_to_the_byte_floor(tiny_step):
    model, floor, _, _ = tiny_step
    parts = R.bytes_by_part(floor, model)
    assert sum(parts.values()) == floor["bytes"]
    assert parts["head"] >= model.head.weight.numel() * model.head.weight.element_size()
    assert {f"layers.{i}" for i in range(model.cfg.num_hidden_layers)} <= set(parts)


def test_peak_rates_by_device_name():
    assert R.peak_tflops("NVIDIA H100 80GB HBM3")["bf16"] == 989.4
    assert R.peak_tflops("NVIDIA H100 PCIe")["bf16"] == 756.0
    assert R.peak_tflops("NVIDIA GeForce RTX 5090") is None
    assert R.peak_tflops("anything", {"bf16": 1.0}) == {"bf16": 1.0}


def test_prediction_sums_the_target_layers_by_type():
    measured = ModelConfig.from_dict(preset("flash-slice"))    # swa-hash, c4, c128, 3 drafts
    target = ModelConfig.from_dict(preset("flash-0731"))
    comp = step_predict.composition(target)
    assert comp.count("swa-hash") == 2 and comp.count("c4-hash") == 1
    assert comp.count("c4") == 20 and comp.count("c128") == 20 and comp.count("draft") == 3
    layers = {"layers.0": {"us": 10.0, "total": 5}, "layers.1": {"us": 20.0, "total": 7},
              "layers.2": {"us": 30.0, "total": 9}, "mtp.0": {"us": 4.0, "total": 2},
              "mtp.1": {"us": 6.0, "total": 2}, "mtp.2": {"us": 8.0, "total": 4},
              "head": {"us": 100.0, "total": 3}, "sampler": {"us": 50.0, "total": 6}}
    floors = {"layers.0": 1.0, "layers.1": 2.0, "layers.2": 3.0, "mtp.0": 1.0, "mtp.1": 1.0,
              "mtp.2": 1.0, "head": 10.0, "other": 5.0}
    row = {"us_median": 300.0, "launches_total": 40}
    p = step_predict.predict(measured, target, layers, row, 260.0, floors, 4, [2.0])
    kernels = 150 + 2 * 10 + 21 * 20 + 20 * 30 + 3 * 6
    launches = 9 + 2 * 5 + 21 * 7 + 20 * 9 + 3 * (8 / 3)
    assert p["kernel_us"] == pytest.approx(kernels)
    assert p["launches"] == pytest.approx(launches)
    assert p["step_us"] == pytest.approx(kernels + 1.0 * launches)     # (300 - 260) / 40 a launch
    assert p["floor_us"] == pytest.approx(15 + 2 * 1 + 21 * 2 + 20 * 3 + 3 * 1)
    assert p["fallbacks"] == ["c4-hash <- c4"]
    assert p["tokens_per_s"]["2.0"] == pytest.approx(4 * 2.0 / p["step_us"] * 1e6)
    with pytest.raises(KeyError, match="c128 not measured"):
        step_predict.predict(measured, target, {k: v for k, v in layers.items() if k != "layers.2"},
                             row, 260.0, floors, 4, [2.0])


def test_op_class_table_sums_each_kernel_once_against_its_class_floor():
    """Kernel names as the H100 profile of 2026-12-07 records them: every kernel lands in one
    class (the first pattern), the classes sum to the replay, floors only where the ledger has
    the class's ops (the max of bytes and FLOPs per op class), largest class first."""
    kernel_us = {"_linear_kernel": 700.0, "_splitk_sum_kernel": 40.0, "_moe_gate_up_kernel": 500.0,
                 "_moe_down_kernel": 280.0, "_fp8_linear_kernel": 330.0,
                 "_fp8_linear_multi_kernel": 130.0, "_markov_logits_kernel": 125.0,
                 "row_refine_kernel": 76.0, "_hc_gates_kernel": 83.0, "_hc_mix_kernel": 59.0,
                 "_sparse_attention_kernel": 80.0, "_combine_kernel": 18.0,
                 "_rmsnorm_quant_kernel": 38.0,
                 "void at::native::unrolled_elementwise_kernel<direct_copy>": 93.0,
                 "some_new_kernel": 1.0}
    op_classes = {"dspark.linear": {"byte_us": 725.0, "flop_us": 190.0},
                  "dspark.moe_experts": {"byte_us": 600.0, "flop_us": 700.0},
                  "dspark.fp8_linear": {"byte_us": 288.0, "flop_us": 5.0}}
    rows = R.op_class_table(kernel_us, 3300.0, op_classes)
    by = {r["class"]: r for r in rows}
    assert sum(r["us"] for r in rows) == sum(kernel_us.values())
    assert by["linear"]["us"] == 740 and by["linear"]["floor_us"] == 725
    assert by["moe"]["us"] == 780 and by["moe"]["floor_us"] == 700       # FLOP-bound
    assert by["fp8_linear"]["us"] == 460 and by["fp8_linear"]["ratio"] == round(460 / 288, 3)
    assert by["samplers"]["us"] == 201 and by["samplers"]["floor_us"] is None
    assert by["mhc"]["us"] == 142 and by["attention"]["us"] == 98
    assert by["aten"]["us"] == 93 and by["other"]["us"] == 1 and by["norm/quant/rope"]["us"] == 38
    assert by["linear"]["share"] == round(740 / 3300, 4)
    assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)
    assert R.op_class_table(kernel_us, None, {})[0]["share"] is None
