"""The fast ``zpoint.quantize`` / ``zpoint.dequantize`` (:mod:`kvqbench.kernels.zpoint`, C) against their
references (:func:`kvqbench.numerics.zpoint.quantize_groups`, :func:`~kvqbench.numerics.zpoint.dequantize_groups`,
plain torch), over shapes, group sizes, widths 1..8, clip ratios and six decades of scale.

Stated tolerance:

* codes (and integer zero-points) equal, except where the reference's quotient ``x/scale`` (``−lo·clip/scale``)
  lies within :data:`TIE_ULPS` fp32 ulps of a rounding boundary (a half-integer), where they may differ by one;
* scales within ``rtol = 1e-6`` (a few fp32 ulps), zero-points of equal value (a zero may carry either sign);
* decoded values within ``|scale|·|Δcode| + 1e-6·|value|``.

Measured share of differing codes on random inputs (:func:`test_share_of_differing_codes_is_measured`, 2·10^6
codes over the families below, this host): 0 — both sides perform the same IEEE fp32 operations per element.
The kernel declines (``steps.DECLINED``, the reference then runs) exactly outside its stated conditions and
for a NaN or an infinity; the quantizer's results with kernels on and off agree within the same tolerance at
every input dtype.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.numerics.packing import unpack_bits
from kvqbench.numerics.zpoint import dequantize_groups, quantize_groups
from kvqbench.quantizers import create
from kvqbench.quantizers.quarot import CLIP_RATIO

from .strategies import kv_tensors

pytestmark = pytest.mark.skipif(build.load("zpoint.c") is None,
                                reason="no C compiler (or KVQBENCH_KERNELS=0): only the reference runs")

#: the tolerances the fast versions declare (:data:`kvqbench.kernels.zpoint.QUANTIZE_TOL`, ``DEQUANTIZE_TOL``)
TIE_ULPS = steps.lookup("zpoint.quantize").tol["tie_ulps"]
RTOL = steps.lookup("zpoint.quantize").tol["rtol"]
RTOL_DEC = steps.lookup("zpoint.dequantize").tol["rtol"]
EPS32 = torch.finfo(torch.float32).eps


def _fast(step: str):
    return steps.lookup(step).fn


def near_tie(v: torch.Tensor) -> torch.Tensor:
    """Whether each quotient ``v`` (fp64) lies within :data:`TIE_ULPS` fp32 ulps of a half-integer."""
    return (v - torch.floor(v) - 0.5).abs() <= TIE_ULPS * EPS32 * v.abs().clamp_min(1.0)


@st.composite
def rotated_rows(draw):
    """``(xr [..., d] fp32, g, bits, include_zero, clip)``: rows of groups from one of several families."""
    d = draw(st.sampled_from([8, 16, 24, 40, 64, 128]))
    g = draw(st.sampled_from([k for k in (8, 16, 24, 32, 40, 64, 128) if d % k == 0]))
    lead = draw(st.sampled_from([(5,), (1, 3, 7), (2, 1, 13)]))
    bits = draw(st.integers(1, 8))
    include_zero = draw(st.booleans())
    clip = draw(st.sampled_from([CLIP_RATIO, 1.0, 0.5, 0.8125]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    family = draw(st.sampled_from(["gauss", "grid", "constant", "tiny", "zeros"]))
    shape = (*lead, d)
    if family == "gauss":  # groups over six decades of scale, some one-signed
        x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(*lead, 1, generator=gen) * 3)
        x += draw(st.sampled_from([0.0, 3.0, -3.0])) * x.abs().amax()
    elif family == "grid":  # a coarse grid: many exact ties of x/scale
        x = torch.randint(-6, 7, shape, generator=gen).float() * 2.0 ** draw(st.integers(-8, 8)) / 4
    elif family == "constant":  # constant groups (the degenerate-scale guard) among others
        x = torch.randn(shape, generator=gen)
        x.view(-1, g)[::2] = torch.randn(1, generator=gen).item()
    elif family == "tiny":  # subnormal values: clipped ranges that round to zero
        x = torch.randint(-3, 4, shape, generator=gen).float() * 1.4e-45
    else:  # signed zeros as group minima or maxima
        x = torch.randn(shape, generator=gen).abs() * draw(st.sampled_from([1.0, -1.0]))
        x.view(-1, g)[:, 0] = draw(st.sampled_from([0.0, -0.0]))
    return x.contiguous(), g, bits, include_zero, clip


def _agree(xr: torch.Tensor, g: int, bits: int, include_zero: bool, clip: float) -> tuple[int, int]:
    """Assert the stated tolerance between fast and reference on ``xr``; returns ``(differing codes, codes)``."""
    ref = quantize_groups.reference(xr, g, bits, include_zero=include_zero, clip_ratio=clip)
    got = _fast("zpoint.quantize")(xr, g, bits, include_zero=include_zero, clip_ratio=clip)
    assert got is not steps.DECLINED
    (p_ref, s_ref, z_ref), (p_got, s_got, z_got) = ref, got
    assert s_got.shape == s_ref.shape and z_got.shape == z_ref.shape and p_got.shape == p_ref.shape
    torch.testing.assert_close(s_got, s_ref, rtol=RTOL, atol=0)
    xg = xr.double().view(*xr.shape[:-1], -1, g)
    lo = xg.amin(-1, keepdim=True)
    if include_zero:
        lo = lo.clamp(max=0.0)
    s64 = s_ref.double()
    z_tie = near_tie(-(lo.float() * clip).double() / torch.where(s64 > 0, s64, torch.ones_like(s64)))
    z_ok = (z_got == z_ref) | z_tie
    assert bool(z_ok.all()), "zero-points differ away from a rounding tie"
    n = xr.numel()
    q_ref = unpack_bits(p_ref, bits, n).view(*xr.shape[:-1], -1, g)
    q_got = unpack_bits(p_got, bits, n).view(q_ref.shape)
    differ = q_got != q_ref
    tie = near_tie(xg / torch.where(s64 > 0, s64, torch.full_like(s64, float("inf")))) | z_tie
    assert bool((~differ | tie).all()), "codes differ away from a rounding tie"
    assert int((q_got - q_ref).abs().max()) <= 1
    dec_ref = dequantize_groups.reference(p_ref, tuple(xr.shape), g, bits, s_ref, z_ref)
    dec_got = _fast("zpoint.dequantize")(p_got, tuple(xr.shape), g, bits, s_got, z_got)
    assert dec_got is not steps.DECLINED
    bound = (s_ref.abs() * (q_got - q_ref).abs()).view(xr.shape) + RTOL_DEC * dec_ref.abs()
    assert bool(((dec_got - dec_ref).abs() <= bound).all())
    return int(differ.sum()), n


@settings(max_examples=200, deadline=None)
@given(case=rotated_rows())
def test_fast_agrees_with_the_reference_within_the_stated_tolerance(case) -> None:
    # _agree asserts the stated tolerance (codes equal away from a rounding tie, off by at most one step at one,
    # decoded values within the step they differ by); what it returns is the count of differing codes
    differ, n = _agree(*case)
    assert 0 <= differ <= n and n == case[0].numel()


def test_share_of_differing_codes_is_measured() -> None:
    """The share stated in the module docstring: 0 differing codes in 2·10^6 (Gaussian rows over six decades of
    scale, K and V, every width, the default and a full clip)."""
    gen = torch.Generator().manual_seed(2404)
    differ = total = 0
    for bits in range(1, 9):
        for include_zero, clip in ((True, CLIP_RATIO), (False, CLIP_RATIO), (False, 1.0), (True, 1.0)):
            x = torch.randn(488, 128, generator=gen) * torch.exp(torch.randn(488, 1, generator=gen) * 3)
            d, n = _agree(x, 128, bits, include_zero, clip)
            differ, total = differ + d, total + n
    assert total >= 2_000_000 - 50_000
    assert differ == 0


def test_declines_outside_its_conditions() -> None:
    """``DECLINED`` (then the reference runs) for fp64, a partial last group, groups not a multiple of 8 codes,
    a non-contiguous tensor, 9 bits, and a NaN or an infinity; applies otherwise."""
    q = _fast("zpoint.quantize")
    x = torch.randn(4, 64)
    assert q(x, 64, 2, include_zero=True, clip_ratio=CLIP_RATIO) is not steps.DECLINED
    assert q(x.double(), 64, 2, include_zero=True, clip_ratio=CLIP_RATIO) is steps.DECLINED
    assert q(x, 48, 2, include_zero=True, clip_ratio=CLIP_RATIO) is steps.DECLINED  # partial last group
    assert q(x, 4, 2, include_zero=True, clip_ratio=CLIP_RATIO) is steps.DECLINED
    assert q(x.t().contiguous().t(), 4, 2, include_zero=True, clip_ratio=CLIP_RATIO) is steps.DECLINED
    assert q(x, 64, 9, include_zero=True, clip_ratio=CLIP_RATIO) is steps.DECLINED
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[2, 5] = bad
        assert q(y, 64, 2, include_zero=True, clip_ratio=CLIP_RATIO) is steps.DECLINED
    p, s, z = q(x, 64, 2, include_zero=True, clip_ratio=CLIP_RATIO)
    dq = _fast("zpoint.dequantize")
    assert dq(p, (4, 64), 64, 2, s, z) is not steps.DECLINED
    assert dq(p, (4, 64), 64, 2, s.double(), z.double()) is steps.DECLINED


def _fields_agree(a, b) -> None:
    assert set(a.fields) == set(b.fields) == {"codes", "scale", "zero"}
    torch.testing.assert_close(a["scale"], b["scale"], rtol=RTOL, atol=0)
    q_a, q_b = a.codes("codes"), b.codes("codes")
    assert int((q_a - q_b).abs().max()) <= 1


@settings(max_examples=40, deadline=None)
@given(x=kv_tensors(max_tokens=160, head_dims=(8, 16, 32, 48, 64, 96, 128)), kind=st.sampled_from(["k", "v"]),
       bits=st.integers(1, 8), group=st.sampled_from([None, 8, 16, 24]))
def test_quarot_with_kernels_on_and_off_agrees(x, kind, bits, group) -> None:
    """Whole QuaRot round trips, fp32/fp16/bf16 inputs, head_dims that are and are not powers of two, partial
    groups (the reference runs): kernels on and off store parameters within ``rtol`` and codes within one step
    (equal on every draw here), and decode within the bound."""
    q = create("quarot", bits, bits, group_size=group)
    qt_on = q.quantize(x, kind)
    with steps.disabled():
        qt_off = q.quantize(x, kind)
        rec_off = q.dequantize(qt_off)
    rec_on = q.dequantize(qt_on)
    _fields_agree(qt_on, qt_off)
    assert torch.equal(qt_on.codes("codes"), qt_off.codes("codes"))
    assert rec_on.dtype == rec_off.dtype == x.dtype
    tol = float(torch.finfo(x.dtype).eps) * 4
    torch.testing.assert_close(rec_on.float(), rec_off.float(), rtol=tol, atol=tol * float(rec_off.float().abs().max()))


@settings(max_examples=30, deadline=None)
@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 64), st.sampled_from([16, 64, 128])),
       dtype=st.sampled_from([torch.float32, torch.float16]), kind=st.sampled_from(["k", "v"]),
       bits=st.integers(1, 4), frac=st.sampled_from([1e-3, 0.05, 0.4, 0.999]), seed=st.integers(0, 2**31 - 1))
def test_quarot_near_the_top_of_the_range_saturates_with_kernels_on_and_off(shape, dtype, kind, bits, frac, seed):
    """Near the top of the dtype's range the decode leaves the dtype's range (saturated at ±finfo.max, never
    ±Inf; NaN where an overflowing scale meets a zero code offset) or the rotation on quantize overflows (the same ``ValueError`` or an accepted finite input), with
    kernels on and off alike."""
    big = float(torch.finfo(dtype).max)
    g = torch.Generator().manual_seed(seed)
    x = ((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * (big * frac)).to(dtype)
    out = []
    for off in (False, True):
        q = create("quarot", bits, bits)
        try:
            if off:
                with steps.disabled():
                    out.append(q.dequantize(q.quantize(x, kind)))
            else:
                out.append(q.dequantize(q.quantize(x, kind)))
        except ValueError as e:
            out.append(str(e))
    if isinstance(out[0], str) or isinstance(out[1], str):
        assert out[0] == out[1]
        return
    for rec in out:
        assert not torch.isinf(rec).any()
    # an infinite scale decodes a code equal to its zero-point to NaN (inf·0), on both sides alike
    torch.testing.assert_close(out[0].float(), out[1].float(), rtol=1e-2, atol=big * 1e-3, equal_nan=True)
