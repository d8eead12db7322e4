"""lint_host_sync: every class of host-synchronising op is rejected with the node and the
source line; the toy step (capture-safe) passes."""
import pytest
import torch
import torch.nn.functional as F

from dspark_compile.passes import HostSyncError, PassManager, find_host_syncs, lint_host_sync


class Module(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def export(fn, x=None):
    return torch.export.export(Module(fn), (torch.randn(4, 8) if x is None else x,))


# Each case: (exported function, node op expected in the error, words of the reason). The
# lambda's source line is what the error must point at.
CASES = {
    "item": (lambda x: x * x.sum().item(), "aten.item", "on the host"),
    "nonzero": (lambda x: torch.nonzero(x > 0), "aten.nonzero", "depends on tensor data"),
    "masked_select": (lambda x: x.masked_select(x > 0), "aten.masked_select",
                      "depends on tensor data"),
    "unique": (lambda x: torch.unique(x), "aten._unique2", "depends on tensor data"),
    "bool_mask_index": (lambda x: x[x > 0], "aten.index.Tensor", "data-dependent size"),
    "repeat_interleave": (lambda x: torch.repeat_interleave(x, (x[:, 0] > 0).long(), dim=0),
                          "aten.repeat_interleave", "tensor repeats"),
    "multinomial": (lambda x: torch.multinomial(x.softmax(-1), 1), "aten.multinomial",
                    "global RNG"),
    "rand": (lambda x: x + torch.rand_like(x), "aten.rand_like", "global RNG"),
    "bernoulli": (lambda x: torch.bernoulli(x.sigmoid()), "aten.bernoulli", "global RNG"),
    "dropout": (lambda x: F.dropout(x, 0.1, training=True), "dropout", "global RNG"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_banned_op_is_named_with_its_source_line(case):
    fn, op, reason = CASES[case]
    ep = export(fn)
    with pytest.raises(HostSyncError) as e:
        lint_host_sync(ep)
    msg = str(e.value)
    assert op in msg and reason in msg
    assert "test_lint_host_sync.py" in msg  # where it came from (export records forward frames)


class Sampler(torch.nn.Module):
    def forward(self, logits):
        probs = logits.softmax(-1)
        return torch.multinomial(probs, 1)   # the line the error must show


def test_error_names_the_node_and_its_source_line():
    ep = torch.export.export(Sampler(), (torch.randn(4, 8),))
    with pytest.raises(HostSyncError) as e:
        lint_host_sync(ep)
    f = e.value.findings[0]
    assert f.node == "multinomial" and f.op == "aten.multinomial.default"
    assert "test_lint_host_sync.py" in f.location and "in forward" in f.location
    assert "return torch.multinomial(probs, 1)" in f.location
    assert "node 'multinomial'" in str(e.value) and f.location in str(e.value)


def _fake_cuda(*shape):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        return torch.empty(*shape, device="cuda")


@pytest.mark.parametrize("how", ["cpu", "to"])
def test_device_to_host_copy_on_a_cuda_graph(how):
    # A CUDA program exported from fake CUDA tensors (no GPU needed).
    fn = (lambda x: x.cpu() * 2) if how == "cpu" else (lambda x: x.to("cpu") + 1)
    ep = export(fn, _fake_cuda(4, 8))
    findings = find_host_syncs(ep)
    assert len(findings) == 1
    assert "device transfer" in findings[0].reason and "cpu/cuda" in findings[0].reason
    assert "test_lint_host_sync.py" in findings[0].location


def test_host_to_device_copy():
    ep = export(lambda x: x + torch.ones(4, 8).to(x.device), _fake_cuda(4, 8))
    findings = find_host_syncs(ep)
    assert [f.node for f in findings] == ["to"]
    assert "device transfer" in findings[0].reason


def test_same_device_factories_pass():
    lint_host_sync(export(lambda x: x + torch.ones(4, 8, device=x.device), _fake_cuda(4, 8)))


def test_all_findings_are_reported_at_once():
    ep = export(lambda x: torch.nonzero(x) + x.sum().item())
    with pytest.raises(HostSyncError) as e:
        lint_host_sync(ep)
    assert len(e.value.findings) == 2
    assert {f.op for f in e.value.findings} == {"aten.nonzero.default", "aten.item.default"}


def test_capture_safe_ops_pass():
    def fn(x):
        y = F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])
        v, i = x.softmax(-1).topk(2)
        return y.sum() * 2, torch.where(x > 0, x, 0.0).argmax(-1), v, i, x.cumsum(0)

    lint_host_sync(export(fn))


def test_toy_step_passes_lint(toy, toy_export):
    _, ep = toy_export
    lint_host_sync(ep)
    stats = PassManager(["lint_host_sync"]).run(ep)
    assert stats[0]["notes"]["checked"] > 10


def test_lint_pass_in_the_pipeline_fails_the_build():
    ep = export(lambda x: x * x.sum().item())
    with pytest.raises(HostSyncError, match="node 'item'"):
        PassManager().run(ep)
