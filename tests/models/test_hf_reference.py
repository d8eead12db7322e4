"""Our DeepSeek-V4 target vs Hugging Face `transformers`' independent DeepseekV4ForCausalLM.

Both run the synthetic tiny checkpoint, written in the native layout and read back by our loader
(every layer type: SWA-only and C4 hash-routed, C4 with the
lightning indexer, C128, bias-routed MoE) in fp32 with the same weight values: HF gets the
FP8 / MXFP4 weights dequantized to fp32 (tests/models/hf_ref.py), we run
`Precision.exact(torch.float32)` (no FP8 KV / activation quant simulation), so the two differ
only by fp32 rounding in differently ordered arithmetic.

Tolerance: logits within 5e-5 x max|logit| (max|logit| ~ 13, so ~6e-4). Observed: 1.1e-5
absolute, 8e-7 relative to the logit scale, after 6 layers of mHC (20 Sinkhorn passes),
attention, compressor softmax-pooling and MoE in differently ordered fp32 arithmetic. Architecture
mistakes planted on the HF side (with our selection still handed over) move the logits far more:
mHC C not transposed 2.5, compressed-entry RoPE at (b+1)·CR-1 3.9, no YaRN on compressed layers
4.2, YaRN on SWA layers 4.0, no sink 4.8, SWA window 9 instead of 8 5.2, C4 overlap halves
swapped 5.5, router bias in the expert weights 0.15; indexer without ReLU changes only the
selection and is caught by the top-k check. So the bound is ~50x the rounding noise and far
below any real disagreement.

One documented deviation: top-k ties in the C4 lightning indexer (docs/model.md, "Indexer")
are broken differently by the two implementations; see hf_ref.IndexerSync, which checks our
selection is a valid top-k of HF's own scores and then makes HF use it.

Prompts: a short one (5 tokens: no compressed block closes) and a long one (150 tokens: 37 C4
blocks so the indexer really selects 4 of up to 37, and the first C128 block closes at position
127). The long one runs through our model as prefill chunks [0, 63) and [63, 126) (a C4 block
straddles the chunk boundary), then single-token decode steps 126..131 (the C128 block and a C4
block close *during decode*), then a multi-token chunk [132, 150); it is compared with HF's
single full forward (no cache) and with HF's own cache following the same schedule.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers (the `test` extra) is not installed: no HF reference")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM (needs >= 5.23)",
                allow_module_level=True)

from dspark_compile.models.batch import Batch  # noqa: E402
from dspark_compile.models.checkpoint import load_checkpoint  # noqa: E402
from dspark_compile.models.config import CacheConfig, Precision  # noqa: E402
from dspark_compile.factory.presets import preset  # noqa: E402
from dspark_compile.models.state import allocate_state  # noqa: E402
from dspark_compile.factory.synth import synth_checkpoint  # noqa: E402
from dspark_compile.models.target import DeepseekV4  # noqa: E402
from dspark_compile.models.weights import load_native  # noqa: E402


def _load_helper():
    # tests are imported with --import-mode=importlib (no sys.path entry): load the sibling file
    name = "dspark_tests_hf_ref"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("hf_ref.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


hf_ref = _load_helper()

RTOL = 5e-5           # of max|logit|; see the module docstring
LONG = 150
# (start, end) forwards of the long prompt: prefill chunks, single-token decode, a verify chunk
SCHEDULE = [(0, 63), (63, 126)] + [(t, t + 1) for t in range(126, 132)] + [(132, LONG)]


def _ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(cfg, our model, HF model, HF loading info) on the same synthetic tiny checkpoint."""
    raw = preset("tiny")
    native = synth_checkpoint(raw, tmp_path_factory.mktemp("native") / "tiny", seed=0, include_draft=False)
    cfg, tensors = load_checkpoint(native, include_draft=False)
    path = hf_ref.write_hf_checkpoint(tmp_path_factory.mktemp("hf_tiny"), raw, tensors, cfg)
    hf, info = hf_ref.load_hf(path)
    prec = Precision.exact(torch.float32)
    ours = DeepseekV4(cfg, prec, max_positions=256, with_draft=False)
    load_native(ours, tensors)
    return cfg, ours.eval(), hf, info


def _run_ours(model, ids: torch.Tensor, schedule):
    cfg, prec = model.cfg, model.prec
    state = allocate_state(cfg, CacheConfig(max_rows=1, max_seq_len=256, max_step_tokens=64), prec)
    out = []
    with hf_ref.OurTrace(model) as trace, torch.no_grad():
        for s, e in schedule:
            b = Batch.make(rows=torch.tensor([0]), pos=torch.arange(s, e)[None], tokens=ids[None, s:e],
                           trash=1, vocab=cfg.vocab_size)
            logits, _ = model(b, state)
            out.append(logits[0])
    return torch.cat(out), trace


def _run_hf(hf, ids: torch.Tensor, selection, schedule=None):
    """HF logits for ids: one cache-less forward, or its DynamicCache following `schedule`."""
    from transformers import DynamicCache

    with hf_ref.IndexerSync(hf, selection) as sync, hf_ref.hf_layer_trace(hf) as layers, torch.no_grad():
        if schedule is None:
            logits = hf(input_ids=ids[None], use_cache=False).logits[0]
        else:
            cache, out = DynamicCache(config=hf.config), []
            for s, e in schedule:
                r = hf(input_ids=ids[None, s:e], position_ids=torch.arange(s, e)[None], cache=cache,
                       use_cache=True)
                cache = r.cache
                out.append(r.logits[0])
            logits = torch.cat(out)
    return logits, sync, layers


def _assert_close(ours, theirs, trace, sync, hf_layers, layer_types, what: str):
    """Logits within RTOL x max|logit|, and every indexer selection of ours a valid top-k."""
    assert torch.isfinite(ours).all() and torch.isfinite(theirs).all(), f"{what}: non-finite logits"
    scale = float(theirs.abs().max())
    diff = (ours.double() - theirs.double()).abs()
    indexer = "\n".join(sync.violations[:4])
    if float(diff.max()) > RTOL * scale:
        bad = (diff.max(-1).values > RTOL * scale).nonzero().flatten().tolist()
        where = hf_ref.first_divergence(trace.layer_outputs(), hf_layers, layer_types, RTOL)
        pytest.fail(f"{what}: logits differ by {float(diff.max()):.3g} (> {RTOL} x {scale:.3g}) at "
                    f"positions {bad[:16]}\n{where}" + (f"\nindexer:\n{indexer}" if indexer else ""))
    if sync.violations:
        pytest.fail(f"{what}: {len(sync.violations)} indexer selection(s) of ours are not a top-k of "
                    f"HF's scores:\n{indexer}")


@pytest.fixture(scope="module")
def long_run(ref):
    cfg, ours, _, _ = ref
    ids = _ids(LONG, 1, cfg.vocab_size)
    logits, trace = _run_ours(ours, ids, SCHEDULE)
    return ids, logits, trace


def test_hf_loads_the_dequantized_native_checkpoint(ref):
    cfg, _, hf, info = ref
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hc = hf.config
    assert hc.layer_types == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                              "heavily_compressed_attention", "compressed_sparse_attention",
                              "heavily_compressed_attention"]
    assert hc.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 3
    # YaRN only on compressed layers, no magnitude scaling (docs/model.md, "RoPE")
    assert hc.rope_parameters["main"]["rope_type"] == "default"
    assert hc.rope_parameters["compress"]["rope_type"] == "yarn"
    assert hc.rope_parameters["compress"]["attention_factor"] == 1.0


def test_short_prompt_matches_hf(ref):
    cfg, ours, hf, _ = ref
    ids = _ids(5, 0, cfg.vocab_size)
    got, trace = _run_ours(ours, ids, [(0, 5)])
    want, sync, layers = _run_hf(hf, ids, trace.selection)
    _assert_close(got, want, trace, sync, layers, hf.config.layer_types, "5-token prompt")
    assert got.std(0).mean() > 0.1  # logits vary with position: the model is not degenerate


def test_long_prompt_matches_hf_full_forward(ref, long_run):
    """Our chunked prefill + decode + verify chunk vs HF's single cache-less forward."""
    _, _, hf, _ = ref
    ids, got, trace = long_run
    want, sync, layers = _run_hf(hf, ids, trace.selection)
    # every C4 query of both C4 layers was checked against HF's scores
    assert sync.checked == 2 * LONG
    _assert_close(got, want, trace, sync, layers, hf.config.layer_types, f"{LONG}-token prompt vs HF forward")


def test_decode_matches_hf_incremental(ref, long_run):
    """Same schedule through HF's DynamicCache (its compressor buffers / overlap state)."""
    _, _, hf, _ = ref
    ids, got, trace = long_run
    want, sync, layers = _run_hf(hf, ids, trace.selection, SCHEDULE)
    assert sync.checked == 2 * LONG
    _assert_close(got, want, trace, sync, layers, hf.config.layer_types, f"{LONG}-token schedule vs HF cache")
