"""The fast PolarQuant steps (:mod:`kvqbench.kernels.polarquant`, C) against their plain-torch references
(:func:`kvqbench.quantizers.polarquant.wrap_angle`, :func:`~kvqbench.quantizers.polarquant.group_codes`,
:func:`~kvqbench.quantizers.polarquant.midpoints`, ``.reference``).

Stated tolerance: each step is the reference's fp32 operations in its order, so angles, codes, group extremes and
midpoints are **equal** (bit for bit; measured share of differing codes over these examples: 0). Where a group's
minimum or maximum is not finite, ``group_codes`` declines and the reference runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.kernels import polarquant as fast_pq
from kvqbench.quantizers.polarquant import group_codes, midpoints, to_polar, wrap_angle

pytestmark = pytest.mark.skipif(build.load("polarquant.c") is None, reason="no C compiler (or KVQBENCH_KERNELS=0)")


def _keys(draw, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    family = draw(st.sampled_from(["gauss", "grid", "constant", "tiny", "signed_zero"]))
    if family == "gauss":
        return torch.randn(shape, generator=gen) * 10.0 ** draw(st.integers(-6, 6))
    if family == "grid":  # exact ties of (v − min)/s and angles on the axes
        return torch.randint(-3, 4, shape, generator=gen).float() * 2.0 ** draw(st.integers(-6, 6))
    if family == "constant":
        x = torch.randn(shape, generator=gen)
        x[..., ::2, :] = torch.randn(1, generator=gen).item()
        return x
    if family == "tiny":  # subnormal values
        return torch.randint(-3, 4, shape, generator=gen).float() * 1.4e-45
    x = torch.zeros(shape)  # ±0 pairs and tiny negative angles near the 2π seam
    x[..., ::2] = -0.0
    x[..., 1::3, :] = -1e-30
    return x


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fast_steps_equal_the_reference(data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    b, h = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    t, d = data.draw(st.integers(1, 300)), 2 * data.draw(st.integers(1, 40))
    g, bits = data.draw(st.sampled_from([1, 7, 32, 128, 512])), data.draw(st.integers(1, 8))
    x = _keys(data.draw, gen, (b, h, t, d))
    with steps.disabled():
        rho, phi = to_polar(x)
    raw = torch.atan2(x[..., d // 2 :], x[..., : d // 2])
    fast_phi = fast_pq.wrap_angle(raw.clone())
    assert torch.equal(fast_phi, wrap_angle.reference(raw.clone()))
    for v in (rho, phi):
        ref = group_codes.reference(v, g, bits)
        got = fast_pq.group_codes(v, g, bits)
        assert got is not steps.DECLINED
        for r, f in zip(ref, got):
            assert r.shape == f.shape and r.dtype == f.dtype
            assert torch.equal(r, f)
        codes, mn, mx = ref
        assert torch.equal(fast_pq.midpoints(codes, mn, mx, g, bits), midpoints.reference(codes, mn, mx, g, bits))


def test_group_codes_declines_non_finite_extremes():
    v = torch.randn(1, 1, 8, 4)
    v[0, 0, 3, 1] = math.inf
    assert fast_pq.group_codes(v, 4, 3) is steps.DECLINED
    codes, mn, mx = group_codes(v, 4, 3)  # the reference ran
    assert torch.equal(mx, group_codes.reference(v, 4, 3)[2])


def test_outside_scope_declines():
    v = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    assert fast_pq.group_codes(v, 4, 3) is steps.DECLINED
    assert fast_pq.wrap_angle(v) is steps.DECLINED
    assert fast_pq.wrap_angle(torch.randn(4, 6).t()) is steps.DECLINED
