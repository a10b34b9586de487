"""Reconstruction metrics: the E_T = E_M + E_D identity and closed forms."""

import pytest
import torch

from kvqbench.numerics import metrics as M


def test_error_split_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 16, generator=g)
    y = x + 0.3 * torch.randn(2, 3, 40, 16, generator=g)
    y[0, 0, 0] = 0.0  # a zero reconstruction
    x[0, 0, 1] = 0.0  # a zero input
    e_t, e_m, e_d = M.error_split(x, y)
    assert torch.allclose(e_m + e_d, e_t, rtol=1e-10, atol=1e-10)
    assert bool((e_m >= 0).all()) and bool((e_d >= -1e-9).all())


def test_pure_scaling_is_all_magnitude_and_rotation_all_direction():
    x = torch.randn(1, 1, 64, 8, generator=torch.Generator().manual_seed(1))
    e_t, e_m, e_d = M.error_split(x, 1.1 * x)
    assert torch.allclose(e_m, e_t) and float(e_d.abs().max()) < 1e-9
    assert M.norm_bias(x, 1.1 * x) == pytest.approx(0.1)
    # a 90° rotation within a pair keeps norms: all direction
    y = x.clone()
    y[..., 0], y[..., 1] = -x[..., 1], x[..., 0]
    y[..., 2:] = x[..., 2:]
    e_t, e_m, e_d = M.error_split(x, y)
    assert float(e_m.max()) < 1e-9
    shares = M.em_share_at_quantiles(x, y)
    assert all(v < 1e-9 for v in shares.values())


def test_mse_and_rel_mse_closed_form():
    x = torch.full((1, 1, 10, 4), 2.0)
    y = x + 0.5
    assert M.mse(x, y) == pytest.approx(0.25)
    assert M.rel_mse(x, y) == pytest.approx(0.25 / 4.0)
    assert M.rel_mse(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)) == 0.0


def test_token_errors_equal_the_per_metric_functions_bit_for_bit():
    # the shared per-token terms of exp1/exp3 against the functions each metric had on its own, per layer
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 50, 16, generator=g)
    y = x + 0.2 * torch.randn(3, 2, 50, 16, generator=g)
    x[1, 0, 3] = 0.0  # a zero input token
    te = M.token_errors(x, y)
    assert te.mse.tolist() == [M.mse(x[i : i + 1], y[i : i + 1]) for i in range(3)]
    assert M.rel_mse_of(te.mse, M.energy_per_layer(x)) == [M.rel_mse(x[i : i + 1], y[i : i + 1]) for i in range(3)]
    # (the masked mean of norm_bias sums in another order than the batched one: equal up to rounding)
    assert M.norm_bias_of_norms(te.nx, te.ny) == pytest.approx([M.norm_bias(x[i : i + 1], y[i : i + 1])
                                                                for i in range(3)], rel=1e-12)
    for i in range(3):
        e_t, e_m, _ = M.error_split(x[i : i + 1], y[i : i + 1])
        assert torch.equal(te.e_t[i], e_t[0]) and torch.equal(te.e_m[i], e_m[0])
        assert M.em_share_of_split(te.e_t[i], te.e_m[i]) == M.em_share_at_quantiles(x[i : i + 1], y[i : i + 1])
    assert torch.equal(te.sq, te.diff * te.diff) and torch.equal(te.diff, y.double() - x.double())
