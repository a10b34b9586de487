"""The compiled butterflies (``kvqbench.kernels.hadamard``, ``fwht.c``) against their reference,
:func:`kvqbench.numerics.hadamard.fwht` in plain torch (``fwht.reference``).

Stated tolerance: every finite output within ``2^-22 · max|row|`` of the reference's (a few ulps of the
row's largest partial sum — both run the same fp32 additions in the same order, so they agree to the bit on
every input measured: 0 differing values over the examples below); the same positions NaN, the same
infinities. Over head_dims that are and are not powers of two (block-diagonal), scales over many decades,
subnormal, overflowing, NaN and infinite values, strided rows, in place and into ``out``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import (
    kernels,  # noqa: F401  (registers the fast versions)
    steps,
)
from kvqbench.numerics.hadamard import fwht

#: the tolerance the fast version declares (:data:`kvqbench.kernels.hadamard.TOL`), relative to the row's max |x|
RTOL_ROW = steps.lookup("hadamard.fwht").tol["rtol_row"]


def _fast():
    k = steps.lookup("hadamard.fwht")
    if k is None or not steps.enabled():
        pytest.skip("no fast fwht registered, or KVQBENCH_KERNELS=0")
    probe = k.fn(torch.ones(1, 4))
    if probe is steps.DECLINED:
        pytest.skip("the compiled butterflies do not load here (no C compiler)")
    return k.fn


@st.composite
def rows(draw):
    d = draw(st.sampled_from([1, 2, 3, 8, 16, 64, 80, 96, 128, 192, 256]))
    n = draw(st.integers(1, 20))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    family = draw(st.sampled_from(["gauss", "tiny", "huge", "nonfinite"]))
    x = torch.randn(n, d + 2, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen) * 4)
    if family == "tiny":
        x *= 1e-41
    elif family == "huge":
        x = x.sign() * 3e38
    elif family == "nonfinite":
        for _ in range(draw(st.integers(1, 4))):
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(
                [float("nan"), -float("nan"), float("inf"), -float("inf")]))
    return x[:, 1 : d + 1]  # rows with a stride of d + 2


def _agree(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], want[inf])
    fin = torch.isfinite(want)
    bound = RTOL_ROW * torch.nan_to_num(x.float().abs(), posinf=0.0).amax(-1, keepdim=True).expand_as(want)
    assert bool(((got - want).abs()[fin] <= bound[fin]).all())


@settings(max_examples=200, deadline=None)
@given(x=rows())
def test_compiled_butterflies_agree_with_the_reference(x) -> None:
    fast = _fast()
    want = fwht.reference(x)
    got = fast(x)
    _agree(got, want, x)
    inplace = x.contiguous()
    assert fast(inplace, out=inplace) is inplace
    _agree(inplace, want, x)


@settings(max_examples=30, deadline=None)
@given(x=rows(), dtype=st.sampled_from([torch.float16, torch.bfloat16]), lead=st.integers(1, 3))
def test_half_inputs_are_computed_in_fp32(x, dtype, lead) -> None:
    fast = _fast()
    xh = x.to(dtype).expand(lead, 2, *x.shape)  # leading dims, a broadcast view
    got, want = fast(xh), fwht.reference(xh)
    assert got.dtype == torch.float32
    _agree(got, want, xh.float())


def test_declines_what_it_does_not_cover() -> None:
    """fp64, empty input and a bad ``out`` go to the reference (which keeps fp64 and raises for the ``out``)."""
    fast = _fast()
    x = torch.randn(3, 64, dtype=torch.float64)
    assert fast(x) is steps.DECLINED and fwht(x).dtype == torch.float64
    assert fast(torch.empty(0, 64)) is steps.DECLINED
    bad = torch.empty(3, 64, dtype=torch.float64)
    assert fast(x.float(), out=bad) is steps.DECLINED
    with pytest.raises(ValueError, match="out must be"):
        fwht(x.float(), out=bad)


def test_off_switch_runs_the_reference(monkeypatch) -> None:
    """With kernels off the dispatching ``fwht`` is the reference itself (bit for bit)."""
    x = torch.randn(4, 96)
    monkeypatch.setenv(steps.ENV, "0")
    assert torch.equal(fwht(x), fwht.reference(x))
