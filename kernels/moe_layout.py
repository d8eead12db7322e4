"""The MoE experts' kernel weight layout: MXFP4 bytes re-laid out at build time for
`dspark::moe_experts`' tiled loader (kernels/moe_kernels.py `_tiled_tile`), and back.

The checkpoint stores one expert matrix [N, K] as packed e2m1 pairs [N, K/2] (low nibble = even
element) and one E8M0 scale byte per 32 consecutive K elements [N, K/32] (docs/model.md, "MXFP4
experts"). The kernel streams [BN, BK] tiles of it (BN output rows, BK input columns). The
tiled layout stores, per matrix of E experts:

    values  int32 [E, N / BN, K / BK, BN, BK / 8]   one tile = BN * BK / 2 contiguous bytes
    scales  uint8 [E, N / BN, K / BK, BN, BK / 32]  one tile = BN * BK / 32 contiguous bytes

- Tile-major: a K step of one program reads one contiguous run (8 KB at 64 x 256) and its
  scales as one 512-byte run (8 bytes a row, one 64-bit load), so every load is whole 128-byte
  lines; the checkpoint layout gives BK / 2 = 128 contiguous bytes per row, 2 KB apart.
- Slabs: word c (0 <= c < W = BK / 8) of a tile row holds the 8 values at the tile's K offsets
  s * W + c, s = 0..7 (slab s), not 8 consecutive ones. Each slab is then a [BN, W] tensor the
  kernel computes from the [BN, W] words with elementwise operations only, so Triton keeps the
  decoded weights in registers in the wgmma A-operand layout (no trip through shared memory, no
  shuffles of a join / reshape; H200 profile in benchmarks/results/h200_moe_2026-12-02/NOTES.md
  run 3: that trip and the moves were the K loop's cost). A slab spans W <= 32 K offsets, i.e.
  one E8M0 group: one scale per row per slab. BK is 128 or 256 (tl.dot needs W >= 16).
- Bit order inside a 32-bit word: value (j, l) = slab 2j + l (pair j = 0..3, lane l = 0..1)
  keeps its 3 magnitude bits
  (exponent e1 e0, mantissa m) at bit 6 + 16 l - A_j and its sign at 15 + 16 l - B_j, with
  (A_j, B_j) = PAIR_SHIFTS[j]. The kernel then gets pair j as two bf16 lanes of one register
  with one or two shifts and one or two masks:

      r_j = ((u << A_j) & 0x01C001C0) | ((u << B_j) & 0x80008000)    (negative: shift right)

  i.e. each lane's bits land on bf16 bits 15 (sign) and 8..6 (exponent low bits, mantissa top
  bit), which is the bf16 e2m1 * 2^-126 (t = 1, the 0.5, lands as the subnormal 2^-127). One
  bf16x2 multiply by (2^(s0 - 1), 2^(s1 - 1)) (s = the two slabs' E8M0 bytes) then gives
  e2m1 * 2^(s - 127), exact. The four (A, B) were searched for the fewest instructions: 5
  distinct shifts and 6 LOP3 per 8 values (two pairs with A = B need one mask each).
- `wide`: 2^(s - 1) is a normal bf16 only for s <= 128; a matrix with any scale byte above
  128 (weights of magnitude >= 8: none in a real checkpoint) is named "-wide" and the kernel
  multiplies twice (2^126, then 2^(s - 127)), exact for every byte.

The layout's name (`layout_name`) goes into the op's `layout` argument, so a graph built for a
layout this code does not know is refused by name (`parse_layout`), never silently misread.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

VERSION = "mxfp4-slab-v2"
CHECKPOINT = "checkpoint"            # the checkpoint's own layout (eager model, reference)
PAIR_SHIFTS = ((-3, 1), (0, 0), (3, 3), (6, 2))
MXFP4_BLOCK = 32
WIDE_FROM = 129                      # first scale byte whose 2^(s - 1) overflows bf16

_NAME_RE = re.compile(rf"^{VERSION}:(\d+)x(\d+):(\d+)x(\d+)(:wide)?$")


@dataclass(frozen=True)
class TiledLayout:
    """The tiles of the two GEMMs' weights (gate/up [I, D], down [D, I]) and the wide flag."""
    gate_up_tile: tuple        # (BN, BK) of w1 and w3
    down_tile: tuple           # (BN, BK) of w2
    wide: bool = False

    @property
    def name(self) -> str:
        (a, b), (c, d) = self.gate_up_tile, self.down_tile
        return f"{VERSION}:{a}x{b}:{c}x{d}" + (":wide" if self.wide else "")


def parse_layout(name: str) -> TiledLayout | None:
    """None for the checkpoint layout; ValueError naming the layout for any unknown name."""
    if name == CHECKPOINT:
        return None
    m = _NAME_RE.match(name)
    if m is None:
        raise ValueError(f"layout {name!r} is not a MoE weight layout this build knows "
                         f"('{CHECKPOINT}' or '{VERSION}:BNxBK:BNxBK[:wide]'); rebuild the engine")
    a, b, c, d = (int(v) for v in m.groups()[:4])
    return TiledLayout((a, b), (c, d), m.group(5) is not None)


SLAB_BKS = (256, 128)                # K tiles of the slab layout (W = BK / 8 in 16..32)


def tile_for(N: int, K: int, max_bk: int = 256, bks: tuple = SLAB_BKS) -> tuple:
    """(BN, BK) of an [N, K] expert matrix, from its shape only (never the token count, so the
    K order of every sum is the same at every batch size): BK 256 where it divides K (a K step
    of a 64-row tile is 8 KB, two 128-byte lines a row), else 128 (the slabs' W >= 16); BN 64
    (one warpgroup's wgmma M), smaller where it does not divide (tiny models). H200, Flash dims,
    the v1 layout (benchmarks/results/h200_moe_2026-12-02/NOTES.md run 3): 64 x 128 gate/up
    tiles +7-12 %, 128-row tiles on 8 warps +42-52 %. `bks`: the K tiles allowed, largest
    first (the checkpoint layout's kernels take others: kernels/moe.py checkpoint_tile)."""
    bk = next((b for b in bks if b <= max_bk and K % b == 0), None)
    bn = next((b for b in (64, 32, 16) if N % b == 0), None)
    if bk is None or bn is None:
        raise ValueError(f"expert matrix [{N}, {K}]: needs N a multiple of 16 and K of "
                         f"{min(bks)}")
    return bn, bk


def tileable(I: int, D: int) -> bool:
    """Whether experts of intermediate I and hidden D have a kernel layout (else they stay in
    the checkpoint's)."""
    try:
        tile_for(I, D), tile_for(D, I)
    except ValueError:
        return False
    return True


def _lane_bits():
    """(magnitude bit, sign bit) of value (j, l) in a word, for j = 0..3, l = 0..1."""
    return [[(6 + 16 * l - a, 15 + 16 * l - b) for l in range(2)] for a, b in PAIR_SHIFTS]


def to_kernel(w: torch.Tensor, s: torch.Tensor, tile: tuple) -> tuple:
    """Checkpoint [E, N, K/2] packed bytes + [E, N, K/32] E8M0 bytes -> (values int32
    [E, N/BN, K/BK, BN, BK/8], scales uint8 [E, N/BN, K/BK, BN, BK/32]). Exact (a bit
    permutation); ~16 M values at a time, so the int64 temporaries stay ~250 MB."""
    E, N, KH = w.shape
    K = 2 * KH
    bn, bk = tile
    if N % bn or K % bk or bk not in SLAB_BKS or tuple(s.shape) != (E, N, K // MXFP4_BLOCK):
        raise ValueError(f"weights {tuple(w.shape)} / scales {tuple(s.shape)} do not tile "
                         f"as {bn}x{bk}")
    bits = _lane_bits()
    out = torch.empty(E, N // bn, K // bk, bn, bk // 8, dtype=torch.int32, device=w.device)
    step = max(1, (1 << 24) // (N * K))        # experts per chunk: ~16 M values
    for e0 in range(0, E, step):
        b = w[e0:e0 + step].contiguous().view(torch.uint8).to(torch.int64)
        n = b.shape[0]
        codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(n, N, K // bk, 8, bk // 8)
        codes = codes.transpose(3, 4).reshape(n, N, K // 8, 4, 2)   # word (kt, c), slab 2j + l
        word = torch.zeros(n, N, K // 8, dtype=torch.int64, device=w.device)
        for j in range(4):
            for l in range(2):
                c = codes[..., j, l]
                mag, sgn = bits[j][l]
                word |= ((c & 7) << mag) | ((c >> 3) << sgn)
        word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
        out[e0:e0 + n] = word.reshape(n, N // bn, bn, K // bk, bk // 8).permute(0, 1, 3, 2, 4)
    sk = s.contiguous().view(torch.uint8).reshape(E, N // bn, bn, K // bk, bk // MXFP4_BLOCK)
    return out, sk.permute(0, 1, 3, 2, 4).contiguous()


def to_checkpoint(values: torch.Tensor, scales: torch.Tensor) -> tuple:
    """The inverse of `to_kernel`: (packed uint8 [E, N, K/2], E8M0 bytes uint8 [E, N, K/32]);
    ~16 M values at a time, as `to_kernel`."""
    E, NT, KT, bn, bw = values.shape
    N, K = NT * bn, KT * bw * 8
    bits = _lane_bits()
    packed = torch.empty(E, N, K // 2, dtype=torch.uint8, device=values.device)
    step = max(1, (1 << 24) // (N * K))
    for e0 in range(0, E, step):
        v = values[e0:e0 + step]
        n = v.shape[0]
        u = v.permute(0, 1, 3, 2, 4).reshape(n, N, K // 8).to(torch.int64) & 0xFFFFFFFF
        codes = torch.empty(n, N, K // 8, 4, 2, dtype=torch.int64, device=values.device)
        for j in range(4):
            for l in range(2):
                mag, sgn = bits[j][l]
                codes[..., j, l] = ((u >> mag) & 7) | (((u >> sgn) & 1) << 3)
        codes = codes.reshape(n, N, KT, bw, 8).transpose(3, 4).reshape(n, N, K // 2, 2)
        packed[e0:e0 + n] = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    s = scales.permute(0, 1, 3, 2, 4).reshape(E, N, K // MXFP4_BLOCK)
    return packed, s.contiguous()


def experts_to_kernel(w1, s1, w3, s3, w2, s2, max_bk: int = 256) -> tuple:
    """The six expert tensors of a layer in the tiled layout, and the layout's name."""
    E, I, DH = w1.shape
    D = 2 * DH
    gu, dn = tile_for(I, D, max_bk), tile_for(D, I, max_bk)
    wide = any(bool((t.view(torch.uint8) >= WIDE_FROM).any()) for t in (s1, s3, s2))
    layout = TiledLayout(gu, dn, wide)
    (a, b), (c, d), (f, g) = to_kernel(w1, s1, gu), to_kernel(w3, s3, gu), to_kernel(w2, s2, dn)
    return (a, b, c, d, f, g), layout.name


def layout_of(w1, s1, w3, s3, w2, s2) -> str:
    """The name of the layout six expert tensors are in: the tiles from the tiled tensors'
    shapes, `wide` from the scale bytes (as `experts_to_kernel` decides it); CHECKPOINT for
    3-d tensors. For weights loaded into a module whose name was not recorded with them."""
    if w1.dim() == 3:
        return CHECKPOINT
    tile = lambda v: (v.shape[3], v.shape[4] * 8)
    wide = any(bool((t.view(torch.uint8) >= WIDE_FROM).any()) for t in (s1, s3, s2))
    return TiledLayout(tile(w1), tile(w2), wide).name


def experts_to_checkpoint(w1, s1, w3, s3, w2, s2) -> tuple:
    """The inverse of `experts_to_kernel` (the six tensors as the checkpoint stores them)."""
    out = []
    for w, s in ((w1, s1), (w3, s3), (w2, s2)):
        out += list(to_checkpoint(w, s))
    return tuple(out)
