"""fuse_act_quant on the tiny model's exported step: rmsnorm_quant per norm that feeds an FP8
GEMM, swiglu_quant per shared expert, act_quant per remaining FP8 GEMM input; the pattern is
gone, the step is unchanged, and option `ops` fuses a subset."""
import pytest
import torch

from dspark_compile.passes import PassConfig, PassManager

OPS = ("rmsnorm_quant", "swiglu_quant", "act_quant", "rmsnorm")


def test_counts_and_pattern_gone(tiny_step):
    lib, ep = tiny_step.lib, tiny_step.cleaned()
    cfg = tiny_step.cfg
    blocks = cfg.num_hidden_layers + cfg.n_mtp_layers
    expected = {"rmsnorm_quant": 3 * blocks + 1, "swiglu_quant": blocks,
                "act_quant": 2 * blocks + 1, "rmsnorm": blocks + cfg.n_mtp_layers + 2}
    assert lib.region_counts(ep, OPS) == expected
    others_before = lib.region_counts(ep, [o for o in lib.ALL_OPS if o not in OPS])

    stats = PassManager(["fuse_act_quant"]).run(ep, state_inputs=tiny_step.states(ep))
    assert stats[0]["matches"] == sum(expected.values())
    assert stats[0]["notes"] == {"fused": expected, "skipped": []}
    assert lib.op_counts(ep, OPS) == expected
    assert lib.annotated_nodes(ep, OPS) == []
    assert lib.region_counts(ep, [o for o in lib.ALL_OPS if o not in OPS]) == others_before
    # rmsnorm_quant's three outputs are all used (y by the compressor/indexer/router paths and
    # the fp8 pair by the GEMM), through getitem nodes carrying meta["val"]
    g = ep.graph_module.graph
    for n in g.nodes:
        if n.target is torch.ops.dspark.rmsnorm_quant.default:
            vals = n.meta["val"]
            assert [v.dtype for v in vals] == [torch.float64, torch.float8_e4m3fn, torch.float32]
            assert all("val" in u.meta for u in n.users)


def test_step_numerics_unchanged(tiny_step):
    before = tiny_step.cleaned()
    after = tiny_step.cleaned()
    PassManager(["fuse_act_quant"]).run(after, state_inputs=tiny_step.states(after))
    tiny_step.lib.assert_same_run(tiny_step.run(before, 5), tiny_step.run(after, 5))


def test_option_ops_fuses_a_subset(tiny_step):
    lib, ep = tiny_step.lib, tiny_step.cleaned()
    ref = tiny_step.cleaned()
    cfg = PassConfig(options={"fuse_act_quant": {"ops": ["swiglu_quant"]}})
    stats = PassManager(["fuse_act_quant", "drop_region_markers"], cfg).run(
        ep, state_inputs=tiny_step.states(ep))
    assert stats[0]["notes"]["fused"] == {"swiglu_quant": tiny_step.expected["swiglu_quant"]}
    assert lib.op_counts(ep, OPS) == {"rmsnorm_quant": 0, "act_quant": 0, "rmsnorm": 0,
                                      "swiglu_quant": tiny_step.expected["swiglu_quant"]}
    # the regions left alone are plain aten again: markers and annotations dropped
    assert lib.annotated_nodes(ep) == []
    assert stats[1]["notes"]["markers"] > 0
    lib.assert_same_run(tiny_step.run(ref, 6), tiny_step.run(ep, 6))

    with pytest.raises(Exception, match="unknown op"):
        bad = PassConfig(options={"fuse_act_quant": {"ops": ["qkv_rope"]}})
        PassManager(["fuse_act_quant"], bad).run(tiny_step.cleaned())
