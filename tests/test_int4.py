"""INT4 pack-quantized layout: bit order, sign handling, roundtrip accuracy."""

import torch

from services.common.int4 import pack_int4, unpack_int4


def _u32_to_i32(u: int) -> int:
    return u - (1 << 32) if u >= (1 << 31) else u


def _decode_bit_by_bit(words: list[int], scales: list[float], group: int) -> list[float]:
    """Independent decoder: element 8j+i is built from bits 4i..4i+3 of word j, one bit at a time."""
    out = []
    for j, word in enumerate(words):
        u = word & 0xFFFFFFFF
        for i in range(8):
            nibble = sum(((u >> (4 * i + b)) & 1) << b for b in range(4))
            out.append((nibble - 8) * scales[(8 * j + i) // group])
    return out


def test_unpack_matches_hand_built_words() -> None:
    rows = [
        [0x76543210, 0xFEDCBA98, 0xF0000000, 0x0000000F],  # nibble 15 in position 7 sets the int32 sign bit
        [0x88888888, 0x1F2E3D4C, 0x80000008, 0x12345678],
    ]
    scales = [[0.5], [0.25]]
    packed = torch.tensor([[_u32_to_i32(w) for w in r] for r in rows], dtype=torch.int32)  # [2, 4]
    assert packed[0, 1] < 0 and packed[0, 2] < 0
    scale = torch.tensor(scales, dtype=torch.float32)  # [2, 1]
    got = unpack_int4(packed, scale, (2, 32), group_size=32)
    want = torch.tensor([_decode_bit_by_bit(r, s, 32) for r, s in zip(rows, scales)])
    assert torch.equal(got, want)
    # Position checks spelled out: word 0x76543210 holds 0..7 -> values -8..-1 (times scale).
    assert got[0, :8].tolist() == [(i - 8) * 0.5 for i in range(8)]
    assert got[0, 23].item() == (15 - 8) * 0.5  # element 8*2+7 = nibble 15
    assert got[0, 16:23].abs().max().item() == 4.0  # nibbles 0 -> -8 * 0.5


def test_unpack_group_scales_and_batched() -> None:
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-(2**31), 2**31 - 1, (3, 5, 8), dtype=torch.int32, generator=g)  # [E, out, 64/8]
    scale = torch.rand(3, 5, 2, generator=g).to(torch.bfloat16)  # two groups of 32
    dense = unpack_int4(packed, scale, (5, 64), 32, dtype=torch.float32)  # [3, 5, 64]
    for e in range(3):
        for r in range(5):
            want = _decode_bit_by_bit(packed[e, r].tolist(), scale[e, r].float().tolist(), 32)
            assert dense[e, r].tolist() == want
    assert unpack_int4(packed, scale, (5, 64)).dtype == torch.bfloat16


def test_pack_unpack_roundtrip_error_within_half_scale() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 96, generator=g) * 0.3
    w[0, :32] = 0.0  # an all-zero group must not divide by zero
    q = pack_int4(w, group_size=32)
    assert q.packed.shape == (24, 12) and q.packed.dtype == torch.int32
    assert q.scale.shape == (24, 3) and q.shape == (24, 96)
    back = unpack_int4(q.packed, q.scale, q.shape, 32)
    bound = q.scale.repeat_interleave(32, dim=1) / 2  # [24, 96]
    assert torch.all((back - w).abs() <= bound * (1 + 1e-6) + 1e-12)
    nibbles = (q.packed.unsqueeze(-1) >> (torch.arange(8, dtype=torch.int32) * 4)) & 0xF
    assert nibbles.min() >= 1 and nibbles.max() <= 15  # symmetric: -7..7


def test_pack_with_bf16_scale_keeps_bound() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    q = pack_int4(w, scale_dtype=torch.bfloat16)
    assert q.scale.dtype == torch.bfloat16
    back = unpack_int4(q.packed, q.scale, q.shape, dtype=torch.float32)
    bound = q.scale.float().repeat_interleave(32, dim=1) / 2
    assert torch.all((back - w).abs() <= bound * 1.01)
