"""Ring-buffer slots of a forward's tokens: reference, Triton kernel, `dspark::ring_slots`.

    slot[b, t] = rows[b] * ring + pos[b, t] mod ring     where the token writes, else -1

A token writes when its row is valid (and `write[b, t]`, where given), and only the newest
`ring` written positions of a row keep their slot, so no slot is named twice in one write (a
CUDA `index_put_` with repeated indices has no defined winner; models/batch.py says more).

Every attention layer's SWA insert, every compressor's ring and the draft's context ring ask for
these slots; unfused, one call is ~11 aten launches (the modulo, the masks, the newest-position
max, the wheres). The kernel is one launch, one program a batch row; the `cse` pass then leaves
one call per distinct ring (passes/cse.py). Integer math only: bit-exact with the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_compile.kernels.registry import add_compile_configs, dspark_op
from dspark_compile.kernels.region import fusable
from dspark_compile.kernels.tl_helpers import compile_config, launch, next_pow2

NUM_WARPS = 1


@fusable("ring_slots")
def ring_slots_reference(rows: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                         write: torch.Tensor | None, ring: int) -> torch.Tensor:
    """rows [B], pos [B, T] (a row's positions distinct), valid [B] bool, write [B, T] bool or
    None (every token) -> flat slots [B * T] int64 into a [rows, ring, ...] tensor, -1 where
    the token writes nothing."""
    slots = rows[:, None] * ring + pos % ring
    ok = valid[:, None].expand_as(slots)
    if write is not None:
        ok = ok & write
    newest = torch.where(ok, pos, torch.full_like(pos, -1)).amax(1, keepdim=True)
    ok = ok & (pos > newest - ring)
    return torch.where(ok, slots, torch.full_like(slots, -1)).reshape(-1)


@triton.jit
def _ring_slots_kernel(rows_ptr, pos_ptr, valid_ptr, write_ptr, out_ptr, T, ring, stride_p,
                       stride_w, HAS_WRITE: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    tm = t < T
    pos = tl.load(pos_ptr + b * stride_p + t, mask=tm, other=0).to(tl.int64)
    ok = tm & (tl.load(valid_ptr + b) != 0)
    if HAS_WRITE:
        ok = ok & (tl.load(write_ptr + b * stride_w + t, mask=tm, other=0) != 0)
    newest = tl.max(tl.where(ok, pos, -1), axis=0)
    ok = ok & (pos > newest - ring)
    rem = pos % ring
    rem = tl.where(rem < 0, rem + ring, rem)        # floor modulo, as torch's `%`
    slot = tl.load(rows_ptr + b).to(tl.int64) * ring + rem
    tl.store(out_ptr + b * T + t, tl.where(ok, slot, -1), mask=tm)


def _check(rows, pos, valid, write, ring):
    if pos.dim() != 2 or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ring_slots: pos must be int32/int64 [B, T], got {pos.dtype} "
                         f"{tuple(pos.shape)}")
    B, T = pos.shape
    if rows.shape != (B,) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ring_slots: rows must be int32/int64 [{B}] (pos' rows), got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    if valid.shape != (B,) or valid.dtype != torch.bool:
        raise ValueError(f"ring_slots: valid must be bool [{B}], got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    if write is not None and (write.shape != (B, T) or write.dtype != torch.bool):
        raise ValueError(f"ring_slots: write must be bool [{B}, {T}] (pos' shape), got "
                         f"{write.dtype} {tuple(write.shape)}")
    if ring < 1:
        raise ValueError(f"ring_slots: ring={ring} must be >= 1")


def ring_slots_launch(rows, pos, valid, write, ring):
    _check(rows, pos, valid, write, ring)
    B, T = pos.shape
    out = torch.empty(B * T, dtype=torch.int64, device=pos.device)
    if out.numel() == 0:
        return out
    pos = pos if pos.stride(1) == 1 else pos.contiguous()
    wb = write.contiguous().view(torch.uint8) if write is not None else valid.view(torch.uint8)
    launch(_ring_slots_kernel)[(B,)](
        rows, pos, valid.contiguous().view(torch.uint8), wb, out, T, ring, pos.stride(0),
        wb.stride(0) if write is not None else 0, HAS_WRITE=write is not None,
        BLOCK_T=next_pow2(T), num_warps=NUM_WARPS)
    return out


def _ring_slots_fake(rows, pos, valid, write, ring):
    return pos.new_empty(pos.numel(), dtype=torch.int64)


@dspark_op("ring_slots", reference=ring_slots_reference, fake=_ring_slots_fake)
def ring_slots(rows: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
               write: torch.Tensor | None, ring: int) -> torch.Tensor:
    return ring_slots_launch(rows, pos, valid, write, ring)


# SM12x readiness: the step's rows (T = N + 1 = 6) and a prefill chunk's (512), int64 inputs
_TYPES = dict(rows_ptr="*i64", pos_ptr="*i64", valid_ptr="*u8", write_ptr="*u8", out_ptr="*i64",
              T="i32", ring="i32", stride_p="i32", stride_w="i32")
add_compile_configs("ring_slots", [
    compile_config(_ring_slots_kernel, _TYPES, dict(HAS_WRITE=w, BLOCK_T=bt), NUM_WARPS)
    for w, bt in ((False, 8), (True, 8), (False, 512))])
