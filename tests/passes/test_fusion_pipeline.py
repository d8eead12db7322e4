"""The fusion passes together, as `dspark-compile build` runs them: numerically verified by
the manager, safe when a region cannot be fused or a torch cannot annotate, and the engine built
with them loads in a fresh process and decodes losslessly."""
import collections
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from dspark_compile.kernels import act_quant as aq
from dspark_compile.kernels import region
from dspark_compile.passes import PassConfig, PassManager, PassNoMatchWarning
from dspark_compile.passes.regions import RegionSkippedWarning, find_regions

FUSIONS = ["fuse_act_quant", "fuse_mhc", "fuse_qkv_postprocess", "fuse_ring_slots",
           "fuse_sampler", "drop_region_markers"]


def test_manager_verifies_every_fusion(tiny_step):
    ep = tiny_step.cleaned()
    pm = PassManager(FUSIONS, PassConfig(verify=True, verify_seeds=1))
    stats = pm.run(ep, input_factory=tiny_step.inputs, state_inputs=tiny_step.states(ep))
    assert [r["name"] for r in stats] == FUSIONS
    assert all(r["verified"] for r in stats)
    exp = tiny_step.expected
    assert [r["matches"] for r in stats[:5]] == [
        exp["rmsnorm_quant"] + exp["swiglu_quant"] + exp["act_quant"] + exp["rmsnorm"],
        exp["hc_pre"] + exp["hc_post"] + exp["hc_head"],
        exp["qkv_postprocess"] + exp["qkv_rope"] + exp["context_kv_store"] + exp["rope"],
        exp["ring_slots"], exp["markov_sample"] + exp["rejection_sample"]]
    assert stats[5]["matches"] == 0                       # nothing left to drop
    assert tiny_step.lib.op_counts(ep) == tiny_step.expected_ops
    assert tiny_step.lib.annotated_nodes(ep) == []


def test_disabled_fusion_leaves_plain_reference(tiny_step):
    ep = tiny_step.program()                              # as exported: the whole pipeline
    stats = PassManager(config=PassConfig(disabled={"fuse_sampler"})).run(
        ep, state_inputs=tiny_step.states(ep))
    names = [r["name"] for r in stats]
    assert "fuse_sampler" not in names and "check_state_in_place" in names
    counts = tiny_step.lib.op_counts(ep)
    assert counts["markov_sample"] == counts["rejection_sample"] == 0
    assert counts["qkv_postprocess"] == tiny_step.expected["qkv_postprocess"]
    assert tiny_step.lib.annotated_nodes(ep) == []
    drop = next(r for r in stats if r["name"] == "drop_region_markers")
    assert drop["matches"] > 0                            # the sampler regions' markers
    tiny_step.lib.assert_same_run(tiny_step.run(tiny_step.cleaned(), 9), tiny_step.run(ep, 9))


def test_region_that_cannot_be_fused_is_left_alone(tiny_step):
    """As if a torch version dropped the annotation of one node inside a region: the region is
    no longer closed, so the pass must leave it unfused (and say so), not rewrite it."""
    ep = tiny_step.cleaned()
    reg = next(r for r in find_regions(ep.graph_module.graph, ["act_quant"]))
    body = next(n for n in reg.nodes if n not in reg.args.values() and n not in reg.outs.values())
    del body.meta["custom"]
    with pytest.warns(RegionSkippedWarning, match="act_quant region"):
        stats = PassManager(["fuse_act_quant", "drop_region_markers"]).run(ep)
    assert stats[0]["matches"] == tiny_step.expected["act_quant"] - 1 + \
        tiny_step.expected["rmsnorm_quant"] + tiny_step.expected["swiglu_quant"] + \
        tiny_step.expected["rmsnorm"]
    assert len(stats[0]["notes"]["skipped"]) == 1
    assert tiny_step.lib.annotated_nodes(ep) == []
    tiny_step.lib.assert_same_run(tiny_step.run(tiny_step.cleaned(), 10), tiny_step.run(ep, 10))


class _Quant(torch.nn.Module):
    def forward(self, x):
        q, s = aq.act_quant_reference(x + 1)
        return q.float() * s.repeat_interleave(128, -1)


def test_torch_without_annotations_warns_and_changes_nothing(monkeypatch):
    """torch 2.11 (the GPU machine) without a working `torch.fx.traceback.annotate`: calls are
    not marked, the fusions find nothing and warn, the program is the unfused reference."""
    monkeypatch.setattr(region, "_SUPPORTED", False)
    x = torch.randn(2, 256)
    with torch.fx.traceback.preserve_node_meta():
        ep = torch.export.export(_Quant(), (x,), strict=False)
    assert find_regions(ep.graph_module.graph, ["act_quant"]) == []
    with pytest.warns(PassNoMatchWarning, match="fuse_act_quant"):
        PassManager(["remove_asserts", "remove_noops", "dce", "fuse_act_quant"]).run(ep)
    torch.testing.assert_close(ep.module()(x), _Quant()(x), rtol=0, atol=0)


def test_fused_program_exports_markers_only_with_preserved_meta():
    with warnings.catch_warnings():
        warnings.simplefilter("error", PassNoMatchWarning)
        with torch.fx.traceback.preserve_node_meta():
            ep = torch.export.export(_Quant(), (torch.randn(2, 256),), strict=False)
        PassManager(["remove_asserts", "remove_noops", "dce", "fuse_act_quant"]).run(ep)
    assert [n.target for n in ep.graph.nodes if n.op == "call_function"].count(
        torch.ops.dspark.act_quant.default) == 1


ENGINE_RUN = textwrap.dedent("""
    import collections, json, sys, torch
    torch.set_num_threads(1)   # as tests/conftest.py: 2 CI cores, tiny matmuls
    from dspark_compile.models.request import SamplingParams
    from dspark_compile.runtime.engine import Engine
    eng = Engine.load(sys.argv[1], device="cpu")
    prompts = json.loads(sys.argv[2])
    res = eng.generate(prompts, SamplingParams(max_new_tokens=int(sys.argv[3])))
    ops = {b: dict(collections.Counter(str(n.target) for n in m.graph.nodes
                                       if str(n.target).startswith("dspark.")))
           for b, m in ((k.size, eng.program(k).fn) for k in eng.table
                        if k.kind == "step" and k.variant == "full")}
    print("RESULT" + json.dumps({"tokens": res.tokens, "ops": ops,
                                 "accepted": res.mean_accepted_length}))
""")


@pytest.mark.slow   # ~60 s: two exports, the engine write, a fresh process loading it
def test_engine_with_fusions_is_lossless_in_a_fresh_process(tiny_step, tmp_path):
    from dspark_compile.models.generate import generate
    from dspark_compile.models.request import SamplingParams
    from dspark_compile.engine_dir.build_config import BuildConfig
    from dspark_compile.build.pipeline import build_engine

    bc = BuildConfig(buckets=(1, 2), dtype="float64", max_seq_len=64)
    manifest = build_engine(tiny_step.ckpt, tmp_path / "engine", bc, log=lambda s: None)
    passes = [p["name"] for p in manifest["passes"]]
    assert {"fuse_act_quant", "fuse_mhc", "fuse_qkv_postprocess", "fuse_sampler"} <= set(passes)

    prompts = [[11, 12, 13, 14, 15, 16, 17, 18], [7, 7, 7], [300, 2, 99, 41, 5]]
    n = 20
    out = subprocess.run([sys.executable, "-c", ENGINE_RUN, str(tmp_path / "engine"),
                          json.dumps(prompts), str(n)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.split("RESULT", 1)[1])
    for b in ("1", "2"):
        ops = got["ops"][b]
        assert ops["dspark.markov_sample.default"] == 1, ops
        assert ops["dspark.qkv_postprocess.default"] == tiny_step.expected["qkv_postprocess"]
        assert ops["dspark.rmsnorm_quant.default"] == tiny_step.expected["rmsnorm_quant"]
        assert ops["dspark.hc_post_pre.default"] == tiny_step.expected_ops["hc_post_pre"]

    params = [SamplingParams(max_new_tokens=n) for _ in prompts]
    ref = generate(tiny_step.model, prompts, params, speculative=False)
    assert got["tokens"] == ref.tokens
    assert got["accepted"] > 1.2        # drafts were accepted: speculation was exercised


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8-simulated", "no-fp8"])
def test_fused_step_on_cuda_commits_what_the_unfused_step_commits(tiny_step_lib, tmp_path, fp8):
    """On the GPU the fused ops run their Triton kernels on exactly the values the passes bind
    (views of the state caches, sliced draft tokens, ...). float32: the fused step commits the
    same tokens as the unfused one, moves the same positions and writes only finite values.

    The stored draft logits are compared only without FP8 simulation. With it, a fused kernel's
    ~1e-7 relative rounding difference from the unfused ops (each op agrees with its reference
    that closely on this step's inputs: test_every_fused_op_agrees_with_its_reference_on_the_gpu)
    moves some value across an FP8 rounding boundary or a top-k tie, and the draft logits a few
    layers later differ by ~1e-2 (H200, fuse_mhc alone: 0.07-0.09 on seed 11, 1e-6 on seeds 12
    and 13): an elementwise tolerance there would test the seed's luck, not the fusion."""
    ts = tiny_step_lib.TinyStep(tmp_path, dtype="float32", device="cuda", fp8=fp8)
    unfused = ts.cleaned()
    PassManager(["drop_region_markers"]).run(unfused, state_inputs=ts.states(unfused))
    fused = ts.program()
    PassManager().run(fused, state_inputs=ts.states(fused))   # the build's default pipeline
    assert ts.lib.op_counts(fused) == ts.expected_ops
    for seed in (11, 12, 13):
        ref, got = ts.run(unfused, seed), ts.run(fused, seed)
        for i, what in enumerate(("tokens", "num_sampled")):
            assert torch.equal(ref.outputs[i], got.outputs[i]), (seed, what, ref.outputs[i],
                                                                got.outputs[i])
        for k in ("state_row_tokens", "state_row_last_pos"):
            assert torch.equal(ref.state[k], got.state[k]), (seed, k)
        if not fp8:
            # every live row's draft logits, greedy ones included (the tensor-core bias sums
            # in another order: ~1e-7 relative)
            torch.testing.assert_close(got.state["state_row_draft_logits"][:-1],
                                       ref.state["state_row_draft_logits"][:-1], rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
        for k, v in got.state.items():
            if not v.dtype.is_floating_point:
                continue
            v = v[:-1] if k == "state_row_draft_logits" else v     # [:-1]: not the trash row
            assert bool(torch.isfinite(v.float()).all()), (seed, k)


def _agreement(got, ref) -> str:
    """'' when a kernel's output agrees with the reference's: same shape and dtype; integers
    equal; every value finite; FP8 codes equal but for one-step rounding flips in at most 0.1 % of
    them (an input a rounding apart lands on the neighbouring code); other floats within 1e-5 of
    the reference's largest magnitude."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"{got.dtype}{list(got.shape)} vs the reference's {ref.dtype}{list(ref.shape)}"
    if not got.is_floating_point():
        return "" if torch.equal(got, ref) else "integers differ"
    if not (bool(torch.isfinite(got.double()).all()) and bool(torch.isfinite(ref.double()).all())):
        return "a value is not finite"
    if got.element_size() == 1:
        def level(t):       # sign-magnitude codes -> integers in value order (+0 and -0 alike)
            c = t.view(torch.uint8).int()
            return torch.where(c >= 128, -(c - 128), c)
        a, b = level(got), level(ref)
        off = a != b
        if bool(((a - b).abs() > 1).any()):
            return "an FP8 code differs by more than one rounding step"
        return "" if off.double().mean() <= 1e-3 else f"{off.double().mean():.2%} FP8 codes flipped"
    g, r = got.double(), ref.double()
    scale = float(r.abs().max()) or 1.0
    err = float((g - r).abs().max()) / scale
    return "" if err <= 1e-5 else f"relative error {err:.2e}"


@pytest.mark.gpu
def test_every_fused_op_agrees_with_its_reference_on_the_gpu(tiny_step_lib, tmp_path):
    """Each dspark:: call of the fused step (default pipeline, float32, FP8 simulated), run by
    its Triton kernel on the GPU, against the op's reference on the very same inputs (the step's
    prefilled state, seeds 11-13): every returned tensor agrees (`_agreement`; H200: at most
    8e-7 relative). The kernel tests cover the in-place cache writes."""
    from dspark_compile.kernels.registry import KERNELS
    from dspark_compile.passes.verify import graph_inputs, make_args
    ts = tiny_step_lib.TinyStep(tmp_path, dtype="float32", device="cuda")
    fused = ts.program()
    PassManager().run(fused, state_inputs=ts.states(fused))
    gm = fused.graph_module
    problems, checked = [], collections.Counter()

    def clone(a):
        if isinstance(a, torch.Tensor):
            return a.clone()
        return type(a)(clone(x) for x in a) if isinstance(a, (list, tuple)) else a

    class Check(torch.fx.Interpreter):
        def run_node(self, n):
            if n.op != "call_function" or not str(n.target).startswith("dspark."):
                return super().run_node(n)
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            rargs, rkw = clone(args), clone(kwargs)        # before the kernel writes any cache
            res = super().run_node(n)
            name = str(n.target).split(".")[1]
            ref = KERNELS[name].reference(*rargs, **rkw)
            outs = res if isinstance(res, (tuple, list)) else (res,)
            refs = ref if isinstance(ref, (tuple, list)) else (ref,)
            if len(outs) != len(refs):
                problems.append(f"{n.name} ({name}): {len(outs)} outputs, the reference "
                                f"{len(refs)}")
            for i, (g, r) in enumerate(zip(outs, refs)):
                if isinstance(g, torch.Tensor):
                    bad = _agreement(g, r)
                    if bad:
                        problems.append(f"seed {seed}, {n.name} ({name}) output {i}: {bad}")
            checked[name] += 1
            return res

    gi = graph_inputs(fused, gm)
    for seed in (11, 12, 13):
        torch.manual_seed(seed)
        with torch.no_grad():
            Check(gm).run(*make_args(gi, ts.inputs(seed)))
    assert checked["fp8_linear"] and checked["moe_experts"] and checked["hc_post_pre"], checked
    assert not problems, "\n".join(problems)
