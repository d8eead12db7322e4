"""dspark_compile/program_load.py: a program loaded with memoised type hints is the program
torch loads, and the deserializer is left as it was after the block (also after an error)."""
import pytest
import torch

from dspark_compile.program_load import faster_deserialization


class _Chain(torch.nn.Module):
    def forward(self, x, y):
        for i in range(12):
            x = torch.where(x > 0, x * y, x.sin()) + i
        return x.sum(-1), x[:, :3]


def test_same_program_and_the_deserializer_restored(tmp_path):
    import typing

    from torch._export.serde import serialize
    ep = torch.export.export(_Chain(), (torch.randn(3, 5), torch.randn(5)))
    torch.export.save(ep, str(tmp_path / "p.pt2"))
    plain = torch.export.load(str(tmp_path / "p.pt2"))
    with faster_deserialization():
        assert serialize.typing is not typing
        fast = torch.export.load(str(tmp_path / "p.pt2"))
    assert serialize.typing is typing
    assert str(fast.graph) == str(plain.graph)
    assert fast.graph_signature == plain.graph_signature
    x, y = torch.randn(3, 5), torch.randn(5)
    for a, b in zip(fast.module()(x, y), plain.module()(x, y)):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="boom"):
        with faster_deserialization():
            raise RuntimeError("boom")
    assert serialize.typing is typing
