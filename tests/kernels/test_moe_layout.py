"""kernels/moe_layout.py: the MoE experts' tiled weight layout is an exact, invertible
permutation of the checkpoint's bytes, with the bit order the kernel's decode assumes, and its
name is parsed or refused. Plain torch (no kernels): milliseconds."""
import pytest
import torch

from dspark_compile.kernels import moe, moe_layout as ml


def _bytes(*shape, seed=0):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("E,N,K,tile", [(3, 64, 256, (64, 256)), (2, 48, 384, (16, 128)),
                                        (1, 32, 512, (32, 256))])
def test_round_trip_is_exact(E, N, K, tile):
    w, s = _bytes(E, N, K // 2, seed=1), _bytes(E, N, K // 32, seed=2)
    vals, scales = ml.to_kernel(w, s, tile)
    bn, bk = tile
    assert vals.dtype == torch.int32 and vals.shape == (E, N // bn, K // bk, bn, bk // 8)
    assert scales.dtype == torch.uint8 and scales.shape == (E, N // bn, K // bk, bn, bk // 32)
    back_w, back_s = ml.to_checkpoint(vals, scales)
    assert torch.equal(back_w, w) and torch.equal(back_s, s)
    assert torch.equal(ml.to_checkpoint(*ml.to_kernel(w.view(torch.int8), s, tile))[0], w)


def test_words_hold_each_value_bit_once_where_the_decode_reads_it():
    """Every bit of a word belongs to exactly one value; decoding pair j by its shifts and the
    masks (moe_kernels._pair_bits) gives the bf16 bits of e2m1 * 2^-126 for both lanes."""
    bits = ml._lane_bits()
    used = sorted(b for pair in bits for mag, sgn in pair for b in (mag, mag + 1, mag + 2, sgn))
    assert used == list(range(32))
    codes = torch.arange(16)
    for j, (a, b) in enumerate(ml.PAIR_SHIFTS):
        for v in codes.tolist():
            w = 0
            for l in range(2):
                mag, sgn = bits[j][l]
                w |= ((v & 7) << mag) | ((v >> 3) << sgn)
            sh = lambda u, n: (u << n) & 0xFFFFFFFF if n >= 0 else u >> -n
            r = (sh(w, a) & 0x01C001C0) | (sh(w, b) & 0x80008000)
            for l in range(2):
                lane = (r >> (16 * l)) & 0xFFFF
                val = torch.tensor([lane << 16], dtype=torch.int64).to(torch.int32).view(
                    torch.float32).double().item() * 2.0 ** 126
                assert val == moe.e2m1_decode(torch.tensor([v])).item(), (j, l, v)


def test_slab_s_word_c_holds_tile_k_offset_s_w_plus_c():
    """Decoding the tiled words as the kernel does (slab s = 2 j + l of word c is the tile's K
    offset s * BK / 8 + c, its scale the slab's 32-group) gives the checkpoint's dequantized
    matrix exactly, at both K tiles."""
    from dspark_compile.kernels.moe import mxfp4_dequant
    for tile, K in (((16, 256), 512), ((32, 128), 384)):
        N, (bn, bk) = 64, tile
        w, s = _bytes(1, N, K // 2, seed=7), torch.randint(118, 130, (1, N, K // 32),
                                                           dtype=torch.uint8)
        vals, scales = ml.to_kernel(w, s, tile)
        u = vals[0].to(torch.int64) & 0xFFFFFFFF                     # [N/bn, K/bk, bn, W]
        W, bits = bk // 8, ml._lane_bits()
        out = torch.empty(N // bn, K // bk, bn, 8, W, dtype=torch.float64)
        for j in range(4):
            for l in range(2):
                mag, sgn = bits[j][l]
                code = ((u >> mag) & 7) | (((u >> sgn) & 1) << 3)
                scale = scales[0][..., ((2 * j + l) * W) // 32].double()[..., None]
                out[:, :, :, 2 * j + l] = (moe.e2m1_decode(code).double()
                                           * torch.exp2(scale - 127))
        dense = out.permute(0, 2, 1, 3, 4).reshape(N, K)
        assert torch.equal(dense, mxfp4_dequant(w[0], s[0], torch.float64)), tile


def test_tiles_follow_the_shape_only():
    assert ml.tile_for(2048, 4096) == ml.tile_for(4096, 2048) == (64, 256)
    assert ml.tile_for(2048, 4096, max_bk=128) == (64, 128)
    assert ml.tile_for(128, 256) == (64, 256) and ml.tile_for(256, 128) == (64, 128)
    assert ml.tile_for(48, 384) == (16, 128)
    with pytest.raises(ValueError, match="multiple of 16"):
        ml.tile_for(40, 128)
    with pytest.raises(ValueError, match="K of 128"):
        ml.tile_for(64, 96)
    assert ml.tileable(128, 256) and not ml.tileable(64, 96)


def test_layout_names_round_trip_and_unknown_ones_are_refused():
    lay = ml.TiledLayout((64, 256), (64, 128), wide=True)
    assert ml.parse_layout(lay.name) == lay and lay.name == "mxfp4-slab-v2:64x256:64x128:wide"
    assert ml.parse_layout(ml.CHECKPOINT) is None
    for bad in ("mxfp4-tiled-v1:64x256:64x256", "tiled", "mxfp4-slab-v2:64x256"):
        with pytest.raises(ValueError, match="rebuild the engine"):
            ml.parse_layout(bad)


def test_experts_wide_only_when_a_scale_byte_overflows_the_single_multiply():
    E, I, D = 2, 128, 128
    ex = [_bytes(E, I, D // 2, seed=3), torch.full((E, I, D // 32), 128, dtype=torch.uint8),
          _bytes(E, I, D // 2, seed=4), torch.full((E, I, D // 32), 0, dtype=torch.uint8),
          _bytes(E, D, I // 2, seed=5), torch.full((E, D, I // 32), 120, dtype=torch.uint8)]
    tensors, name = ml.experts_to_kernel(*ex)
    assert name == "mxfp4-slab-v2:64x128:64x128"                    # 128 still fits 2^(s-1)
    assert all(torch.equal(a, b) for a, b in zip(ml.experts_to_checkpoint(*tensors), ex))
    ex[5][1, 3, 0] = ml.WIDE_FROM
    assert ml.experts_to_kernel(*ex)[1].endswith(":wide")
