"""mHC (manifold-constrained hyper-connections, docs/model.md "mHC"): references, Triton kernels,
`dspark::` ops.

The residual stream X is [T, m, D] (m = hc_mult copies of the hidden state). Per call site:

- `hc_pre_reference(X, fn, scale, base, ...)`: ρ = rsqrt(mean(x̂²) + norm_eps) over the m·D row
  x̂, μ = (x̂ @ fnᵀ) · ρ with fn [(2+m)m, mD]; pre = sigmoid(·) + eps, post = 2 sigmoid(·), the
  m × m mixing matrix C from a softmax and `iters` Sinkhorn passes; returns (a = Σ_i pre_i X_i
  in X's dtype, post, C) in the compute dtype;
- `hc_post_reference(y, X, post, comb)`: X'_j = post_j y + Σ_i C[i, j] X_i, in X's dtype;
- `hc_head_reference(X, fn, scale, base, ...)`: fn [m, mD], g = sigmoid(μ · scale + base) + eps,
  h = Σ_i g_i X_i (the HC head before the final norm; no Sinkhorn);
- `hc_post_pre_reference`, `hc_post_head_reference`: one site's post followed by the next site's
  pre (or the head) on X', exactly the two references in a row; returns (X', *pre outputs). The
  models never call these: passes/fuse_mhc.py merges a fused post with the pre or head its X'
  feeds.

Compute dtype: fp32 for 16-bit and fp32 X, fp64 for fp64 X (kernels/common.py `upcast`).

Bytes per row at Flash dims (D = 4096, m = 4, bf16 X): pre reads X 32 KB and writes a 8 KB and
post + C 80 B; post reads y 8 KB and X 32 KB and writes X' 32 KB; post_pre reads y and X (40 KB),
writes X' (32 KB), reads X' back from L2 for the weighted sum and writes a (8 KB) — the eager
graph materialises X' in fp32 and every Sinkhorn intermediate instead. fn is 1.5 MB per site
(fp32 [24, 16384]); every row tile reads it, from L2 after the first.

Kernels, two launches per op with a projection:
1. `_hc_mix_kernel`, grid (row tiles of BLOCK_T, d-blocks of BLOCK_D): program (tile, db) takes
   d-block db of all m streams; POST computes X' there (rounded to X's dtype, stored), PROJ
   forms the block's products x·fn and x² (the m streams added in stream order, elementwise; no
   tl.dot, which would round fn to bf16 / tf32 on tensor cores, and this works for fp64), sums
   them over the block's BLOCK_D columns by the pairwise tree below and stores one partial per
   row and d-block in a [T, ·, d-blocks] workspace.
2. `_hc_gates_kernel`, one program per row: sums the row's d-block partials by the same tree,
   the gates, the softmax + Sinkhorn on an m × m tile, then Σ_i gate_i X_i.
hc_post alone is launch 1 with POST only.

Batch invariance by construction: μ and Σx² of a row are sums over the columns d of D (each
term the m streams added in order), taken as ONE fixed binary tree: adjacent pairs (2i, 2i + 1)
first, then adjacent pairs of those, ..., over D padded with zeros to a power of two. A d-block
of a power-of-two width is a subtree of it, and the gates sum the blocks' partials by its upper
levels, so every tiling (rows per tile, d-block width) and every batch gives a row the same
bits; the plan picks the fastest tiling for each T (`_tiles`) and the interpreter's one-block
tiling equals the GPU's (test_mhc.py::test_every_tiling_gives_the_same_bits).
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.common import row_matmul, simd_pointwise, upcast
from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.region import fusable
from dspark_compile.kernels.tl_helpers import (
    compile_config, interpreting, launch, next_pow2, round_to)


# ----------------------------------------------------------------------------------------------
# References (the models call these; the numerics are defined here)
# ----------------------------------------------------------------------------------------------

def _mix(X: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """μ = (x̂ @ fnᵀ) · rsqrt(mean(x̂²) + norm_eps), x̂ = X [T, m, D] flattened, compute dtype."""
    xf = upcast(X.flatten(1))
    rho = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    return row_matmul(xf, fn.to(xf.dtype).T) * rho


def _sigmoid_ref(x: torch.Tensor) -> torch.Tensor:
    """sigmoid in fp64, rounded back, through the CPU's vector path only (`simd_pointwise`):
    on [T, m] gates a row's bits would otherwise depend on T."""
    return simd_pointwise(torch.sigmoid, x.double()).to(x.dtype)


def _sinkhorn(c: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """softmax over j + eps, a column pass, then `iters - 1` (row, column) passes."""
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


@fusable("hc_pre")
def hc_pre_reference(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                     eps: float, norm_eps: float, iters: int):
    """X [T, m, D], fn [(2+m)m, mD], scale [3], base [(2+m)m] ->
    (a [T, D] in X.dtype, post [T, m], comb [T, m, m]) in the compute dtype."""
    m = X.shape[1]
    mu = _mix(X, fn, norm_eps)                                                    # [T, (2+m)m]
    pre = _sigmoid_ref(mu[:, :m] * scale[0] + base[:m]) + eps
    post = 2.0 * _sigmoid_ref(mu[:, m:2 * m] * scale[1] + base[m:2 * m])
    c = _sinkhorn((mu[:, 2 * m:] * scale[2] + base[2 * m:]).view(-1, m, m), eps, iters)
    a = (pre.unsqueeze(-1) * upcast(X)).sum(1)
    return a.to(X.dtype), post, c


@fusable("hc_post")
def hc_post_reference(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor,
                      comb: torch.Tensor) -> torch.Tensor:
    """y [T, D], X [T, m, D] -> X'_j = post_j y + Σ_i comb[i, j] X_i (compute dtype), X.dtype."""
    mixed = torch.einsum("tij,tid->tjd", comb.to(upcast(X).dtype), upcast(X))
    return (post.unsqueeze(-1) * upcast(y).unsqueeze(1) + mixed).to(X.dtype)


@fusable("hc_head")
def hc_head_reference(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                      eps: float, norm_eps: float) -> torch.Tensor:
    """X [T, m, D], fn [m, mD], scale [1], base [m] -> h = Σ_i g_i X_i [T, D] in X.dtype."""
    g = _sigmoid_ref(_mix(X, fn, norm_eps) * scale[0] + base) + eps
    return (g.unsqueeze(-1) * upcast(X)).sum(1).to(X.dtype)


@fusable("hc_post_pre")
def hc_post_pre_reference(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor,
                          comb: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                          base: torch.Tensor, eps: float, norm_eps: float, iters: int):
    """(X', a, post', comb') = (hc_post(y, X, post, comb), *hc_pre(X', fn, scale, base, ...))."""
    Xn = hc_post_reference(y, X, post, comb)
    return (Xn,) + hc_pre_reference(Xn, fn, scale, base, eps, norm_eps, iters)


@fusable("hc_post_head")
def hc_post_head_reference(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor,
                           comb: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                           base: torch.Tensor, eps: float, norm_eps: float):
    """(X', h) = (hc_post(y, X, post, comb), hc_head(X', fn, scale, base, ...))."""
    Xn = hc_post_reference(y, X, post, comb)
    return Xn, hc_head_reference(Xn, fn, scale, base, eps, norm_eps)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

@triton.jit
def _round(x, dt: tl.constexpr, SOFT: tl.constexpr):
    """x (compute dtype) rounded to dt and back: the reference's `.to(X.dtype)`."""
    if dt == tl.float64:
        return x
    else:
        return round_to(x, dt, SOFT)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _halve(x, ROWS: tl.constexpr, N: tl.constexpr):
    """[ROWS, N] -> [ROWS, N / 2]: columns 2i and 2i + 1 added (one add: the same bits
    whichever thread does it)."""
    a, b = tl.split(tl.reshape(x, [ROWS, N // 2, 2]))
    return a + b


@triton.jit
def _tree_sum(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """Sum of each row of x [ROWS, N = 2^LOG_N] by the adjacent-pairs tree (module docstring)."""
    for i in tl.static_range(LOG_N):
        x = _halve(x, ROWS, N >> i)
    return tl.reshape(x, [ROWS])


@triton.jit
def _hc_mix_kernel(y_ptr, x_ptr, post_ptr, comb_ptr, xn_ptr, fn_ptr, mu_ptr, ss_ptr, T, D, NDB,
                   stride_yt, stride_xt, stride_nt, M: tl.constexpr, MIX: tl.constexpr,
                   MIX_P2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                   LOG_D: tl.constexpr, POST: tl.constexpr, PROJ: tl.constexpr,
                   SOFT: tl.constexpr):
    db = tl.program_id(1)
    cdt = mu_ptr.dtype.element_ty                  # the workspace holds the compute dtype
    dt = x_ptr.dtype.element_ty
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = t < T
    r = tl.arange(0, MIX_P2)
    mu = tl.zeros((BLOCK_T, MIX_P2, BLOCK_D), dtype=cdt)
    ss = tl.zeros((BLOCK_T, BLOCK_D), dtype=cdt)
    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    m2 = tm[:, None] & (d < D)[None, :]
    if POST:
        y = tl.load(y_ptr + t[:, None] * stride_yt + d[None, :], mask=m2, other=0.0).to(cdt)
    for j in tl.static_range(M):
        if POST:
            mixed = tl.zeros((BLOCK_T, BLOCK_D), dtype=cdt)
            for i in tl.static_range(M):
                c = tl.load(comb_ptr + t * (M * M) + (i * M + j), mask=tm, other=0.0)
                xi = tl.load(x_ptr + t[:, None] * stride_xt + i * D + d[None, :], mask=m2,
                             other=0.0)
                mixed += c.to(cdt)[:, None] * xi.to(cdt)
            p = tl.load(post_ptr + t * M + j, mask=tm, other=0.0).to(cdt)
            xj = _round(p[:, None] * y + mixed, dt, SOFT)
            tl.store(xn_ptr + t[:, None] * stride_nt + j * D + d[None, :], xj.to(dt), mask=m2)
        else:
            xj = tl.load(x_ptr + t[:, None] * stride_xt + j * D + d[None, :], mask=m2,
                         other=0.0).to(cdt)
        if PROJ:
            ss += xj * xj
            f = tl.load(fn_ptr + r[:, None] * (M * D) + j * D + d[None, :],
                        mask=(r < MIX)[:, None] & (d < D)[None, :], other=0.0).to(cdt)
            mu += xj[:, None, :] * f[None, :, :]
    if PROJ:       # workspace mu [T, MIX_P2, NDB], ss [T, NDB]: this block's subtree sums
        mu = tl.reshape(_tree_sum(tl.reshape(mu, [BLOCK_T * MIX_P2, BLOCK_D]),
                                  BLOCK_T * MIX_P2, BLOCK_D, LOG_D), [BLOCK_T, MIX_P2])
        tl.store(mu_ptr + (t[:, None] * MIX_P2 + r[None, :]) * NDB + db, mu, mask=tm[:, None])
        tl.store(ss_ptr + t * NDB + db, _tree_sum(ss, BLOCK_T, BLOCK_D, LOG_D), mask=tm)


@triton.jit
def _reduce_blocks(mu_ptr, ss_ptr, t, NDB, MIX_P2: tl.constexpr, NDB_P2: tl.constexpr,
                   LOG_NDB: tl.constexpr):
    """Sum row t's d-block partials by the tree's upper levels (blocks past NDB are the zero
    padding) into the first MIX_P2 slots of the row's workspace, which the gates then read
    with their own index patterns; returns Σx². All partials come in one load: 256 partials
    summed in 8 dependent loads of 32 took 10.9 µs a gates call at T = 6 (H200)."""
    r = tl.arange(0, MIX_P2)
    b = tl.arange(0, NDB_P2)
    rows = mu_ptr + t * (MIX_P2 * NDB)
    mu = tl.load(rows + r[:, None] * NDB + b[None, :], mask=(b < NDB)[None, :], other=0.0)
    mu = _tree_sum(mu, MIX_P2, NDB_P2, LOG_NDB)
    ss = _tree_sum(tl.reshape(tl.load(ss_ptr + t * NDB + b, mask=b < NDB, other=0.0),
                              [1, NDB_P2]), 1, NDB_P2, LOG_NDB)
    tl.debug_barrier()       # every thread has read the row's partials before they are overwritten
    tl.store(rows + r, mu)
    tl.debug_barrier()       # and the sums are visible to every thread of the program
    return tl.sum(ss, axis=0)


@triton.jit
def _mu_at(mu_ptr, t, idx, mask, ROW: tl.constexpr, NDB):
    """The reduced μ of row t (the first MIX_P2 slots of its [MIX_P2, NDB] workspace)."""
    return tl.load(mu_ptr + t * (ROW * NDB) + idx, mask=mask, other=0.0)


@triton.jit
def _sinkhorn_tile(c, i, M: tl.constexpr, eps, ITERS):
    """c [M_P2, M_P2] logits (rows i, columns j; padding beyond M) -> the reference's C, 0 in the
    padding (padded rows and columns stay 0: 0 / (0 + eps))."""
    valid = (i < M)[:, None] & (i < M)[None, :]
    z = tl.where((i < M)[None, :], c, float("-inf"))       # padded rows stay finite (logits 0)
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    c = tl.where(valid, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)
    c = c / (tl.sum(c, axis=0)[None, :] + eps)
    for _ in range(1, ITERS):
        c = c / (tl.sum(c, axis=1)[:, None] + eps)
        c = c / (tl.sum(c, axis=0)[None, :] + eps)
    return c


@triton.jit
def _hc_gates_kernel(mu_ptr, ss_ptr, x_ptr, scale_ptr, base_ptr, a_ptr, post_ptr, comb_ptr, T, D,
                     NDB, ITERS, stride_xt, stride_at, eps_hi, eps_lo, neps_hi, neps_lo,
                     M: tl.constexpr, M_P2: tl.constexpr, MIX_P2: tl.constexpr,
                     NDB_P2: tl.constexpr, LOG_NDB: tl.constexpr, BLOCK_D: tl.constexpr,
                     PRE: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cdt = mu_ptr.dtype.element_ty
    dt = x_ptr.dtype.element_ty
    # the eps constants as hi + lo fp32 pairs: exact to ~2^-48 in fp64, the fp32 value in fp32
    eps = tl.cast(eps_hi, cdt) + tl.cast(eps_lo, cdt)
    norm_eps = tl.cast(neps_hi, cdt) + tl.cast(neps_lo, cdt)
    ss = _reduce_blocks(mu_ptr, ss_ptr, t, NDB, MIX_P2, NDB_P2, LOG_NDB)
    rho = 1.0 / tl.sqrt(ss / (M * D) + norm_eps)
    i = tl.arange(0, M_P2)
    im = i < M
    b = tl.load(base_ptr + i, mask=im, other=0.0).to(cdt)
    g = _mu_at(mu_ptr, t, i, im, MIX_P2, NDB) * rho * tl.load(scale_ptr).to(cdt) + b
    g = tl.where(im, _sigmoid(g) + eps, 0.0)
    if PRE:
        b = tl.load(base_ptr + M + i, mask=im, other=0.0).to(cdt)
        p = _mu_at(mu_ptr, t, M + i, im, MIX_P2, NDB) * rho * tl.load(scale_ptr + 1).to(cdt)
        tl.store(post_ptr + t * M + i, 2.0 * _sigmoid(p + b), mask=im)
        valid = im[:, None] & im[None, :]
        k = 2 * M + i[:, None] * M + i[None, :]
        c = _mu_at(mu_ptr, t, k, valid, MIX_P2, NDB) * rho * tl.load(scale_ptr + 2).to(cdt)
        c = _sinkhorn_tile(c + tl.load(base_ptr + k, mask=valid, other=0.0).to(cdt), i, M, eps,
                           ITERS)
        tl.store(comb_ptr + t * (M * M) + i[:, None] * M + i[None, :], c, mask=valid)
    for d0 in range(0, D, BLOCK_D):                          # a = Σ_i g_i X_i
        d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + t * stride_xt + i[:, None] * D + d[None, :],
                    mask=im[:, None] & (d < D)[None, :], other=0.0).to(cdt)
        a = _round(tl.sum(g[:, None] * x, axis=0), dt, SOFT)
        tl.store(a_ptr + t * stride_at + d, a.to(dt), mask=d < D)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# GPU tiles (BLOCK_T, BLOCK_D) of the mix kernel, by rows: [BLOCK_T, MIX_P2 = 32, BLOCK_D] = 8192
# accumulators. Few rows want wide d-blocks (each program reads fn's columns once); many rows
# want tall tiles, as every row tile reads all of fn (1.5 MB per site) from L2. H200, post_pre
# (mix + gates) at Flash dims, one d-block a program, 2026-12-06: T = 6: (4, 64) 18.2 µs,
# (2, 128) 18.3, (16, 16) 19.2, (8, 16) 31.3; T = 96: (4, 64) 36.9, (2, 128) 38.8, (16, 16) 44.3;
# T = 384 (an earlier kernel, 2026-12-01): (4, 64) 400 vs (16, 16) 259. Any tiling gives a row
# the same bits (module docstring), so the table follows T.
GPU_TILES = ((128, (4, 64)), (None, (16, 16)))      # (up to T rows, tile)
# the gates load a row's d-block partials at once: [MIX_P2, blocks] <= 32 x 256 values, 64
# registers a thread at 4 warps; wider d-blocks where D would need more blocks
MAX_BLOCKS = 256
GATES_BLOCK_D = 1024
MIX_WARPS, GATES_WARPS = 8, 4   # 8: the accumulators take 32 registers per thread, not 64


def _compute_dtype(X: torch.Tensor) -> torch.dtype:
    return upcast(X).dtype


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _split_eps(x: float) -> tuple[float, float]:
    """x = hi + lo with hi, lo fp32: Triton passes float arguments as fp32 (see the kernel)."""
    hi = _fp32(x)
    return hi, _fp32(x - hi)


def _stream(X: torch.Tensor, name: str = "X") -> torch.Tensor:
    """X [T, m, D] of a float dtype, each row's [m, D] contiguous (the kernels index j D + d)."""
    if X.dim() != 3 or X.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a float [T, m, D] tensor, got {X.dtype} "
                         f"{tuple(X.shape)}")
    T, m, D = X.shape
    if X.stride(2) != 1 or X.stride(1) != D:
        X = X.contiguous()
    return X


def _check_weights(X, fn, scale, base, mix: int, n_scale: int) -> None:
    T, m, D = X.shape
    want = {"fn": (fn, (mix, m * D)), "scale": (scale, (n_scale,)), "base": (base, (mix,))}
    for name, (w, shape) in want.items():
        if tuple(w.shape) != shape or not w.dtype.is_floating_point:
            raise ValueError(f"{name} must be a float {list(shape)} tensor (m = {m}, D = {D}), "
                             f"got {w.dtype} {tuple(w.shape)}")


def _check_post(y, X, post, comb) -> None:
    T, m, D = X.shape
    if tuple(y.shape) != (T, D) or y.dtype != X.dtype:
        raise ValueError(f"y must be {X.dtype} [{T}, {D}] like X, got {y.dtype} {tuple(y.shape)}")
    if tuple(post.shape) != (T, m) or tuple(comb.shape) != (T, m, m):
        raise ValueError(f"post must be [{T}, {m}] and comb [{T}, {m}, {m}], got "
                         f"{tuple(post.shape)} and {tuple(comb.shape)}")


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _tiles(T, D, kernel, block_t=None, block_d=None):
    """(BLOCK_T, BLOCK_D, d-blocks) of the mix kernel: GPU_TILES by T, or the arguments (tests
    run the GPU tilings interpreted). Triton's interpreter pays per operation, not per element:
    there one program takes up to 16 rows and the whole (<= 256) row. Both are powers of two
    (aranges; BLOCK_D a subtree of the sum's tree), BLOCK_D at least next_pow2(D) / MAX_BLOCKS."""
    if interpreting(kernel):
        bt, bd = min(next_pow2(T), 16), min(next_pow2(D), 256)
    else:
        bt, bd = next(tile for rows, tile in GPU_TILES if rows is None or T <= rows)
    bt, bd = block_t or bt, block_d or bd
    if bd < 1 or bt < 1 or bd & (bd - 1) or bt & (bt - 1):
        raise ValueError(f"mHC tiles: block_t and block_d must be powers of two, got "
                         f"block_t={bt}, block_d={bd}")
    bd = max(bd, next_pow2(D) // MAX_BLOCKS)
    return bt, bd, triton.cdiv(D, bd)


def _mix_launch(X, fn, y=None, post=None, comb=None, tiles=None):
    """Launch 1: X' (when y is given) and the workspace partials (when fn is given)."""
    T, m, D = X.shape
    cdt = _compute_dtype(X)
    kernel = _hc_mix_kernel
    bt, bd, n_db = _tiles(T, D, kernel, **(tiles or {}))
    mix = fn.shape[0] if fn is not None else 1
    mu = X.new_empty((T, next_pow2(mix), n_db) if fn is not None else (1,), dtype=cdt)
    ss = X.new_empty((T, n_db) if fn is not None else (1,), dtype=cdt)
    if y is not None:
        xn = torch.empty_like(X, memory_format=torch.contiguous_format)
        y = y if y.stride(-1) == 1 else y.contiguous()
        post, comb = post.contiguous(), comb.contiguous()
    else:                        # no post: X is the stream; unused pointers get X
        xn, y, post, comb = X, X[:, 0], X, X
    launch(kernel)[(triton.cdiv(T, bt), n_db)](
        y, X, post, comb, xn, fn.contiguous() if fn is not None else X, mu, ss, T, D, n_db,
        y.stride(0), X.stride(0), xn.stride(0), M=m, MIX=mix, MIX_P2=next_pow2(mix),
        BLOCK_T=bt, BLOCK_D=bd, LOG_D=_log2(bd), POST=xn is not X, PROJ=fn is not None,
        SOFT=interpreting(kernel), num_warps=MIX_WARPS)
    return xn, mu, ss, n_db


def _gates_launch(Xs, mu, ss, n_db, scale, base, eps, norm_eps, iters, pre: bool):
    """Launch 2 on the stream the projection read (X, or X' of a merged op)."""
    T, m, D = Xs.shape
    cdt = _compute_dtype(Xs)
    a = Xs.new_empty((T, D))
    post = Xs.new_empty((T, m), dtype=cdt) if pre else a
    comb = Xs.new_empty((T, m, m), dtype=cdt) if pre else a
    kernel = _hc_gates_kernel
    interp = interpreting(kernel)
    bd = next_pow2(D) if interp else min(GATES_BLOCK_D, next_pow2(D))
    launch(kernel)[(T,)](
        mu, ss, Xs, scale.contiguous(), base.contiguous(), a, post, comb, T, D, n_db,
        int(iters), Xs.stride(0), a.stride(0), *_split_eps(eps), *_split_eps(norm_eps), M=m,
        M_P2=next_pow2(m), MIX_P2=mu.shape[1], NDB_P2=next_pow2(n_db),
        LOG_NDB=_log2(next_pow2(n_db)), BLOCK_D=bd, PRE=pre, SOFT=interp,
        num_warps=GATES_WARPS)
    return (a, post, comb) if pre else a


def _hc_launch(X, fn, scale, base, eps, norm_eps, iters, pre: bool, post_args=None, tiles=None):
    """The shared launcher: optional post (y, X, post, comb), then the pre (pre=True) or head
    projection and gates on the resulting stream. Returns the op's outputs as a tuple."""
    X = _stream(X)
    m = X.shape[1]
    _check_weights(X, fn, scale, base, (2 + m) * m if pre else m, 3 if pre else 1)
    if pre and iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if post_args is not None:
        y, post, comb = post_args
        _check_post(y, X, post, comb)
    if X.shape[0] == 0:          # nothing to launch: the (empty) outputs the fakes describe
        gated = _gated_fake(X, pre)
        return ((torch.empty_like(X),) if post_args is not None else ()) + gated
    y = post_args[0] if post_args is not None else None
    xn, mu, ss, n_db = _mix_launch(X, fn, y, *(post_args[1:] if post_args else (None, None)),
                                   tiles=tiles)
    gated = _gates_launch(xn, mu, ss, n_db, scale, base, eps, norm_eps, iters, pre)
    gated = gated if isinstance(gated, tuple) else (gated,)
    return ((xn,) if post_args is not None else ()) + gated


def hc_pre_launch(X, fn, scale, base, eps, norm_eps, iters, tiles=None):
    return _hc_launch(X, fn, scale, base, eps, norm_eps, iters, True, tiles=tiles)


def hc_head_launch(X, fn, scale, base, eps, norm_eps, tiles=None):
    return _hc_launch(X, fn, scale, base, eps, norm_eps, 1, False, tiles=tiles)[0]


def hc_post_pre_launch(y, X, post, comb, fn, scale, base, eps, norm_eps, iters, tiles=None):
    return _hc_launch(X, fn, scale, base, eps, norm_eps, iters, True, (y, post, comb), tiles)


def hc_post_head_launch(y, X, post, comb, fn, scale, base, eps, norm_eps, tiles=None):
    return _hc_launch(X, fn, scale, base, eps, norm_eps, 1, False, (y, post, comb), tiles)


def hc_post_launch(y, X, post, comb, tiles=None):
    X = _stream(X)
    _check_post(y, X, post, comb)
    if X.shape[0] == 0:
        return torch.empty_like(X)
    return _mix_launch(X, None, y, post, comb, tiles)[0]


# ----------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------

def _gated_fake(X, pre: bool) -> tuple:
    """(a, post, comb) of a pre, (h,) of a head, for X [T, m, D]."""
    T, m, D = X.shape
    a = X.new_empty((T, D))
    if not pre:
        return (a,)
    cdt = _compute_dtype(X)
    return a, X.new_empty((T, m), dtype=cdt), X.new_empty((T, m, m), dtype=cdt)


def _new_stream(X):
    return torch.empty_like(X, memory_format=torch.contiguous_format)


def _pre_fake(X, fn, scale, base, eps, norm_eps, iters):
    return _gated_fake(X, True)


def _head_fake(X, fn, scale, base, eps, norm_eps):
    return _gated_fake(X, False)[0]


def _post_fake(y, X, post, comb):
    return _new_stream(X)


def _post_pre_fake(y, X, post, comb, fn, scale, base, eps, norm_eps, iters):
    return (_new_stream(X),) + _gated_fake(X, True)


def _post_head_fake(y, X, post, comb, fn, scale, base, eps, norm_eps):
    return _new_stream(X), _gated_fake(X, False)[0]


@dspark_op("hc_pre", reference=hc_pre_reference, fake=_pre_fake)
def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           eps: float, norm_eps: float,
           iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_pre_launch(X, fn, scale, base, eps, norm_eps, iters)


@dspark_op("hc_post", reference=hc_post_reference, fake=_post_fake)
def hc_post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    return hc_post_launch(y, X, post, comb)


@dspark_op("hc_head", reference=hc_head_reference, fake=_head_fake)
def hc_head(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            eps: float, norm_eps: float) -> torch.Tensor:
    return hc_head_launch(X, fn, scale, base, eps, norm_eps)


@dspark_op("hc_post_pre", reference=hc_post_pre_reference, fake=_post_pre_fake)
def hc_post_pre(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
                norm_eps: float,
                iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_post_pre_launch(y, X, post, comb, fn, scale, base, eps, norm_eps, iters)


@dspark_op("hc_post_head", reference=hc_post_head_reference, fake=_post_head_fake)
def hc_post_head(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
                 norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return hc_post_head_launch(y, X, post, comb, fn, scale, base, eps, norm_eps)


# SM12x readiness: the GPU tiling at Flash dims (bf16 X, fp32 compute, m = 4), per op the mix
# kernel's (POST, PROJ, MIX) and the gates kernel's PRE.
_D16 = "i32:16"    # D, row strides: multiples of 16 at Flash dims, as the JIT specialises them
_MIX_TYPES = dict(y_ptr="*bf16", x_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32",
                  xn_ptr="*bf16", fn_ptr="*fp32", mu_ptr="*fp32", ss_ptr="*fp32", T="i32",
                  D=_D16, NDB="i32", stride_yt=_D16, stride_xt=_D16, stride_nt=_D16)
_GATES_TYPES = dict(mu_ptr="*fp32", ss_ptr="*fp32", x_ptr="*bf16", scale_ptr="*fp32",
                    base_ptr="*fp32", a_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", T="i32",
                    D=_D16, NDB="i32", ITERS="i32", stride_xt=_D16, stride_at=_D16,
                    eps_hi="fp32", eps_lo="fp32", neps_hi="fp32", neps_lo="fp32")
_M, _D = 4, 4096


def _mix_config(post: bool, mix: int):
    return [compile_config(_hc_mix_kernel, _MIX_TYPES, dict(
        M=_M, MIX=mix, MIX_P2=next_pow2(mix), BLOCK_T=bt, BLOCK_D=bd, LOG_D=_log2(bd),
        POST=post, PROJ=mix > 1, SOFT=False), MIX_WARPS) for _, (bt, bd) in GPU_TILES]


def _gates_config(pre: bool):
    mix = (2 + _M) * _M if pre else _M
    blocks = sorted({next_pow2(triton.cdiv(_D, bd)) for _, (_, bd) in GPU_TILES})
    return [compile_config(_hc_gates_kernel, _GATES_TYPES, dict(
        M=_M, M_P2=_M, MIX_P2=next_pow2(mix), NDB_P2=n, LOG_NDB=_log2(n),
        BLOCK_D=GATES_BLOCK_D, PRE=pre, SOFT=False), GATES_WARPS) for n in blocks]


_PRE_MIX, _HEAD_MIX = (2 + _M) * _M, _M
add_compile_configs("hc_pre", _mix_config(False, _PRE_MIX) + _gates_config(True))
add_compile_configs("hc_post", _mix_config(True, 1))
add_compile_configs("hc_head", _mix_config(False, _HEAD_MIX) + _gates_config(False))
add_compile_configs("hc_post_pre", _mix_config(True, _PRE_MIX))          # + hc_pre's gates
add_compile_configs("hc_post_head", _mix_config(True, _HEAD_MIX))        # + hc_head's gates
