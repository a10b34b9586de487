"""Quantizer-level properties at extreme scales and layouts, over every registered method (built-in or
third-party), fp32/fp16/bf16, bits 2–8 (issue 9, items 9–13).

* scale: the relative error at input scale ``s`` is within 2× of its value at ``s = 1`` (plus a few
  ulps of the dtype, the output's own rounding), for ``s`` from 1e-30 to 1e30 in fp32 and bf16 and over
  fp16's normal range; never NaN, never an all-zero output for a non-zero input;
* range: the output is finite in the input's dtype, also for fp16 data at the top of its range (a
  reconstruction beyond ``finfo.max`` saturates);
* layout: the same values as a contiguous tensor, a transposed-back view, a strided slice or a view
  with a storage offset give bitwise the same output;
* self-describing: a representation made with non-default constructor arguments decodes bitwise the
  same with a default-constructed instance of the method;
* KVQuant: its codebook has distinct levels whatever the data (zero or constant heads, ties), and none
  is empty when the data hold enough distinct values.

Each example quantizes small tensors; heavy methods get fewer examples (``_examples``).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvqbench.numerics.layouts import layout_variants
from kvqbench.quantizers import available, create, get
from kvqbench.quantizers.base import QuantizedTensor, Quantizer, Stored, _saturate

from .strategies import kv_tensors

ALL = available()
BITS = st.integers(2, 8)
KINDS = st.sampled_from(["k", "v"])
DTYPE = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
#: methods whose round trip costs much more than RTN's (k-means fits, 16 VarN iterations, D×D rotations)
HEAVY = {"kvquant", "kvarn", "turboquant"}
#: non-default values for constructor keywords, applied to any method that accepts the keyword
ALT_KWARGS = {
    "group_size": 48, "seed": 3, "variant": "prod", "rotation": "hadamard", "codebook": "beta",
    "boost_fraction": 0.1, "outlier_frac": 0.05, "attention_sink": True, "varn_iters": 8,
    "clip_ratio": 0.9, "v_fp16": True, "residual_tokens": 0, "kmeans_iters": 20,
}


def _examples(method_id: str, n: int = 25) -> settings:
    return settings(max_examples=max(8, n // 2) if method_id in HEAVY else n)


def _make(method_id: str, bits: int, calib: torch.Tensor, **kw) -> Quantizer:
    q = create(method_id, bits, bits, **kw)
    if not q.local_stats:
        q.fit(k=calib, v=calib)
    return q


def _relerr(y: torch.Tensor, x: torch.Tensor) -> float:
    xd = x.double()
    return float(torch.linalg.vector_norm(y.double() - xd) / torch.linalg.vector_norm(xd))


def _unit(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp64 with max |x| = 1 (non-zero input)."""
    xd = x.double()
    return xd / xd.abs().amax()


def _scales(dtype: torch.dtype):
    if dtype == torch.float16:  # max |x| from 2^-10 (elements mostly normal) to 2^14 (< 65504/2)
        return st.integers(-10, 14).map(lambda e: 2.0**e)
    return st.integers(-30, 30).map(lambda e: 10.0**e) | st.integers(-99, 99).map(lambda e: 2.0**e)


def _kv(**kw):
    return kv_tensors(max_heads=2, max_tokens=40, head_dims=(8, 16, 32, 64), dtypes=(torch.float32,), **kw)


@pytest.mark.parametrize("method_id", ALL)
def test_relative_error_does_not_depend_on_scale(method_id):
    @_examples(method_id)
    @given(x=_kv(), dtype=DTYPE, kind=KINDS, bits=BITS, data=st.data())
    def prop(x, dtype, kind, bits, data):
        s = data.draw(_scales(dtype), label="scale")
        xu = _unit(x)
        ref_x, ref_c = xu.to(dtype), (0.5 * xu.flip(2)).to(dtype)
        x_s, c_s = (xu * s).to(dtype), (0.5 * xu.flip(2) * s).to(dtype)
        y1 = _make(method_id, bits, ref_c).roundtrip(ref_x, kind)
        ys = _make(method_id, bits, c_s).roundtrip(x_s, kind)
        assert bool(torch.isfinite(ys).all()), f"non-finite output at scale {s:g}"
        assert bool((ys != 0).any()), f"all-zero output at scale {s:g}"
        e1, es = _relerr(y1, ref_x), _relerr(ys, x_s)
        slack = 4 * torch.finfo(dtype).eps
        assert e1 / 2 - slack <= es <= 2 * e1 + slack, f"relative error {es:.4g} at scale {s:g} vs {e1:.4g}"

    prop()


@pytest.mark.parametrize("method_id", ALL)
def test_output_finite_and_saturates_at_the_top_of_fp16(method_id):
    @_examples(method_id, 12)
    @given(x=_kv(), kind=KINDS, bits=BITS, top=st.sampled_from([0.5, 0.9, 1.0]))
    def prop(x, kind, bits, top):
        xh = (_unit(x) * torch.finfo(torch.float16).max * top).to(torch.float16)
        y = _make(method_id, bits, xh.flip(2)).roundtrip(xh, kind)
        assert y.dtype == torch.float16 and bool(torch.isfinite(y).all())

    prop()


def test_base_saturates_a_reconstruction_beyond_the_dtype_range():
    """The base contract: a decoder whose fp32 reconstruction exceeds fp16's range returns ±65504, not ±Inf;
    NaN is not hidden."""

    class Overshoot(Quantizer):
        id = "overshoot_test_only"

        def _quantize(self, x, kind, bits):
            qt = self._new_qt(x, kind, bits)
            qt.fields["v"] = Stored(x.float() * 4.0, 16)
            return qt

        def _dequantize(self, qt: QuantizedTensor) -> torch.Tensor:
            return qt["v"]

        def nominal_bits_for(self, kind, bits, shape):
            return 16.0

    x = torch.tensor([60000.0, -60000.0, 1.0, 0.0], dtype=torch.float16).reshape(1, 1, 1, 4)
    y = Overshoot(4).roundtrip(x, "k")
    big = torch.finfo(torch.float16).max
    assert y.tolist() == [[[[big, -big, 4.0, 0.0]]]]
    assert bool(torch.isnan(_saturate(torch.tensor([float("nan")]), torch.float16)).all())
    assert torch.equal(_saturate(torch.tensor([float("inf")]), torch.float32), torch.tensor([torch.finfo(torch.float32).max]))




@pytest.mark.parametrize("method_id", ALL)
def test_result_depends_only_on_the_values_not_the_layout(method_id):
    @_examples(method_id, 16)
    @given(x=kv_tensors(max_heads=2, max_tokens=40, head_dims=(8, 16, 32, 64, 96)), kind=KINDS, bits=BITS)
    def prop(x, kind, bits):
        q = _make(method_id, bits, x.flip(2))
        y = q.roundtrip(x, kind)
        for name, xl in layout_variants(x).items():
            assert torch.equal(xl, x)
            assert torch.equal(q.roundtrip(xl, kind), y), f"{name} layout gives other bits"

    prop()


def _alt_kwargs(method_id: str) -> dict:
    accepted = inspect.signature(get(method_id).__init__).parameters
    return {k: v for k, v in ALT_KWARGS.items() if k in accepted}


@pytest.mark.parametrize("method_id", ALL)
def test_representation_decodes_with_a_default_instance(method_id):
    kw = _alt_kwargs(method_id)

    @_examples(method_id, 12)
    @given(x=kv_tensors(max_heads=2, max_tokens=130, head_dims=(16, 32, 64)), kind=KINDS, bits=BITS)
    def prop(x, kind, bits):
        q = _make(method_id, bits, x.flip(2), **kw)
        qt = q.quantize(x, kind)
        assert torch.equal(get(method_id)().dequantize(qt), q.dequantize(qt)), f"params {kw}"

    prop()


@st.composite
def _degenerate_heads(draw):
    """K/V with some heads all zero or constant, or tied values."""
    x = draw(kv_tensors(max_batch=2, max_heads=3, max_tokens=40, head_dims=(8, 16, 32), dtypes=(torch.float32,)))
    mode = draw(st.sampled_from(["zero_head", "constant_head", "ties", "all_constant"]))
    x = x.clone()
    if mode == "zero_head":
        x[:, 0] = 0.0
    elif mode == "constant_head":
        x[:, -1] = draw(st.sampled_from([-2.0, 0.5, 3.0]))
    elif mode == "ties":
        x = torch.round(x / x.abs().amax() * 2) / 2
    else:
        x = torch.full_like(x, 1.5)
    return x


@settings(max_examples=30)
@given(x=_degenerate_heads(), kind=KINDS, bits=st.integers(1, 6), fitted=st.booleans())
def test_kvquant_codebook_has_distinct_levels_none_wasted(x, kind, bits, fitted):
    q = create("kvquant", bits, bits)
    if fitted:
        q.fit(k=x, v=x)
    qt = q.quantize(x, kind)
    cb = qt["codebook"]
    assert bool((cb[:, 1:] > cb[:, :-1]).all()), "repeated codebook level"
    # every level is the nearest one for some value when a layer's live (non-constant) vectors hold
    # plenty of distinct normalized values (4 per level: with barely k values k-means may spend a level
    # on two values one rounding apart, e.g. 1 and 1 − 2^-24 from two vectors' normalized maxima)
    from kvqbench.numerics import dense_sparse
    from kvqbench.quantizers.kvquant import outlier_count_per_tail

    vec = q._vectors(x.float(), kind)
    out_idx, mid, half = dense_sparse.split(vec, outlier_count_per_tail(vec.shape[-1], q.outlier_frac))
    dense = dense_sparse.dense_mask(vec, out_idx)
    y = dense_sparse.normalize(vec, mid, half)
    # levels lie in the normalized range [−1, 1] (or the data's, which may pass ±1 by a rounding)
    assert float(cb.min()) >= min(-1.0, float(y.min())) and float(cb.max()) <= max(1.0, float(y.max()))
    codes = qt.codes("codes")
    for layer in range(x.shape[0]):
        live = (half[layer, :, 0] > 0)
        vals = torch.unique(y[layer][live][dense[layer][live]])
        if vals.numel() >= 4 * 2**bits:
            used = torch.unique(codes[layer][live][dense[layer][live]])
            assert used.numel() == 2**bits, f"layer {layer}: {2**bits - used.numel()} empty levels"
    y_hat = q.dequantize(qt)
    assert bool(torch.isfinite(y_hat).all())
