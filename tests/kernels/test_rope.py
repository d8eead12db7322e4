"""`dspark::rope` (kernels/rope.py) against its reference.

Without CUDA the launcher runs the Triton kernel in the CPU interpreter (tests/conftest.py).
What must hold, on fresh random inputs at irregular shapes, both directions:
- the nope columns are the input's bytes, unchanged (the reference's cat copies them);
- the rotated columns: identical in fp32 up to FMA contraction on a GPU (exact in the
  interpreter), within one ulp of the rounded pair in bf16;
- NaN / inf in x propagate as in the reference; negative positions index from the end;
- the op exports as one node and its CPU dispatch is the reference, bit for bit.
"""
import pytest
import torch

from dspark_compile.kernels import rope as rk
from batch_cases import cos_sin

# the launcher on the GPU where there is one, else the kernel in the interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"
MAX_POS = 97
SHAPES = [(1, 1, 64, 64), (7, 3, 192, 64), (13, 5, 128, 64), (6, 64, 512, 64), (5, 4, 96, 32)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _inputs(T, H, D, R, dtype, seed):
    g = _gen(seed)
    x = (torch.randn(T, H, D, generator=g) * 3).to(dtype)
    pos = torch.randint(0, MAX_POS, (T,), generator=g)
    return x, pos, cos_sin(R, MAX_POS)


def _u8(t):
    return t.contiguous().view(torch.uint8)


def _assert_close(y, ref, x, R):
    """Nope columns bit-equal; rotated ones within one ulp of |even| + |odd| of the pair that
    went in (e cos - o sin can cancel to ~0 while its rounding error is an ulp of the inputs)."""
    D = x.shape[-1]
    assert torch.equal(_u8(y[..., :D - R]), _u8(x[..., :D - R]))
    assert not torch.isnan(y.float()).any()
    xf = x.float()
    pair = (xf[..., D - R::2].abs() + xf[..., D - R + 1::2].abs()).repeat_interleave(2, -1)
    ulp = 2.0 ** -7 if x.dtype == torch.bfloat16 else 2.0 ** -22
    err = (y[..., D - R:].float() - ref[..., D - R:].float()).abs()
    assert (err <= pair * ulp + 1e-30).all(), err.max()


@pytest.mark.parametrize("T,H,D,R", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_reference(T, H, D, R, dtype, inverse):
    x, pos, cs = _inputs(T, H, D, R, dtype, seed=T * 31 + H + D + int(inverse))
    y = rk.rope_launch(x.to(DEV), cs.to(DEV), pos.to(DEV), R, inverse).cpu()
    ref = rk.rope_reference(x, cs, pos, R, inverse)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    _assert_close(y, ref, x, R)


def test_inverse_undoes_forward_in_fp32():
    x, pos, cs = _inputs(9, 3, 128, 64, torch.float32, seed=5)
    dev = lambda t: t.to(DEV)
    back = rk.rope_launch(rk.rope_launch(dev(x), dev(cs), dev(pos), 64, False), dev(cs), dev(pos),
                          64, True).cpu()
    assert torch.allclose(back, x, rtol=0, atol=1e-5)


def test_head_blocks_and_layouts_agree():
    """Every head block size, a 4-D x and a strided x give the same bytes."""
    x, pos, cs = _inputs(5, 7, 128, 64, torch.bfloat16, seed=9)
    dev = lambda t: t.to(DEV)
    base = rk.rope_launch(dev(x), dev(cs), dev(pos), 64, True).cpu()
    for bh in (1, 2, 4, 8):
        assert torch.equal(rk.rope_launch(dev(x), dev(cs), dev(pos), 64, True, block_h=bh).cpu(),
                           base)
    four = rk.rope_launch(dev(x.view(5, 7, 1, 128)), dev(cs), dev(pos), 64, True).cpu()
    assert torch.equal(four.view(5, 7, 128), base)
    wide = torch.zeros(5, 9, 128, dtype=x.dtype)
    wide[:, 1:8] = x                                   # heads at a stride of 9 * 128
    strided = rk.rope_launch(dev(wide)[:, 1:8], dev(cs), dev(pos), 64, True).cpu()
    assert torch.equal(strided, base)
    int32 = rk.rope_launch(dev(x), dev(cs), dev(pos.int()), 64, True).cpu()
    assert torch.equal(int32, base)


def test_edge_values_propagate_like_the_reference():
    x, pos, cs = _inputs(4, 2, 128, 64, torch.float32, seed=11)
    x[0, 0, 3] = float("nan")                 # nope column: copied
    x[1, 1, 64] = float("nan")                # rope pair (64, 65): both outputs NaN
    x[2, 0, 100] = float("inf")
    x[3, 1, 127] = -float("inf")
    y = rk.rope_launch(x.to(DEV), cs.to(DEV), pos.to(DEV), 64, False).cpu()
    ref = rk.rope_reference(x, cs, pos, 64, False)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isinf(y), torch.isinf(ref))
    assert torch.equal(y[torch.isinf(ref)], ref[torch.isinf(ref)])
    assert torch.allclose(y[fin], ref[fin], rtol=1e-6, atol=1e-6)


def test_negative_positions_index_from_the_end():
    x, pos, cs = _inputs(3, 2, 128, 64, torch.float32, seed=13)
    neg = torch.tensor([-1, -MAX_POS, -5])
    y = rk.rope_launch(x.to(DEV), cs.to(DEV), neg.to(DEV), 64, False).cpu()
    ref = rk.rope_reference(x, cs, neg, 64, False)
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6)


def test_no_tokens():
    x = torch.zeros(0, 4, 128)
    y = rk.rope_launch(x, cos_sin(64, 8), torch.zeros(0, dtype=torch.long), 64, True)
    assert y.shape == (0, 4, 128)


def test_registered_op_on_cpu_is_reference_and_exports():
    x, pos, cs = _inputs(6, 3, 128, 64, torch.bfloat16, seed=17)
    assert torch.equal(torch.ops.dspark.rope(x, cs, pos, 64, True),
                       rk.rope_reference(x, cs, pos, 64, True))

    class M(torch.nn.Module):
        def forward(self, x, cs, pos):
            return torch.ops.dspark.rope(x, cs, pos, 64, True)

    ep = torch.export.export(M(), (x, cs, pos), strict=False)
    assert sum(n.target == torch.ops.dspark.rope.default for n in ep.graph.nodes) == 1
    assert torch.equal(ep.module()(x, cs, pos), M()(x, cs, pos))


def test_bad_inputs_name_the_argument():
    x, pos, cs = _inputs(3, 2, 128, 64, torch.bfloat16, seed=19)
    with pytest.raises(ValueError, match="positions"):
        rk.rope_launch(x, cs, pos[:2], 64, False)
    with pytest.raises(ValueError, match="rope_dim"):
        rk.rope_launch(x, cs, pos, 63, False)
    with pytest.raises(ValueError, match="cos_sin.shape"):
        rk.rope_launch(x, cos_sin(32, MAX_POS), pos, 64, False)
    with pytest.raises(ValueError, match="x must be"):
        rk.rope_launch(x[0, 0], cs, pos, 64, False)
    with pytest.raises(TypeError, match="x must be"):
        rk.rope_launch(x.to(torch.int32), cs, pos, 64, False)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [6, 384])
def test_gpu_flash_dims_in_a_cuda_graph(T):
    """Flash dims (64 heads x 512, rope 64; the indexer's 64 x 128), captured and replayed with
    new positions: equal to the eager launch."""
    x, pos, cs = _inputs(T, 64, 512, 64, torch.bfloat16, seed=T)
    xg, pg, cg = x.cuda(), pos.cuda(), cs.cuda()
    _assert_close(rk.rope_launch(xg, cg, pg, 64, True).cpu(), rk.rope_reference(x, cs, pos, 64, True),
                  x, 64)
    rk.rope_launch(xg, cg, pg, 64, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rk.rope_launch(xg, cg, pg, 64, True)
    pg.copy_(torch.randint(0, MAX_POS, (T,), generator=_gen(T + 1)).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, rk.rope_launch(xg, cg, pg, 64, True))
    xi = x[:, :, :128].contiguous()
    _assert_close(rk.rope_launch(xi.cuda(), cg, pg, 64, False).cpu(),
                  rk.rope_reference(xi, cs, pg.cpu(), 64, False), xi, 64)
