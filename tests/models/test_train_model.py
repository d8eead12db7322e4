"""The training forms (dspark_compile/factory/train_model.py) compute the reference models' function of the same
weights: the target over a whole sequence equals the reference forward of one chunk, the draft's
blocks equal the reference step's draft block; and the weights go back to the stored formats."""
import pytest
import torch

from dspark_compile.models.batch import Batch
from dspark_compile.models.config import CacheConfig, ModelConfig, Precision
from dspark_compile.models.draft import store_context
from dspark_compile.factory.presets import preset
from dspark_compile.models.quant_formats import fp8_block_dequant, mxfp4_dequant
from dspark_compile.models.schema import checkpoint_schema
from dspark_compile.models.state import allocate_state
from dspark_compile.models.step import draft_block
from dspark_compile.factory.random_weights import synth_tensors
from dspark_compile.factory.train_model import (
    Rope, TrainParams, draft_forward, quantize_roundtrip, target_forward)

EXACT = Precision(torch.float64, act_quant=False, kv_fp8=False)


@pytest.fixture(scope="module")
def tiny():
    from dspark_compile.models import load_model
    cfg = ModelConfig.from_dict(preset("tiny"))
    tensors = synth_tensors(cfg, 0)
    model = load_model(None, EXACT, 512, tensors=tensors, cfg=cfg)
    P = TrainParams(cfg, tensors).double()
    rope = Rope(cfg, 512)
    rope.main, rope.comp = rope.main.double(), rope.comp.double()
    return cfg, tensors, model, P, rope


def test_target_sequence_forward_equals_the_reference_forward(tiny):
    cfg, _, model, P, rope = tiny
    # 130 positions: C4 entries with the indexer's top-k, and C128's first entry (position 127)
    B, T = 2, 130
    tok = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    state = allocate_state(cfg, CacheConfig(max_rows=B, max_seq_len=256, max_step_tokens=T), EXACT)
    batch = Batch.make(torch.arange(B), torch.arange(T).expand(B, T), tok, B, cfg.vocab_size)
    with torch.no_grad():
        want, want_aux = model(batch, state, aux_layers=cfg.dspark_target_layer_ids)
        got, got_aux = target_forward(P, tok, rope, aux=True)
    # the same references on the same fp64 values: equal to rounding (measured: bit-equal)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_aux, want_aux, rtol=1e-12, atol=1e-12)


def test_draft_blocks_equal_the_reference_draft_block(tiny):
    cfg, _, model, P, rope = tiny
    B, T, L = 2, 20, 12      # context from the first L positions of a longer sequence
    tok = torch.randint(3, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    state = allocate_state(cfg, CacheConfig(max_rows=B, max_seq_len=64, max_step_tokens=32), EXACT)
    rows = torch.arange(B)
    batch = Batch.make(rows, torch.arange(L).expand(B, L), tok[:, :L], B, cfg.vocab_size)
    anchor = tok[:, L]
    with torch.no_grad():
        _, aux = model(batch, state, aux_layers=cfg.dspark_target_layer_ids)
        store_context(model, aux.reshape(B * L, -1), batch.flat_pos(),
                      batch.ring_slots(cfg.sliding_window), state)
        drafts, want = draft_block(model, state, rows, anchor, torch.full((B,), L - 1))
        _, seq_aux = target_forward(P, tok, rope, aux=True)
        prev = torch.cat((anchor[:, None], drafts[:, :-1]), 1)[:, None]
        got = draft_forward(P, seq_aux, anchor[:, None], torch.full((B, 1), L - 1), prev, rope)
    # the reference adds the Markov bias in fp32 (kernels/sampling: markov_bias): |logit| ~ 50
    torch.testing.assert_close(got[:, 0].float(), want, rtol=0, atol=1e-4)
    assert torch.equal(got[:, 0].argmax(-1), drafts)


def _dequant(name, t, tensors, cfg):
    spec = checkpoint_schema(cfg)[name]
    base = name[: -len(".weight")]
    if spec.kind == "fp8_weight":
        return fp8_block_dequant(t, tensors[f"{base}.scale"], cfg.fp8_block)
    if spec.kind == "mxfp4_weight":
        return mxfp4_dequant(t, tensors[f"{base}.scale"])
    return t


def test_to_checkpoint_gives_back_the_stored_values(tiny):
    cfg, tensors, _, _, _ = tiny
    out = TrainParams(cfg, tensors).to_checkpoint()
    schema = checkpoint_schema(cfg)
    assert list(out) == [n for n in schema if n in tensors]
    for name, t in out.items():
        assert (t.shape, t.dtype) == (tensors[name].shape, tensors[name].dtype), name
        if schema[name].kind.endswith("_scale"):
            continue       # a requantized MXFP4 block may pick a smaller scale, same values
        assert torch.equal(_dequant(name, t, out, cfg), _dequant(name, tensors[name], tensors, cfg)), name


def test_fake_quant_reads_every_weight_in_its_stored_format(tiny):
    cfg, tensors, _, _, _ = tiny
    P = TrainParams(cfg, tensors, fake_quant=True)
    with torch.no_grad():
        for p in P.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 1e-3)
    stored = P.to_checkpoint()
    for name, key in (("layers.2.attn.wq_a.weight", "fp8"), ("head.weight", "bf16")):
        assert P.kind[name] == key
        want = _dequant(name, stored[name], stored, cfg).float()
        assert torch.equal(P.w(name).detach(), want), name
    w = P.w("layers.3.ffn.experts.w2")
    assert torch.equal(w.detach()[5], mxfp4_dequant(stored["layers.3.ffn.experts.5.w2.weight"],
                                                    stored["layers.3.ffn.experts.5.w2.scale"]))
    # the straight-through gradient reaches the fp32 parameter
    w.sum().backward()
    g = P.params["layers__3__ffn__experts__w2"].grad
    assert g is not None and torch.equal(g, torch.ones_like(g))
    assert P.kind["layers.0.hc_attn_fn"] == "f32"
    assert P.w("layers.0.hc_attn_fn") is P.params["layers__0__hc_attn_fn"]
    assert torch.equal(quantize_roundtrip(torch.tensor([[1.0 + 2 ** -10]]), "bf16", cfg),
                       torch.tensor([[1.0]]))
