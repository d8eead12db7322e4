"""fuse_qkv_postprocess on the tiny model's exported step: every qkv_postprocess (target layer),
qkv_rope (draft layer) and context_kv_store (draft ring) region becomes one dspark:: op, the
pattern is gone, the step computes the same outputs and state, and caches stay in place."""
import pytest
import torch

from dspark_compile.passes import PassManager, assert_no_whole_cache_copy
from dspark_compile.passes.graph_utils import alias_root

OPS = ("qkv_postprocess", "qkv_rope", "context_kv_store", "rope")


def test_counts_and_pattern_gone(tiny_step):
    lib, ep = tiny_step.lib, tiny_step.cleaned()
    cfg = tiny_step.cfg
    expected = {"qkv_postprocess": cfg.num_hidden_layers, "qkv_rope": cfg.n_mtp_layers,
                "context_kv_store": cfg.n_mtp_layers, "rope": tiny_step.expected["rope"]}
    others_before = lib.region_counts(ep, [o for o in lib.ALL_OPS if o not in OPS])
    assert lib.region_counts(ep, OPS) == expected
    assert lib.op_counts(ep, OPS) == dict.fromkeys(OPS, 0)

    stats = PassManager(["fuse_qkv_postprocess"]).run(ep, state_inputs=tiny_step.states(ep))
    assert stats[0]["matches"] == sum(expected.values())
    assert stats[0]["notes"]["fused"] == expected and stats[0]["notes"]["skipped"] == []
    assert lib.op_counts(ep, OPS) == expected
    assert lib.region_counts(ep, OPS) == dict.fromkeys(OPS, 0)
    assert lib.annotated_nodes(ep, OPS) == []
    # the other fusions' regions are untouched
    assert lib.region_counts(ep, [o for o in lib.ALL_OPS if o not in OPS]) == others_before


def test_caches_written_in_place(tiny_step):
    ep = tiny_step.cleaned()
    states = tiny_step.states(ep)
    PassManager(["fuse_qkv_postprocess"]).run(ep, state_inputs=states)
    assert_no_whole_cache_copy(ep, states)
    written = set()
    for n in ep.graph_module.graph.nodes:
        if n.target in (torch.ops.dspark.qkv_postprocess.default,
                        torch.ops.dspark.context_kv_store.default):
            caches = n.args[5:8] if n.target is torch.ops.dspark.qkv_postprocess.default \
                else n.args[4:5]
            for c in caches:
                root = alias_root(c)
                assert root.op == "placeholder" and root.name in states, (n.name, root.name)
                written.add(root.name)
    L, S = tiny_step.cfg.num_hidden_layers, tiny_step.cfg.n_mtp_layers
    assert len(written) == 3 * L + S            # every SWA nope/scale/rope cache and draft ring
    assert all(w.endswith(("swa_nope", "swa_scale", "swa_rope", "_ctx")) for w in written)


def test_step_numerics_unchanged(tiny_step):
    before = tiny_step.cleaned()
    after = tiny_step.cleaned()
    PassManager(["fuse_qkv_postprocess"]).run(after, state_inputs=tiny_step.states(after))
    for seed in (3, 4):
        tiny_step.lib.assert_same_run(tiny_step.run(before, seed), tiny_step.run(after, seed))

    # the comparison can fail: a fused op with the wrong eps changes q and everything after it
    node = next(n for n in after.graph_module.graph.nodes
                if n.target is torch.ops.dspark.qkv_postprocess.default)
    node.args = node.args[:-1] + (0.5,)
    after.graph_module.recompile()
    with pytest.raises(AssertionError, match="differ"):
        tiny_step.lib.assert_same_run(tiny_step.run(before, 3), tiny_step.run(after, 3))
