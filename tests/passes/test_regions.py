"""passes/regions.py on small exported modules: partial outputs, and the checks that make a
region unfusable (it must then stay exactly as traced, with a warning)."""
import pytest
import torch

from dspark_compile.kernels import act_quant as aq
from dspark_compile.kernels import region
from dspark_compile.kernels.act_quant import ACT_QUANT_GROUP
from dspark_compile.passes import PassManager
from dspark_compile.passes.regions import RegionSkippedWarning, find_regions

CLEANUP = ["remove_asserts", "remove_noops", "dce"]


def _export(mod, *args):
    with torch.fx.traceback.preserve_node_meta():
        return torch.export.export(mod, args, strict=False)


def _targets(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


class _NormQuantOnly(torch.nn.Module):
    """Uses only the fp8 pair of rmsnorm_quant: the y output marker dies in dce."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.linspace(0.5, 1.5, 256))

    def forward(self, x):
        _, q, s = aq.rmsnorm_quant_reference(x, self.w, 1e-6)
        return q.float() * s.repeat_interleave(ACT_QUANT_GROUP, -1)


def test_unused_output_is_not_needed():
    x = torch.randn(3, 256)
    ep = _export(_NormQuantOnly(), x)
    stats = PassManager(CLEANUP + ["fuse_act_quant"]).run(ep)
    assert stats[-1]["notes"]["fused"]["rmsnorm_quant"] == 1
    (op,) = [n for n in ep.graph.nodes if n.target is torch.ops.dspark.rmsnorm_quant.default]
    assert len(op.meta["val"]) == 3                      # every output has a fake value
    assert sorted(u.args[1] for u in op.users) == [1, 2]  # getitems of the used outputs only
    torch.testing.assert_close(ep.module()(x), _NormQuantOnly()(x), rtol=0, atol=0)


def test_region_writing_an_undeclared_argument_is_left_alone(monkeypatch):
    # a reference that (wrongly) updates its input in place: dspark::act_quant does not declare
    # `x` as mutated, so replacing the region would drop that write
    monkeypatch.setitem(region.FUSABLE, "act_quant", region.FUSABLE["act_quant"])

    @region.fusable("act_quant")
    def bad_act_quant(x):
        x.mul_(2.0)
        return aq.act_quant_reference.__wrapped_reference__(x)

    class M(torch.nn.Module):
        def forward(self, x):
            y = x + 1
            q, s = bad_act_quant(y)
            return q.float() * s.repeat_interleave(ACT_QUANT_GROUP, -1) + y

    x = torch.randn(2, 256)
    ep = _export(M(), x)
    assert len(find_regions(ep.graph, ["act_quant"])) == 1
    with pytest.warns(RegionSkippedWarning, match="writes argument 'x'"):
        stats = PassManager(CLEANUP + ["fuse_act_quant", "drop_region_markers"]).run(ep)
    assert stats[-2]["matches"] == 0 and len(stats[-2]["notes"]["skipped"]) == 1
    assert torch.ops.dspark.act_quant.default not in _targets(ep)
    torch.testing.assert_close(ep.module()(x), M()(x), rtol=0, atol=0)


def test_region_output_used_without_marker_is_left_alone():
    class M(torch.nn.Module):
        def forward(self, x):
            q, s = aq.act_quant_reference(x)
            return q.float() * s.repeat_interleave(ACT_QUANT_GROUP, -1)

    x = torch.randn(2, 256)
    ep = _export(M(), x)
    PassManager(CLEANUP).run(ep)
    reg = find_regions(ep.graph, ["act_quant"])[0]
    inner = next(n for n in reg.nodes if n not in reg.args.values()
                 and n not in reg.outs.values() and n.target is torch.ops.aten.abs.default)
    out = next(n for n in ep.graph.nodes if n.op == "output")
    with ep.graph.inserting_before(out):       # a use of an inner value from outside
        leak = ep.graph.call_function(torch.ops.aten.neg.default, (inner,))
    leak.meta["val"] = inner.meta["val"]
    out.args = ((out.args[0][0], leak),)
    ep.graph_module.recompile()
    with pytest.warns(RegionSkippedWarning, match="used outside the region"):
        PassManager(["fuse_act_quant"]).run(ep.graph_module)
    assert torch.ops.dspark.act_quant.default not in _targets(ep)
