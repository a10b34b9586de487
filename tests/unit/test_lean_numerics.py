"""Numerics against independent formulations: packing of uint8 codes, per-channel groups against per-token
groups of the transposed tensor, and the finiteness check every method gets from the base class (exact: rejects
NaN/Inf, never finite data)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics.packing import pack_bits, unpack_bits
from kvqbench.numerics.rtn import PerChannel, PerToken, rtn_quantize
from kvqbench.quantizers import available, create
from kvqbench.quantizers.base import all_finite


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.uint8, torch.int64]))
def test_pack_unpack_inverse_for_uint8_and_int64(bits: int, n: int, seed: int, dtype: torch.dtype) -> None:
    c = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(seed)).to(dtype)
    p = pack_bits(c, bits)
    assert torch.equal(p, pack_bits(c.to(torch.int64), bits))  # the bytes do not depend on the input dtype
    for out in (torch.uint8, torch.int64):
        u = unpack_bits(p, bits, n, out)
        assert u.dtype == out and torch.equal(u.to(torch.int64), c.to(torch.int64))


def test_out_of_range_uint8_codes_raise() -> None:
    with pytest.raises(ValueError, match="codes must lie in"):
        pack_bits(torch.tensor([0, 4], dtype=torch.uint8), 2)


@pytest.mark.parametrize(("t", "g"), [(64, 16), (64, None), (48, 48)])
def test_per_channel_groups_equal_per_token_groups_of_the_transpose(t: int, g: int | None) -> None:
    x = torch.randn(2, 3, t, 8, generator=torch.Generator().manual_seed(t)) * 3
    codes, lo, scale = rtn_quantize(x, 3, PerChannel(g))
    codes2, lo2, scale2 = rtn_quantize(x.transpose(-1, -2), 3, PerToken(g))  # (B, H, D, T): groups along T
    assert torch.equal(lo, lo2) and torch.equal(scale, scale2)
    assert torch.equal(codes, codes2.transpose(-1, -2))


@pytest.mark.parametrize("method", available())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finite_check_rejects_nan_inf(method: str, bad: float) -> None:
    x = torch.randn(1, 2, 32, 16)
    x[0, 1, 7, 3] = bad
    with pytest.raises(ValueError, match="contains 1 NaN/Inf"):
        create(method, 2).quantize(x, "k")


@pytest.mark.parametrize("method", ["rtn_token", "rtn_tensor", "kivi"])
def test_finite_check_accepts_finite_data_whose_range_overflows(method: str) -> None:
    x = torch.zeros(1, 1, 32, 16)
    x[..., 0], x[..., 1] = -3e38, 3e38  # hi − lo overflows to inf: the check must look at x itself
    qt = create(method, 2).quantize(x, "k")
    assert qt.effective_bits() > 0


def test_all_finite_is_exact() -> None:
    x = torch.full((1000,), 3e38)  # finite values whose sum overflows
    assert all_finite(x)
    x[500] = float("nan")
    assert not all_finite(x)


def test_layout_variants_hold_the_same_values_in_other_layouts():
    import torch

    from kvqbench.numerics.layouts import layout_variants

    x = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(0))
    for name, y in layout_variants(x).items():
        assert torch.equal(y, x), name
        assert y.shape == x.shape and y.dtype == x.dtype
        assert y.stride() != x.stride() or y.storage_offset() != x.storage_offset(), name
