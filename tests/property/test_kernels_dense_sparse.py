"""The fast ``dense_sparse.quantize`` (:mod:`kvqbench.kernels.dense_sparse`, C) against its reference
(:func:`kvqbench.numerics.dense_sparse.quantize`, plain torch), over vector lengths, outlier counts, 1..8-bit
codebooks (per layer and shared), scales over many decades, heavy tails, ties and non-finite values.

Stated tolerance:

* outlier positions and values equal (both select the ``k`` largest and smallest values; vectors whose tails
  tie at their boundary are given to the reference by the kernel);
* midpoints and half-ranges within ``rtol = 1e-6`` (a few fp32 ulps; equal in value on every draw);
* codes equal, except where the reference's normalized value ``y = (x − mid)/half`` lies within
  :data:`TIE_ULPS` fp32 ulps of a threshold (a midpoint between levels), where they may differ by one;
* decoded values within ``|Δlevel|·half + 1e-6·|value|``.

Measured share of differing codes on random inputs (:func:`test_share_of_differing_codes_is_measured`,
about 1.3·10^6 codes, this host): 0 — both sides perform the same IEEE fp32 operations per element. KVQuant's
results with kernels on and off agree within the same tolerance.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.numerics import dense_sparse
from kvqbench.quantizers.kvquant import KVQuant, outlier_count_per_tail

pytestmark = pytest.mark.skipif(build.load("dense_sparse.c") is None,
                                reason="no C compiler (or KVQBENCH_KERNELS=0): only the reference runs")

#: the tolerance the fast version declares (:data:`kvqbench.kernels.dense_sparse.TOL`)
TIE_ULPS = steps.lookup("dense_sparse.quantize").tol["tie_ulps"]
RTOL = steps.lookup("dense_sparse.quantize").tol["rtol"]
EPS32 = torch.finfo(torch.float32).eps


def _fast(vec: torch.Tensor, k: int, cb: torch.Tensor):
    return steps.lookup("dense_sparse.quantize").fn(vec, k, cb)


def _vectors(draw, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Vectors of ``shape`` from one of several families (ties and non-finite values included)."""
    n = shape[-1]
    family = draw(st.sampled_from(["gauss", "cauchy", "grid", "sorted", "constant", "tiny", "huge", "zeros",
                                   "nonfinite"]))
    if family == "gauss":  # vectors over many decades of scale, some one-signed
        x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen) * 4)
        x += draw(st.sampled_from([0.0, 3.0, -3.0])) * x.abs().amax()
    elif family == "cauchy":  # heavy tails
        x = torch.distributions.Cauchy(0.0, 1.0).sample(shape)
    elif family == "grid":  # few distinct values: tied tails in most vectors
        x = torch.randint(-draw(st.integers(1, 40)), 41, shape, generator=gen).float() * 2.0 ** draw(st.integers(-8, 8))
    elif family == "sorted":  # every value a new candidate for a tail
        x = torch.randn(shape, generator=gen).sort(-1, descending=draw(st.booleans())).values
    elif family == "constant":  # constant dense part (half-range 0) with distinct outliers
        x = torch.full(shape, torch.randn(1, generator=gen).item())
        x[..., ::7] += torch.arange(len(range(0, n, 7)), dtype=torch.float32) + 1
    elif family == "tiny":  # subnormal
        x = torch.randn(shape, generator=gen) * 1e-41
    elif family == "huge":  # hi − lo overflows: an infinite half-range
        x = torch.randn(shape, generator=gen).sign() * torch.rand(shape, generator=gen).add(1) * 1.5e38
    else:  # signed zeros at the dense boundary, or a NaN/inf
        x = torch.randn(shape, generator=gen)
        at = draw(st.integers(0, x.numel() - 1))
        if family == "zeros":
            x.view(-1, n)[at // n].abs_()  # all positive: a zero is the minimum
            x.view(-1)[at] = draw(st.sampled_from([0.0, -0.0]))
        else:
            x.view(-1)[at] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    return x.contiguous()


@st.composite
def vector_blocks(draw):
    """``(vec [B, rows, n], k, codebook [B, 2^b])``."""
    n = draw(st.sampled_from([3, 5, 16, 64, 100, 128, 257, 1000]))
    k = outlier_count_per_tail(n, draw(st.sampled_from([0.01, 0.02, 0.1, 0.3, 0.6])))
    k = max(k, 1)
    layers, rows, bits = draw(st.integers(1, 3)), draw(st.integers(1, 12)), draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = _vectors(draw, gen, (layers, rows, n))
    cb, _ = torch.sort(torch.randn(layers, 2**bits, generator=gen) * draw(st.sampled_from([0.5, 1.0, 2.0])), -1)
    if draw(st.booleans()):
        cb = cb[:1].expand(layers, -1)  # one codebook for every layer
    return x, k, cb


def _agree(x: torch.Tensor, k: int, cb: torch.Tensor) -> tuple[int, int]:
    """Assert the stated tolerance on finite ``x``; returns ``(differing codes, codes)``."""
    codes_r, idx_r, mid_r, half_r, val_r = dense_sparse.quantize.reference(x, k, cb)
    got = _fast(x, k, cb)
    assert got is not steps.DECLINED
    codes_f, idx_f, mid_f, half_f, val_f = got
    assert torch.equal(idx_f, idx_r) and torch.equal(val_f, val_r)
    torch.testing.assert_close(mid_f, mid_r, rtol=RTOL, atol=0)
    torch.testing.assert_close(half_f, half_r, rtol=RTOL, atol=0)
    dense = dense_sparse.dense_mask(x, idx_r)
    differ = (codes_f != codes_r) & dense
    y = dense_sparse.normalize(x, mid_r, half_r).double()
    th = ((cb[:, 1:] + cb[:, :-1]) / 2).double()[:, None, None, :]  # [B, 1, 1, m]
    tie = ((y.unsqueeze(-1) - th).abs() <= TIE_ULPS * EPS32 * y.abs().clamp_min(1.0).unsqueeze(-1)).any(-1)
    assert bool((~differ | tie).all()), "codes differ away from a threshold"
    assert int((codes_f.long() - codes_r.long()).abs().max()) <= 1
    c = cb.unsqueeze(1)
    dec_r = torch.gather(c.expand(-1, x.shape[1], -1), -1, codes_r.long()) * half_r + mid_r
    dec_f = torch.gather(c.expand(-1, x.shape[1], -1), -1, codes_f.long()) * half_f + mid_f
    dl = (torch.gather(c.expand(-1, x.shape[1], -1), -1, codes_f.long())
          - torch.gather(c.expand(-1, x.shape[1], -1), -1, codes_r.long())).abs()
    bound = dl * half_r.abs() + RTOL * dec_r.abs()
    live = torch.isfinite(dec_r) & dense
    assert bool(((dec_f - dec_r).abs() <= bound)[live].all())
    return int(differ.sum()), int(dense.sum())


@settings(max_examples=200, deadline=None)
@given(case=vector_blocks())
def test_fast_agrees_with_the_reference_within_the_stated_tolerance(case) -> None:
    x, k, cb = case
    if not bool(torch.isfinite(x).all()):  # the kernel gives these vectors to the reference: the same results
        got, ref = _fast(x, k, cb), dense_sparse.quantize.reference(x, k, cb)
        finite = torch.isfinite(x).all(-1)
        for a, b in zip(got, ref, strict=True):
            assert torch.allclose(a[~finite].double(), b[~finite].double(), rtol=0, atol=0, equal_nan=True)
        x = torch.where(finite.unsqueeze(-1), x, torch.zeros_like(x))
    _agree(x, k, cb)


def test_share_of_differing_codes_is_measured() -> None:
    """The share stated in the module docstring: 0 differing codes (Gaussian and Cauchy vectors, K-like
    4096-long and V-like 128-long, every width)."""
    gen = torch.Generator().manual_seed(2401)
    differ = total = 0
    for bits in range(1, 9):
        cb, _ = torch.sort(torch.randn(2, 2**bits, generator=gen).clamp(-1, 1), -1)
        for n, rows in ((4096, 8), (128, 256)):
            k = outlier_count_per_tail(n, 0.01)
            x = torch.randn(2, rows, n, generator=gen) * torch.exp(torch.randn(2, rows, 1, generator=gen) * 3)
            d, t = _agree(x, k, cb)
            y = torch.distributions.Cauchy(0.0, 1.0).sample((2, rows // 2, n))
            d2, t2 = _agree(y, k, cb)
            differ, total = differ + d + d2, total + t + t2
    assert total > 1_000_000
    assert differ == 0


def test_declines_outside_its_conditions() -> None:
    """``DECLINED`` (then the reference runs) without outliers, for ``n < 2k + 1``, fp64, more than 256 levels;
    tied tails, NaN and infinities are handed vector by vector to the reference (equal results)."""
    x, cb = torch.randn(1, 4, 64), torch.linspace(-1, 1, 4).unsqueeze(0)
    assert _fast(x, 2, cb) is not steps.DECLINED
    assert _fast(x, 0, cb) is steps.DECLINED
    assert _fast(x, 32, cb) is steps.DECLINED
    assert _fast(x.double(), 2, cb) is steps.DECLINED
    assert _fast(x, 2, torch.linspace(-1, 1, 257).unsqueeze(0)) is steps.DECLINED
    x[0, 1, 5], x[0, 2, 7] = float("nan"), float("-inf")
    x[0, 3] = x[0, 3].round()
    x[0, 3, 0] = x[0, 3, 1] = x[0, 3].max()  # tied top tail
    got, ref = _fast(x, 2, cb), dense_sparse.quantize.reference(x, 2, cb)
    for a, b in zip(got, ref, strict=True):
        assert torch.allclose(a.double(), b.double(), equal_nan=True)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_kvquant_with_kernels_on_and_off_agrees(data) -> None:
    """Whole KVQuant round trips (K and V, in-sample and fitted codebooks): kernels on and off store the same
    outliers, parameters within ``rtol``, codes within one step (equal on every draw here), and decode within the
    bound; NaN/Inf raise the same error."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    shape = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.sampled_from([2, 9, 70, 300])),
             data.draw(st.sampled_from([16, 64, 128])))
    x = _vectors(data.draw, gen, shape)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    if data.draw(st.booleans()):
        x = x.clamp(-6e4, 6e4).to(dtype)
    kind, bits = data.draw(st.sampled_from(["k", "v"])), data.draw(st.integers(1, 4))
    frac, fitted = data.draw(st.sampled_from([0.01, 0.05, 0.2])), data.draw(st.booleans())
    results = []
    for off in (False, True):
        q = KVQuant(bits, outlier_frac=frac)
        try:
            with steps.disabled() if off else contextlib.nullcontext():
                if fitted:
                    q.fit(k=torch.randn(shape, generator=torch.Generator().manual_seed(1)),
                          v=torch.randn(shape, generator=torch.Generator().manual_seed(2)))
                qt = q.quantize(x, kind)
                results.append((qt, q.dequantize(qt)))
        except ValueError as e:
            results.append(str(e))
    if isinstance(results[0], str) or isinstance(results[1], str):
        assert results[0] == results[1]
        return
    (a, ra), (b, rb) = results
    assert set(a.fields) == set(b.fields)
    for name in ("outlier_index", "outlier_value", "outlier_ptr", "codebook"):
        if name in a.fields:
            assert torch.equal(a[name], b[name]), name
    for name in ("mid", "half"):
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=0, equal_nan=True)
    assert torch.equal(a.codes("codes"), b.codes("codes"))
    torch.testing.assert_close(ra, rb, rtol=RTOL, atol=0, equal_nan=True)
