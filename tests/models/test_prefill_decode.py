"""Prefill of a prompt and token-by-token decode must give the same logits.

Catches compressor block boundaries, the C4 overlap, ring indexing and RoPE positions across every
layer type (the tiny preset has SWA, C4 with indexer, C128, hash and bias routing). In float64 the
two paths agree to rounding, with and without the FP8 KV / activation quantization simulation
(fp64 keeps FP8 rounding decisions identical in both paths).
"""
import pytest
import torch

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


@pytest.mark.parametrize("prec", [Precision.exact(torch.float64), Precision(dtype=torch.float64)],
                         ids=["exact", "fp8-sim"])
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
