"""fuse_mhc on the tiny model's exported step: every hc_pre / hc_post / hc_head region becomes one
dspark:: op, each post is merged with the pre or head its stream feeds, the pattern is gone and
the step computes the same outputs and state; on a toy, the merge keeps the stream's other
readers and refuses to move a pre across a side effect."""
import io

import torch

from dspark_compile.kernels import mhc
from dspark_compile.passes import PassConfig, PassManager

REGIONS = ("hc_pre", "hc_post", "hc_head")
OPS = REGIONS + ("hc_post_pre", "hc_post_head")
CLEANUP = ["remove_asserts", "remove_noops", "dce"]


def test_counts_merges_and_pattern_gone(tiny_step):
    lib, ep = tiny_step.lib, tiny_step.cleaned()
    regions = {o: tiny_step.expected[o] for o in OPS}
    assert lib.region_counts(ep, OPS) == regions
    others_before = lib.region_counts(ep, [o for o in lib.ALL_OPS if o not in OPS])

    stats = PassManager(["fuse_mhc"]).run(ep, state_inputs=tiny_step.states(ep))
    sites = sum(regions.values())
    assert stats[0]["matches"] == sites
    assert stats[0]["notes"]["fused"] == regions and stats[0]["notes"]["skipped"] == []
    merged = {"hc_post_pre": regions["hc_post"] - 2, "hc_post_head": 2}
    assert stats[0]["notes"]["merged"] == merged
    assert lib.op_counts(ep, OPS) == {o: tiny_step.expected_ops[o] for o in OPS}
    assert lib.annotated_nodes(ep, OPS) == []
    assert lib.region_counts(ep, [o for o in lib.ALL_OPS if o not in OPS]) == others_before
    # each site was ~80 aten nodes after cleanup (a pre ~150, a post ~10)
    assert stats[0]["nodes_before"] - stats[0]["nodes_after"] > 60 * sites
    for n in ep.graph_module.graph.nodes:
        if n.target is torch.ops.dspark.hc_post_pre.default:
            assert [v.dtype for v in n.meta["val"]] == [torch.float64] * 4
            assert all("val" in u.meta for u in n.users)


def test_step_numerics_unchanged(tiny_step):
    before = tiny_step.cleaned()
    after = tiny_step.cleaned()
    PassManager(["fuse_mhc"]).run(after, state_inputs=tiny_step.states(after))
    tiny_step.lib.assert_same_run(tiny_step.run(before, 5), tiny_step.run(after, 5))


def test_option_merge_off_keeps_one_op_per_site(tiny_step):
    lib, ep = tiny_step.lib, tiny_step.cleaned()
    cfg = PassConfig(options={"fuse_mhc": {"merge": False}})
    stats = PassManager(["fuse_mhc"], cfg).run(ep, state_inputs=tiny_step.states(ep))
    assert "merged" not in stats[0]["notes"]
    assert lib.op_counts(ep, OPS) == {o: tiny_step.expected[o] for o in OPS}


class _Chain(torch.nn.Module):
    """post -> pre on one stream whose X' is also read by a mean, then post -> head; with
    `write_between`, a cache write sits between the first post and the pre."""

    def __init__(self, m=4, D=32, write_between=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("fn", torch.randn((2 + m) * m, m * D, generator=g) * 0.1)
        self.register_buffer("base", torch.randn((2 + m) * m, generator=g))
        self.register_buffer("scale", torch.tensor([1.0, 1.1, 0.9]))
        self.register_buffer("hfn", torch.randn(m, m * D, generator=g) * 0.1)
        self.register_buffer("hbase", torch.randn(m, generator=g))
        self.register_buffer("hscale", torch.tensor([1.2]))
        self.write_between = write_between

    def forward(self, X, y, cache):
        a, post, comb = mhc.hc_pre_reference(X, self.fn, self.scale, self.base, 1e-6, 1e-6, 5)
        X = mhc.hc_post_reference(y * a, X, post, comb)
        if self.write_between:
            cache.index_copy_(0, torch.tensor([0]), X[:1, 0])
        mean = X.mean(1)
        a, post, comb = mhc.hc_pre_reference(X, self.fn, self.scale, self.base, 1e-6, 1e-6, 5)
        X = mhc.hc_post_reference(a.tanh(), X, post, comb)
        return mhc.hc_head_reference(X, self.hfn, self.hscale, self.hbase, 1e-6, 1e-6) + mean


def _toy_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, 4, 32, generator=g, dtype=torch.float64),
            torch.randn(3, 32, generator=g, dtype=torch.float64),
            torch.zeros(2, 32, dtype=torch.float64))


def _fused_toy(write_between):
    model = _Chain(write_between=write_between).double()
    with torch.fx.traceback.preserve_node_meta():
        ep = torch.export.export(model, _toy_inputs(0), strict=False)
    stats = PassManager(CLEANUP + ["fuse_mhc"], PassConfig(verify=True)).run(
        ep, input_factory=_toy_inputs, state_inputs=("cache",))
    assert stats[-1]["verified"] and stats[-1]["matches"] == 5
    buf = io.BytesIO()            # the merged ops' nodes serialise (meta["val"] on each)
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    a, b = _toy_inputs(7), _toy_inputs(7)
    torch.testing.assert_close(loaded.module()(*a), model(*b), rtol=0, atol=0)
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)     # the cache got the same write
    counts = {o: 0 for o in OPS}
    for n in loaded.graph_module.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("dspark.hc_"):
            counts[str(n.target).split(".")[1]] += 1
    return counts


def test_toy_merge_keeps_other_readers_and_stops_at_side_effects():
    assert _fused_toy(False) == {"hc_pre": 1, "hc_post": 0, "hc_head": 0, "hc_post_pre": 1,
                                 "hc_post_head": 1}
    # the cache write between the first post and the pre: that pair stays apart
    assert _fused_toy(True) == {"hc_pre": 2, "hc_post": 1, "hc_head": 0, "hc_post_pre": 0,
                                "hc_post_head": 1}
