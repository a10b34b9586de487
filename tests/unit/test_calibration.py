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


def test_fit_state_is_reused_for_the_same_method_parameters_and_calibration_batch():
    # a second instance with the same id/params on the same calibration batch gets the first one's
    # fitted state (no fit: its fit() would raise here) and quantizes bit-identically to a fresh fit
    from kvqbench.experiments.common import fit_method

    data = make_synthetic(seed=0, batch=1, kv_heads=2, q_heads=4, seq_len=64, head_dim=32)
    data.calibration = make_synthetic(seed=9, batch=1, kv_heads=2, q_heads=4, seq_len=64, head_dim=32)
    first = fit_method(create("kvquant", 2, 2, seed=3), data)
    again = create("kvquant", 2, 2, seed=3)
    again.fit = None  # type: ignore[assignment]  # must not be called
    fit_method(again, data)
    fresh = create("kvquant", 2, 2, seed=3).fit(k=data.calibration.k, v=data.calibration.v)
    for kind in ("k", "v"):
        assert torch.equal(again.codebook(kind), fresh.codebook(kind))
        assert torch.equal(again.dequantize(again.quantize(data.k, kind)), first.dequantize(first.quantize(data.k, kind)))
    other = fit_method(create("kvquant", 2, 2, seed=4), data)  # other params: a fit of its own
    assert other.codebook("k") is not None and len([k for k in data.calibration.cache if k[0] == "fitted_state"]) == 2
