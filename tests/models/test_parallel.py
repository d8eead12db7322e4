"""Tensor / expert parallelism on CPU processes (models/parallel.py, models/sharding.py): two gloo
ranks run the sharded reference and match the unsharded model; the per-rank loader reads only
its rank's bytes; a split that would cut a 128 x 128 FP8 scale block is refused by name.

The sharded checkpoint is the tiny one widened so every split holds whole blocks at tp = 2
(dspark_compile/factory/tp_checkpoint.py: o_lora_rank 64 -> 128, moe_intermediate_size 128 ->
256; the tiny preset itself is refused at tp = 2, tested below).
"""

import pytest
import torch

from dspark_compile.models.checkpoint import load_checkpoint
from dspark_compile.models.config import Precision
from dspark_compile.factory.tp_checkpoint import tp_checkpoint
from dspark_compile.models.parallel_check import run_check
from dspark_compile.models.parallel import ParallelConfig, ParallelError
from dspark_compile.factory.presets import preset
from dspark_compile.models.config import ModelConfig
from dspark_compile.models.sharding import (EXPERT, REPLICATE, ParallelDeepseekV4, check_splits,
                                            forward_collectives, load_rank_tensors,
                                            rank_weight_bytes, split_of)
from dspark_compile.models.schema import checkpoint_schema

TP = 2
PREC = Precision(dtype=torch.float64)


@pytest.fixture(scope="module")
def tp_ckpt(tiny_ckpt, tmp_path_factory):
    return tp_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("tp") / "tiny-wide")


@pytest.fixture(scope="module")
def tp_run(tp_ckpt, tmp_path_factory):
    """Both ranks' outputs (spawned gloo processes) and the unsharded model's (this process,
    run while the ranks run)."""
    return run_check(tp_ckpt, TP, tmp_path_factory.mktemp("tp_out"), PREC)


def _pairs(a: dict, b: dict, prefix=""):
    for k, v in a.items():
        if isinstance(v, dict):
            yield from _pairs(v, b[k], f"{prefix}{k}.")
        elif isinstance(v, list):
            for i, (x, y) in enumerate(zip(v, b[k])):
                yield f"{prefix}{k}[{i}]", x, y
        else:
            yield f"{prefix}{k}", v, b[k]


def test_ranks_agree_bitwise(tp_run):
    """Every rank ends with the same bits: tokens, logits and the whole decode state (the
    reductions add gathered operands in rank order, so no rank sees another sum)."""
    _, (r0, r1) = tp_run
    for name, x, y in _pairs(r0, r1):
        if name == "bytes_read":
            continue
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)), name
        else:
            assert x == y, name


def _bits(t: torch.Tensor) -> torch.Tensor:
    if not t.dtype.is_floating_point:
        return t
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.dtype.itemsize])


def test_tp2_equals_unsharded(tp_run):
    """TP = 2's prefill logits, sampled tokens (greedy and temperature rows, speculative and
    target-only steps) and decode state equal the unsharded model's. Tokens exactly; floats in
    fp64 to 1e-12 relative (+1e-12 absolute): not bitwise, since the row-parallel wo_b and shared
    w2 add two K-halves instead of one K-sum, and the routed sum adds each rank's slots before
    the other's (the reassociation's rounding, ~1e-16 per op, grows over 6 + 3 layers)."""
    ref, (r0, _) = tp_run
    assert r0["first"] == ref["first"]
    for k in ("spec_tokens", "spec_num", "target_tokens", "target_num"):
        assert torch.equal(r0[k], ref[k]), k
    assert int(ref["spec_num"][:2].min()) >= 1 and int(ref["spec_num"][2]) == 0
    assert r0["lossless"] == ref["lossless"]
    for name, x, y in _pairs(ref, r0):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            continue
        if x.dtype.itemsize == 1:                 # fp8 cache bytes: equal bytes
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
            continue
        torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12, equal_nan=True, msg=name)


def test_tp2_speculation_lossless(tp_run):
    """At TP = 2, greedy speculative decoding commits the tokens of greedy target-only decoding
    (three speculative steps against as many target-only tokens)."""
    _, (r0, _) = tp_run
    spec, target = r0["lossless"]
    assert len(spec) >= 4 and spec == target


def test_rank_reads_only_its_bytes(tp_ckpt):
    """Each rank reads its split shares, its own experts and the replicated tensors, nothing
    more (bytes of what get_slice handed back); the ranks' shares reassemble into the
    checkpoint's tensors, bit for bit."""
    cfg, full = load_checkpoint(tp_ckpt)
    schema = checkpoint_schema(cfg)
    nbytes = {n: t.numel() * t.element_size() for n, t in full.items()}
    replicated = sum(b for n, b in nbytes.items() if split_of(n).kind == REPLICATE)
    split = sum(b for n, b in nbytes.items() if split_of(n).kind != REPLICATE)
    parts = []
    for r in range(TP):
        _, tensors, read = load_rank_tensors(tp_ckpt, ParallelConfig(r, TP))
        assert read == replicated + split // TP == rank_weight_bytes(cfg, TP)
        parts.append(tensors)
    assert replicated < sum(nbytes.values()) // 2          # most bytes are split (experts)
    for name, t in full.items():
        kind = split_of(name).kind
        if kind == REPLICATE:
            got = parts[0][name]
        elif kind == EXPERT:
            owners = [p[name] for p in parts if name in p]
            assert len(owners) == 1, name
            got = owners[0]
        else:
            dim = 0 if kind == "rows" else 1
            got = torch.cat([p[name] for p in parts], dim)
        assert got.shape == schema[name].shape
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name


def test_split_cutting_a_scale_block_is_refused(tiny_ckpt, tp_ckpt):
    """The tiny preset at tp = 2 would give each rank 64 rows of wo_a (o_lora_rank 64): half a
    128-row scale block. Refused naming the tensor, before any data is read; a rank count that
    is not a power of two, or that does not divide the heads, is refused by name too."""
    with pytest.raises(ParallelError, match=r"tensor 'layers\.0\.attn\.wo_a\.weight'.*64 rows.*"
                                            r"cuts its 128 x 128 scale blocks"):
        load_rank_tensors(tiny_ckpt, ParallelConfig(0, TP))
    cfg, _ = load_checkpoint(tp_ckpt)
    with pytest.raises(ParallelError, match=r"'o_groups' = 2 does not split over tp=4"):
        check_splits(cfg, 4, checkpoint_schema(cfg))
    with pytest.raises(ParallelError, match=r"tp=3: the rank count must be a power of two"):
        ParallelConfig(0, 3)
    with pytest.raises(ParallelError, match=r"rank=2: must be in \[0, tp=2\)"):
        ParallelConfig(2, 2)
    with pytest.raises(ParallelError, match=r"tp=True: the rank count must be a power of two"):
        ParallelConfig(0, True)


def test_flash_splits_and_collectives():
    """Flash-0731 splits at tp = 2, 4, 8 with whole scale blocks (tp = 16 is refused: 8 output
    groups); a rank holds the replicated tensors plus 1 / tp of the rest (TP = 2: 78.4 GiB of
    155.4); one target forward at tp = 2 makes 1 + 2 L + 1 collectives (the embedding, each
    layer's attention and MoE, the logits)."""
    cfg = ModelConfig.from_dict(preset("flash-0731"))
    full = rank_weight_bytes(cfg, 1)
    for tp in (2, 4, 8):
        check_splits(cfg, tp, checkpoint_schema(cfg))
        assert full / tp < rank_weight_bytes(cfg, tp) < full / tp + (2 << 30)
    with pytest.raises(ParallelError, match="'o_groups' = 8 does not split over tp=16"):
        rank_weight_bytes(cfg, 16)
    calls = forward_collectives(cfg, 2, 6, torch.bfloat16)
    assert sum(c.count for c in calls) == 2 + 2 * cfg.num_hidden_layers == 88
    assert [c.nbytes for c in calls] == [6 * 4096 * 2, 6 * 4096 * 4, 6 * 4096 * 4,
                                         6 * 129280 // 2 * 4]
    assert forward_collectives(cfg, 1, 6, torch.bfloat16) == []
    with torch.device("meta"):                    # shapes only: a rank never allocates all experts
        rank = ParallelDeepseekV4(cfg, ParallelConfig(0, 2), Precision(), 64)
    E = {tuple(b.shape)[0] for n, b in rank.named_buffers() if ".experts.w" in n}
    assert E == {cfg.n_routed_experts // 2}
