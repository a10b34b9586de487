"""The compiled dense-and-sparse split (:mod:`kvqbench.numerics.dense_sparse`) against KVQuant's torch block steps
(:func:`kvqbench.quantizers.kvquant._split_and_snap`, the second implementation): for every vector the kernel
accepts, the codes, outlier indices and values, dense minimum, midpoint and half-range are bit-identical; it
declines exactly the vectors it documents (tied values at a tail's boundary, a zero dense minimum or maximum, a
NaN or an infinity), and the quantizer's results with the kernel equal those of its torch steps alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics import dense_sparse
from kvqbench.quantizers import kvquant as kvquant_mod
from kvqbench.quantizers.kvquant import KVQuant, outlier_count_per_tail

pytestmark = pytest.mark.skipif(not dense_sparse.available(), reason="no C compiler (or KVQBENCH_KERNELS=0)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


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
    elif family == "constant":  # constant dense part (half-range 0) with distinct outliers, or all constant
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
def blocks_(draw):
    """``(x [B, rows, n], k, cb [B, 2^b])``."""
    n = draw(st.sampled_from([3, 5, 16, 64, 100, 128, 257, 1000]))
    frac = draw(st.sampled_from([0.01, 0.02, 0.1, 0.3, 0.6]))
    k = outlier_count_per_tail(n, frac)
    if k < 1:
        frac, k = 0.99, outlier_count_per_tail(n, 0.99)
    layers, rows, bits = draw(st.integers(1, 3)), draw(st.integers(1, 12)), draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = _vectors(draw, gen, (layers, rows, n))
    cb, _ = torch.sort(torch.randn(layers, 2**bits, generator=gen) * draw(st.sampled_from([0.5, 1.0, 2.0])), -1)
    if draw(st.booleans()):
        cb = cb[:1].expand(layers, -1)  # one codebook for every layer
    return x, frac, k, cb


def _declines(x: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, rows]``: the vectors the kernel must decline, from sorted values (independent of its heaps)."""
    s = x.sort(-1).values
    n = x.shape[-1]
    lo, hi = s[..., k], s[..., n - 1 - k]
    tied = (s[..., k - 1] == lo) | (s[..., n - k] == hi)
    return tied | (lo == 0) | (hi == 0) | ~torch.isfinite(x).all(-1)


@settings(max_examples=300, deadline=None)
@given(case=blocks_())
def test_compiled_split_gives_the_torch_bits(case) -> None:
    x, frac, k, cb = case
    q = KVQuant(outlier_frac=frac)
    want_codes = torch.full(x.shape, 7, dtype=torch.uint8)
    with torch.no_grad():
        want = kvquant_mod._split_and_snap(q, x, cb, want_codes)
    got_codes = torch.full(x.shape, 9, dtype=torch.uint8)
    out = dense_sparse.quantize_rows(x, k, (cb[:, 1:] + cb[:, :-1]).div_(2).contiguous(), got_codes)
    assert out is not None
    got, declined = out
    expect = _declines(x, k)
    assert torch.equal(torch.zeros_like(expect) if declined is None else declined, expect)
    keep = ~expect
    assert torch.equal(_bits(got_codes[keep]), _bits(want_codes[keep]))
    for a, b, name in zip(got, want, ("idx", "lo", "mid", "half", "values"), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(_bits(a[keep]), _bits(b[keep])), name


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_quantizer_with_the_kernel_equals_its_torch_steps(data) -> None:
    """Whole :class:`KVQuant` round trips (K and V, in-sample codebooks, blocks with declined vectors) store the
    same bytes and decode the same values with and without the kernel; NaN/Inf raise the same error."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    shape = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), data.draw(st.sampled_from([2, 9, 70, 300])),
             data.draw(st.sampled_from([16, 64, 128])))
    x = _vectors(data.draw, gen, shape)
    kind, bits = data.draw(st.sampled_from(["k", "v"])), data.draw(st.integers(1, 4))
    frac = data.draw(st.sampled_from([0.01, 0.05, 0.2]))
    results = []
    assert kvquant_mod._compiled_ok()
    try:
        for compiled in (True, False):
            kvquant_mod._COMPILED["ok"] = compiled
            try:
                qt = KVQuant(bits, outlier_frac=frac).quantize(x, kind)
            except ValueError as e:
                results.append(("error", str(e)))
                continue
            rec = KVQuant(bits, outlier_frac=frac).dequantize(qt)
            results.append(({name: _bits(f.tensor) for name, f in qt.fields.items()}, _bits(rec)))
    finally:
        kvquant_mod._COMPILED["ok"] = True
    (a, ra), (b, rb) = results
    if a == "error":
        assert (a, ra) == (b, rb)
        return
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(ra, rb)


def test_the_once_per_process_check_passes_and_scope() -> None:
    """The quantizer's own check (its probe vectors: Gaussian, Cauchy, one-signed, constant dense part,
    subnormal, huge, sorted; every width; NaN/Inf/tied vectors declined and redone) accepts the kernel on this
    host; the kernel's scope is fp32 CPU vectors of at least 2k + 1 values with k ≥ 1 and ≤ 255 thresholds."""
    assert kvquant_mod._compiled_ok()
    x, mids = torch.randn(1, 2, 64), torch.zeros(1, 3)
    codes = torch.empty(1, 2, 64, dtype=torch.uint8)
    assert dense_sparse.quantize_rows(x, 2, mids, codes) is not None
    assert dense_sparse.quantize_rows(x, 0, mids, codes) is None  # no outliers: the torch steps
    assert dense_sparse.quantize_rows(x, 32, mids, codes) is None  # n < 2k + 1
    assert dense_sparse.quantize_rows(x.double(), 2, mids, codes) is None
    assert dense_sparse.quantize_rows(x, 2, torch.zeros(1, 256), codes) is None
    assert dense_sparse.quantize_rows(x.transpose(1, 2).contiguous().transpose(1, 2), 2, mids, codes) is None
