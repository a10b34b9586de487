"""TurboQuant's fused MSE stage (:mod:`kvqbench.kernels.turboquant`, C) against its plain-torch references
(:func:`kvqbench.quantizers.turboquant.encode` / :func:`~kvqbench.quantizers.turboquant.decode`, ``.reference``).

Stated tolerance. Both compute a ``D``-term dot product of a unit row with a column of an orthogonal matrix in fp32,
in different summation orders, so by the standard forward error bound the rotated values differ by at most
``γ = D·2⁻²³`` (plus the last-ulp difference of the row's norm, ``≤ 2⁻²⁰``):

* norms within ``2⁻²⁰`` relative; the row maxima equal;
* codes equal except where the reference's rotated value lies within ``TIE = (D + 8)·2⁻²³`` of a threshold
  (measured on an AMD EPYC over 1.5·10⁸ Gaussian-row codes, D ∈ {64, 128, 256}, 1/2/4/8 bits: 1.1·10⁻⁶ of the
  codes differ — ≤ 2·10⁻⁷ at 1–4 bits, 2·10⁻⁶–8·10⁻⁶ at 8 bits — every one at such a near-tie);
* decoded values within ``(D + 2)·2⁻²³·‖c[idx]‖·‖x‖`` per row (``c[idx]`` the row's centroids).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.kernels import turboquant as fast_tq
from kvqbench.numerics.lloyd_max import lloyd_max
from kvqbench.quantizers.turboquant import _draws, decode, encode, unit_rows

pytestmark = pytest.mark.skipif(build.load("turboquant.c") is None, reason="no C compiler (or KVQBENCH_KERNELS=0)")

#: the tolerances the fast versions declare (:data:`kvqbench.kernels.turboquant.ENCODE_TOL`, ``DECODE_TOL``)
ENCODE_TOL = steps.lookup("turboquant.encode").tol
EPS = ENCODE_TOL["eps"]
DECODE_EPS = steps.lookup("turboquant.decode").tol["eps"]


def _setup(bits: int, d: int, seed: int):
    pi = _draws(seed, d)[0].float()
    cent, thr = lloyd_max("gaussian", bits, (1.0 / math.sqrt(d),)).tensors(dtype=torch.float32)
    return pi, cent, thr


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), d=st.sampled_from([32, 64, 96, 128, 256]), n=st.integers(1, 300),
       seed=st.integers(0, 2**31 - 1), log_scale=st.sampled_from([-30, -3, 0, 3, 30]))
def test_encode_agrees_with_the_reference_except_at_near_ties(bits, d, n, seed, log_scale):
    pi, _, thr = _setup(bits, d, seed % 7)
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * 10.0**log_scale
    x[::5, ::3] = 0.0  # sparse rows
    if n > 3:
        x[3] = 0.0  # a zero row stays zero
    got = fast_tq.encode(x, pi.T.contiguous(), thr)
    assert got is not steps.DECLINED
    codes, norm, amax = got
    ref_codes, ref_norm, ref_amax = encode.reference(x, pi.T.contiguous(), thr)
    assert torch.equal(amax, ref_amax)
    assert torch.allclose(norm, ref_norm, rtol=ENCODE_TOL["norm_rtol"], atol=0.0)
    diff = codes != ref_codes
    if diff.any():  # only at values within TIE of a threshold
        u, _, _ = unit_rows(x)
        y = (u @ pi.T.contiguous())[diff]
        gap = (y[:, None] - thr[None, :]).abs().amin(dim=1)
        assert bool((gap <= (d + 8) * EPS).all()), f"codes differ away from a threshold: {gap.max()}"


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), d=st.sampled_from([32, 64, 96, 128, 256]), n=st.integers(1, 300),
       seed=st.integers(0, 2**31 - 1), log_scale=st.sampled_from([-30, 0, 30]))
def test_decode_agrees_with_the_reference_within_the_bound(bits, d, n, seed, log_scale):
    pi, cent, _ = _setup(bits, d, seed % 7)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, cent.numel(), (n, d), generator=gen, dtype=torch.uint8)
    norm = torch.rand(n, 1, generator=gen) * 10.0**log_scale
    got = fast_tq.decode(codes, norm, pi, cent)
    assert got is not steps.DECLINED
    ref = decode.reference(codes, norm, pi, cent)
    bound = (d + 2) * DECODE_EPS * torch.linalg.vector_norm(cent[codes.long()], dim=1, keepdim=True) * norm
    assert bool(((got - ref).abs() <= bound).all())


def test_a_nan_row_shows_in_its_maximum():
    pi, _, thr = _setup(2, 64, 0)
    x = torch.randn(9, 64)
    x[4, 7] = float("nan")
    x[6, 1] = float("inf")
    _, _, amax = fast_tq.encode(x, pi.T.contiguous(), thr)
    assert math.isnan(amax[4, 0]) and math.isinf(amax[6, 0])
    assert bool(torch.isfinite(amax[[0, 1, 2, 3, 5, 7, 8]]).all())


def test_outside_scope_declines():
    pi, cent, thr = _setup(2, 64, 0)
    x = torch.randn(5, 64)
    assert fast_tq.encode(x.double(), pi.T.contiguous().double(), thr.double()) is steps.DECLINED
    assert fast_tq.encode(torch.randn(5, 48), torch.eye(48), thr) is steps.DECLINED  # D not a multiple of 32
    codes = torch.full((5, 64), 4, dtype=torch.uint8)  # beyond a 2-bit codebook: the reference raises
    assert fast_tq.decode(codes, torch.ones(5, 1), pi, cent) is steps.DECLINED
    with pytest.raises(IndexError):
        decode(codes, torch.ones(5, 1), pi, cent)
