"""Bit packing: exact inverse, exact byte counts, documented bit order."""

import math

import pytest
import torch

from kvqbench.numerics.packing import pack_bits, packed_nbytes, unpack_bits


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 13, 1000])
def test_roundtrip_and_size(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    c = torch.randint(0, 2**bits, (n,), generator=g)
    p = pack_bits(c, bits)
    assert p.dtype == torch.uint8 and p.numel() == math.ceil(n * bits / 8) == packed_nbytes(n, bits)
    assert torch.equal(unpack_bits(p, bits, n), c)


def test_documented_bit_order_lsb_first():
    # 2-bit codes [1, 2, 3, 0] → byte 0b00_11_10_01 = 0x39
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0x39]
    # 3-bit codes [5, 6]: stream bits 1,0,1, 0,1,1 → byte 0b00110101 = 0x35
    assert pack_bits(torch.tensor([5, 6]), 3).tolist() == [0x35]


def test_out_of_range_codes_raise():
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_bits(torch.tensor([4]), 2)
    with pytest.raises(ValueError, match="1..8 bits"):
        pack_bits(torch.tensor([0]), 9)
