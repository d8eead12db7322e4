"""Reference math shared by several kernels' references and by the models.

Everything here is plain PyTorch and is *the* definition of the numerics: a fused kernel is
correct when it matches these functions, and the models call these functions so that the
exported step contains exactly the subgraphs the fusion passes look for.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

FP8_MAX = 448.0          # largest finite float8_e4m3fn
SCALE_AMAX_FLOOR = 1e-4  # DeepSeek's amax floor for power-of-two (UE8M0) scales


def upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 for 16-bit inputs; fp64 stays fp64 (exact-precision test runs stay exact)."""
    return x if x.dtype == torch.float64 else x.float()


# ATen's CPU pointwise loops send whole pairs of SIMD vectors through vectorized (Sleef) math and
# the tail of fewer than two vectors through scalar libm; for softplus, sigmoid, silu and exp2 the
# two differ in the last bit (2338 / 633 / 674 / 988 of 16000 fp32 values, AVX512, torch 2.13),
# so a token's value would depend on where its tensor's length ends. Padding the flat tensor to a
# multiple of 64 elements (two AVX512 vectors of fp64 and then some) sends every element through
# the vector path. Tensors here stay below ATen's 32768-element parallel grain, so no thread
# boundary makes a tail either. GPU pointwise math has no such split.
SIMD_PAD = 64


def simd_pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a pointwise `fn`, every element computed the same way whatever x's length."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    if isinstance(flat.numel(), torch.SymInt):
        return _padded_rows(flat.unsqueeze(-1), SIMD_PAD, fn).view(x.shape)
    pad = (-flat.numel()) % SIMD_PAD
    return fn(torch.cat((flat, flat.new_zeros(pad))))[:flat.numel()].view(x.shape)


def _padded_rows(a2: torch.Tensor, chunk: int, fn) -> torch.Tensor:
    """fn on a2 [M, K] zero-padded to [ceil(M / chunk), chunk, K], read back as [M, ...], for
    an M that is symbolic (a program exported with a dynamic batch, build/pipeline.py): the
    eager path's `cat` of a pad that may be empty guards on M. The rows are placed and read
    back by index (index_put / gather, no slice whose bound the shape solver would have to
    prove), so fn sees the eager path's padded values in the same contiguous layout."""
    M, K = a2.shape
    n = (M + chunk - 1) // chunk
    idx = torch.arange(M, device=a2.device)
    at = (idx // chunk, idx % chunk)
    return fn(a2.new_zeros(n, chunk, K).index_put(at, a2))[at]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in fp32 (weight multiplied in fp32), one cast back to x's dtype at the end."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False):
    """GPT-J (interleaved pairs) rotation of x[..., 2p], x[..., 2p+1] by angle p; fp32 math.

    x: [..., R]; cos/sin: broadcastable to [..., R/2]. Returns fp32 (fp64 for fp64 x).
    """
    xf = upcast(x)
    even, odd = xf[..., 0::2], xf[..., 1::2]
    if inverse:
        sin = -sin
    out_even = even * cos - odd * sin
    out_odd = odd * cos + even * sin
    return torch.stack((out_even, out_odd), dim=-1).flatten(-2)


def rope_last(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, rope_dim: int,
              inverse: bool = False) -> torch.Tensor:
    """Apply GPT-J RoPE to the last `rope_dim` dims of x at `positions`; result in x.dtype.

    x: [T, ..., D]; positions: [T]; cos_sin: [max_pos, rope_dim] (cos for the first half of the
    columns, sin for the second).
    """
    cs = cos_sin[positions]                     # [T, rope_dim]
    half = rope_dim // 2
    # [T, 1.., half] views by unsqueeze: a reshape of the strided half would ask whether T is
    # 1 (a guard on the batch of a target-only program exported for every batch size)
    cos, sin = cs[:, :half], cs[:, half:]
    for _ in range(x.dim() - 2):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = rope_gptj(x[..., -rope_dim:], cos, sin, inverse=inverse).to(x.dtype)
    return torch.cat((x[..., :-rope_dim], rot), dim=-1)


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)) (fp32)."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp_min(SCALE_AMAX_FLOOR) / FP8_MAX)))


def fp8_group_quant(x: torch.Tensor, group: int):
    """Per-`group` FP8 e4m3 quantization along the last dim with UE8M0 scales.

    Returns (q float8_e4m3fn [..., K], scale fp32 [..., K/group]).
    """
    xf = upcast(x).unflatten(-1, (-1, group))
    scale = ue8m0_scale(xf.abs().amax(-1))
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale


def fp8_group_dequant(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of :func:`fp8_group_quant` (fp32)."""
    return (q.float().unflatten(-1, (-1, group)) * scale.float().unsqueeze(-1)).flatten(-2)


def scale_to_e8m0_byte(scale: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scale -> uint8 exponent byte (exponent + 127), as fp8_ds_mla stores it."""
    return (torch.log2(scale).round() + 127).clamp(0, 254).to(torch.uint8)


def e8m0_byte_to_scale(b: torch.Tensor) -> torch.Tensor:
    return torch.exp2(b.to(torch.float32) - 127.0)


def masked_row_write(dst: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[slots[i]] = rows[i] for slots >= 0; slot -1 writes nothing to a real slot.

    Convention of every cache in this project: its last slot (dst[-1]) is scratch that no
    reader trusts. Fixed-shape PyTorch cannot skip a write, so slot -1 is redirected there;
    Triton kernels skip it instead. Either way every real slot is untouched.
    """
    idx = torch.where(slots >= 0, slots, torch.full_like(slots, dst.shape[0] - 1))
    dst.index_put_((idx,), rows.to(dst.dtype))


ROW_CHUNK = 16   # rows per matmul call of row_matmul


def row_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., K] @ b [K, N], each row's result independent of the other rows of the call.

    A BLAS GEMM picks its kernel and blocking by M (on the CPU, M < 16 and M = 1 take other
    paths than larger M, and the sums' order changes with them), so a row's bits would depend
    on how many rows share the call. Here every call has exactly ROW_CHUNK rows (the last chunk
    zero-padded): one kernel, one blocking, the row's position inside a chunk does not change
    its sums (tests/kernels/test_batch_invariance.py checks every reference that uses this)."""
    lead, K = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, K)
    M = a2.shape[0]
    if isinstance(M, torch.SymInt):
        # traced with a dynamic batch (build/pipeline.py): the chunk count is not known, so
        # the graph calls this very function as one op (dspark::row_matmul), which runs it at
        # the concrete M. A bmm of the padded chunks is no substitute: MKL's threaded GEMM
        # sums differently from bmm's per-matrix GEMMs (on 16 threads 25 of 84 fp32/fp64
        # shapes, M 1-64, K 64-2048, N 24-4096, differed in the last bits; torch 2.13, MKL).
        return torch.ops.dspark.row_matmul(a2, b).reshape(*lead, b.shape[-1])
    pad = -M % ROW_CHUNK
    if pad:
        a2 = torch.cat((a2, a2.new_zeros(pad, K)))
    y = torch.cat([c @ b for c in a2.split(ROW_CHUNK)]) if a2.shape[0] else a2 @ b
    return y[:M].reshape(*lead, b.shape[-1])


@torch.library.custom_op("dspark::row_matmul", mutates_args=())
def _row_matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """row_matmul(a [M, K], b [K, N]) at a concrete M: the traced form of a row_matmul whose
    row count is symbolic. A reference helper, not a kernel (kernels/registry.py's KERNELS
    does not list it): the fused programs hold none, since every traced row_matmul is inside
    a fusable region."""
    y = row_matmul(a, b)
    return y.clone() if y._base is not None else y


@_row_matmul_op.register_fake
def _row_matmul_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


# Decoded weights between eager CPU calls of a reference (the CPU engine, the eager model): the
# MoE experts' e2m1 decode was 70 % of a tiny-trained fp32 CPU step (811 ms), the FP8 block
# dequant most of fp8_linear's share (with this cache a 4-prompt x 12-token generate takes
# 1.60 s, not 6.76 s). Kept per storage and view of the encoded tensors (the
# programs pass a fresh view object per call), up to DECODE_CACHE_BYTES, least recently used
# first out. An entry holds its storages, so their addresses cannot be freed and reused while
# it lives; the version counter (shared by every view of a tensor) catches an in-place write.
DECODE_CACHE_BYTES = 512 << 20
_DECODED: OrderedDict = OrderedDict()


def _view_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype)


def cached_decode(encoded: tuple, tag: tuple, nbytes: int, decode: Callable[[], tuple]):
    """decode()'s tensors for the weights `encoded`, computed once per (weights, tag) while they
    are unchanged; None where caching does not apply (traced or non-CPU tensors, or a result of
    `nbytes` over the bound): the caller decodes as it would without a cache."""
    if (nbytes > DECODE_CACHE_BYTES or torch.compiler.is_compiling()
            or any(type(t) is not torch.Tensor or t.device.type != "cpu" for t in encoded)):
        return None
    key = (tuple(_view_key(t) for t in encoded), tag)
    versions = tuple(t._version for t in encoded)
    hit = _DECODED.get(key)
    if hit is not None:
        if hit[1] == versions:
            _DECODED.move_to_end(key)
            return hit[2]
        del _DECODED[key]
    out = decode()
    _DECODED[key] = (tuple(t.untyped_storage() for t in encoded), versions, out)
    while sum(d.nbytes for v in _DECODED.values() for d in v[2]) > DECODE_CACHE_BYTES:
        _DECODED.popitem(last=False)
    return out
