"""The TensorRT dense-subgraph report's partitioning, on a toy program with a stand-in for
torch-tensorrt's converter registry (torch-tensorrt itself is only on NVIDIA's package index;
tests/runtime/test_inspect_onnx.py checks the real report when it is installed)."""
import torch

from dspark_compile.inspection.tensorrt_report import dense_subgraphs, subgraph_report


class _Toy(torch.nn.Module):
    def forward(self, x, cache):
        a = torch.relu(x) + 1          # relu, add: one set ...
        b = torch.sigmoid(a) * 2       # ... sigmoid, mul join it
        s = torch.sort(b).values       # sort: "no converter" splits the graph
        cache.index_copy_(0, torch.tensor([0]), s[:1])     # a side effect: never taken
        return torch.tanh(s) - 1       # tanh, sub: a second set


def test_maximal_connected_sets_without_unsupported_or_side_effects():
    ep = torch.export.export(_Toy(), (torch.randn(2, 4), torch.zeros(3, 4)), strict=False)
    unsupported = {"aten::sort", "aten::slice.Tensor"}

    def supported(node):
        return node.target.name() not in unsupported if hasattr(node.target, "name") else True

    groups, left = dense_subgraphs(ep.graph, supported)
    names = [sorted(n.target.name() for n in g if hasattr(n.target, "name")) for g in groups]
    assert ["aten::add.Tensor", "aten::mul.Tensor", "aten::relu", "aten::sigmoid"] in names
    assert ["aten::sub.Tensor", "aten::tanh"] in names
    assert left.get("aten::index_copy_") == 1 and left.get("aten::sort") == 1
    rep = subgraph_report(ep.graph, supported, min_block_size=3)
    assert [g["nodes"] for g in rep["subgraphs"]] == [4]
    assert rep["small_sets"] == len(groups) - 1 and rep["nodes_in_subgraphs"] == 4
