"""The compiled VarN and balanced per-row RTN (``kvqbench.kernels.varn``, ``varn_sums.c``) against their
references in plain torch (:func:`kvqbench.numerics.varn.varn` and ``balanced_rtn_rows``, ``.reference``),
and KVarN with its fast steps against KVarN with every step's reference (``steps.disabled()``).

Stated tolerances (measured figures in brackets):

* VarN: ``imbalance`` and ``imbalance_init`` within ``RTOL_SCALE = 1e-4`` [≤ 3e-6]; ``s_row`` and
  ``s_col`` each within ``RTOL_SCALE`` where both chose the same best iterate; always, the tile's scale
  ``s_row[r]·s_col[c]`` within ``RTOL_SCALE`` up to one factor per tile [≤ 1e-5]. The imbalance does not
  change when a factor moves from the rows to the columns or multiplies the whole tile, and once VarN has
  converged consecutive iterates differ by just such factors, their imbalances tying to ~1e-6 (exactly,
  where every std sits at a clamp): which iterate wins such a tie may differ, and the row and column
  scales then differ by those factors [up to 1.4 % at 16 iterations on Gaussian 128×128 tiles] while the
  balanced tile differs by one factor only, which the per-row RTN absorbs (same codes).
* Balanced RTN on the same scales: ``lo`` and ``scale`` within ``2^-20`` relative, codes equal except where
  the reference's ``(B − lo)/scale`` lies within ``EPS_CODE`` of a rounding boundary ``k + ½`` [both run
  the same fp32 operations: 0 differing codes measured].
* VarN + RTN (fast scales vs reference scales, the reference RTN): codes equal except where the
  reference's ``(B − lo)/scale`` lies within ``EPS_CODE = 2^-10`` code steps of a rounding boundary
  [measured on 8 heads × 4096 tokens × 128 (256 tiles of 128×128, 16 iterations), Gaussian and
  heavy-tailed with channel offsets, K and V, 2 and 4 bits: 4.8e-7 to 7.2e-6 of the codes differ, every one
  within 3.1e-5 code steps of a boundary].
* KVarN round trip: share of differing codes ≤ ``MAX_CODE_SHARE = 1e-3``; the reconstruction within
  ``‖ŷ_fast − ŷ_ref‖_F ≤ sqrt(Σ_differing step²) + RTOL_DEQ·‖ŷ_ref‖_F`` with ``RTOL_DEQ = 1e-4`` (a code that
  differs moves its element by one quantization step ``a[r]·t[c]``; the rest moves with the scales; the
  inverse rotation is orthogonal).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvqbench import (
    kernels,  # noqa: F401  (registers the fast versions)
    steps,
)
from kvqbench.numerics.varn import balanced_rtn_rows, varn
from kvqbench.quantizers.kvarn import SCALE_FLOOR, KVarN

#: the tolerances the fast versions declare (:data:`kvqbench.kernels.varn.ITERATE_TOL`, ``RTN_TOL``)
RTOL_SCALE = steps.lookup("varn.iterate").tol["rtol"]
EPS_CODE = steps.lookup("varn.iterate").tol["eps_code"]
RTOL_RTN = steps.lookup("varn.balanced_rtn").tol["rtol"]
EPS_CODE_RTN = steps.lookup("varn.balanced_rtn").tol["eps_code"]
#: KVarN's round trip with both fast steps (a method's bound, from the steps' bounds above)
MAX_CODE_SHARE = 1e-3
RTOL_DEQ = 1e-4


def _fast(step: str):
    k = steps.lookup(step)
    if k is None or not steps.enabled():
        pytest.skip(f"no fast {step} registered, or KVQBENCH_KERNELS=0")
    if k.fn(torch.ones(2, 2, 2)) is steps.DECLINED if step == "varn.iterate" else False:
        pytest.skip("the compiled VarN does not load here (no C compiler)")
    return k.fn


@st.composite
def tile_batches(draw, *, max_tiles: int = 6):
    """``[lead..., R, C]`` fp32 tiles (maybe a transposed view), with scale and offsets VarN has to balance."""
    n = draw(st.integers(1, max_tiles))
    r = draw(st.sampled_from([1, 2, 3, 7, 16, 64, 96, 128]))
    c = draw(st.sampled_from([1, 2, 5, 16, 64, 80, 128]))
    scale = draw(st.sampled_from([1e-3, 0.1, 1.0, 30.0, 1e3]))
    offset = draw(st.sampled_from([0.0, 4.0, 40.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(n, r, c, generator=g) * torch.exp(torch.randn(n, r, 1, generator=g))
    x = x * torch.exp(torch.randn(n, 1, c, generator=g))
    x = x + offset * (torch.rand(n, 1, c, generator=g) < 0.1) + offset * (torch.rand(n, r, 1, generator=g) < 0.1)
    x = x * scale
    if draw(st.booleans()):  # a transposed view, as KVarN's K tiles
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if draw(st.booleans()):
        x = x.unsqueeze(0)  # one more leading dim
    return x


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> torch.Tensor:
    return (a - b).abs() <= rtol * b.abs()


def _same_balanced_tile(got, want) -> None:
    """``s_row[r]·s_col[c]`` of both within ``RTOL_SCALE`` up to one factor per tile (the balanced tiles are
    proportional: the per-row RTN gives the same codes)."""
    ratio = (got.s_row * got.s_col) / (want.s_row * want.s_col)
    assert bool(_close(ratio, ratio[..., :1, :1].expand_as(ratio), RTOL_SCALE).all())


@settings(max_examples=60, deadline=None)
@given(x=tile_batches(), n_iter=st.sampled_from([0, 1, 2, 4, 16]))
def test_varn_agrees_with_the_reference(x, n_iter) -> None:
    fast = _fast("varn.iterate")
    got, want = fast(x, n_iter), varn.reference(x, n_iter)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert bool(_close(got.imbalance, want.imbalance, RTOL_SCALE).all())
    assert bool(_close(got.imbalance_init, want.imbalance_init, RTOL_SCALE).all())
    _same_balanced_tile(got, want)
    same = (got.best_iter == want.best_iter)[..., None, None]
    assert bool((_close(got.s_row, want.s_row, RTOL_SCALE) | ~same).all())
    assert bool((_close(got.s_col, want.s_col, RTOL_SCALE) | ~same).all())


@settings(max_examples=30, deadline=None)
@given(x=tile_batches(max_tiles=3), dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_varn_of_half_tiles_agrees_with_the_reference(x, dtype) -> None:
    fast = _fast("varn.iterate")
    xh = x.to(dtype)
    assume(bool(torch.isfinite(xh).all()))  # fp16 overflows at 1e3 · e^4
    got, want = fast(xh, 4), varn.reference(xh, 4)
    _same_balanced_tile(got, want)
    assert bool(_close(got.imbalance, want.imbalance, RTOL_SCALE).all())


def _near_boundary(v: torch.Tensor, eps: float) -> torch.Tensor:
    """Where ``v`` (codes before rounding) lies within ``eps`` of some ``k + ½``."""
    return ((v - torch.floor(v)) - 0.5).abs() <= eps


def _reference_codes(x: torch.Tensor, s_col: torch.Tensor, s_row: torch.Tensor, bits: int):
    b = x.float() / s_col / s_row
    q, lo, scale = balanced_rtn_rows.reference(x.float(), s_col, s_row, bits, SCALE_FLOOR)
    return q, lo, scale, (b - lo) / scale


@settings(max_examples=60, deadline=None)
@given(x=tile_batches(), bits=st.sampled_from([1, 2, 3, 4, 8]))
def test_balanced_rtn_agrees_with_the_reference(x, bits) -> None:
    fast = _fast("varn.balanced_rtn")
    res = varn.reference(x, 2)
    q, lo, scale = fast(x, res.s_col, res.s_row, bits, SCALE_FLOOR)
    q_ref, lo_ref, scale_ref, v = _reference_codes(x, res.s_col, res.s_row, bits)
    assert q.dtype == q_ref.dtype == torch.uint8 and q.shape == q_ref.shape
    assert bool(_close(lo, lo_ref, RTOL_RTN).all()) and bool(_close(scale, scale_ref, RTOL_RTN).all())
    assert bool(((q == q_ref) | _near_boundary(v, EPS_CODE_RTN)).all())


@settings(max_examples=40, deadline=None)
@given(x=tile_batches(), bits=st.sampled_from([1, 2, 4]), n_iter=st.sampled_from([1, 4, 16]))
def test_varn_then_rtn_codes_differ_only_at_rounding_boundaries(x, bits, n_iter) -> None:
    """Fast VarN's scales through the reference RTN give the reference's codes except where the reference's
    value lies within ``EPS_CODE`` of a rounding boundary."""
    fast = _fast("varn.iterate")
    got, want = fast(x, n_iter), varn.reference(x, n_iter)
    q_ref, _lo, _scale, v = _reference_codes(x, want.s_col, want.s_row, bits)
    q = balanced_rtn_rows.reference(x.float(), got.s_col, got.s_row, bits, SCALE_FLOOR)[0]
    assert bool(((q == q_ref) | _near_boundary(v, EPS_CODE)).all())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_balanced_rtn_rounds_half_to_even_as_the_reference(bits: int) -> None:
    """Values exactly halfway between two codes and a constant row (scale floor): the compiled RTN gives
    the reference's codes, round half to even."""
    fast = _fast("varn.balanced_rtn")
    levels = 2**bits - 1
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(bits))
    x[0, 0] = torch.arange(96).float() % levels + 1.5  # lo 1, hi 1 + levels (scale 1): every value a tie
    x[0, 0, :2] = torch.tensor([1.0, 1.0 + levels])
    x[1, 2] = 2.0  # constant row
    ones_c, ones_r = torch.ones(2, 1, 96), torch.ones(2, 3, 1)
    q, lo, scale = fast(x, ones_c, ones_r, bits, SCALE_FLOOR)
    ties = torch.arange(2, 96) % levels  # k + 0.5 rounds to the even one of k, k + 1
    assert torch.equal(q[0, 0, 2:].long(), ties + ties % 2)
    assert torch.equal(q[1, 2], torch.zeros(96, dtype=torch.uint8))
    assert float(scale[1, 2]) == float(torch.tensor(SCALE_FLOOR, dtype=torch.float32))
    for a, b in zip((q, lo, scale), balanced_rtn_rows.reference(x, ones_c, ones_r, bits, SCALE_FLOOR)):
        assert torch.equal(a, b)


def test_declines_non_finite_and_bad_arguments() -> None:
    """Non-finite tiles, a negative ``n_iter`` and 9-bit codes go to the reference (which raises where it
    should)."""
    fast = _fast("varn.iterate")
    x = torch.randn(2, 8, 8)
    x[1, 3, 4] = float("nan")
    assert fast(x, 4) is steps.DECLINED
    assert fast(torch.randn(2, 8, 8), -1) is steps.DECLINED
    with pytest.raises(ValueError):
        varn(torch.randn(2, 8, 8), -1)
    rtn = steps.lookup("varn.balanced_rtn").fn
    ones_c, ones_r = torch.ones(2, 1, 8), torch.ones(2, 8, 1)
    assert rtn(torch.randn(2, 8, 8), ones_c, ones_r, 9, SCALE_FLOOR) is steps.DECLINED
    with pytest.raises(ValueError):
        balanced_rtn_rows(torch.randn(2, 8, 8), ones_c, ones_r, 9, SCALE_FLOOR)


def _roundtrips(x: torch.Tensor, kind: str, bits: int, g: int, n_iter: int):
    q = KVarN(bits, group_size=g, varn_iters=n_iter)
    qt = q.quantize(x, kind)
    with steps.disabled():
        qt_ref = q.quantize(x, kind)
        y_ref = q.dequantize(qt_ref)
    return qt, q.dequantize(qt), qt_ref, y_ref


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), h=st.integers(1, 2), t=st.integers(1, 300),
       d=st.sampled_from([16, 64, 96, 128]), g=st.sampled_from([1, 16, 64, 128]), kind=st.sampled_from(["k", "v"]),
       bits=st.sampled_from([1, 2, 4, 8]), scale=st.sampled_from([2.0**-40, 1e-3, 1.0, 1e3, 2.0**30]),
       offset=st.booleans(), n_iter=st.sampled_from([1, 8, 16]))
def test_kvarn_fast_agrees_with_kvarn_reference(seed, h, t, d, g, kind, bits, scale, offset, n_iter) -> None:
    """Every tile size (1-token tiles, partial last tiles), head_dims that are and are not powers of two,
    scales inside and far outside the window: codes within ``MAX_CODE_SHARE``, reconstruction within the
    bound of the module docstring."""
    _fast("varn.iterate")
    x = torch.randn(1, h, t, d, generator=torch.Generator().manual_seed(seed)) * scale
    if offset:
        x[..., d // 3] += 6.0 * scale
    qt, y, qt_ref, y_ref = _roundtrips(x, kind, bits, g, n_iter)
    assert y.shape == y_ref.shape == x.shape and y.dtype == y_ref.dtype
    differ, total, step2 = 0, 0, 0.0
    for name, _s, _n in qt_ref.meta["spans"]:
        c, c_ref = qt.codes(f"{name}.codes"), qt_ref.codes(f"{name}.codes")
        step = qt_ref[f"{name}.row_scale"].unsqueeze(-1) * qt_ref[f"{name}.col_scale"].unsqueeze(-2)
        mask = c != c_ref
        differ += int(mask.sum())
        total += c.numel()
        step2 += float(((step.double() * (c - c_ref).double()) ** 2).sum())
    assert differ <= MAX_CODE_SHARE * total + 1  # (a handful of codes in a tiny tensor)
    bound = math.sqrt(step2) + RTOL_DEQ * float(y_ref.double().norm()) + 1e-30
    assert float((y.double() - y_ref.double()).norm()) <= bound


@pytest.mark.parametrize("kind", ["k", "v"])
def test_kvarn_share_of_differing_codes_on_gaussian_heads(kind: str) -> None:
    """The measured figure of the docstring: 8 heads × 1024 tokens × 128 (64 tiles of 128×128)."""
    _fast("varn.iterate")
    x = torch.randn(1, 8, 1024, 128, generator=torch.Generator().manual_seed(2606))
    qt, _y, qt_ref, _y_ref = _roundtrips(x, kind, 2, 128, 16)
    c, c_ref = qt.codes("full.codes"), qt_ref.codes("full.codes")
    assert float((c != c_ref).float().mean()) <= 1e-5


def test_same_results_at_every_thread_count() -> None:
    """The compiled steps split the tiles over ``torch.get_num_threads()`` threads; each tile is computed on
    its own, so 1, 2 and 3 threads give the same bits (and the caller's thread count is left as it was)."""
    fast, rtn = _fast("varn.iterate"), _fast("varn.balanced_rtn")
    x = torch.randn(2, 37, 64, 96, generator=torch.Generator().manual_seed(9)).transpose(-1, -2)
    nt = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            res = fast(x, 4)
            outs.append((*res, *rtn(x, res.s_col, res.s_row, 2, SCALE_FLOOR)))
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(nt)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
