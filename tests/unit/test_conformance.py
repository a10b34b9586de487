"""Conformance suite over the whole registry (every registered method, built-in or third-party).

Each property holds for any correct method: round-trip preserves shape/dtype/device; exact at 16 bits;
deterministic under a seed; no NaN/Inf on constant, zero and one-sign inputs; effective bits equal the
billed size of what the representation stores (codes packed to real bytes); MSE non-increasing in bits.
"""

import math

import pytest
import torch

from kvqbench.numerics.packing import packed_nbytes
from kvqbench.quantizers import available, create

METHODS = available()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _x(shape=(1, 2, 256, 128), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _fitted(method_id, bits, x, seed=0, **kw):
    q = create(method_id, bits, bits, seed=seed, **kw)
    if not q.local_stats:
        q.fit(k=x, v=x)
    return q


@pytest.mark.parametrize("method_id", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_shape_dtype_device_preserved(method_id, dtype, kind):
    x = _x(dtype=dtype)
    q = _fitted(method_id, 3, x)
    y = q.roundtrip(x, kind)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("method_id", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_exact_at_16_bits(method_id, dtype):
    x = _x(dtype=dtype)
    q = _fitted(method_id, 16, x)
    for kind in ("k", "v"):
        assert torch.equal(q.roundtrip(x, kind), x)
        assert q.nominal_bits(kind) == 16.0


@pytest.mark.parametrize("method_id", METHODS)
def test_deterministic_under_seed(method_id):
    x = _x(seed=5)
    a = _fitted(method_id, 2, x, seed=7)
    b = _fitted(method_id, 2, x, seed=7)
    for kind in ("k", "v"):
        assert torch.equal(a.roundtrip(x, kind), b.roundtrip(x, kind))


@pytest.mark.parametrize("method_id", METHODS)
@pytest.mark.parametrize("case", ["constant", "zero", "positive", "negative"])
def test_degenerate_inputs_stay_finite(method_id, case):
    shape = (1, 2, 256, 128)
    if case == "constant":
        x = torch.full(shape, 0.75)
    elif case == "zero":
        x = torch.zeros(shape)
    else:
        x = _x(shape).abs() + 0.01
        x = x if case == "positive" else -x
    q = _fitted(method_id, 2, x)
    for kind in ("k", "v"):
        y = q.roundtrip(x, kind)
        assert bool(torch.isfinite(y).all()), f"{method_id} {case} {kind}"
        if case == "zero":
            assert float(y.abs().max()) == 0.0, f"{method_id} must reconstruct zeros as zeros"


@pytest.mark.parametrize("method_id", METHODS)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_effective_bits_equal_stored_bits(method_id, bits):
    x = _x()
    q = _fitted(method_id, bits, x)
    for kind in ("k", "v"):
        qt = q.quantize(x, kind)
        total = sum(f.tensor.numel() * f.bits for f in qt.fields.values())
        assert qt.effective_bits() == pytest.approx(total / x.numel())
        # packed code buffers are real bytes: exactly ceil(n*b/8) of them
        for name, f in qt.fields.items():
            nkey = f"{name}.numel"
            if nkey in qt.meta:
                assert f.tensor.dtype == torch.uint8 and f.bits == 8
                assert f.tensor.numel() == packed_nbytes(qt.meta[nkey], qt.meta[f"{name}.bits"])
        # a method at b bits stores at least the b-bit codes of every element
        assert qt.effective_bits() >= min(bits, 16) - 1e-9 or method_id == "fp16"
        # decoding uses only what is stored: a fresh, unfitted instance decodes it identically
        fresh = create(method_id, bits, bits, seed=0)
        assert torch.equal(fresh.dequantize(qt), q.dequantize(qt))


@pytest.mark.parametrize("method_id", METHODS)
def test_mse_non_increasing_in_bits(method_id):
    x = _x(seed=11)
    prev = {"k": math.inf, "v": math.inf}
    for bits in (2, 3, 4, 8, 16):
        q = _fitted(method_id, bits, x)
        for kind in ("k", "v"):
            mse = float(((q.roundtrip(x, kind).double() - x.double()) ** 2).mean())
            assert mse <= prev[kind] * (1 + 1e-6), f"{method_id} {kind}: {bits} bits MSE {mse} > {prev[kind]}"
            prev[kind] = mse
    assert prev["k"] == 0.0 and prev["v"] == 0.0


@pytest.mark.parametrize("method_id", METHODS)
def test_metadata_complete(method_id):
    q = create(method_id, 2)
    d = q.describe()
    assert d["id"] == method_id and d["name"] and d["paper"]
    assert d["fidelity"] in ("faithful", "approximate")
    if d["fidelity"] == "approximate":
        assert d["deltas"], "an approximate method must list its deltas"
    assert isinstance(d["params"], dict) and d["params"]["seed"] == 0
