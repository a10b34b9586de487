"""VarN (KVarN step 2): matches a literal implementation, never increases imbalance, equalizes planted scales —
for the dispatching ``varn`` (the compiled version where it loads) and for the plain-torch reference. The
agreement of the two is tests/property/test_kernels_varn.py."""

from __future__ import annotations

import math

import pytest
import torch

from kvqbench.numerics.varn import LOG_SCALE_CLIP, imbalance, varn


@pytest.fixture(params=["dispatch", "reference"])
def run_varn(request):
    """``varn`` as called (its compiled version where it loads) and its plain-torch reference."""
    return varn if request.param == "dispatch" else varn.reference


def _literal_varn(x: torch.Tensor, n_iter: int = 16) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """The docs/DESIGN.md §7 recipe written out for one 2-D tile, with the balanced tile materialized."""
    def imb(b: torch.Tensor) -> float:
        cs, rs = b.std(0, unbiased=True), b.std(1, unbiased=True)
        return float(cs.max() / cs.min().clamp_min(1e-8) + rs.max() / rs.min().clamp_min(1e-8))

    lc, lr = torch.zeros(1, x.shape[1]), torch.zeros(x.shape[0], 1)
    best_c, best_r, best, best_it = lc.clone(), lr.clone(), imb(x), 0
    for it in range(1, n_iter + 1):
        b = x / torch.exp(lc) / torch.exp(lr)
        lc = torch.clamp(lc + torch.log(b.std(0, keepdim=True).clamp(1e-3, 1e3)), -0.3, 10)
        b = x / torch.exp(lc) / torch.exp(lr)
        lr = torch.clamp(lr + torch.log(b.std(1, keepdim=True).clamp(1e-3, 1e3)), -0.3, 10)
        cur = imb(x / torch.exp(lc) / torch.exp(lr))
        if cur <= best:
            best_c, best_r, best, best_it = lc.clone(), lr.clone(), cur, it
    return torch.exp(best_r), torch.exp(best_c), best, best_it


def _planted(seed: int, n: int = 4, r: int = 64, c: int = 48, row_spread: float = 3.0, col_spread: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, r, c, generator=g)
    rs = torch.exp(torch.rand(n, r, 1, generator=g) * row_spread)
    cs = torch.exp(torch.rand(n, 1, c, generator=g) * col_spread)
    return base, base * rs * cs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_matches_literal_recipe(seed: int, run_varn) -> None:
    _, tiles = _planted(seed)
    res = run_varn(tiles)
    for i in range(tiles.shape[0]):
        s_row, s_col, best, best_it = _literal_varn(tiles[i])
        torch.testing.assert_close(res.s_row[i], s_row, rtol=1e-4, atol=0)
        torch.testing.assert_close(res.s_col[i], s_col, rtol=1e-4, atol=0)
        assert math.isclose(float(res.imbalance[i]), best, rel_tol=1e-4)
        assert int(res.best_iter[i]) == best_it


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "gaussian": torch.randn(3, 32, 32, generator=g),
        "planted": _planted(3)[1],
        "heavy_tail": torch.randn(3, 32, 40, generator=g) * torch.exp(2 * torch.randn(3, 32, 40, generator=g)),
        "one_sign": torch.rand(3, 16, 64, generator=g) * 50 + 10,
        "zeros": torch.zeros(2, 8, 8),
        "constant": torch.full((2, 8, 8), 3.5),
        "single_row": torch.randn(2, 1, 16, generator=g),
        "single_col": torch.randn(2, 16, 1, generator=g),
        "tiny": torch.randn(2, 16, 16, generator=g) * 1e-5,
        "huge": torch.randn(2, 16, 16, generator=g) * 1e5,
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_never_increases_imbalance(name: str, run_varn) -> None:
    tiles = _cases()[name]
    res = run_varn(tiles)
    assert torch.isfinite(res.s_row).all() and torch.isfinite(res.s_col).all()
    assert (res.imbalance <= res.imbalance_init).all()
    after = imbalance(tiles / res.s_col / res.s_row)
    before = imbalance(tiles)
    assert torch.isfinite(after).all()
    assert (after <= before * (1 + 1e-5) + 1e-6).all()


@pytest.mark.parametrize("name", list(_cases()))
def test_log_scales_stay_within_clip(name: str, run_varn) -> None:
    res = run_varn(_cases()[name])
    lo, hi = LOG_SCALE_CLIP
    for s in (res.s_row, res.s_col):
        assert (s.log() >= lo - 1e-6).all() and (s.log() <= hi + 1e-6).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_equalizes_planted_row_and_column_scales(seed: int, run_varn) -> None:
    base, tiles = _planted(seed, r=128, c=128)
    res = run_varn(tiles)
    bal = tiles / res.s_col / res.s_row
    col = bal.std(-2)
    assert (imbalance(tiles) > 20).all()  # the planted scales make the tile very unbalanced
    # balanced at least as well as the unscaled Gaussian tile the scales were planted on
    assert (imbalance(bal) <= imbalance(base) * 1.05).all()
    assert (col.amax(-1) / col.amin(-1) < 1.05).all()  # column pass leaves columns nearly equal


def test_ties_go_to_the_later_iterate(run_varn) -> None:
    # checkerboard ±1: every row and column std is identical, so every iterate has imbalance exactly 2
    n = 16
    idx = torch.arange(n)
    tile = (-1.0) ** (idx[:, None] + idx[None, :])
    res = run_varn(tile, 5)
    assert float(res.imbalance) == 2.0 == float(res.imbalance_init)
    assert int(res.best_iter) == 5


def test_zero_iterations_is_identity(run_varn) -> None:
    tiles = _planted(0)[1]
    res = run_varn(tiles, 0)
    assert torch.equal(res.s_row, torch.ones_like(res.s_row))
    assert torch.equal(res.s_col, torch.ones_like(res.s_col))
    assert (res.best_iter == 0).all()


def test_no_mean_is_subtracted(run_varn) -> None:
    # a positive offset is part of the tile: scales are computed on the raw tile, and the balanced tile
    # is a pure rescaling of the input (same signs everywhere)
    tiles = torch.rand(2, 16, 16, generator=torch.Generator().manual_seed(4)) + 5.0
    res = run_varn(tiles)
    bal = tiles / res.s_col / res.s_row
    assert (bal > 0).all()
    assert (bal.mean(dim=(-1, -2)) > 1.0).all()  # a centring implementation would give mean ≈ 0


def test_rejects_rank_one(run_varn) -> None:
    with pytest.raises(ValueError):
        run_varn(torch.ones(4))


def test_rejects_negative_iterations(run_varn) -> None:
    with pytest.raises(ValueError):
        run_varn(torch.ones(2, 2), -1)
