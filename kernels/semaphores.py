"""Tile counters for kernels whose last program of a tile finishes the tile ("last one reduces").

Why: a reduction split over programs (fp8_linear's split-K) needs a second launch to sum the
partials in a fixed order, unless the program that completes a tile does it. At batch 1 on the
H200 that second launch was 60 of a step's launches (131 µs). The kernel keeps its fixed sum
order; it only needs, per output tile, a counter that every program of the tile increments
once: the one that sees `splits - 1` sums the partials in split order and sets the counter
back to 0. So the counters must be zero before each launch, and two launches that may run at
the same time must not share one.

This module keeps, per device, one zero-initialised int32 ring of RING_SLOTS counters,
allocated on first use and never again, and gives each launch the next `count` slots of it
(`tile_counters`). The slots are chosen on the host when the launch is issued, so a launch
captured in a CUDA graph keeps its own range for every replay, and two captured call sites
never share counters unless the ring has wrapped between their captures.

Limits:
- Launches on one stream are ordered, and each leaves its counters at 0, so reusing slots
  after the ring wraps is safe there (a graph's replays included). Two launches running
  concurrently on different streams collide only if they were handed overlapping ranges,
  i.e. after RING_SLOTS slots were handed out between them.
- The buffer is allocated outside any CUDA-graph capture (an allocation and a memset inside
  one would belong to the graph): while the current stream captures and the device has no
  ring yet, `tile_counters` returns None and the caller takes its path without counters.
  Engines warm every program up eagerly before capture, so the ring exists by then.
- A kernel that can stop a tile before its last program counts would leave a counter
  non-zero; every user must count each tile's programs unconditionally.
"""
from __future__ import annotations

import threading

import torch

# 2^20 counters (4 MiB a device). The most one launch takes: the output tiles of one GEMM at
# prefill, e.g. 8192 tokens x wq_b's 32768 rows in 128 x 64 tiles = 32768 counters, so the
# ring holds about 32 such launches (and thousands of decode launches) before it wraps.
RING_SLOTS = 1 << 20

_LOCK = threading.Lock()
_RINGS: dict = {}           # torch.device -> [int32 buffer, next free slot]


def _key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def tile_counters(device, count: int) -> torch.Tensor | None:
    """`count` zeroed int32 counters on `device` for one launch (a view into the device's ring;
    the launch must leave them at 0), or None while a CUDA-graph capture is running on a device
    whose ring does not exist yet (see the module docstring)."""
    if count < 1 or count > RING_SLOTS:
        raise ValueError(f"count must be in [1, {RING_SLOTS}] tile counters, got {count}")
    device = _key(device)
    with _LOCK:
        ring = _RINGS.get(device)
        if ring is None:
            if _capturing(device):
                return None
            ring = _RINGS[device] = [torch.zeros(RING_SLOTS, dtype=torch.int32, device=device), 0]
        buf, start = ring
        if start + count > RING_SLOTS:
            start = 0
        ring[1] = start + count
        return buf[start:start + count]


def ring_of(device) -> torch.Tensor | None:
    """The device's counter ring (tests: every counter is back at 0 after a launch)."""
    ring = _RINGS.get(_key(device))
    return ring[0] if ring is not None else None
