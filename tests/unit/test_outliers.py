"""Experiment 3 (outliers): closed forms of incoherence, off-diagonal mass, densities, tail shares."""

import math

import pytest
import torch

from kvqbench.data.synthetic import make_synthetic
from kvqbench.experiments.outliers import (
    NORM_DIFF_EDGES,
    TAU,
    norm_diff_density,
    offdiag_mass,
    run_outliers,
    tail_em_share,
)
from kvqbench.metrics import CATALOG
from kvqbench.numerics.attention import incoherence
from kvqbench.numerics.hadamard import hadamard_transform
from kvqbench.quantizers import available, create


@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("amp", [1.0, 37.5])
def test_incoherence_of_one_hot_outlier_before_and_after_hadamard(d, amp):
    x = torch.zeros(1, 1, 1, d, dtype=torch.float64)
    x[..., 5 % d] = amp
    # one channel carries everything: max/RMS = amp / (amp/√D) = √D; the normalized Hadamard spreads it
    # to D entries of magnitude amp/√D: max/RMS = 1
    assert float(incoherence(x)) == pytest.approx(math.sqrt(d), rel=1e-12)
    assert float(incoherence(hadamard_transform(x))) == pytest.approx(1.0, rel=1e-12)


def test_incoherence_channel_rms_over_tokens():
    # channel 0 has RMS 3 over the tokens, the other 3 channels RMS 1: max / RMS_c = 3 / √((9+3)/4)
    x = torch.ones(1, 1, 2, 4, dtype=torch.float64)
    x[..., 0, 0], x[..., 1, 0] = 3.0, -3.0
    assert float(incoherence(x)) == pytest.approx(3 / math.sqrt(3.0), rel=1e-12)
    assert float(incoherence(torch.zeros(1, 1, 3, 4))) == 1.0


def test_offdiag_mass_counts_tokens_beyond_tau():
    x = torch.randn(1, 1, 10, 8, generator=torch.Generator().manual_seed(0))
    x_hat = x.clone()
    x_hat[..., :3, :] *= 1 + 2 * TAU  # 3 of 10 tokens off the diagonal
    x_hat[..., 3:6, :] *= 1 + TAU / 2  # within τ
    assert offdiag_mass(x, x_hat) == pytest.approx(0.3)
    assert offdiag_mass(x, x) == 0.0


def test_norm_diff_density_bins():
    x = torch.zeros(1, 1, 5, 2, dtype=torch.float64)
    x[..., 0] = 1.0  # every token norm 1, RMS token norm 1
    x_hat = x.clone()
    x_hat[..., 0, 0] = 1.005  # +0.005 → bin [0, 0.01)
    x_hat[..., 1, 0] = 0.985  # −0.015 → bin [−0.02, −0.01)
    x_hat[..., 2, 0] = 2.0  # +1 → the tail bin [0.8, 0.8·√2)
    x_hat[..., 4, 0] = 101.0  # +100 → beyond the last edge (51.2): overflow
    dens = norm_diff_density(x, x_hat)
    assert len(dens) == len(NORM_DIFF_EDGES) + 1 and sum(dens) == pytest.approx(1.0)
    zero_bin = 1 + NORM_DIFF_EDGES.index(0.0)
    assert dens[zero_bin] == pytest.approx(0.4)  # token 0 and the unchanged token 3
    assert dens[zero_bin - 2] == pytest.approx(0.2)
    assert dens[1 + NORM_DIFF_EDGES.index(0.8)] == pytest.approx(0.2)
    assert NORM_DIFF_EDGES[NORM_DIFF_EDGES.index(0.8) + 1] == pytest.approx(0.8 * 2 ** 0.5)
    assert dens[-1] == pytest.approx(0.2) and dens[0] == 0.0


def test_tail_em_share_pure_magnitude_and_pure_direction():
    x = torch.randn(1, 2, 500, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert tail_em_share(x, 1.5 * x, 0.99) == pytest.approx(1.0)
    rot = torch.roll(x, 1, dims=-1)  # a permutation keeps every norm: the error is all direction
    assert tail_em_share(x, rot, 0.999) == pytest.approx(0.0, abs=1e-12)
    assert tail_em_share(x, x, 0.99) == 0.0
    with pytest.raises(ValueError):
        tail_em_share(x, x, 1.0)


def test_run_outliers_fp16_is_zero_and_metrics_catalogued():
    d = make_synthetic(seed=0, batch=1, kv_heads=2, q_heads=4, seq_len=128, head_dim=64)
    res = run_outliers(create("fp16", 2, 2), d)
    for name, v in res.metrics.items():
        assert CATALOG[name].experiment == "exp3"
        if name != "k_incoherence_shift" and "incoherence" in name:
            assert v == 1.0  # an all-zero error: incoherence 1 by convention
        else:
            assert v == 0.0, name
    assert res.extra["input_incoherence"]["k_incoherence"] > res.extra["input_incoherence"]["k_incoherence_hadamard"]
    other = run_outliers(create("rtn_token", 2, 2), d)
    assert other.metrics["k_offdiag_mass"] > 0


def test_outliers_every_registered_method_runs_small():
    d = make_synthetic(seed=1, batch=1, kv_heads=1, q_heads=2, seq_len=64, head_dim=64)
    for m in available():
        res = run_outliers(create(m, 2, 2), d)
        assert all(math.isfinite(v) for v in res.metrics.values()), m
