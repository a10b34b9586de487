"""Bit packing: exact inverse, exact byte counts, documented bit order."""

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import steps
from kvqbench.kernels.packing import MIN_CODES as C_MIN_CODES
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


def _reference_pack(codes: list[int], bits: int) -> list[int]:
    """The documented bit stream, one bit at a time (second implementation)."""
    out = [0] * math.ceil(len(codes) * bits / 8)
    for i, c in enumerate(codes):
        for j in range(bits):
            s = i * bits + j
            out[s // 8] |= ((c >> j) & 1) << (s % 8)
    return out


@settings(max_examples=80, deadline=None)
@given(bits=st.integers(1, 8), n=st.one_of(st.integers(0, 300), st.integers(C_MIN_CODES, C_MIN_CODES + 300)),
       offset=st.integers(0, 9), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.uint8, torch.int64, torch.float32]))
def test_pack_matches_the_bit_stream_and_packs_slices_into_slices(bits, n, offset, seed, dtype):
    """pack_bits (word path for 1/2/4 bits on contiguous uint8 codes at any storage offset, slot loop
    otherwise; from C_MIN_CODES codes the fast version, where a C compiler is present) against the bit-by-bit stream;
    unpack_bits inverts it (into a new tensor and into ``out``);
    the packing of codes [i, j) with i·b a multiple of 8, written into ``out``, is bytes [i·b/8, ceil(j·b/8))
    of the whole packing; ``check=False`` changes nothing for codes in range."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 2**bits, (n + offset,), generator=g, dtype=torch.int64)
    codes = base.to(dtype)[offset:]
    want = _reference_pack(base[offset:].tolist(), bits)
    packed = pack_bits(codes, bits)
    assert packed.tolist() == want
    assert torch.equal(pack_bits(codes, bits, check=False), packed)
    assert torch.equal(pack_bits(torch.stack([codes, codes], 1)[:, 0], bits), packed)  # strided codes
    assert torch.equal(unpack_bits(packed, bits, n), base[offset:])
    assert torch.equal(unpack_bits(torch.stack([packed, packed], 1)[:, 0], bits, n), base[offset:])  # strided
    into = torch.full((n,), 7.5)
    assert torch.equal(unpack_bits(packed, bits, n, out=into), base[offset:].float())
    assert torch.equal(into, base[offset:].float())
    cut = (n // 2) // 8 * 8  # a multiple of 8 codes: whole bytes at any width
    whole = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8)
    pack_bits(codes[:cut], bits, out=whole[: cut * bits // 8])
    pack_bits(codes[cut:], bits, out=whole[cut * bits // 8:])
    assert torch.equal(whole, packed)
    assert torch.equal(unpack_bits(packed[cut * bits // 8:], bits, n - cut), base[offset + cut:])


def test_pack_out_and_unpack_out_of_the_wrong_size_raise():
    with pytest.raises(ValueError, match="out must be"):
        pack_bits(torch.tensor([1, 2, 3, 0]), 2, out=torch.empty(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out must be"):
        pack_bits(torch.tensor([1, 2, 3, 0]), 2, out=torch.empty(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="out holds"):
        unpack_bits(torch.tensor([0x39], dtype=torch.uint8), 2, 4, out=torch.empty(3))


def _kernels(on: bool):
    return contextlib.nullcontext() if on else steps.disabled()


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(C_MIN_CODES - 9, C_MIN_CODES + 70), seed=st.integers(0, 2**31 - 1),
       bad_at=st.one_of(st.none(), st.integers(0, C_MIN_CODES - 10)))
def test_compiled_pass_equals_the_torch_passes(bits, n, seed, bad_at):
    """From C_MIN_CODES codes on the CPU the fast version (where a C compiler is present) gives the reference's
    bytes and codes (packing is integer work: exactly), tails of 1–7 codes included, and rejects a code out of range as they do."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.uint8)
    if bad_at is not None and bits < 8:
        codes[bad_at] = 2**bits
    results = []
    for use_c in (True, False):
        with _kernels(use_c):
            try:
                p = pack_bits(codes, bits)
            except ValueError as e:
                results.append(str(e))
                continue
            results.append((p, unpack_bits(p, bits, n, torch.uint8), unpack_bits(p[:-1], bits, n - 8, torch.uint8)))
    a, b = results
    if isinstance(a, str):
        assert a == b and bad_at is not None
        return
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert torch.equal(a[1], codes)


@pytest.mark.parametrize("use_c", [True, False])
@pytest.mark.parametrize("n", [4095, 8192])
def test_errors_write_nothing_and_come_in_the_same_order(use_c: bool, n: int) -> None:
    """Both passes check the codes' range before writing into ``out`` (left untouched) and before ``out``'s size;
    a ``packed`` of another integer dtype unpacks by value; 8-bit packing returns a new tensor, never a view."""
    with _kernels(use_c):
        codes = torch.randint(0, 16, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
        bad = codes.clone()
        bad[n - 5] = 16
        out = torch.zeros(packed_nbytes(n, 4), dtype=torch.uint8)
        with pytest.raises(ValueError, match="codes must lie in"):
            pack_bits(bad, 4, out=out)
        assert not out.any()
        with pytest.raises(ValueError, match="codes must lie in"):  # the range before the size of out
            pack_bits(bad.long(), 4, out=torch.zeros(5, dtype=torch.uint8))
        p = pack_bits(codes, 4)
        assert torch.equal(unpack_bits(p.to(torch.int32), 4, n, torch.uint8), codes)
        p8 = pack_bits(codes, 8)
        codes[0] += 1
        assert p8[0] != codes[0]
