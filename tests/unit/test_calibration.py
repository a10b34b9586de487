"""Data-dependent methods are fitted on an independent calibration batch, never on the scored tensor."""

import dataclasses

import torch

from kvqbench.data.synthetic import make_synthetic
from kvqbench.experiments.common import roundtrip_kv
from kvqbench.quantizers import create


def _data(seed):
    return make_synthetic(seed=seed, kv_heads=2, seq_len=256, head_dim=64)


def test_fit_uses_the_calibration_batch():
    data, calib = _data(0), _data(99)
    in_sample = roundtrip_kv(create("kvquant", 2, 2), data)
    with_cal = roundtrip_kv(create("kvquant", 2, 2), dataclasses.replace(data, calibration=calib))
    # second route: fit by hand on the calibration batch, then quantize the evaluation batch
    q = create("kvquant", 2, 2)
    q.fit(k=calib.k, v=calib.v)
    by_hand = q.dequantize(q.quantize(data.v, "v"))
    assert torch.equal(with_cal.v_hat, by_hand)
    assert not torch.equal(with_cal.v_hat, in_sample.v_hat)
    # a calibration batch identical to the data reproduces the in-sample fit
    same = roundtrip_kv(create("kvquant", 2, 2), dataclasses.replace(data, calibration=_data(0)))
    assert torch.equal(same.v_hat, in_sample.v_hat)


def test_local_methods_ignore_calibration():
    data, calib = _data(1), _data(2)
    for m in ("kivi", "kvarn", "turboquant"):
        a = roundtrip_kv(create(m, 2, 2), data)
        b = roundtrip_kv(create(m, 2, 2), dataclasses.replace(data, calibration=calib))
        assert torch.equal(a.k_hat, b.k_hat) and torch.equal(a.v_hat, b.v_hat)


def test_window_and_truncate_keep_calibration_and_rope():
    data = dataclasses.replace(_data(3), calibration=_data(4))
    w = data.window(64, 128)
    assert w.k.shape[2] == 64 and torch.equal(w.k, data.k[:, :, 64:128]) and w.calibration is data.calibration
    assert data.truncate(32).calibration is data.calibration


def test_reused_fit_equals_a_fresh_fit_and_is_not_shared():
    """``fit_method(..., reuse=True)`` memoizes the fitted state per (class, params) on the calibration
    data: a later instance gets the state a fit of its own gives (codebooks, Fisher flags, round trip),
    as a copy; other bits or seeds get their own fit; the fit is never shared across data objects."""
    from kvqbench.experiments.common import fit_method

    data = dataclasses.replace(_data(5), calibration=_data(6))
    fresh = fit_method(create("kvquant", 2, 2, seed=1), data)  # no reuse: an ordinary fit
    first = fit_method(create("kvquant", 2, 2, seed=1), data, reuse=True)  # fits and memoizes
    n_cached = len(data.calibration.cache)
    again = fit_method(create("kvquant", 2, 2, seed=1), data, reuse=True)  # from the memo
    assert len(data.calibration.cache) == n_cached
    for m in (first, again):
        for kind in ("k", "v"):
            assert torch.equal(m.codebook(kind), fresh.codebook(kind))
        assert m.fisher_weighted == fresh.fisher_weighted and m.fitted == {"k": True, "v": True}
        assert torch.equal(m.dequantize(m.quantize(data.v, "v")), fresh.dequantize(fresh.quantize(data.v, "v")))
    assert again.codebook("k") is not first.codebook("k")  # a copy: no cell can alter another's state
    other = fit_method(create("kvquant", 4, 4, seed=1), data, reuse=True)
    assert len(data.calibration.cache) == n_cached + 1 and other.codebook("v").shape[-1] == 16
    # another data object (same values) holds its own memo
    twin = dataclasses.replace(_data(5), calibration=_data(6))
    fit_method(create("kvquant", 2, 2, seed=1), twin, reuse=True)
    assert len(twin.calibration.cache) == 1
    # a local method has no state to fit or memoize
    fit_method(create("kivi", 2, 2), twin, reuse=True)
    assert len(twin.calibration.cache) == 1
