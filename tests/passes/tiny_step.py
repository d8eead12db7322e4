"""The tiny model's exported draft-plus-verify step, shared by the fusion-pass tests.

Exporting takes 10-40 s on a loaded CI box, so the session exports one program (bucket 2, fp64
activations, FP8 activation quant and FP8 KV caches simulated, so every fusable region exists)
and every test works on a deep copy. `run` executes a program on a realistic prefilled state
(dspark_compile.models.random_requests.prefilled_state: random prompts prefilled, mixed sampling settings, the
last row padding) and returns the outputs and every state tensor after the step.
"""
from __future__ import annotations

import collections
import copy
import sys
import warnings

import torch
from torch.utils import _pytree as pytree

from dspark_compile.models import load_model
from dspark_compile.models.checkpoint import load_checkpoint
from dspark_compile.models.state import allocate_state
from dspark_compile.factory.synth import synth_checkpoint
from dspark_compile.passes import PassManager
from dspark_compile.passes.graph_utils import region_meta
from dspark_compile.passes.regions import find_regions
from dspark_compile.passes.verify import compare_runs, graph_inputs, run_graph
from dspark_compile.engine_dir.build_config import BuildConfig
from dspark_compile.models.config import rope_positions
from dspark_compile.models.random_requests import prefilled_state
from dspark_compile.build.pipeline import export_step, state_input_names

BUCKET = 2
CLEANUP = ("remove_asserts", "remove_noops", "dce")
ALL_OPS = ("qkv_postprocess", "qkv_rope", "context_kv_store", "rope", "ring_slots", "rmsnorm_quant", "swiglu_quant",
           "act_quant", "rmsnorm", "markov_sample", "rejection_sample", "sample", "hc_pre", "hc_post",
           "hc_head", "hc_post_pre", "hc_post_head")


def expected_regions(cfg, prec) -> dict:
    """How many times each fusable op runs in one step, from the config.

    Every block (target layers and draft stages) has 3 norms feeding FP8 GEMMs (attn_norm ->
    wq_a/wkv, q_norm -> wq_b, ffn_norm -> shared expert w1/w3), a shared expert, and two more FP8
    GEMMs whose inputs are quantized alone (wo_a after the inverse RoPE, wo_b); the draft's
    context path adds main_norm (-> wkv of every stage) and main_proj's input quant. The norms
    that feed no FP8 GEMM are `rmsnorm`: kv_norm of every block, the context kv of every stage,
    the final norm of both heads (and, without the activation quant, the three norms above).
    """
    L, S = cfg.num_hidden_layers, cfg.n_mtp_layers
    q = prec.act_quant
    return {
        "qkv_postprocess": L if prec.kv_fp8 else 0,   # target layers, FP8 SWA cache insert
        "qkv_rope": S + (0 if prec.kv_fp8 else L),    # draft layers (no store)
        "context_kv_store": S,                        # accepted rows into each draft ring
        # the output's inverse rotation of every block, the indexer's query of C4 layers
        "rope": L + S + sum(cfg.layer_ratio(i) == 4 for i in range(L)),
        # the SWA insert of every target layer, every compressor's ring (C4 layers have two:
        # the attention's and the indexer's), the draft context
        "ring_slots": L + sum((r > 0) + (r == 4) for r in map(cfg.layer_ratio, range(L))) + 1,
        "rmsnorm_quant": (3 * (L + S) + 1) if q else 0,
        "swiglu_quant": (L + S) if q else 0,
        "act_quant": (2 * (L + S) + 1) if q else 0,
        "rmsnorm": (L + S) + S + 2 + (0 if q else 3 * (L + S) + 1),
        "markov_sample": 1,
        "rejection_sample": 1,
        "sample": 0,                                  # plain sampling is prefill's, not the step's
        "hc_pre": 2 * (L + S),                        # attn and ffn site of every block
        "hc_post": 2 * (L + S),
        "hc_head": 2,                                 # target and draft heads
        "hc_post_pre": 0,                             # only fuse_mhc's merge makes these
        "hc_post_head": 0,
    }


def expected_ops(cfg, prec) -> dict:
    """How many times each op runs in the fully fused step: the regions, except that fuse_mhc
    merges every post with the pre or head reading its stream. Per forward (target, draft) one
    hc_pre is left, on the embedded stream; the last block's post merges into the head."""
    ops = expected_regions(cfg, prec)
    sites = ops["hc_post"]
    ops.update(hc_pre=2, hc_post=0, hc_head=0, hc_post_pre=sites - 2, hc_post_head=2)
    return ops


def region_counts(ep, ops=ALL_OPS) -> dict:
    c = collections.Counter(r.op_name for r in find_regions(ep.graph_module.graph, ops))
    return {o: c.get(o, 0) for o in ops}


def op_counts(ep, ops=ALL_OPS) -> dict:
    c = collections.Counter(str(n.target) for n in ep.graph_module.graph.nodes
                            if n.op == "call_function")
    return {o: c.get(f"dspark.{o}.default", 0) for o in ops}


def annotated_nodes(ep, ops=ALL_OPS) -> list:
    """Nodes still carrying a region annotation of one of `ops`."""
    return [n for n in ep.graph_module.graph.nodes if region_meta(n).get("dspark_region") in ops]


def _copy(ep):
    with warnings.catch_warnings():   # torch's pytree deprecation notice from copying specs
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(ep)


class TinyStep:
    def __init__(self, root, dtype: str = "float64", device: str = "cpu", fp8: bool = True):
        """`fp8=False`: no FP8 simulation (activation quant and FP8 KV caches off)."""
        self.ckpt = synth_checkpoint("tiny", root / "tiny", seed=0)
        self.build = BuildConfig(dtype=dtype, buckets=(BUCKET,), max_seq_len=64, device=device,
                                 act_quant=fp8, kv_fp8=fp8)
        self.cfg, tensors = load_checkpoint(self.ckpt, device=device)
        self.prec = self.build.precision()
        self.model = load_model(None, self.prec,
                                rope_positions(self.build.max_seq_len, self.cfg.dspark_block_size),
                                True, device=device,
                                tensors=tensors, cfg=self.cfg)
        self.cache = self.build.cache(self.cfg.dspark_block_size)
        state = allocate_state(self.cfg, self.cache, self.prec, device)
        self.exported = export_step(self.model, state, BUCKET)
        self._cleaned = None
        self.lib = sys.modules[__name__]   # this module's helpers, for the test files
        self.expected = expected_regions(self.cfg, self.prec)
        self.expected_ops = expected_ops(self.cfg, self.prec)

    def program(self):
        """A fresh copy of the program as exported."""
        return _copy(self.exported)

    def cleaned(self):
        """A fresh copy of the program after the cleanup passes (what the fusions see)."""
        if self._cleaned is None:
            self._cleaned = self.program()
            PassManager(CLEANUP).run(self._cleaned, state_inputs=self.states(self._cleaned))
        return _copy(self._cleaned)

    @staticmethod
    def states(ep) -> list:
        return state_input_names(ep)

    def inputs(self, seed: int) -> tuple:
        """Flat user inputs (rows, then the state tensors) of a prefilled state."""
        return tuple(pytree.tree_flatten(prefilled_state(self.model, self.cache, BUCKET, seed))[0])

    def run(self, ep, seed: int):
        """RunRecord (outputs, state after the step) of `ep` on the prefilled state `seed`."""
        gm = ep.graph_module
        return run_graph(gm, graph_inputs(ep, gm), self.inputs(seed), seed)


def assert_same_run(ref, got) -> None:
    """Outputs and every state tensor equal: integers exactly, floats within fp64 rounding
    (passes/verify.py's tolerances; NaN never passes). On CPU a fused op runs the very
    reference it replaced, so everything is in fact bit-identical; that is checked too."""
    problems = compare_runs(ref, got)
    assert not problems, "\n".join(problems)
    assert set(ref.state) == set(got.state) and len(ref.state) > 10
    for what, a, b in ([(f"output {i}", x, y) for i, (x, y) in enumerate(zip(ref.outputs,
                                                                             got.outputs))]
                       + [(k, v, got.state[k]) for k, v in ref.state.items()]):
        assert torch.equal(a, b), f"{what} is not bit-identical"
