"""The memory plan (dspark_compile/build/memory_plan.py) against what the loaders and the state
allocator really hold: its exact parts (weights, RoPE tables, decode state) equal the bytes of
the synthetic checkpoint's files, of the per-rank models sharding.py builds and of
allocate_state's buffers; a plan larger than the device is refused naming the numbers.

The checkpoint is the tiny preset widened as tests/models/test_parallel.py widens it
(o_lora_rank 64 -> 128, moe_intermediate_size 128 -> 256), so every split holds whole 128 x 128
scale blocks at tp = 2; its tensors come from synth_tensors (random values: the plan counts
bytes, the loaders check shapes and dtypes), written by write_checkpoint (~3 s on 2 cores).
"""
import json
import struct

import pytest
import torch

from dspark_compile.build.checks import check_build
from dspark_compile.build.memory_plan import (DEVICES, GiB, DeviceMemory, check_fits,
                                              device_memory, format_plan, max_rows_that_fit,
                                              memory_plan, rope_table_bytes)
from dspark_compile.engine_dir.build_config import BuildConfig
from dspark_compile.factory.checkpoint_dir import write_checkpoint
from dspark_compile.factory.presets import preset
from dspark_compile.factory.random_weights import synth_tensors
from dspark_compile.models import load_model
from dspark_compile.models.config import ModelConfig, Precision
from dspark_compile.models.parallel import ParallelConfig
from dspark_compile.models.sharding import build_rank_model, rank_weight_bytes
from dspark_compile.models.state import allocate_state
from dspark_compile.models.target import DeepseekV4

# fp32 compute, the CPU build's default; buckets up to 4 rows, 64-token prefill chunks
BC = BuildConfig(buckets=(1, 2, 4), max_rows=4, max_seq_len=160, prefill_chunks=(32, 64),
                 dtype="float32", target_programs=True)


def _wide_raw() -> dict:
    raw = preset("tiny")
    raw.update(o_lora_rank=2 * raw["o_lora_rank"],
               moe_intermediate_size=2 * raw["moe_intermediate_size"])
    return raw


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    raw = _wide_raw()
    tensors = synth_tensors(ModelConfig.from_dict(raw), seed=0)
    return write_checkpoint(raw, tensors, tmp_path_factory.mktemp("plan") / "tiny-wide")


@pytest.fixture(scope="module")
def cfg(wide_ckpt):
    return ModelConfig.from_file(wide_ckpt / "config.json")


def _file_tensor_bytes(path) -> int:
    """Sum of the tensors' byte ranges in a safetensors file's header (what the file holds)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())


def _buffer_bytes(model, persistent: bool, unique: bool = True) -> int:
    """Bytes of the model's checkpoint buffers (persistent) or RoPE tables (non-persistent);
    `unique` False counts a table once per module FQN, as the engine's weights file does."""
    total = 0
    for name, b in model.named_buffers(remove_duplicate=unique):
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if (attr not in mod._non_persistent_buffers_set) == persistent:
            total += b.numel() * b.element_size()
    return total


def test_weights_at_tp1_equal_the_checkpoint_files_bytes(wide_ckpt, cfg):
    """tp = 1: the planned weights are every tensor byte of the checkpoint's safetensors (the
    draft and the optional confidence head included: the synth writes it), and the reference
    model built from it holds the same bytes in its checkpoint buffers."""
    plan = memory_plan(cfg, BC, 1)
    assert plan.weight_bytes == _file_tensor_bytes(wide_ckpt / "model.safetensors")
    model = load_model(wide_ckpt, Precision(dtype=torch.float32), 64)
    assert _buffer_bytes(model, persistent=True) == plan.weight_bytes


def test_weights_at_tp2_equal_each_rank_models_buffers(wide_ckpt, cfg):
    """tp = 2: each rank's planned weights equal what build_rank_model keeps (its checkpoint
    buffers: H / 2 heads, its 4 of 8 experts, half the vocab and the shared expert's I, the
    gates and the latent KV whole) and the bytes its loader read; the two ranks hold the same,
    the replicated part is counted on both, the rest is halved."""
    plan1, plan2 = memory_plan(cfg, BC, 1), memory_plan(cfg, BC, 2)
    for rank in range(2):
        model, read = build_rank_model(wide_ckpt, ParallelConfig(rank, 2),
                                       Precision(dtype=torch.float32), max_positions=64)
        assert _buffer_bytes(model, persistent=True) == plan2.weight_bytes == read, rank
    assert plan2.weight_bytes == rank_weight_bytes(cfg, 2)
    split = plan1.weight_bytes - plan1.replicated_weights
    assert plan2.replicated_weights == plan1.replicated_weights > 0
    assert plan2.weight_bytes == plan1.replicated_weights + split // 2


def test_rope_tables_equal_the_engine_and_eager_models_tables(cfg):
    """The RoPE tables counted as the engine holds them: one per attention module and
    rope_main at the build's positions (the weights file keys them by module FQN), plus the
    eager prefill model's two (main, compressed), deduplicated inside that model."""
    block = cfg.dspark_block_size
    engine_pos, eager_pos = BC.rope_positions(block), BC.max_seq_len + block + 2
    with torch.device("meta"):
        built = DeepseekV4(cfg, BC.precision(), engine_pos)
        eager = DeepseekV4(cfg, BC.precision(), eager_pos)
    want = _buffer_bytes(built, persistent=False, unique=False) \
        + _buffer_bytes(eager, persistent=False, unique=True)
    assert memory_plan(cfg, BC, 2).rope_tables == want == rope_table_bytes(cfg, engine_pos,
                                                                          eager_pos)


@pytest.mark.parametrize("kv_fp8", [True, False])
def test_state_equals_allocate_states_buffers(cfg, kv_fp8):
    """The planned decode state is the bytes allocate_state allocates for the build's cache
    (max_rows + 1 rows, the largest prefill chunk's tokens per forward), FP8 KV or not, and
    the same on every rank (replicated with the latent KV)."""
    bc = BuildConfig(buckets=(1, 2), max_rows=3, max_seq_len=96, prefill_chunks=(16,),
                     dtype="float32", kv_fp8=kv_fp8)
    state = allocate_state(cfg, bc.cache(cfg.dspark_block_size), bc.precision())
    want = sum(t.numel() * t.element_size() for t in state.values())
    assert memory_plan(cfg, bc, 1).state_bytes == want == memory_plan(cfg, bc, 2).state_bytes
    assert state["row.last_pos"].shape[0] == 4                  # the trash row counted


def test_graph_pool_estimate_stays_above_the_measured_pool():
    """The one measured pool (tiny fp32 engine, buckets 1-64, 64 rows x 256 positions: 28 MiB,
    benchmarks/results/README.md "Engine") is below the estimate, and the estimate grows with
    the largest bucket."""
    tiny = ModelConfig.from_dict(preset("tiny"))
    bc = BuildConfig(buckets=(1, 4, 16, 64), max_rows=64, max_seq_len=256, dtype="float32")
    plan = memory_plan(tiny, bc, 1)
    assert 28 * (1 << 20) < plan.graph_pool < 4 * 28 * (1 << 20)
    assert plan.graph_pool_program == "step, bucket 64"
    small = BuildConfig(buckets=(1, 4), max_rows=64, max_seq_len=256, dtype="float32")
    assert memory_plan(tiny, small, 1).graph_pool < plan.graph_pool


def test_plan_that_does_not_fit_is_refused_naming_the_numbers(cfg):
    """A device smaller than the plan: one line with the rank count, the total, every
    category's GiB, the settings and the device's GiB; weights alone too large say so."""
    plan = memory_plan(cfg, BC, 2)
    small = DeviceMemory("test-gpu", plan.total - GiB // 4)
    with pytest.raises(ValueError) as e:
        check_fits(plan, small)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"memory plan: each of the 2 rank(s) needs {plan.total / GiB:.2f} GiB")
    for part in ("weights", "RoPE tables", "decode state", "CUDA graph pool (estimate)",
                 "workspace (estimate)", "max_rows=4 x max_seq_len=160",
                 f"the device test-gpu has {small.usable / GiB:.2f} GiB", "0.25 GiB short"):
        assert part in msg, part
    check_fits(plan, DeviceMemory("big", plan.total))              # exactly full fits
    with pytest.raises(ValueError, match=r"its weights alone \(.* GiB at tp=2\) exceed it"):
        check_fits(plan, DeviceMemory("tiny-gpu", plan.weight_bytes - 1))


@pytest.mark.parametrize("tp", [0, 3, -2, 2.0, True, "2"])
def test_bad_rank_counts_are_refused(cfg, tp):
    with pytest.raises(ValueError, match=r"tp must be a power of two >= 1 \(1, 2, 4, 8\), got"):
        memory_plan(cfg, BC, tp)


def test_rank_count_that_does_not_split_the_shapes_is_refused(cfg):
    """tp = 4 would split the 2 output groups of the widened tiny config; the tiny preset at
    tp = 2 would cut wo_a's 128-row scale blocks: both named before anything is planned."""
    with pytest.raises(ValueError, match=r"tp=4: config field 'o_groups' = 2 does not split"):
        memory_plan(cfg, BC, 4)
    tiny = ModelConfig.from_dict(preset("tiny"))
    with pytest.raises(ValueError, match=r"tp=2: tensor 'layers\.0\.attn\.wo_a\.weight'"):
        memory_plan(tiny, BC, 2)


def test_build_check_prints_the_plan_and_refuses_a_small_device(wide_ckpt, tmp_path):
    """check_build (before any weight is loaded) logs the table and refuses a target device
    the plan does not fit, naming it."""
    lines = []
    check_build(wide_ckpt, tmp_path / "eng", BC, log=lines.append)
    assert lines and lines[0].startswith("memory plan per rank: tp=1, max_rows=4")
    with pytest.raises(ValueError, match=r"memory plan: .*the device of 0\.01 GiB has 0\.01 GiB"):
        check_build(wide_ckpt, tmp_path / "eng", BC, target=device_memory(gib=0.01))


def test_device_inputs_are_checked():
    assert device_memory("h200") is DEVICES["h200"]
    assert device_memory(gib=96).usable == 96 * GiB
    assert device_memory() is None                                  # CPU build: nothing to check
    for bad in (0, -1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="--device-memory-gib must be a positive number"):
            device_memory(gib=bad)
    with pytest.raises(ValueError, match="--target-device must be one of rtx-pro-6000"):
        device_memory("a100")


def test_flash_0731_tp2_fits_two_rtx_pro_6000_with_8_rows_of_64k():
    """Issue 53's target: Flash-0731 at tp = 2, 8 rows x 65,536 positions, bf16 with FP8 KV,
    fits an RTX PRO 6000 (and with 3 GiB to spare under the stricter 96e9-byte reading); at
    tp = 1 it fits no target device (its weights alone are 155 GiB)."""
    flash = ModelConfig.from_dict(preset("flash-0731"))
    bc = BuildConfig(buckets=(1, 2, 4, 8), max_rows=8, max_seq_len=65536, dtype="bfloat16",
                     prefill_chunks="auto", target_programs=True)
    plan = memory_plan(flash, bc, 2)
    check_fits(plan, DEVICES["rtx-pro-6000"])
    check_fits(plan, DeviceMemory("96e9", 96 * 10**9 - 3 * GiB))
    assert max_rows_that_fit(flash, bc, 2, DEVICES["rtx-pro-6000"]) >= 8
    assert "total per rank" in format_plan(plan, DEVICES["gb10"])
    with pytest.raises(ValueError, match="its weights alone"):
        check_fits(memory_plan(flash, bc, 1), DEVICES["h200"])


def test_plan_command_prints_the_table_and_exits_1_with_one_line_when_it_does_not_fit(
        wide_ckpt, capsys):
    """`dspark-compile plan CKPT` reads only config.json: the table on stdout, exit 0; a
    target device too small: exit 1 and one line on stderr naming the flags and the device."""
    from dspark_compile.cli.main import main
    assert main(["plan", str(wide_ckpt), "--tp", "2", "--max-rows", "4",
                 "--max-seq-len", "160", "--device-memory-gib", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan per rank: tp=2, max_rows=4 x max_seq_len=160")
    assert "device of 64 GiB (usable)" in out
    assert main(["plan", "--preset", "flash-0731", "--tp", "2", "--max-rows", "64",
                 "--max-seq-len", "65536", "--target-device", "rtx-pro-6000"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--max-rows=64 x --max-seq-len=65536" in err
    assert "the device rtx-pro-6000 has 95.59 GiB" in err and "GiB short" in err
    assert main(["plan", "--preset", "flash-0731", "--tp", "3"]) == 1
    assert "--tp must be a power of two" in capsys.readouterr().err
