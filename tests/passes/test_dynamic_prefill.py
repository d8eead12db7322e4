"""One prefill program for every chunk length (build/pipeline.py `export_prefill(dynamic=True)`).

The tiny model's prefill chunk is exported once with a symbolic length C in [1, MAX_CHUNK]
(inputs [C + 3]; fp64, FP8 simulated, so every fusable region exists) and run through the whole
pass pipeline; at C = 1, 4, 5 and MAX_CHUNK (one compressed block of the ratio-4 layers and
less, exactly one, more than one) its output and every state tensor equal the eager
PrefillChunk(C)'s bit for bit, on a prefilled state with a fresh prompt chunk. One export for
the module (~35 s on a 2-core CPU).
"""
from __future__ import annotations

import random

import pytest
import torch

from dspark_compile.build.pipeline import export_prefill, state_input_names
from dspark_compile.engine_dir.build_config import BuildConfig
from dspark_compile.factory.synth import synth_checkpoint
from dspark_compile.models import load_model
from dspark_compile.models.checkpoint import load_checkpoint
from dspark_compile.models.config import rope_positions
from dspark_compile.models.prefill_chunk import PrefillChunk, chunk_inputs
from dspark_compile.models.random_requests import prefilled_state
from dspark_compile.models.state import allocate_state
from dspark_compile.passes import PassManager

MAX_CHUNK = 8


class _Tiny:
    def __init__(self, root):
        bc = BuildConfig(dtype="float64", buckets=(1, 2), max_seq_len=64, device="cpu",
                         act_quant=True, kv_fp8=True)
        self.cfg, tensors = load_checkpoint(synth_checkpoint("tiny", root / "tiny", seed=0),
                                            device="cpu")
        self.prec = bc.precision()
        # the RoPE tables hold a chunk's positions past max_seq_len (models/prefill_chunk.py)
        self.model = load_model(None, self.prec, rope_positions(
            bc.max_seq_len + MAX_CHUNK, self.cfg.dspark_block_size), True, device="cpu",
            tensors=tensors, cfg=self.cfg)
        self.cache = bc.cache(self.cfg.dspark_block_size)
        self.ep = export_prefill(self.model, allocate_state(self.cfg, self.cache, self.prec,
                                                            "cpu"), MAX_CHUNK, dynamic=True)
        self.stats = {r["name"]: r["matches"] for r in PassManager().run(
            self.ep, state_inputs=state_input_names(self.ep))}
        self.ep.example_inputs = None
        self.module = self.ep.module()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _Tiny(tmp_path_factory.mktemp("dynamic_prefill"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _comparable(t: torch.Tensor, trash: int) -> torch.Tensor:
    """t's bits, but a per-row ring's scratch slot [trash row, last slot] (kernels/common.py
    masked_row_write: the skipped writes land there, no reader trusts it)."""
    if t.dim() >= 2 and t.shape[0] == trash + 1:
        t = t.clone()
        t[trash, -1] = 0
    return _bits(t)


def test_one_program_for_every_chunk_length(tiny):
    """The inputs' length is one symbol in [1 + 3, MAX_CHUNK + 3]."""
    assert [(int(r.lower), int(r.upper)) for r in tiny.ep.range_constraints.values()] == \
        [(4, MAX_CHUNK + 3)]


@pytest.mark.parametrize("C", [1, 4, 5, MAX_CHUNK])
def test_each_chunk_length_equals_the_eager_chunk(tiny, C):
    trash = tiny.cache.max_rows
    for seed in (0, 1):
        rows, ref_state = prefilled_state(tiny.model, tiny.cache, 1, seed)
        rng = random.Random(seed)
        row, start = int(rows[0]), int(ref_state["row.last_pos"][rows[0]]) + 1
        ids = [rng.randrange(tiny.cfg.vocab_size) for _ in range(rng.randint(1, C))]
        x = chunk_inputs(row, start, ids, C)
        got_state = {k: v.clone() for k, v in ref_state.items()}
        with torch.no_grad():
            torch.manual_seed(seed)
            ref = PrefillChunk(tiny.model, C)(x, ref_state)
            torch.manual_seed(seed)
            got = tiny.module(x, got_state)
        assert torch.equal(_bits(ref), _bits(got)), f"C={C} seed {seed}: the sampled token"
        for k, a in ref_state.items():
            assert torch.equal(_comparable(a, trash), _comparable(got_state[k], trash)), \
                f"C={C} seed {seed}: state '{k}' differs"


def test_every_fusion_matches(tiny, tiny_step_lib):
    """Every fusable region of the dynamic program is fused: no region annotation is left and
    the sampler fused (the prefill's `sample` and the draft block's markov_sample)."""
    assert tiny_step_lib.annotated_nodes(tiny.ep) == []
    assert tiny.stats["fuse_sampler"] == 2 and tiny.stats["drop_region_markers"] == 0
