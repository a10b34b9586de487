"""The fast RTN steps (:mod:`kvqbench.kernels.rtn`, C) against their plain-torch references
(:func:`kvqbench.numerics.rtn.quantize_packed` / :func:`~kvqbench.numerics.rtn.dequantize_packed`, ``.reference``).

Stated tolerance (what the kernel promises on any CPU; ``TIE_ULPS``, ``RTOL``):

* codes: equal, except where the reference's ``(x − lo)/scale`` lies within :data:`TIE_ULPS` fp32 ulps of a
  rounding boundary ``k + ½``; there a code may differ by one step. Measured share of codes that differ, over
  this module's hypothesis examples on the development machine: 0 (bit-identical);
* ``lo`` and ``scale``: equal within relative :data:`RTOL` (one fp32 ulp; measured: equal);
* decoded values from the same packed bytes: within ``RTOL_DEC·(|lo| + |scale|·(2^b − 1))`` of the reference
  (measured: equal);
* the fast version declines exactly the tensors its docstring names (a group holding a NaN or an infinity, a
  range that overflows fp32, a zero of both signs at a group's minimum or maximum) and tensors outside its
  scope; the reference then runs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.kernels import rtn as fast_rtn
from kvqbench.numerics.packing import unpack_bits
from kvqbench.numerics.rtn import (
    PerChannel,
    PerTensor,
    PerToken,
    dequantize_packed,
    quantize_packed,
    to_groups,
)

pytestmark = pytest.mark.skipif(build.load("rtnpack.c") is None, reason="no C compiler (or KVQBENCH_KERNELS=0)")

#: the tolerances the fast versions declare (:data:`kvqbench.kernels.rtn.QUANTIZE_TOL`, ``DEQUANTIZE_TOL``): a
#: code may differ by one step where the reference value is within TIE_ULPS fp32 ulps of a rounding boundary;
#: lo and scale within relative RTOL, decoded values within RTOL_DEC
TIE_ULPS = steps.lookup("rtn.quantize_packed").tol["tie_ulps"]
RTOL = steps.lookup("rtn.quantize_packed").tol["rtol"]
RTOL_DEC = steps.lookup("rtn.dequantize_packed").tol["rtol"]


def _values(draw, gen: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``shape`` from one of several families (ties, zeros, scales over many decades, non-finite)."""
    family = draw(st.sampled_from(["gauss", "grid", "constant", "tiny", "huge", "overflow", "zeros", "nonfinite"]))
    if family == "gauss":  # rows over many decades of scale, some one-signed
        x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen) * 4)
        x += draw(st.sampled_from([0.0, 3.0, -3.0])) * x.abs().amax()
    elif family == "grid":  # a coarse grid: exact ties of (x − lo)/scale
        x = torch.randint(-6, 7, shape, generator=gen).float() * 2.0 ** draw(st.integers(-8, 8)) / 4
    elif family == "constant":  # constant rows and columns mixed with others
        x = torch.randn(shape, generator=gen)
        x.view(-1, shape[-1])[::2] = torch.randn(1, generator=gen).item()
        x[..., ::3] = torch.randn(1, generator=gen).item()
    elif family == "tiny":  # subnormal values and scales
        x = torch.randint(-3, 4, shape, generator=gen).float() * 1.4e-45
        x[x == 0] = 1.4e-45
    elif family == "huge":  # near the fp32 maximum, ranges that still fit
        x = torch.rand(shape, generator=gen) * 3.3e38 - 1.6e38
    elif family == "overflow":  # hi − lo overflows: an infinite scale
        x = torch.randn(shape, generator=gen).sign() * 3.3e38
    else:
        x = torch.randn(shape, generator=gen)
        if family == "zeros":  # signed zeros at a group's extreme
            x.abs_() if draw(st.booleans()) else x.abs_().neg_()
            x.view(-1)[torch.randperm(x.numel(), generator=gen)[: max(1, x.numel() // 7)]] = 0.0
            x.view(-1)[torch.randperm(x.numel(), generator=gen)[: draw(st.integers(0, 4))]] = -0.0
        else:
            x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(
                st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    return x.contiguous()


@st.composite
def cases(draw):
    """``(x, bits, granularity)``: shapes, group sizes (partial groups too), bits 1..8, fp32/fp16/bf16."""
    d = draw(st.sampled_from([8, 16, 40, 64, 128]))
    t = draw(st.sampled_from([1, 3, 8, 24, 64]))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), t, d)
    if draw(st.booleans()):
        g = draw(st.sampled_from([None, 256] + [k for k in (8, 16, 32, 40, 64, 128) if d % k == 0]))
        gran = PerToken(g)  # 256: longer than every row
    else:
        gran = PerChannel(draw(st.sampled_from([None, 1, 2, 5, 8, 24, 100])))  # partial last groups too
    if draw(st.booleans()):  # one group per flattened tensor, as rtn_tensor (rows longer than a packing piece)
        shape, gran = (shape[0], 1, 1, draw(st.sampled_from([8, 2048, 4104]))), PerToken()
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = _values(draw, gen, shape)
    return x.to(draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))), draw(st.integers(1, 8)), gran


def _groups(x: torch.Tensor, gran) -> torch.Tensor:
    """``[n_groups, G]``: every group's values (independent of the kernel's traversal)."""
    xg, _ = to_groups(x if isinstance(gran, PerToken) else x.transpose(-1, -2), -1, gran.group_size)
    return xg.reshape(-1, xg.shape[-1])


def _declines(x: torch.Tensor, bits: int, gran) -> bool:
    """Whether the fast version must decline ``x`` (its docstring), from each group's sorted values and signs."""
    g = _groups(x.float(), gran)
    if not bool(torch.isfinite(g).all()):
        return True
    s = g.sort(-1).values
    lo, hi = s[:, 0], s[:, -1]
    if not bool(torch.isfinite((hi - lo) / (2**bits - 1)).all()):
        return True
    zero = g == 0
    both = (zero & torch.signbit(g)).any(-1) & (zero & ~torch.signbit(g)).any(-1)
    return bool((both & ((lo == 0) | (hi == 0))).any())


def _near_tie(x: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, gran) -> torch.Tensor:
    """Where the reference value ``(x − lo)/scale`` lies within TIE_ULPS ulps of a boundary ``k + ½`` (x's layout)."""
    xg, restore = to_groups(x.float(), -1 if isinstance(gran, PerToken) else -2, gran.group_size)
    v = (xg - lo) / torch.where(scale > 0, scale, torch.full_like(scale, float("inf")))
    frac = (v - torch.floor(v) - 0.5).abs()
    ulp = torch.finfo(torch.float32).eps * v.abs().clamp(min=1.0)
    return restore(frac <= TIE_ULPS * ulp)


def _close(a: torch.Tensor, b: torch.Tensor, tol: torch.Tensor | float) -> bool:
    return bool(((a - b).abs() <= tol).all()) and bool((a.isnan() == b.isnan()).all())


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_fast_rtn_agrees_with_the_reference(case) -> None:
    x, bits, gran = case
    got = fast_rtn.quantize_packed(x, bits, gran)
    assert (got is steps.DECLINED) == _declines(x, bits, gran)
    if got is steps.DECLINED:
        return
    packed, lo, scale = got
    ref_packed, ref_lo, ref_scale = quantize_packed.reference(x, bits, gran)
    assert lo.shape == ref_lo.shape and scale.shape == ref_scale.shape and packed.shape == ref_packed.shape
    assert _close(lo, ref_lo, RTOL * ref_lo.abs()) and _close(scale, ref_scale, RTOL * ref_scale.abs())
    codes = unpack_bits(packed, bits, x.numel()).view(x.shape)
    ref_codes = unpack_bits(ref_packed, bits, x.numel()).view(x.shape)
    differ = codes != ref_codes
    if bool(differ.any()):
        assert bool(((codes - ref_codes).abs() <= 1).all())
        assert bool((~differ | _near_tie(x, ref_lo, ref_scale, gran)).all()), "a code differs away from a tie"
    dec = fast_rtn.dequantize_packed(ref_packed, tuple(x.shape), bits, ref_lo, ref_scale, gran)
    assert dec is not steps.DECLINED
    want = dequantize_packed.reference(ref_packed, tuple(x.shape), bits, ref_lo, ref_scale, gran)
    bound = _per_element(RTOL_DEC * (ref_lo.abs() + ref_scale.abs() * (2**bits - 1)), x, gran)
    assert dec.shape == want.shape and _close(dec, want, bound)


def _per_element(bound: torch.Tensor, x: torch.Tensor, gran) -> torch.Tensor:
    """A per-group bound ``(…, n_groups, 1)`` spread over ``x``'s elements."""
    xg, restore = to_groups(torch.zeros(x.shape), -1 if isinstance(gran, PerToken) else -2, gran.group_size)
    return restore(xg + bound)


def test_the_scope() -> None:
    """Whole-byte per-token groups that divide head_dim (or span it), per-channel groups of any size with head_dim
    a multiple of 8, fp32/fp16/bf16 on the CPU, 1..8 bits; anything else is declined."""
    assert fast_rtn.layout((2, 8, 16, 128), 2, PerToken()) == ("token", 256, 128, 128)
    assert fast_rtn.layout((2, 8, 16, 128), 2, PerChannel(8)) == ("channel", 256, 128, 8)
    assert fast_rtn.layout((1, 1, 16, 96), 2, PerToken(64)) is None  # a partial last group
    assert fast_rtn.layout((1, 1, 16, 36), 2, PerToken()) is None  # groups not whole bytes at every width
    assert fast_rtn.layout((1, 1, 16, 128), 2, PerChannel(5)) == ("channel", 16, 128, 5)
    assert fast_rtn.layout((1, 1, 16, 64), 2, PerToken(128)) == ("token", 16, 64, 64)  # one group per row
    assert fast_rtn.layout((1, 1, 16, 36), 2, PerChannel()) is None
    assert fast_rtn.layout((1, 1, 16, 128), 9, PerToken()) is None
    assert fast_rtn.layout((1, 1, 16, 128), 2, PerTensor()) is None
    x = torch.randn(1, 2, 16, 128)
    assert fast_rtn.quantize_packed(x.double(), 2, PerToken()) is steps.DECLINED
    assert fast_rtn.quantize_packed(x.half(), 2, PerToken()) is not steps.DECLINED


def test_the_dispatcher_runs_the_reference_when_disabled_or_declined() -> None:
    """``quantize_packed`` is the reference inside :func:`kvqbench.steps.disabled` and where the fast version
    declines (a NaN): the same outputs as ``.reference``."""
    x = torch.randn(1, 2, 16, 36)  # head_dim 36: outside the fast version's scope
    for a, b in zip(quantize_packed(x, 3, PerToken()), quantize_packed.reference(x, 3, PerToken())):
        assert torch.equal(a, b)
    x = torch.randn(1, 2, 16, 64)
    with steps.disabled():
        out = quantize_packed(x, 3, PerChannel())
    for a, b in zip(out, quantize_packed.reference(x, 3, PerChannel())):
        assert torch.equal(a, b)
