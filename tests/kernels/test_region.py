"""kernels/region.py: `@fusable` reference calls become annotated regions while an export traces
with node meta preserved, and nothing at all otherwise."""
import inspect

import torch

from dspark_compile.kernels import act_quant as aq
from dspark_compile.kernels import mhc, qkv_postprocess, ring_slots, rope, sampling  # noqa: F401
from dspark_compile.kernels import region as R

ALL = {"qkv_postprocess", "qkv_rope", "context_kv_store", "rope", "ring_slots", "act_quant", "swiglu_quant",
       "rmsnorm_quant", "rmsnorm", "markov_sample", "rejection_sample", "sample", "hc_pre", "hc_post",
       "hc_head", "hc_post_pre", "hc_post_head"}


def test_every_fusable_reference_has_an_op_with_its_parameters():
    assert set(R.FUSABLE) == ALL
    for name, fn in R.FUSABLE.items():
        params = list(inspect.signature(fn).parameters)
        schema = getattr(torch.ops.dspark, name).default._schema
        args = [a.name for a in schema.arguments]
        assert args[:len(params)] == params, name
        assert all(a.has_default_value() for a in schema.arguments[len(params):]), name


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.linspace(0.5, 1.5, 256, dtype=torch.float64))

    def forward(self, x):
        y, q, s = aq.rmsnorm_quant_reference(x * 2, self.w, 1e-6)   # calls act_quant inside
        return y + 1, q, s


def _export(preserve: bool):
    x = torch.randn(3, 256, dtype=torch.float64)
    if preserve:
        with torch.fx.traceback.preserve_node_meta():
            return torch.export.export(_Norm(), (x,), strict=False)
    return torch.export.export(_Norm(), (x,), strict=False)


def _annotated(ep):
    return [n for n in ep.graph.nodes
            if isinstance(n.meta.get("custom"), dict) and R.CALL in n.meta["custom"]]


def test_export_marks_one_region_with_named_markers():
    ep = _export(True)
    nodes = _annotated(ep)
    assert {n.meta["custom"][R.REGION] for n in nodes} == {"rmsnorm_quant"}   # nested: one
    assert len({n.meta["custom"][R.CALL] for n in nodes}) == 1
    c = nodes[0].meta["custom"]
    assert c[R.CONSTS] == {"eps": 1e-6} and c[R.TENSOR_ARGS] == ["x", "weight"]
    alias = [n for n in nodes if n.target is torch.ops.aten.alias.default]
    args = {n.meta["custom"][R.ARG]: n for n in alias if R.ARG in n.meta["custom"]}
    outs = {n.meta["custom"][R.OUT]: n for n in alias if R.OUT in n.meta["custom"]}
    assert set(args) == {"x", "weight"} and set(outs) == {0, 1, 2}
    assert args["x"].args[0].target is torch.ops.aten.mul.Tensor         # x * 2 from outside
    assert all(o.meta["custom"][R.NUM_OUT] == 3 for o in outs.values())
    assert [u.target for u in outs[0].users] == [torch.ops.aten.add.Tensor]  # y + 1 outside


def test_no_marks_without_preserved_meta_or_outside_tracing():
    ep = _export(False)
    assert _annotated(ep) == []
    assert not any(n.target is torch.ops.aten.alias.default for n in ep.graph.nodes)
    assert not R._marking()


def test_eager_calls_are_unchanged():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 256, generator=g), torch.rand(256, generator=g) + 0.5
    got = aq.rmsnorm_quant_reference(x, w, 1e-6)
    ref = aq.rmsnorm_quant_reference.__wrapped_reference__(x, w, 1e-6)
    for a, b in zip(got, ref):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    assert aq.rmsnorm_quant_reference.__name__ == "rmsnorm_quant_reference"
