"""`tl.dot` for Triton's CPU interpreter with one summation order, whatever the CPU, BLAS or shape.

Triton 3.7.1's interpreter computes a `tl.dot` as `np.matmul(a, b)`: an OpenBLAS sgemm whose
summation order follows the micro-kernel the CPU gets (numpy's OpenBLAS is built for many CPUs
and picks one at load) and, within it, the output element's place in the tile (the edge rows
and columns of a tile take other kernels). So the same row of the same data summed
differently at position 0 and at position 7 of a 16-row dot on an AMD EPYC with AVX2
(OpenBLAS's Haswell and Zen kernels; its Prescott and Sandybridge kernels summed both alike),
and a bit comparison across shapes -- a row alone against the row in a batch, one tiling
against another, one fused call against separate calls -- passed or failed with the machine
(issue 50: `test_kernel_is_batch_invariant[markov_sample]`, 2.4e-7 apart).

Here every output element is a function of its own row of `a` and column of `b` alone:

    out[m, n] = round_to_out_dtype(tree_sum_k(float64(a[m, k]) * float64(b[k, n]))) + acc[m, n]

- operands as float64: fp8 and fp16 through fp16 (exact), bf16 by its bits (exact: the
  interpreter holds bf16 as uint16, which np.matmul multiplied as integers), fp32 and fp64 as is;
- the products are exact for every operand type up to fp32 (24 + 24 significand bits <= 53;
  fp32's smallest subnormal squared, 2^-298, is a normal float64);
- the sum over k is one binary tree fixed by K alone (pairs (0, 1), (2, 3), ...; an odd last
  term goes up a level as it is), in float64 with numpy's elementwise add: one IEEE operation per
  node, the same on every CPU and SIMD width, no BLAS, no reduction whose order numpy chooses;
- rounded once to the accumulator's dtype, then the `acc` operand added in it, as the
  interpreter's own `matmul(...) + acc` does. NaN and inf operands propagate as in fp32; finite
  terms whose partial sums pass fp32's range but whose total does not give the total here (in
  fp32 that depends on the summation order, so no test relies on either).

The interpreted kernel's bits then depend only on what its programs compute, which is what a
batch-invariance or tiling test is about; on a GPU the tensor cores keep their own order (the
GPU tests measure that). Integer dots keep np.matmul: exact, their sums wrap the same in any
order. The cost is a [K, M, N] float64 product tensor and log2(K) vector adds per dot: ~0.1 ms
for a [64, 16] x [16, 16] tile, ~0.5 ms for [64, 128] x [128, 16] (BLAS: 4 and 13 us). Over a
test file that is +2.2 s of tl.dot time in test_moe_experts.py (13052 dots, ~130 s of CPU),
+0.4 s in test_batch_invariance.py and test_markov_sampler.py: inside the files' run-to-run
spread (2 cores, 2026-12-07).
"""
from __future__ import annotations

import numpy as np


def _operand(h) -> np.ndarray:
    """An interpreter TensorHandle's values as float64."""
    import triton.language as tl
    from triton.runtime import interpreter

    dt = h.dtype
    if dt.is_fp8():
        return interpreter._convert_float(h.data, dt, tl.float16, None).view(np.float16) \
            .astype(np.float64)
    if dt.is_bf16():
        return (h.data.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return h.data.astype(np.float64)


# products held at once: 2^22 float64 (32 MiB); a larger dot goes by row blocks, which changes
# no element's sum (the interpreted kernel tests' largest, [64, 128] x [128, 128], has 2^20)
_MAX_PRODUCTS = 1 << 22


def fixed_order_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float64 a [..., M, K] @ b [..., K, N]: exact products summed over k in a binary tree that
    depends on K only (the module docstring)."""
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    rows = max(1, _MAX_PRODUCTS // max(1, K * N * int(np.prod(a.shape[:-2], dtype=np.int64))))
    if rows < M:
        return np.concatenate([fixed_order_matmul(a[..., i:i + rows, :], b)
                               for i in range(0, M, rows)], axis=-2)
    # [K, ..., M, N]: k first, so each level of the tree adds two contiguous slabs elementwise
    t = np.moveaxis(a, -1, 0)[..., :, None] * np.moveaxis(b, -2, 0)[..., None, :]
    while t.shape[0] > 1:
        n = t.shape[0]
        pairs = t[0:n - 1:2] + t[1:n:2]
        t = pairs if n % 2 == 0 else np.concatenate((pairs, t[n - 1:]))
    return t[0]


def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """InterpreterBuilder.create_dot with the fixed order. input_precision and
    max_num_imprecise_acc choose tensor-core precisions; Triton's interpreter ignores them, and
    so does this one."""
    from triton.runtime import interpreter

    if a.dtype.is_int() or b.dtype.is_int():
        return _INTERPRETER_DOT[0](self, a, b, d, input_precision, max_num_imprecise_acc)
    out = fixed_order_matmul(_operand(a), _operand(b)).astype(d.data.dtype)
    return interpreter.TensorHandle(out + d.data, d.dtype.scalar)


create_dot._fixed_order = True
_INTERPRETER_DOT: list = []     # Triton's own create_dot, for the integer dots


def install() -> None:
    """Make Triton's interpreter compute tl.dot with create_dot above. Only the interpreter's
    builder changes: a compiled (GPU) kernel never reaches it. Idempotent; a no-op for a Triton
    without the interpreter builder."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or getattr(builder.create_dot, "_fixed_order", False):
        return
    _INTERPRETER_DOT.append(builder.create_dot)
    builder.create_dot = create_dot
