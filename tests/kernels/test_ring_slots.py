"""`dspark::ring_slots` (kernels/ring_slots.py) against its reference: integer math, so equal.

Without CUDA the launcher runs the Triton kernel in the CPU interpreter (tests/conftest.py).
Cases: the step's rows (T = 6) and a prefill chunk longer than the ring (only the newest `ring`
written positions keep a slot), padded rows, a write mask, negative positions (floor modulo
like torch's `%`), int32 inputs, and no slot named twice.
"""
import pytest
import torch

from dspark_compile.kernels import ring_slots as rs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, T, seed, trash=50):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(trash, generator=g)[:B]
    start = torch.randint(0, 300, (B, 1), generator=g)
    pos = start + torch.arange(T)[None, :]
    valid = torch.rand(B, generator=g) > 0.25
    rows = torch.where(valid, rows, torch.full_like(rows, trash))
    write = torch.rand(B, T, generator=g) > 0.3
    return rows, pos, valid, write


def _run(rows, pos, valid, write, ring):
    dev = lambda t: None if t is None else t.to(DEV)
    return rs.ring_slots_launch(dev(rows), dev(pos), dev(valid), dev(write), ring).cpu()


@pytest.mark.parametrize("B,T,ring", [(1, 6, 128), (7, 6, 8), (16, 6, 4), (3, 64, 8),
                                      (5, 37, 128), (2, 1, 1)])
@pytest.mark.parametrize("with_write", [False, True])
def test_ring_slots_equal_the_reference(B, T, ring, with_write):
    rows, pos, valid, write = _inputs(B, T, seed=B * 100 + T + ring)
    write = write if with_write else None
    got = _run(rows, pos, valid, write, ring)
    ref = rs.ring_slots_reference(rows, pos, valid, write, ring)
    assert got.dtype == torch.int64 and torch.equal(got, ref)
    live = got[got >= 0]
    assert live.unique().numel() == live.numel()          # no slot named twice


def test_negative_positions_and_int32_inputs():
    rows = torch.tensor([3, 0], dtype=torch.int32)
    pos = torch.tensor([[-3, -2, -1], [5, 6, 7]], dtype=torch.int32)
    valid = torch.tensor([True, True])
    got = _run(rows, pos, valid, None, 4)
    assert torch.equal(got, rs.ring_slots_reference(rows.long(), pos.long(), valid, None, 4))
    assert got[:3].tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3]


def test_registered_op_on_cpu_is_reference_and_exports():
    rows, pos, valid, write = _inputs(4, 6, seed=3)
    assert torch.equal(torch.ops.dspark.ring_slots(rows, pos, valid, write, 8),
                       rs.ring_slots_reference(rows, pos, valid, write, 8))

    class M(torch.nn.Module):
        def forward(self, rows, pos, valid, write):
            return torch.ops.dspark.ring_slots(rows, pos, valid, write, 8)

    ep = torch.export.export(M(), (rows, pos, valid, write), strict=False)
    assert sum(n.target == torch.ops.dspark.ring_slots.default for n in ep.graph.nodes) == 1
    assert torch.equal(ep.module()(rows, pos, valid, write), M()(rows, pos, valid, write))


def test_bad_inputs_name_the_argument():
    rows, pos, valid, write = _inputs(3, 6, seed=5)
    with pytest.raises(ValueError, match="rows"):
        rs.ring_slots_launch(rows[:2], pos, valid, None, 8)
    with pytest.raises(ValueError, match="valid"):
        rs.ring_slots_launch(rows, pos, valid.long(), None, 8)
    with pytest.raises(ValueError, match="write"):
        rs.ring_slots_launch(rows, pos, valid, write[:, :2], 8)
    with pytest.raises(ValueError, match="pos"):
        rs.ring_slots_launch(rows, pos.float(), valid, None, 8)
    with pytest.raises(ValueError, match="ring=0"):
        rs.ring_slots_launch(rows, pos, valid, None, 0)
