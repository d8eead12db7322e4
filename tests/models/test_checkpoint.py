"""Checkpoint I/O: synthetic writer -> strict loader round trips, and every class of bad
checkpoint rejected with a CheckpointError naming the tensor and the file."""
import json
import math
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from dspark_compile.factory import synth as synth_mod
from dspark_compile.models.checkpoint import CheckpointError, load_checkpoint, validate_tid2eid
from dspark_compile.models.config import ConfigError, ModelConfig
from dspark_compile.factory.presets import preset
from dspark_compile.models.quant_formats import fp8_block_dequant, mxfp4_dequant
from dspark_compile.models.schema import checkpoint_schema, target_schema
from dspark_compile.factory.random_weights import SynthScales, iter_synth_tensors, synth_tensors
from dspark_compile.factory.synth import synth_checkpoint

TINY = ModelConfig.from_dict(preset("tiny"))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (float8 types have no CPU comparison kernels; compare their bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def tiny_synth():
    return synth_tensors(TINY, seed=0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("ck") / "tiny", seed=0)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    return synth_checkpoint("tiny", tmp_path_factory.mktemp("ck") / "sharded", seed=0,
                            shard_size_bytes=3 << 20)


def write_checkpoint(root, files: dict[str, dict], index: dict | None = None, config=None):
    """Hand-made checkpoint: {file name: {tensor name: tensor}} (+ weight_map) + config.json."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or preset("tiny")))
    for fname, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / fname))
    if index is not None:
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return root


def split_two(tensors: dict):
    """Two shards: target tensors in A, draft tensors in B, and the matching weight_map."""
    a = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    b = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    wm = {**{k: "a.safetensors" for k in a}, **{k: "b.safetensors" for k in b}}
    return {"a.safetensors": a, "b.safetensors": b}, wm


def load_error(root, **kw) -> CheckpointError:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(root, **kw)
    return ei.value


# ---- round trips -------------------------------------------------------------------------------

def test_round_trip_single_file(tiny_dir, tiny_synth):
    assert sorted(os.listdir(tiny_dir)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((tiny_dir / "config.json").read_text()) == preset("tiny")
    cfg, tensors = load_checkpoint(tiny_dir)
    assert cfg == TINY
    schema = checkpoint_schema(TINY)
    assert list(tensors) == list(schema) and set(tiny_synth) == set(schema)
    for name, spec in schema.items():
        t = tensors[name]
        assert tuple(t.shape) == spec.shape and t.dtype == spec.dtype, name
        assert same(t, tiny_synth[name]), name
    # formats stay raw: no numeric casts on the way in
    assert tensors["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.2.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.2.ffn.experts.3.w2.weight"].dtype == torch.int8
    assert tensors["layers.2.ffn.experts.3.w2.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64


def test_round_trip_sharded(sharded_dir, tiny_synth):
    out = sharded_dir
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tiny_synth)
    assert set(index["weight_map"].values()) == set(shards)
    total = sum(t.numel() * t.element_size() for t in tiny_synth.values())
    assert index["metadata"]["total_size"] == total
    for p in out.glob("*.safetensors"):  # every shard respects the limit (no unit is bigger)
        assert p.stat().st_size <= (3 << 20) + 200_000
    cfg, tensors = load_checkpoint(out)
    assert set(tensors) == set(tiny_synth)
    assert all(same(tensors[n], tiny_synth[n]) for n in tensors)


def test_seed_determinism(tiny_synth):
    # same seed, same bytes: the round trips compare files against a separate synth_tensors call
    names = ["embed.weight", "layers.1.ffn.experts.0.w1.weight"]
    again = dict(iter_synth_tensors(TINY, seed=0, names=names))
    assert list(again) == names and all(same(again[n], tiny_synth[n]) for n in names)
    other = dict(iter_synth_tensors(TINY, seed=1, names=names))
    assert not same(other["embed.weight"], tiny_synth["embed.weight"])
    assert not same(other["layers.1.ffn.experts.0.w1.weight"],
                    tiny_synth["layers.1.ffn.experts.0.w1.weight"])


def test_include_draft_false_skips_mtp(tiny_dir):
    cfg, tensors = load_checkpoint(tiny_dir, include_draft=False)
    assert cfg.has_draft
    assert set(tensors) == set(target_schema(TINY))


def test_target_only_checkpoint(tmp_path, tiny_synth):
    out = synth_checkpoint("tiny", tmp_path / "target", include_draft=False)
    cfg, tensors = load_checkpoint(out)
    assert not cfg.has_draft and set(tensors) == set(target_schema(TINY))
    assert all(same(t, tiny_synth[n]) for n, t in tensors.items())  # the same target weights
    # a checkpoint with draft tensors whose config has no draft fields: strict, with a hint
    raw = json.loads((out / "config.json").read_text())
    root = write_checkpoint(tmp_path / "base", {"model.safetensors": tiny_synth}, config=raw)
    err = load_error(root)
    assert "unexpected" in str(err) and err.tensor.startswith("mtp.") and "include_draft=False" in str(err)
    _, tensors = load_checkpoint(root, include_draft=False)
    assert set(tensors) == set(target_schema(TINY))


def test_optional_confidence_head_may_be_absent(tmp_path, tiny_synth):
    name = "mtp.2.confidence_head.proj.weight"
    assert checkpoint_schema(TINY)[name].optional
    t = {k: v for k, v in tiny_synth.items() if k != name}
    root = write_checkpoint(tmp_path / "ck", {"model.safetensors": t})
    _, tensors = load_checkpoint(root)
    assert name not in tensors and len(tensors) == len(tiny_synth) - 1


def test_cfg_override_and_device(tiny_dir):
    cfg, tensors = load_checkpoint(tiny_dir, cfg=preset("tiny"), device="meta")
    assert cfg == TINY
    assert all(t.device.type == "meta" for t in tensors.values())


# ---- synthetic values are well-conditioned ------------------------------------------------------

def test_synth_values_well_conditioned(tiny_synth):
    cfg, T = TINY, tiny_synth
    for name, t in T.items():
        if t.is_floating_point() and t.element_size() > 1:
            assert torch.isfinite(t.float()).all(), name
    for name, t in T.items():  # dequantize every quantized weight: finite, unit-variance scale
        if name.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            w = fp8_block_dequant(t, T[name[:-len("weight")] + "scale"], cfg.fp8_block)
        elif name.endswith(".weight") and t.dtype == torch.int8:
            w = mxfp4_dequant(t, T[name[:-len("weight")] + "scale"])
        else:
            continue
        assert torch.isfinite(w).all(), name
        fan_in_std = w.std().item() * math.sqrt(w.shape[1])
        assert 0.3 < fan_in_std < 1.3, (name, fan_in_std)
    # norms ~ 1 + small noise
    norm = T["layers.3.attn.kv_norm.weight"].float()
    assert (norm - 1).abs().max() < 0.3 and norm.std() > 0.01
    # tid2eid: valid, distinct expert ids per row, and all experts used
    for i in range(cfg.num_hash_layers):
        ids = T[f"layers.{i}.ffn.gate.tid2eid"]
        assert ids.min() >= 0 and ids.max() < cfg.n_routed_experts
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()
        assert ids.unique().numel() == cfg.n_routed_experts
    validate_tid2eid(T, cfg)
    # mHC: mixing logits O(0.5) for a unit-RMS input -> unsaturated sigmoids
    fn, base = T["layers.2.hc_attn_fn"], T["layers.2.hc_attn_base"]
    x = torch.randn(64, fn.shape[1], generator=torch.Generator().manual_seed(0))
    mu = x @ fn.T * T["layers.2.hc_attn_scale"][0]
    pre = mu[:, :4] + base[:4]
    assert pre.abs().max() < 4 and mu.std() > 0.2
    assert base[8:].std() > 0.5  # Sinkhorn logits: C clearly non-uniform
    # logits of the embedding alone (head . rmsnorm(embed)): varied, non-degenerate
    e = T["embed.weight"].float()
    h = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True))
    logits = h @ T["head.weight"].float().T
    assert 1.5 < logits.std() < 6
    bigram = logits.argmax(-1)
    assert bigram.unique().numel() > cfg.vocab_size // 4
    # the synthetic language: the Markov table is the (low-rank) bigram table, times 2
    w1 = T["mtp.2.markov_head.markov_w1.weight"].float()
    w2 = T["mtp.2.markov_head.markov_w2.weight"].float()
    markov = w1 @ w2.T
    sv = torch.linalg.svdvals(logits)  # rank r up to bf16 rounding of embed / head
    r = cfg.dspark_markov_rank
    assert sv[:r].pow(2).sum() / sv.pow(2).sum() > 0.999 and sv[r - 1] > 50 * sv[r]
    assert (markov.argmax(-1) == bigram).float().mean() > 0.95
    raw = e @ T["head.weight"].float().T  # before the final RMSNorm's per-token rescaling
    keep = torch.arange(cfg.vocab_size) != cfg.dspark_noise_token_id
    assert ((markov[keep] - 2 * raw[keep]).norm(dim=-1) < 0.05 * markov[keep].norm(dim=-1)).all()
    # the noise token predicts nothing: flat logits from its embedding, no Markov row
    assert logits[cfg.dspark_noise_token_id].abs().max() < 0.05
    assert w1[cfg.dspark_noise_token_id].abs().max() == 0


def test_synth_draft_agrees_sometimes():
    """What lossless speculative-decoding tests need from the tiny checkpoint: the draft agrees
    with the target often at the first position, sometimes for a whole block, and not always."""
    from dspark_compile.models import load_model
    from dspark_compile.models.config import Precision
    from dspark_compile.models.generate import generate
    from dspark_compile.models.request import SamplingParams

    model = load_model(None, Precision(dtype=torch.float32), 512,
                       tensors=synth_tensors(TINY, seed=0), cfg=TINY)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 11, 17, 23)]
    res = generate(model, prompts, [SamplingParams(max_new_tokens=40) for _ in prompts],
                   speculative=True)
    acc = res.acceptance_per_position
    assert 0.25 < acc[0] < 0.95, acc
    assert acc[1] > 0.05 and 0 < acc[-1] < 0.5, acc
    toks = sum(res.tokens, [])
    assert len(set(toks)) > len(toks) // 6  # not stuck on a token


def test_synth_scales_are_a_knob():
    T = dict(iter_synth_tensors(TINY, seed=0, scales=SynthScales(logit_std=6.0), names=["head.weight"]))
    assert list(T) == ["head.weight"]
    base = dict(iter_synth_tensors(TINY, seed=0, names=["head.weight"]))  # same draw, 2x scale
    assert torch.equal(T["head.weight"].float(), (base["head.weight"].float() * 2))


# ---- writer behaviour ---------------------------------------------------------------------------

def test_synth_refuses_non_empty_out_and_overwrites_on_request(tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        synth_checkpoint("tiny", out)
    assert os.listdir(out) == ["keep.txt"]
    # overwrite replaces a checkpoint, never a directory of other files
    with pytest.raises(FileExistsError, match=f"refusing to replace {out}: it is not a "
                                              r"checkpoint directory \(no config.json\)"):
        synth_checkpoint("tiny", out, overwrite=True)
    assert os.listdir(out) == ["keep.txt"]
    (out / "keep.txt").unlink()
    synth_checkpoint("tiny", out, seed=1)
    synth_checkpoint("tiny", out, overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp or trash directory left behind


def test_synth_failure_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def boom(path, specs, tensors, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(path, specs, tensors, metadata)

    real = synth_mod.write_safetensors
    monkeypatch.setattr(synth_mod, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        synth_checkpoint("tiny", tmp_path / "ck", shard_size_bytes=3 << 20)
    assert os.listdir(tmp_path) == []


def test_synth_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="shard size"):
        synth_checkpoint("tiny", tmp_path / "a", shard_size_bytes=0)
    with pytest.raises(ValueError, match="unknown preset"):
        synth_checkpoint("huge", tmp_path / "b")
    raw = preset("tiny")
    raw["o_groups"] = 3
    with pytest.raises(ConfigError, match="o_groups"):
        synth_checkpoint(raw, tmp_path / "c")
    assert os.listdir(tmp_path) == []


# ---- bad checkpoints ---------------------------------------------------------------------------

def test_missing_tensor(tmp_path, tiny_synth):
    t = dict(tiny_synth)
    del t["layers.3.attn.compressor.ape"]
    err = load_error(write_checkpoint(tmp_path / "ck", {"model.safetensors": t}))
    assert err.tensor == "layers.3.attn.compressor.ape"
    assert "missing" in str(err) and "layers.3.attn.compressor.ape" in str(err)
    assert "model.safetensors" in str(err)


def test_missing_draft_tensor_hints_target_only(tmp_path, tiny_synth):
    t = {k: v for k, v in tiny_synth.items() if k != "mtp.0.main_proj.scale"}
    root = write_checkpoint(tmp_path / "ck", {"model.safetensors": t})
    err = load_error(root)
    assert err.tensor == "mtp.0.main_proj.scale" and "include_draft=False" in str(err)
    load_checkpoint(root, include_draft=False)  # the target alone is complete


def test_unexpected_tensor(tmp_path, tiny_synth):
    t = {**tiny_synth, "layers.0.attn.bogus": torch.zeros(3)}
    err = load_error(write_checkpoint(tmp_path / "ck", {"model.safetensors": t}))
    assert err.tensor == "layers.0.attn.bogus" and err.file == "model.safetensors"
    assert "unexpected" in str(err) and "layers.0.attn.bogus" in str(err)


def test_wrong_shape(tmp_path, tiny_synth):
    t = {**tiny_synth, "layers.1.attn.attn_sink": torch.zeros(5)}
    err = load_error(write_checkpoint(tmp_path / "ck", {"model.safetensors": t}))
    assert err.tensor == "layers.1.attn.attn_sink" and err.file == "model.safetensors"
    assert "shape [5], expected [4]" in str(err)


@pytest.mark.parametrize("name,bad", [
    ("layers.2.attn.wq_a.scale", lambda t: t.view(torch.uint8)),               # e8m0 stored as U8
    ("layers.2.attn.wq_a.weight", lambda t: t.to(torch.bfloat16)),             # FP8 upcast
    ("layers.4.ffn.experts.1.w3.weight", lambda t: t.view(torch.uint8)),       # I8 vs U8
    ("layers.0.ffn.gate.tid2eid", lambda t: t.to(torch.int32)),
    ("layers.5.hc_ffn_fn", lambda t: t.to(torch.bfloat16)),
])
def test_wrong_dtype(tmp_path, tiny_synth, name, bad):
    t = {**tiny_synth, name: bad(tiny_synth[name])}
    err = load_error(write_checkpoint(tmp_path / "ck", {"model.safetensors": t}))
    assert err.tensor == name and err.file == "model.safetensors" and "dtype" in str(err)


def test_index_names_missing_shard(tmp_path, tiny_synth):
    files, wm = split_two(tiny_synth)
    del files["b.safetensors"]
    err = load_error(write_checkpoint(tmp_path / "ck", files, wm))
    assert err.file == "b.safetensors" and "does not exist" in str(err)
    assert err.tensor.startswith("mtp.")


def test_tensor_in_other_shard_than_index_says(tmp_path, tiny_synth):
    files, wm = split_two(tiny_synth)
    wm["mtp.0.main_norm.weight"] = "a.safetensors"
    err = load_error(write_checkpoint(tmp_path / "ck", files, wm))
    assert err.tensor == "mtp.0.main_norm.weight" and err.file == "b.safetensors"
    assert "a.safetensors" in str(err) and "b.safetensors" in str(err)


def test_tensor_listed_in_no_shard(tmp_path, tiny_synth):
    files, wm = split_two(tiny_synth)
    del wm["layers.0.attn_norm.weight"]
    err = load_error(write_checkpoint(tmp_path / "ck", files, wm))
    assert err.tensor == "layers.0.attn_norm.weight" and err.file == "a.safetensors"
    assert "lists it in no shard" in str(err)


def test_index_maps_tensor_to_shard_without_it(tmp_path, tiny_synth):
    files, wm = split_two(tiny_synth)
    del files["a.safetensors"]["norm.weight"]
    err = load_error(write_checkpoint(tmp_path / "ck", files, wm))
    assert err.tensor == "norm.weight" and err.file == "a.safetensors"
    assert "do not contain" in str(err)


def test_duplicate_tensor_across_shards(tmp_path, tiny_synth):
    files, wm = split_two(tiny_synth)
    files["b.safetensors"]["embed.weight"] = tiny_synth["embed.weight"]
    err = load_error(write_checkpoint(tmp_path / "ck", files, wm))
    assert err.tensor == "embed.weight" and "two shards" in str(err)
    assert "a.safetensors" in str(err) and "b.safetensors" in str(err)


def test_truncated_file(tmp_path, tiny_dir):
    root = tmp_path / "ck"
    root.mkdir()
    (root / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    data = (tiny_dir / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(data[: len(data) - 1000])
    err = load_error(root)
    assert err.file == "model.safetensors" and "model.safetensors" in str(err)
    assert "truncated or corrupt" in str(err)


def test_truncated_shard(tmp_path, sharded_dir):
    out = tmp_path / "ck"
    shutil.copytree(sharded_dir, out)
    shard = sorted(out.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    err = load_error(out)
    assert err.file == shard.name and shard.name in str(err)


@pytest.mark.parametrize("corrupt", [
    lambda d: b"\x00" * 8 + d[8:],                                         # header length 0
    lambda d: struct.pack("<Q", 1 << 40) + d[8:],                          # absurd header length
    lambda d: d[:8] + b"{not json" + d[17:],                               # garbage header
    lambda d: b"",                                                          # empty file
])
def test_corrupt_file(tmp_path, tiny_dir, corrupt):
    root = tmp_path / "ck"
    root.mkdir()
    (root / "config.json").write_bytes((tiny_dir / "config.json").read_bytes())
    (root / "model.safetensors").write_bytes(corrupt((tiny_dir / "model.safetensors").read_bytes()))
    err = load_error(root)
    assert err.file == "model.safetensors" and "not a readable safetensors file" in str(err)


@pytest.mark.parametrize("text,match", [
    ("{not json", "cannot read the shard index"),
    ('{"metadata": {}}', "no 'weight_map'"),
    ('{"weight_map": {"embed.weight": "../x.safetensors"}}', "not a file name"),
    ('{"weight_map": {"embed.weight": 3}}', "not a file name"),
])
def test_bad_index(tmp_path, tiny_synth, text, match):
    files, _ = split_two(tiny_synth)
    root = write_checkpoint(tmp_path / "ck", files)
    (root / "model.safetensors.index.json").write_text(text)
    err = load_error(root)
    assert err.file == "model.safetensors.index.json" and match in str(err)


def test_no_or_ambiguous_files(tmp_path, tiny_synth):
    root = write_checkpoint(tmp_path / "empty", {})
    assert "no *.safetensors" in str(load_error(root))
    files, _ = split_two(tiny_synth)
    root = write_checkpoint(tmp_path / "two", files)
    assert "no model.safetensors.index.json" in str(load_error(root))
    assert "not found" in str(load_error(tmp_path / "nowhere"))


def test_any_single_safetensors_name(tmp_path, tiny_synth):
    root = write_checkpoint(tmp_path / "ck", {"weights.safetensors": tiny_synth})
    _, tensors = load_checkpoint(root)
    assert len(tensors) == len(tiny_synth)


def test_missing_config_is_config_error(tmp_path, tiny_synth):
    root = write_checkpoint(tmp_path / "ck", {"model.safetensors": tiny_synth})
    (root / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        load_checkpoint(root)


def test_config_not_utf8_names_the_file(tmp_path, tiny_synth):
    root = write_checkpoint(tmp_path / "ck", {"model.safetensors": tiny_synth})
    cfg = root / "config.json"
    cfg.write_bytes(cfg.read_bytes().replace(b'"deepseek_v4"', b'"deepseek\xe9v4"'))
    with pytest.raises(ConfigError, match=f"{cfg} is not UTF-8 text"):
        load_checkpoint(root)


@pytest.mark.parametrize("value", [8, -1])
def test_tid2eid_out_of_range(tmp_path, tiny_synth, value):
    ids = tiny_synth["layers.1.ffn.gate.tid2eid"].clone()
    ids[17, 1] = value
    t = {**tiny_synth, "layers.1.ffn.gate.tid2eid": ids}
    err = load_error(write_checkpoint(tmp_path / "ck", {"model.safetensors": t}))
    assert err.tensor == "layers.1.ffn.gate.tid2eid"
    assert f"expert id {value} at [17, 1]" in str(err) and "n_routed_experts=8" in str(err)
    assert err.file == "model.safetensors"
    with pytest.raises(CheckpointError, match="layers.1.ffn.gate.tid2eid"):
        validate_tid2eid(t, TINY)


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_synth_and_load_on_cuda(tmp_path):
    schema = checkpoint_schema(TINY)
    T = synth_tensors(TINY, seed=0, device="cuda")
    assert set(T) == set(schema)
    for name, t in T.items():
        assert t.is_cuda and tuple(t.shape) == schema[name].shape and t.dtype == schema[name].dtype
    out = synth_checkpoint("tiny", tmp_path / "ck", device="cuda")
    cfg, L = load_checkpoint(out, device="cuda")
    assert all(t.is_cuda for t in L.values())
    assert all(same(L[n].cpu(), T[n].cpu()) for n in L)


# ---- streaming safetensors writer ------------------------------------------------------------

def test_streaming_writer_reads_back_with_safe_open(tmp_path):
    from safetensors import safe_open

    from dspark_compile.models.safetensors_writer import write_safetensors

    tensors = {"b": torch.arange(6, dtype=torch.int64).view(2, 3),
               "a": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
               "s": torch.tensor([127, 130], dtype=torch.uint8).view(torch.float8_e8m0fnu),
               "q": torch.tensor([0.5, -448.0]).to(torch.float8_e4m3fn),
               "e": torch.zeros(0, 4)}
    specs = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    # an iterator in an order different from the file's, with no reference kept
    write_safetensors(tmp_path / "x.safetensors", specs, iter(list(tensors.items())[::-1]))
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tensors)
        for n, t in tensors.items():
            assert same(f.get_tensor(n), t), n


@pytest.mark.parametrize("bad,match", [
    ({"a": torch.zeros(2)}, "never produced"),
    ({"a": torch.zeros(2), "b": torch.zeros(1), "c": torch.zeros(1)}, "unexpected or repeated"),
    ({"a": torch.zeros(3), "b": torch.zeros(1)}, "spec says"),
])
def test_streaming_writer_rejects_mismatch(tmp_path, bad, match):
    from dspark_compile.models.safetensors_writer import write_safetensors

    specs = [("a", (2,), torch.float32), ("b", (1,), torch.float32)]
    with pytest.raises((KeyError, ValueError), match=match):
        write_safetensors(tmp_path / "x.safetensors", specs, iter(bad.items()))


# ---- real Flash dimensions -------------------------------------------------------------------

def test_flash_slice_tensors_at_real_shape():
    """A few flash-slice tensors (not all 24 GB): real shapes, formats and conditioning."""
    cfg = ModelConfig.from_dict(preset("flash-slice"))
    schema = checkpoint_schema(cfg)
    names = ["layers.1.attn.wkv.weight", "layers.1.attn.wkv.scale",
             "layers.2.ffn.experts.255.w2.weight", "layers.2.ffn.experts.255.w2.scale",
             "layers.0.hc_attn_fn"]
    T = dict(iter_synth_tensors(cfg, seed=0, names=names))
    assert set(T) == set(names)  # (yielded in schema order)
    for n, t in T.items():
        assert tuple(t.shape) == schema[n].shape and t.dtype == schema[n].dtype, n
    wkv = fp8_block_dequant(T[names[0]], T[names[1]])
    assert abs(wkv.std().item() * math.sqrt(4096) - 1) < 0.05
    w2 = mxfp4_dequant(T[names[2]], T[names[3]])
    assert abs(w2.std().item() * math.sqrt(2048) - SynthScales().branch_gain) < 0.05
    assert schema["mtp.0.main_proj.scale"].shape == (32, 96)


@pytest.mark.gpu
@pytest.mark.slow
def test_flash_slice_built_in_gpu_memory():
    """The step benchmark's path: every flash-slice tensor generated on the GPU, streaming (the
    peak is the checkpoint plus one tensor's transient, not twice the checkpoint)."""
    cfg = ModelConfig.from_dict(preset("flash-slice"))
    schema = checkpoint_schema(cfg)
    total = sum(math.prod(s.shape) * s.dtype.itemsize for s in schema.values())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    T = synth_tensors(cfg, seed=0, device="cuda")
    assert set(T) == set(schema)
    assert torch.cuda.memory_allocated() - base <= total + (64 << 20)  # allocator rounding
    assert torch.cuda.max_memory_allocated() - base < total + (2 << 30)  # transients: < 1 GB
    validate_tid2eid(T, cfg)
    del T
    torch.cuda.empty_cache()


# ---- hostile directories and config.json ------------------------------------------------------
def _with_config(tmp_path, tiny_dir, text=None) -> "os.PathLike":
    root = tmp_path / "ck"
    root.mkdir()
    os.symlink(tiny_dir / "model.safetensors", root / "model.safetensors")
    if text is not None:
        (root / "config.json").write_text(text)
    return root


def test_config_json_beyond_the_size_limit_is_refused_unread(tmp_path, tiny_dir):
    from dspark_compile.models.checkpoint import MAX_CONFIG_BYTES
    root = _with_config(tmp_path, tiny_dir)
    with open(root / "config.json", "wb") as f:    # sparse: no gigabyte written
        f.truncate(1 << 30)
    err = load_error(root)
    assert err.file == "config.json" and "1,073,741,824 bytes" in str(err)
    assert f"at most {MAX_CONFIG_BYTES:,} bytes are read" in str(err)


def test_config_json_that_is_a_fifo_is_refused_not_waited_on(tmp_path, tiny_dir):
    root = _with_config(tmp_path, tiny_dir)
    os.mkfifo(root / "config.json")          # reading it would block until a writer came
    err = load_error(root)
    assert err.file == "config.json" and "is not a regular file" in str(err)


def test_config_json_nested_past_the_parser_is_named(tmp_path, tiny_dir):
    root = _with_config(tmp_path, tiny_dir, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    err = load_error(root)                   # json's RecursionError escaped as a traceback
    assert err.file == "config.json" and "nested too deep" in str(err)


def test_a_checkpoint_path_that_is_a_symlink_loop_says_so(tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    err = load_error(loop)
    assert "symbolic link to no directory" in str(err) and f"{loop} -> {loop}" in str(err)


@pytest.mark.parametrize("field, value", [("n_routed_experts", 10 ** 8),
                                          ("num_hidden_layers", 300_000)])
def test_counts_no_file_could_hold_are_refused_before_the_schema(tmp_path, tiny_dir, tiny_synth,
                                                                 field, value):
    """A schema of 10^8 experts or 300,000 layers takes minutes to build (millions of names); the
    files' tensor count refuses it at once. The test would time out without that check."""
    raw = {**preset("tiny"), field: value}
    if field == "num_hidden_layers":
        raw["compress_ratios"] = [0] * (value + 3)
    root = _with_config(tmp_path, tiny_dir, json.dumps(raw))
    err = load_error(root)
    assert err.file == "config.json" and f"{field}={value}" in str(err)
    assert f"the checkpoint's files hold {len(tiny_synth):,}" in str(err)
