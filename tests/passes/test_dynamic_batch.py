"""One step program for every batch size (build/pipeline.py `export_step(dynamic=True)`,
`export_target(dynamic=True)`).

The tiny model's step and target-only step are exported once each with a symbolic batch B in
[1, max_rows] (fp64, FP8 simulated, so every fusable region exists) and run through the whole
pass pipeline; then, at B = 1, 2 and max_rows, the program's outputs and every state tensor
after the step equal the eager step's (the references every static program is checked
against) bit for bit, on prefilled states. Two exports for the module (~50 s on a 2-core CPU).
"""
from __future__ import annotations

import pytest
import torch

from dspark_compile.build.dynamic_batch import is_size_node
from dspark_compile.build.pipeline import export_step, export_target, state_input_names
from dspark_compile.engine_dir.build_config import BuildConfig
from dspark_compile.factory.synth import synth_checkpoint
from dspark_compile.models import load_model
from dspark_compile.models.checkpoint import load_checkpoint
from dspark_compile.models.config import rope_positions
from dspark_compile.models.random_requests import prefilled_state
from dspark_compile.models.state import allocate_state
from dspark_compile.models.step import DraftVerifyStep, TargetStep
from dspark_compile.passes import PassManager

MAX_ROWS = 3


class _Tiny:
    def __init__(self, root):
        bc = BuildConfig(dtype="float64", buckets=(1, MAX_ROWS), max_seq_len=64, device="cpu",
                         act_quant=True, kv_fp8=True)
        self.cfg, tensors = load_checkpoint(synth_checkpoint("tiny", root / "tiny", seed=0),
                                            device="cpu")
        self.prec = bc.precision()
        self.model = load_model(None, self.prec,
                                rope_positions(bc.max_seq_len, self.cfg.dspark_block_size),
                                True, device="cpu", tensors=tensors, cfg=self.cfg)
        self.cache = bc.cache(self.cfg.dspark_block_size)
        self.ep, self.stats = self._program(export_step)
        self.module = self.ep.module()
        self.target = self._program(export_target)[0].module()

    def _program(self, export):
        """(program exported for every batch and run through the passes, pass matches)."""
        ep = export(self.model, allocate_state(self.cfg, self.cache, self.prec, "cpu"), 2,
                    dynamic=True)
        stats = {r["name"]: r["matches"] for r in PassManager().run(
            ep, state_inputs=state_input_names(ep))}
        ep.example_inputs = None
        return ep, stats


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _Tiny(tmp_path_factory.mktemp("dynamic_batch"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _run(fn, tiny, B: int, seed: int):
    rows, state = prefilled_state(tiny.model, tiny.cache, B, seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = fn(rows, state)
    return out, state


def _comparable(t: torch.Tensor, trash: int) -> torch.Tensor:
    """t's bits, but the scratch slot of a per-row ring ([trash row, last slot], where every
    padded or skipped write of the step lands: kernels/common.py masked_row_write; no reader
    trusts it, and which of several such writes lands last is not fixed, not even between two
    eager runs)."""
    if t.dim() >= 2 and t.shape[0] == trash + 1:
        t = t.clone()
        t[trash, -1] = 0
    return _bits(t)


def test_one_program_for_every_batch(tiny):
    """The batch is one symbol B in [1, max_rows] (B = 1 included: traced size-oblivious), and
    the state's shapes are static."""
    assert [(int(r.lower), int(r.upper)) for r in tiny.ep.range_constraints.values()] == \
        [(1, MAX_ROWS)]
    rows = next(n for n in tiny.ep.graph.nodes if n.op == "placeholder"
                and n.name == tiny.ep.graph_signature.user_inputs[0])
    assert isinstance(rows.meta["val"].shape[0], torch.SymInt)
    sizes = [n for n in tiny.ep.graph.nodes if is_size_node(n)]
    assert sizes and all(i.op == "placeholder" or is_size_node(i)
                         for n in sizes for i in n.all_input_nodes)


def _assert_same_step(ref, got, tiny, B: int, seeds) -> None:
    """ref(rows, state) and got(rows, state): outputs and every state tensor after the step
    bit for bit (the rings' scratch slot aside), on prefilled states of B rows."""
    trash = tiny.cache.max_rows
    for seed in seeds:
        (ref_out, ref_state), (got_out, got_state) = (_run(ref, tiny, B, seed),
                                                      _run(got, tiny, B, seed))
        assert len(ref_out) == len(got_out)
        for i, (a, b) in enumerate(zip(ref_out, got_out)):
            assert a.dtype == b.dtype and a.shape == b.shape, f"output {i}"
            assert torch.equal(_bits(a), _bits(b)), f"B={B} seed {seed}: output {i} differs"
        assert list(ref_state) == list(got_state) and len(ref_state) > 10
        for k, a in ref_state.items():
            assert torch.equal(_comparable(a, trash), _comparable(got_state[k], trash)), \
                f"B={B} seed {seed}: state '{k}' differs"


@pytest.mark.parametrize("B", [1, 2, MAX_ROWS])
def test_each_batch_equals_the_eager_step(tiny, B):
    """The step program at B rows computes the eager step's bits, on two prefilled states."""
    _assert_same_step(DraftVerifyStep(tiny.model), tiny.module, tiny, B, (0, 1))


@pytest.mark.parametrize("B", [1, MAX_ROWS])
def test_each_batch_equals_the_eager_target_step(tiny, B):
    """The target-only program (one token a row: at B = 1 a single token, where a reshape of
    a strided view would have asked whether B is 1) computes the eager TargetStep's bits."""
    _assert_same_step(TargetStep(tiny.model), tiny.target, tiny, B, (0,))


def test_every_fusion_matches(tiny, tiny_step_lib):
    """The passes fuse every region of the dynamic program, as of the static one: each fusion
    pass matches every region of its ops, counted from the config (tests/passes/tiny_step.py
    expected_regions), and no region annotation is left."""
    lib, st = tiny_step_lib, tiny.stats
    exp = lib.expected_regions(tiny.cfg, tiny.prec)
    assert [st["fuse_act_quant"], st["fuse_mhc"], st["fuse_qkv_postprocess"],
            st["fuse_ring_slots"], st["fuse_sampler"], st["drop_region_markers"]] == [
        exp["rmsnorm_quant"] + exp["swiglu_quant"] + exp["act_quant"] + exp["rmsnorm"],
        exp["hc_pre"] + exp["hc_post"] + exp["hc_head"],
        exp["qkv_postprocess"] + exp["qkv_rope"] + exp["context_kv_store"] + exp["rope"],
        exp["ring_slots"], exp["markov_sample"] + exp["rejection_sample"], 0]
    assert lib.annotated_nodes(tiny.ep) == []
