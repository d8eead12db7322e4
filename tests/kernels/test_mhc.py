"""mHC kernels (hc_pre, hc_post, hc_head and the merged hc_post_pre / hc_post_head) against their
references.

On a machine without CUDA the launchers run the Triton kernels in Triton's CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1). The kernels sum in another order than torch (the
projection by a pairwise tree over D, the Sinkhorn sums as tile reductions), so results agree to
rounding: ~1e-12 relative in fp64, ~1e-5 in fp32, and NaN never passes (assert_close).
Shapes are small and irregular (odd T, D not a multiple of the d-block, m = 4 and m = 3) to keep
the interpreter fast and every mask exercised.
"""
import pytest
import torch

from dspark_compile.kernels import mhc
from dspark_compile.kernels.registry import KERNELS

EPS, NORM_EPS, ITERS = 1e-6, 1e-6, 20
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}
SHAPES = [(7, 4, 40), (1, 4, 64), (5, 3, 33)]      # (T, m, D): odd T, batch 1, another m
OPS = ("hc_pre", "hc_post", "hc_head", "hc_post_pre", "hc_post_head")


def _inputs(T, m, D, dtype, seed=0, head=False):
    """Weights as dspark_compile/factory/synth.py draws them (μ of order 0.5, scales near 1), a stream X, a layer
    output y and a (post, comb) pair from a real hc_pre; row 0 is all zeros (a padded row of a
    bucket holds whatever its trash row holds; zeros are the degenerate case of the rms)."""
    g = torch.Generator().manual_seed(seed)
    mix = m if head else (2 + m) * m
    fn = torch.randn(mix, m * D, generator=g) * (0.5 / (m * D) ** 0.5)
    scale = 1 + 0.1 * torch.randn(1 if head else 3, generator=g)
    base = torch.randn(mix, generator=g)
    X = torch.randn(T, m, D, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(T, D, generator=g, dtype=torch.float64).to(dtype)
    if T:
        X[0], y[0] = 0.0, 0.0
    pfn = torch.randn((2 + m) * m, m * D, generator=g) * (0.5 / (m * D) ** 0.5)
    _, post, comb = mhc.hc_pre_reference(X, pfn, torch.ones(3), torch.randn((2 + m) * m,
                                                                            generator=g),
                                         EPS, NORM_EPS, ITERS)
    return dict(y=y, X=X, post=post, comb=comb, fn=fn, scale=scale, base=base)


def _call(fn, a, op):
    """Call a reference or launcher of `op` with the arguments it takes from `a`."""
    w = (a["fn"], a["scale"], a["base"], EPS, NORM_EPS)
    p = (a["y"], a["X"], a["post"], a["comb"])
    return {"hc_pre": lambda: fn(a["X"], *w, ITERS), "hc_head": lambda: fn(a["X"], *w),
            "hc_post": lambda: fn(*p), "hc_post_pre": lambda: fn(*p, *w, ITERS),
            "hc_post_head": lambda: fn(*p, *w)}[op]()


def _launcher(op):
    return getattr(mhc, f"{op}_launch")


def _assert_outputs(got, ref, tol):
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"output {i}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,m,D", SHAPES)
def test_kernels_match_references(T, m, D, dtype):
    for op in OPS:
        a = _inputs(T, m, D, dtype, seed=T + D, head=op.endswith("head"))
        _assert_outputs(_call(_launcher(op), a, op), _call(KERNELS[op].reference, a, op),
                        TOL[dtype])


# the tilings below run in the interpreter on CPU tensors; on a GPU machine the batch-invariance
# test (tests/kernels/test_batch_invariance.py, 1 to 400 rows across the tile switch at 64) and
# test_gpu_flash_shapes cover the compiled kernels
INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="interpreter tilings on CPU tensors (GPU: see above)")


@INTERPRETED
@pytest.mark.parametrize("tiles", [dict(block_t=2, block_d=16), dict(block_t=4, block_d=8),
                                   dict(block_t=8, block_d=32), dict(block_t=1, block_d=64)])
def test_gpu_tilings_interpreted(tiles):
    """Row tiles with masked rows (T = 5 over tiles of 1, 2, 4, 8), d-blocks with a partial last
    one (D = 40), several d-blocks summed by the gates kernel's tree."""
    for op in ("hc_pre", "hc_post", "hc_post_pre", "hc_post_head"):
        a = _inputs(5, 4, 40, torch.float64, seed=3, head=op.endswith("head"))
        _assert_outputs(_call(lambda *x: _launcher(op)(*x, tiles=tiles), a, op),
                        _call(KERNELS[op].reference, a, op), TOL[torch.float64])


@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tiling_gives_the_same_bits(dtype):
    """Batch invariance by construction: a row's sums follow one tree over D, whatever the rows
    per tile, the d-block width (1 to 64 columns; D = 40 pads to 64) and the rows beside it, so
    every output is bit-equal across tilings, and a row alone equals the same row in a batch."""
    for op in ("hc_pre", "hc_post_pre", "hc_post_head"):
        a = _inputs(7, 4, 40, dtype, seed=11, head=op.endswith("head"))
        want = _call(_launcher(op), a, op)
        for tiles in (dict(block_t=1, block_d=1), dict(block_t=2, block_d=8),
                      dict(block_t=4, block_d=16), dict(block_t=8, block_d=64)):
            got = _call(lambda *x: _launcher(op)(*x, tiles=tiles), a, op)
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), (op, tiles, i)
        row = {k: (v[3:4] if k in ("y", "X", "post", "comb") else v) for k, v in a.items()}
        alone = _call(lambda *x: _launcher(op)(*x, tiles=dict(block_t=1, block_d=4)), row, op)
        for i, (g, w) in enumerate(zip(alone, want)):
            assert torch.equal(g[0], w[3]), (op, "alone", i)


def test_tiles_must_be_powers_of_two():
    a = _inputs(3, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="powers of two"):
        mhc.hc_pre_launch(a["X"], a["fn"], a["scale"], a["base"], EPS, NORM_EPS, ITERS,
                          tiles=dict(block_t=2, block_d=12))


def test_bf16_stream_rounds_like_the_reference():
    """bf16 X and y: X' and a are rounded to bf16 (round to nearest even, emulated in the
    interpreter); the compute in fp32 may move a value by one bf16 ulp at a rounding tie."""
    a = _inputs(6, 4, 48, torch.bfloat16, seed=5)
    got = mhc.hc_post_pre_launch(a["y"], a["X"], a["post"], a["comb"], a["fn"], a["scale"],
                                 a["base"], EPS, NORM_EPS, ITERS)
    ref = mhc.hc_post_pre_reference(a["y"], a["X"], a["post"], a["comb"], a["fn"], a["scale"],
                                    a["base"], EPS, NORM_EPS, ITERS)
    _assert_outputs(got[:2], ref[:2], dict(rtol=8e-3, atol=1e-2))     # one bf16 ulp
    assert (got[0] == ref[0]).float().mean() > 0.99                   # flips are rare
    _assert_outputs(got[2:], ref[2:], TOL[torch.float32])             # post, comb: fp32


def test_large_and_degenerate_rows_stay_finite():
    a = _inputs(4, 4, 40, torch.float32, seed=9)
    a["X"][1] *= 1e4
    a["X"][2] = 1e-30                        # rms at the eps floor
    for op in ("hc_pre", "hc_post_pre"):
        got = _call(_launcher(op), a, op)
        assert all(bool(torch.isfinite(o).all()) for o in got)
        _assert_outputs(got, _call(KERNELS[op].reference, a, op), dict(rtol=1e-5, atol=1e-2))


def test_empty_batch_launches_nothing():
    """T = 0 (which the references cannot reshape): empty outputs of the op's shapes."""
    T, m, D = 0, 4, 16
    shapes = {"hc_pre": [(T, D), (T, m), (T, m, m)], "hc_head": [(T, D)], "hc_post": [(T, m, D)],
              "hc_post_pre": [(T, m, D), (T, D), (T, m), (T, m, m)],
              "hc_post_head": [(T, m, D), (T, D)]}
    for op in OPS:
        out = _call(_launcher(op), _inputs(T, m, D, torch.float32, head=op.endswith("head")), op)
        out = out if isinstance(out, tuple) else (out,)
        assert [tuple(o.shape) for o in out] == shapes[op], op


@pytest.mark.parametrize("op", OPS)
def test_registered_op_on_cpu_is_reference(op):
    a = _inputs(5, 4, 32, torch.float64, seed=1, head=op.endswith("head"))
    got = _call(getattr(torch.ops.dspark, op), a, op)
    ref = _call(KERNELS[op].reference, a, op)
    _assert_outputs(got, ref, dict(rtol=0, atol=0))


def test_bad_inputs_name_the_argument():
    a = _inputs(3, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="fn must be"):
        mhc.hc_pre_launch(a["X"], a["fn"][:, :8], a["scale"], a["base"], EPS, NORM_EPS, ITERS)
    with pytest.raises(ValueError, match="y must be"):
        mhc.hc_post_launch(a["y"].double(), a["X"], a["post"], a["comb"])
    with pytest.raises(ValueError, match="X must be"):
        mhc.hc_post_launch(a["y"], a["X"][0], a["post"], a["comb"])
    with pytest.raises(ValueError, match="iters"):
        mhc.hc_pre_launch(a["X"], a["fn"], a["scale"], a["base"], EPS, NORM_EPS, 0)


# ------------------------------------------------------------------------------------------------
# GPU (H200): compiled kernels at Flash dims
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T", [6, 384])
def test_gpu_flash_shapes(T):
    for dtype, tol in ((torch.float32, TOL[torch.float32]),
                       (torch.float64, TOL[torch.float64]),
                       (torch.bfloat16, dict(rtol=8e-3, atol=1e-2))):
        for op in OPS:
            a = _inputs(T, 4, 4096, dtype, seed=T, head=op.endswith("head"))
            got = _call(getattr(torch.ops.dspark, op), {k: v.cuda() for k, v in a.items()}, op)
            got = tuple(o.cpu() for o in (got if isinstance(got, tuple) else (got,)))
            _assert_outputs(got, _call(KERNELS[op].reference, a, op), tol)
