"""The butterflies of kvqbench.numerics.hadamard.fwht: the Walsh–Hadamard rotation (equal to x @ Q, the
matrix of hadamard_matrix, up to rounding; its own inverse) — for the dispatching fwht (compiled where it
loads) and its plain-torch reference. Their agreement: tests/property/test_kernels_hadamard.py."""

from __future__ import annotations

import math

import pytest
import scipy.linalg
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvqbench.numerics.hadamard import fwht, hadamard_blocks, hadamard_matrix


@st.composite
def rows_(draw):
    d = draw(st.sampled_from([1, 2, 8, 16, 64, 80, 96, 128, 192, 256]))
    n = draw(st.integers(1, 20))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    family = draw(st.sampled_from(["gauss", "tiny", "huge", "nonfinite", "ints"]))
    x = torch.randn(n, d + 2, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen) * 4)
    if family == "tiny":
        x *= 1e-41
    elif family == "huge":
        x = x.sign() * 3e38
    elif family == "nonfinite":
        for _ in range(draw(st.integers(1, 4))):
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(
                [float("nan"), -float("nan"), float("inf"), -float("inf")]))
    elif family == "ints":  # exact sums: the butterflies and the product agree exactly before the scale
        x = torch.randint(-50, 51, (n, d + 2), generator=gen).float()
    return x[:, 1 : d + 1], family  # rows with a stride of d + 2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@settings(max_examples=100, deadline=None)
@given(case=rows_(), reference=st.booleans())
def test_fwht_is_the_hadamard_rotation_up_to_rounding_and_its_own_inverse(case, reference) -> None:
    x, family = case
    fwht_ = fwht.reference if reference else fwht
    assume(family not in ("huge", "nonfinite"))  # no rounding bound for overflowing or non-finite rows
    d = x.shape[-1]
    y = fwht_(x)
    # an independent rotation: scipy's Sylvester blocks, in fp64
    q = torch.zeros(d, d, dtype=torch.float64)
    start = 0
    for n in hadamard_blocks(d):
        q[start : start + n, start : start + n] = torch.from_numpy(scipy.linalg.hadamard(n)) / math.sqrt(n)
        start += n
    ref = x.double() @ q
    scale = x.double().abs().amax(-1, keepdim=True)
    # log2(d) additions, each rounding by at most half an ulp of a partial sum ≤ √d·max|x|, then the scale
    # (plus the subnormal spacing 2^-149 per operation)
    bound = (math.log2(max(d, 2)) + 2) * (2.0**-24 * math.sqrt(d) * scale + 2.0**-149)
    assert bool(((y.double() - ref).abs() <= bound).all())
    assert torch.allclose(fwht_(y).double(), x.double(), rtol=0, atol=float((2 * bound).max()) + 1e-45)
    assert torch.equal(fwht_(x.double()), fwht_(x.double()))  # fp64 stays fp64, deterministic
    assert fwht_(x.double()).dtype == torch.float64


def test_fwht_out_and_errors() -> None:
    x = torch.randn(2, 3, 5, 128)
    out = torch.empty_like(x)
    assert fwht(x, out=out) is out and torch.equal(out, fwht(x))
    assert torch.allclose(fwht(x), x @ hadamard_matrix(128), atol=1e-5)
    assert fwht(x.half()).dtype == torch.float32
    with pytest.raises(TypeError):
        fwht(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="out must be"):
        fwht(x, out=torch.empty(2, 3, 5, 128, dtype=torch.float64))
    assert fwht(torch.empty(0, 128)).shape == (0, 128)
