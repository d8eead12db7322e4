"""Prefill of a prompt and token-by-token decode must give the same logits.

Catches compressor block boundaries, the C4 overlap, ring indexing and RoPE positions across every
layer type (the tiny preset has SWA, C4 with indexer, C128, hash and bias routing). In float64
without quantization the two paths agree to rounding; in fp32 and bf16 with the FP8 KV /
activation quantization simulation they agree to the bit (batch invariance).
"""
import pytest
import torch

from dspark_compile.kernels.region import fused_eager
from dspark_compile.models.batch import Batch
from dspark_compile.models.config import CacheConfig, Precision
from dspark_compile.models.state import allocate_state


def run_chunks(model, state, row, ids, chunk):
    outs = []
    trash = state["row.last_pos"].shape[0] - 1
    for s in range(0, len(ids), chunk):
        e = min(s + chunk, len(ids))
        b = Batch.make(torch.tensor([row]), torch.arange(s, e)[None], ids[None, s:e], trash,
                       model.cfg.vocab_size)
        logits, _ = model(b, state)
        outs.append(logits[0])
    return torch.cat(outs)


# with the FP8 simulation the bit-equality test below is stronger (fp32, the same chunkings)
@pytest.mark.parametrize("prec", [Precision.exact(torch.float64)], ids=["exact"])
def test_prefill_equals_decode(make_model, prec):
    model = make_model(prec, with_draft=False, max_positions=512)
    cfg = model.cfg
    # 140 tokens: closes a C128 block (positions 0..127) and 35 C4 blocks (indexer selects top-4)
    L = 140
    ids = torch.randint(0, cfg.vocab_size, (L,), generator=torch.Generator().manual_seed(1))
    state = allocate_state(cfg, CacheConfig(max_rows=3, max_seq_len=256, max_step_tokens=48), prec)
    with torch.no_grad():
        pre = run_chunks(model, state, 0, ids, 48)      # chunked prefill, row 0
        dec = run_chunks(model, state, 2, ids, 1)       # one token at a time, row 2
        mid = run_chunks(model, state, 1, ids, 6)       # verify-sized chunks, row 1
    assert torch.isfinite(pre).all()
    scale = pre.abs().max()
    assert (pre - dec).abs().max() <= 1e-10 * scale
    assert (pre - mid).abs().max() <= 1e-10 * scale
    # the logits actually vary with position (a model that ignored its input would pass otherwise)
    assert pre.std(0).mean() > 0.1


def _rows_chunks(model, state, rows, ids, chunk):
    """Logits [len(rows), L, V] of rows fed ids [len(rows), L] together, `chunk` tokens a call."""
    outs = []
    trash = state["row.last_pos"].shape[0] - 1
    dev = state["row.last_pos"].device
    for s in range(0, ids.shape[1], chunk):
        e = min(s + chunk, ids.shape[1])
        b = Batch.make(torch.tensor(rows, device=dev), torch.arange(s, e, device=dev)[None].repeat(len(rows), 1),
                       ids[:, s:e], trash, model.cfg.vocab_size)
        outs.append(model(b, state)[0])
    return torch.cat(outs, 1)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the kernels' half of this test needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunks_and_batches_are_bit_equal_to_decoding_alone(make_model, dtype, device):
    """Batch invariance of the whole forward, FP8 simulation on: a token's logits are the same
    bits whether its request runs alone one token at a time (the target-only step), in
    verify-sized blocks of 6 (the speculative step), in 48-token prefill chunks, or next to
    other requests. The fusable references run as their `dspark::` ops (fused_eager), as in the
    engine: on the CPU that is the references themselves (the CPU engine), on the GPU the Triton
    kernels with aten's CUDA glue between them."""
    prec = Precision(dtype=dtype)
    model = make_model(prec, with_draft=False, max_positions=512).to(device)
    cfg = model.cfg
    # fp32 closes a C128 block (positions 0..127) and 33 C4 blocks; bf16 (half the CPU time
    # again) closes C4 blocks and runs the indexer only
    L = 132 if dtype == torch.float32 else 40
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (3, L), generator=g).to(device)
    state = allocate_state(cfg, CacheConfig(max_rows=6, max_seq_len=L + 8, max_step_tokens=48),
                           prec, device=device)
    with torch.no_grad(), fused_eager():
        alone = _rows_chunks(model, state, [0], ids[:1], 1)[0]
        block = _rows_chunks(model, state, [1], ids[:1], 6)[0]
        chunk = _rows_chunks(model, state, [2], ids[:1], 48)[0]
        # the request in the middle of a batch of three, decoding and verifying
        three = _rows_chunks(model, state, [3, 4, 5], ids[[1, 0, 2]], 6)[1]
    assert torch.isfinite(alone).all() and alone.std(0).mean() > 0.1
    for name, got in (("6-token blocks", block), ("48-token chunks", chunk), ("a batch of 3", three)):
        bad = (got != alone).any(-1).nonzero().flatten()
        assert bad.numel() == 0, (f"{name}: logits of positions {bad[:8].tolist()} differ from "
                                  f"decoding alone (max |diff| {(got - alone).abs().max():.3g})")


def test_padded_rows_are_inert(make_model):
    """A batch with a padded row (the trash row) leaves every real row's caches untouched."""
    prec = Precision(dtype=torch.float64)
    model = make_model(prec, with_draft=False, max_positions=256)
    cfg = model.cfg
    state = allocate_state(cfg, CacheConfig(max_rows=2, max_seq_len=64, max_step_tokens=8), prec)
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    with torch.no_grad():
        b = Batch.make(torch.tensor([0]), torch.arange(6)[None], ids, 2, cfg.vocab_size)
        model(b, state)
        before = {k: v[:2].clone() for k, v in state.items()}
        pad = Batch.make(torch.tensor([2, 2]), torch.arange(6, 12)[None].repeat(2, 1),
                         torch.randint(0, cfg.vocab_size, (2, 6)), 2, cfg.vocab_size)
        logits, _ = model(pad, state)
    for k, v in before.items():
        assert torch.equal(state[k][:2].view(torch.uint8) if v.dtype.itemsize == 1 else state[k][:2],
                           v.view(torch.uint8) if v.dtype.itemsize == 1 else v), k
    assert logits.shape == (2, 6, cfg.vocab_size)


# ------------------------------------------------------------------ misuse: checked on the host
def _state(model, **cache):
    return allocate_state(model.cfg, CacheConfig(**cache), model.prec)


@pytest.mark.parametrize("kw, match", [
    (dict(chunk=128), r"chunk=128 exceeds the state's max_step_tokens=64"),
    (dict(chunk=0), r"chunk must be a positive int, got 0"),
    (dict(prompt_len=300, chunk=64), r"prompt of 300 tokens exceeds the state's max_seq_len=200"),
    (dict(row=2), r"row=2 outside \[0, 2\) \(the state's max_rows; row 2 is the trash row\)"),
    (dict(prompt_len=0), r"prompt is empty"),
    (dict(bad_id=True), r"prompt token ids \[512\] outside \[0, vocab_size=512\)"),
])
def test_prefill_refuses_what_the_state_cannot_hold(make_model, kw, match):
    """Measured before these checks: chunk 128 on a state sized for 64 gave logits off by 0.16;
    300 tokens on max_seq_len 200, off by 0.20 -- and no error."""
    from dspark_compile.models.step import prefill
    model = make_model(with_draft=False, max_positions=512)
    state = _state(model, max_rows=2, max_seq_len=200, max_step_tokens=64)
    prompt = [7] * kw.get("prompt_len", 10) + ([512] if kw.get("bad_id") else [])
    with pytest.raises(ValueError, match=match):
        prefill(model, state, kw.get("row", 0), prompt, kw.get("chunk", 64), speculative=False)


def test_forward_refuses_more_tokens_than_the_state_holds(make_model):
    """A forward of more tokens per row than max_step_tokens would overrun the rings' headroom
    (wrong logits, no error before this check)."""
    model = make_model(with_draft=False, max_positions=512)
    state = _state(model, max_rows=1, max_seq_len=200, max_step_tokens=16)
    ids = torch.zeros(1, 17, dtype=torch.int64)
    b = Batch.make(torch.tensor([0]), torch.arange(17)[None], ids, 1, model.cfg.vocab_size)
    with pytest.raises(ValueError, match="forward: 17 tokens per row exceed the state's "
                                         "max_step_tokens=16"):
        model(b, state)


def test_prefill_positions_past_the_rope_tables(make_model):
    from dspark_compile.models.step import prefill
    model = make_model(with_draft=True, max_positions=100)
    state = _state(model, max_rows=1, max_seq_len=256, max_step_tokens=64)
    with pytest.raises(ValueError, match=r"prompt of 98 tokens \+ a draft block of 5 needs 103 "
                                         r"positions, the model's RoPE tables hold 100"):
        prefill(model, state, 0, [3] * 98, 64, speculative=True)


def test_state_limits_from_shapes_match_the_cache_config(make_model):
    """A state allocate_state did not make (a dict of copies) is sized from its shapes."""
    from dspark_compile.models.state import state_limits
    model = make_model(with_draft=False, max_positions=512)
    state = _state(model, max_rows=1, max_seq_len=200, max_step_tokens=48)
    assert state_limits(state, model.cfg) == (48, 200)
    copy = {k: v.clone() for k, v in state.items()}
    # the C4 caches hold 200 // 4 = 50 entries (the C128 ones 2, i.e. 256 positions)
    assert state_limits(copy, model.cfg) == (48, 200)


def test_generate_checks_rows_and_positions_before_any_forward(make_model):
    from dspark_compile.models.generate import generate
    from dspark_compile.models.request import SamplingParams
    model = make_model(with_draft=True, max_positions=64)
    sp = [SamplingParams(max_new_tokens=4)] * 3
    with pytest.raises(ValueError, match=r"cache.max_rows=2 < 3 prompts"):
        generate(model, [[1, 2]] * 3, sp, True,
                 cache=CacheConfig(max_rows=2, max_seq_len=32, max_step_tokens=8))
    # models/request.py's positions rule, one message wherever a request is checked
    with pytest.raises(ValueError, match=r"prompt 0: 30 tokens leave no room for a new token: "
                                         r"with one they need 38 positions .* the cache holds "
                                         r"max_seq_len=32"):
        generate(model, [[1] * 30], sp[:1], True,
                 cache=CacheConfig(max_rows=1, max_seq_len=32, max_step_tokens=8))
    with pytest.raises(ValueError, match=r"cache.max_seq_len=100 needs RoPE tables of 107 "
                                         r"positions, the model's hold 64"):
        generate(model, [[1, 2]], sp[:1], True,
                 cache=CacheConfig(max_rows=1, max_seq_len=100, max_step_tokens=8))


@pytest.mark.parametrize("field, value, match", [
    ("temperature", float("inf"), "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "temperature must be a finite number >= 0"),
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("top_k", -1, r"top_k must be >= 0 \(0 = off\), got -1"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", float("nan"), r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("seed", 1 << 63, "seed must fit in 64 bits"),
    ("max_new_tokens", 0, "max_new_tokens must be >= 1"),
])
def test_sampling_params_refuse_values_the_samplers_cannot_use(field, value, match):
    from dspark_compile.models.request import SamplingParams
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value}).validate(512)


def test_target_step_equals_target_decode_step(make_model):
    """models/step.py TargetStep (the engine's target-only program) reads its input token from
    row.tokens[:, 0] and writes the next one there: the same tokens, logits-derived, and the
    same positions as target_decode_step fed the last token by hand, for greedy and sampled
    rows, with a padded row (the trash row) that commits nothing and moves no live position."""
    from dspark_compile.models.generate import set_row_sampling
    from dspark_compile.models.request import SamplingParams
    from dspark_compile.models.step import TargetStep, prefill, target_decode_step
    prec = Precision(dtype=torch.float64)
    model = make_model(prec, with_draft=True, max_positions=256)
    cache = CacheConfig(max_rows=3, max_seq_len=96, max_step_tokens=16)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 1, 4], [2, 7, 1, 8, 2]]
    params = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=4),
              SamplingParams(temperature=1.0, top_k=20, seed=-3)]

    def decode(use_target_step: bool):
        state = allocate_state(model.cfg, cache, prec)
        outs = []
        for r, (p, sp) in enumerate(zip(prompts, params)):
            set_row_sampling(state, r, sp)
            outs.append([prefill(model, state, r, p, 16, speculative=True)])
        rows = torch.tensor([0, 1, 2, 3])          # row 3: the trash row, padding
        for _ in range(12):
            if use_target_step:
                tokens, num = TargetStep(model)(rows, state)
                assert tokens.shape == (4, 1) and num.tolist() == [1, 1, 1, 0]
                assert int(tokens[3, 0]) == -1
                nxt = tokens[:3, 0]
            else:
                nxt = target_decode_step(model, state, rows, torch.tensor(
                    [o[-1] for o in outs] + [0]))[0][:3]
            for r in range(3):
                outs[r].append(int(nxt[r]))
        return outs, state["row.last_pos"][:3].tolist()

    with torch.no_grad():
        a, b = decode(True), decode(False)
    assert a == b
    outs, _ = a
    assert len(set(outs[1])) > 1          # the sampled row's tokens vary: not a constant
