"""The `tiny-deep` preset: the tiny widths at DeepSeek-V4-Flash-0731's depth.

Checked against the real model's facts, written out here rather than read from the presets
(the reference notes, dsv4_target.md §1.2 and §1.4): 43 target layers; compress ratios
`[0, 0] + [4, 128] * 20 + [4]` for the target and three trailing zeros for the draft; layers
0, 1 SWA-only, layer 2 and the even layers C4 (with an indexer), the odd layers C128; a layer
is hash-routed (tid2eid, no gate bias) iff its id is below num_hash_layers = 3; the 3-stage
draft conditioned on layers 40, 41, 42.
"""
import json

import pytest
import torch

from dspark_compile.factory.presets import preset
from dspark_compile.factory.synth import synth_checkpoint
from dspark_compile.models import load_model
from dspark_compile.models.checkpoint import load_checkpoint
from dspark_compile.models.config import Precision
from dspark_compile.models.generate import generate
from dspark_compile.models.request import SamplingParams

FLASH_LAYERS = 43
FLASH_HASH_LAYERS = 3
FLASH_DRAFT_LAYERS = (40, 41, 42)
DEPTH_FIELDS = ("num_hidden_layers", "compress_ratios", "num_hash_layers",
                "dspark_target_layer_ids")


def flash_ratio(layer: int) -> int:
    """The layer-type map of Flash (§1.4): 0, 1 SWA-only; even C4; odd C128."""
    return 0 if layer < 2 else 4 if layer % 2 == 0 else 128


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """`synth --preset tiny-deep` written and read back through the strict loader."""
    out = synth_checkpoint("tiny-deep", tmp_path_factory.mktemp("deep") / "ckpt")
    cfg, tensors = load_checkpoint(out)
    return json.loads((out / "config.json").read_text()), cfg, tensors


def test_tiny_deep_has_flash_0731s_layers_types_and_hash_layers(deep):
    raw, cfg, tensors = deep
    assert raw["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4] + [0, 0, 0]
    assert cfg.num_hidden_layers == FLASH_LAYERS
    assert list(cfg.compress_ratios) == [flash_ratio(i) for i in range(FLASH_LAYERS)]
    assert [cfg.compress_ratios.count(r) for r in (0, 4, 128)] == [2, 21, 20]
    assert cfg.num_hash_layers == FLASH_HASH_LAYERS
    assert cfg.dspark_target_layer_ids == FLASH_DRAFT_LAYERS and cfg.n_mtp_layers == 3
    for i in range(FLASH_LAYERS):
        layer = f"layers.{i}."
        hashed = i < FLASH_HASH_LAYERS
        assert (layer + "ffn.gate.tid2eid" in tensors) == hashed, i
        assert (layer + "ffn.gate.bias" in tensors) == (not hashed), i
        assert (layer + "attn.compressor.wkv.weight" in tensors) == (flash_ratio(i) != 0), i
        assert (layer + "attn.indexer.wq_b.weight" in tensors) == (flash_ratio(i) == 4), i
    assert f"layers.{FLASH_LAYERS}.attn_norm.weight" not in tensors
    stages = {n.split(".")[1] for n in tensors if n.startswith("mtp.")}
    assert stages == {"0", "1", "2"}
    assert not any(n.startswith("mtp.") and (".compressor." in n or ".tid2eid" in n)
                   for n in tensors)


def test_tiny_deep_differs_from_tiny_only_in_depth():
    deep_raw, tiny_raw = preset("tiny-deep"), preset("tiny")
    assert {k: v for k, v in deep_raw.items() if k not in DEPTH_FIELDS} == \
        {k: v for k, v in tiny_raw.items() if k not in DEPTH_FIELDS}
    assert deep_raw["num_hidden_layers"] == FLASH_LAYERS != tiny_raw["num_hidden_layers"]


def test_the_reference_model_runs_a_speculative_step_at_full_depth(deep):
    """A 2-token prompt's prefill, then one draft-and-verify step: the draft reads the hidden
    states of layers 40-42 and the target verifies through all 43 layers."""
    _, cfg, tensors = deep
    model = load_model(None, Precision(torch.float32), 64, tensors=tensors, cfg=cfg)
    assert len(model.layers) == FLASH_LAYERS and len(model.mtp) == 3
    res = generate(model, [[5, 6]], [SamplingParams(max_new_tokens=2)], speculative=True)
    assert res.steps == 1
    assert len(res.tokens[0]) == 2 and all(0 <= t < cfg.vocab_size for t in res.tokens[0])
