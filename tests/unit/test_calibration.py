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
