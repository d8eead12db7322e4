"""Lossless to the bit on the CPU in fp32 with the FP8 simulation (issue 34's CI target): the
engine's greedy speculative output equals its own target-only greedy output, token for token,
for 64 random prompts x 64 new tokens.

The trained tiny pair, so drafts are accepted often and each verify step commits several tokens
a row. The 64 requests share 4 state rows: each step runs bucket 4 while 2..4 rows are live and
bucket 1 for the last one, so a request is decoded inside ever-changing batches and padded rows,
and still must emit what target-only decoding emits.
"""
import random

import pytest

PROMPTS, NEW_TOKENS = 64, 64


@pytest.fixture(scope="module")
def fp32_engine(tmp_path_factory):
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.factory.synth import synth_checkpoint
    from dspark_compile.runtime.engine import Engine
    from dspark_compile.build.pipeline import build_engine

    root = tmp_path_factory.mktemp("cpu_lossless")
    ckpt = synth_checkpoint("tiny-trained", root / "ckpt", seed=0)
    build_engine(ckpt, root / "engine",
                 BuildConfig(buckets=(1, 4), max_rows=4, max_seq_len=112, dtype="float32",
                             device="cpu", prefill_chunks=(), target_programs=True),
                 log=lambda s: None)
    return Engine.load(root / "engine", device="cpu")


def test_speculative_equals_target_only_fp32_fp8_sim(fp32_engine):
    from dspark_compile.runtime.lossless import compare_outputs
    from dspark_compile.models.request import SamplingParams

    eng = fp32_engine
    assert eng.build.act_quant and eng.build.kv_fp8 and eng.build.dtype == "float32"
    rng = random.Random(34)
    V = eng.cfg.vocab_size
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 40))] for _ in range(PROMPTS)]
    params = [SamplingParams(max_new_tokens=NEW_TOKENS) for _ in prompts]
    spec = eng.generate(prompts, params)
    plain = eng.generate(prompts, params, speculative=False).tokens
    report = compare_outputs(plain, spec.tokens)
    assert report.ok, report.line()
    assert sum(spec.accepted_at) > PROMPTS * NEW_TOKENS // 4, "drafts are rarely accepted"
