"""The fast packing steps (:mod:`kvqbench.kernels.packing`, C) against their plain-torch references
(:func:`kvqbench.numerics.packing.pack_uint8` / :func:`~kvqbench.numerics.packing.unpack_uint8`, ``.reference``).

Stated tolerance: none — packing is integer work, so the packed bytes and the unpacked codes are equal exactly,
at every width 1..8, for counts with and without a ragged tail of fewer than 8 codes, into a new tensor or into
an ``out`` slice. Below :data:`~kvqbench.kernels.packing.MIN_CODES` codes the fast versions decline."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.kernels import packing as fast
from kvqbench.numerics.packing import pack_bits, pack_uint8, packed_nbytes, unpack_bits, unpack_uint8

pytestmark = pytest.mark.skipif(build.load("packbits.c") is None, reason="no C compiler (or KVQBENCH_KERNELS=0)")


@settings(max_examples=120, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(fast.MIN_CODES, 3 * fast.MIN_CODES + 13), seed=st.integers(0, 2**31 - 1),
       into=st.booleans())
def test_fast_packing_gives_the_reference_bytes(bits: int, n: int, seed: int, into: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)
    want = pack_uint8.reference(codes, bits)
    out = torch.full((packed_nbytes(n, bits),), 0xA5, dtype=torch.uint8) if into else None
    got = fast.pack(codes, bits, out)
    assert got is not steps.DECLINED and torch.equal(got, want)
    if into:
        assert got.data_ptr() == out.data_ptr()
    if bits < 8:
        unpacked = fast.unpack(want, bits, n)
        assert unpacked is not steps.DECLINED and torch.equal(unpacked, unpack_uint8.reference(want, bits, n))
        assert torch.equal(unpacked, codes)


def test_fast_packing_declines_few_codes_and_other_devices_or_dtypes() -> None:
    small = torch.zeros(fast.MIN_CODES - 1, dtype=torch.uint8)
    assert fast.pack(small, 2) is steps.DECLINED
    assert fast.unpack(small, 2, 4 * small.numel()) is not steps.DECLINED  # 4·n codes: enough
    assert fast.unpack(small, 2, fast.MIN_CODES - 1) is steps.DECLINED
    assert fast.pack(torch.zeros(fast.MIN_CODES, dtype=torch.int16), 2) is steps.DECLINED
    assert fast.unpack(torch.zeros(fast.MIN_CODES, dtype=torch.uint8), 8, fast.MIN_CODES) is steps.DECLINED


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(1, 3 * fast.MIN_CODES), seed=st.integers(0, 2**31 - 1))
def test_pack_bits_is_the_same_with_kernels_on_and_off(bits: int, n: int, seed: int) -> None:
    """Through the public functions (range check, dtype cast, dispatch): the same bytes and codes either way."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.int64)
    on = pack_bits(codes, bits)
    with steps.disabled():
        off = pack_bits(codes, bits)
        back_off = unpack_bits(off, bits, n)
    assert torch.equal(on, off)
    assert torch.equal(unpack_bits(on, bits, n), back_off) and torch.equal(back_off, codes)
