"""VarN (KVarN step 2): matches a literal implementation, bit-identical to the plain blockwise recipe, never
increases imbalance, equalizes planted scales."""

from __future__ import annotations

import math
from unittest.mock import patch

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import assume, given, settings

from kvqbench.numerics import varn as varn_mod
from kvqbench.numerics.varn import LOG_SCALE_CLIP, imbalance, varn


def _literal_varn(x: torch.Tensor, n_iter: int = 16) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """The METHODS.md recipe written out for one 2-D tile, with the balanced tile materialized."""
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
def test_batched_matches_literal_recipe(seed: int) -> None:
    _, tiles = _planted(seed)
    res = varn(tiles)
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
def test_never_increases_imbalance(name: str) -> None:
    tiles = _cases()[name]
    res = varn(tiles)
    assert torch.isfinite(res.s_row).all() and torch.isfinite(res.s_col).all()
    assert (res.imbalance <= res.imbalance_init).all()
    after = imbalance(tiles / res.s_col / res.s_row)
    before = imbalance(tiles)
    assert torch.isfinite(after).all()
    assert (after <= before * (1 + 1e-5) + 1e-6).all()


@pytest.mark.parametrize("name", list(_cases()))
def test_log_scales_stay_within_clip(name: str) -> None:
    res = varn(_cases()[name])
    lo, hi = LOG_SCALE_CLIP
    for s in (res.s_row, res.s_col):
        assert (s.log() >= lo - 1e-6).all() and (s.log() <= hi + 1e-6).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_equalizes_planted_row_and_column_scales(seed: int) -> None:
    base, tiles = _planted(seed, r=128, c=128)
    res = varn(tiles)
    bal = tiles / res.s_col / res.s_row
    col = bal.std(-2)
    assert (imbalance(tiles) > 20).all()  # the planted scales make the tile very unbalanced
    # balanced at least as well as the unscaled Gaussian tile the scales were planted on
    assert (imbalance(bal) <= imbalance(base) * 1.05).all()
    assert (col.amax(-1) / col.amin(-1) < 1.05).all()  # column pass leaves columns nearly equal


def test_ties_go_to_the_later_iterate() -> None:
    # checkerboard ±1: every row and column std is identical, so every iterate has imbalance exactly 2
    n = 16
    idx = torch.arange(n)
    tile = (-1.0) ** (idx[:, None] + idx[None, :])
    res = varn(tile, 5)
    assert float(res.imbalance) == 2.0 == float(res.imbalance_init)
    assert int(res.best_iter) == 5


def test_zero_iterations_is_identity() -> None:
    tiles = _planted(0)[1]
    res = varn(tiles, 0)
    assert torch.equal(res.s_row, torch.ones_like(res.s_row))
    assert torch.equal(res.s_col, torch.ones_like(res.s_col))
    assert (res.best_iter == 0).all()


def test_no_mean_is_subtracted() -> None:
    # a positive offset is part of the tile: scales are computed on the raw tile, and the balanced tile
    # is a pure rescaling of the input (same signs everywhere)
    tiles = torch.rand(2, 16, 16, generator=torch.Generator().manual_seed(4)) + 5.0
    res = varn(tiles)
    bal = tiles / res.s_col / res.s_row
    assert (bal > 0).all()
    assert (bal.mean(dim=(-1, -2)) > 1.0).all()  # a centring implementation would give mean ≈ 0


def test_rejects_rank_one() -> None:
    with pytest.raises(ValueError):
        varn(torch.ones(4))


def test_rejects_negative_iterations() -> None:
    with pytest.raises(ValueError):
        varn(torch.ones(2, 2), -1)


# --------------------------------------------------------------------------------------------------
# The optimized VarN (chunks of many tiles, in-place updates, a fallback applied per group) against the
# same recipe written plainly — blocks of 512 KiB of tiles, each run through the iterations on its own,
# every intermediate a fresh tensor. Bit for bit: same scales, imbalances and iterations.


def _plain_std(x: torch.Tensor, scale: torch.Tensor, dim: int, s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """One-pass unbiased std from the sums; the whole block two-pass when any value would cancel."""
    n = x.shape[dim]
    mean2 = (s1 / n) ** 2
    var = ((s2 - s1 * s1 / n) / (n - 1)).clamp_min(0.0)
    if bool((mean2 > 15.0 * var).any()):
        z = x * scale
        z = z - z.mean(dim, keepdim=True)
        return torch.linalg.vector_norm(z, dim=dim, keepdim=True) / math.sqrt(n - 1)
    return torch.sqrt(var)


def _plain_block(x: torch.Tensor, n_iter: int) -> tuple[torch.Tensor, ...]:
    n, r, c = x.shape
    x2 = x * x

    def col_std(ir, ic):
        if r < 2:
            return torch.ones(n, 1, c)
        irt = ir.transpose(-1, -2)
        return _plain_std(x, ir, -2, torch.matmul(irt, x), torch.matmul(irt * irt, x2)) * ic

    def row_std(ic):
        if c < 2:
            return torch.ones(n, r, 1)
        ict = ic.transpose(-1, -2)
        return _plain_std(x, ic, -1, torch.matmul(x, ict), torch.matmul(x2, ict * ict))

    def imb(cs, rs):
        cs, rs = cs.flatten(-2), rs.flatten(-2)
        return cs.amax(-1) / cs.amin(-1).clamp_min(1e-8) + rs.amax(-1) / rs.amin(-1).clamp_min(1e-8)

    lc, lr = torch.zeros(n, 1, c), torch.zeros(n, r, 1)
    best_c, best_r = lc.clone(), lr.clone()
    cs, rs = col_std(torch.ones(n, r, 1), torch.ones(n, 1, c)), row_std(torch.ones(n, 1, c))
    best = imb(cs, rs)
    best0, best_it = best.clone(), torch.zeros(n, dtype=torch.int64)
    for it in range(1, n_iter + 1):
        lc = torch.clamp(lc + torch.log(cs.clamp(1e-3, 1e3)), -0.3, 10.0)
        ic = 1.0 / torch.exp(lc)
        rz = row_std(ic)
        lr = torch.clamp(lr + torch.log((rz / torch.exp(lr)).clamp(1e-3, 1e3)), -0.3, 10.0)
        ir = 1.0 / torch.exp(lr)
        rs = rz * ir
        cs = col_std(ir, ic)
        cur = imb(cs, rs)
        better = cur <= best
        best = torch.where(better, cur, best)
        best_c = torch.where(better[:, None, None], lc, best_c)
        best_r = torch.where(better[:, None, None], lr, best_r)
        best_it = torch.where(better, torch.full_like(best_it, it), best_it)
    return torch.exp(best_r), torch.exp(best_c), best, best0, best_it


def _plain_varn(tiles: torch.Tensor, n_iter: int) -> tuple[torch.Tensor, ...]:
    r, c = tiles.shape[-2:]
    x = tiles.float().reshape(-1, r, c)
    per = max(1, (1 << 19) // (r * c * 4))
    nt = torch.get_num_threads()
    torch.set_num_threads(1)  # as varn (its kernels are the same at every thread count; small ops are faster)
    try:
        parts = [_plain_block(x[i : i + per].contiguous(), n_iter) for i in range(0, x.shape[0], per)]
    finally:
        torch.set_num_threads(nt)
    return tuple(torch.cat(p) for p in zip(*parts))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), r=st.sampled_from([1, 2, 7, 32, 64, 128]),
       c=st.sampled_from([1, 3, 16, 64, 128]), offset=st.sampled_from([0.0, 4.0, 40.0]),
       n_iter=st.sampled_from([0, 1, 4, 16]), chunk_groups=st.integers(1, 3))
def test_bit_identical_to_the_plain_recipe(seed, n, r, c, offset, n_iter, chunk_groups) -> None:
    """Tiles with a random offset on some rows/columns (so the two-pass fallback fires in some groups),
    counts that leave a last group of one tile, and chunks of 1–3 groups (chunk boundaries inside small
    inputs): every output equals the plain recipe's exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, r, c, generator=g) * torch.exp(torch.randn(n, r, 1, generator=g))
    x = x + offset * (torch.rand(n, 1, c, generator=g) < 0.1) + offset * (torch.rand(n, r, 1, generator=g) < 0.1)
    per = max(1, (1 << 19) // (r * c * 4))
    with patch.object(varn_mod, "_CHUNK_BYTES", chunk_groups * per * r * c * 4):
        got = varn(x, n_iter)
    want = _plain_varn(x, n_iter)
    for name, a, b in zip(("s_row", "s_col", "imbalance", "imbalance_init", "best_iter"), got, want):
        assert torch.equal(a.reshape(b.shape), b), name


def test_bit_identical_on_kvarn_sized_batches() -> None:
    """KVarN's own case: 65 tiles [128, 128] (eight groups of 8 and a last group of one; 64 KiB tiles),
    some with a large offset (two-pass fallback), in the default chunking."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(65, 128, 128, generator=g) + 30.0 * (torch.rand(65, 1, 1, generator=g) < 0.1)
    for a, b in zip(varn(x), _plain_varn(x, 16)):
        assert torch.equal(a.reshape(b.shape), b)


def test_same_bits_at_every_thread_count() -> None:
    """1, 2 and 3 torch threads give the plain recipe's bits (six chunks of one group each, a last group of
    one tile, the fallback in some), and the caller's thread count is restored."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(41, 128, 128, generator=g) + 30.0 * (torch.rand(41, 1, 1, generator=g) < 0.15)
    want = _plain_varn(x, 6)
    nt = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with patch.object(varn_mod, "_CHUNK_BYTES", 8 * 128 * 128 * 4):
                got = varn(x, 6)
            assert torch.get_num_threads() == threads  # restored
            for a, b in zip(got, want):
                assert torch.equal(a.reshape(b.shape), b)
    finally:
        torch.set_num_threads(nt)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 20), r=st.sampled_from([2, 32, 128]),
       c=st.sampled_from([3, 64, 128]), offset=st.sampled_from([0.0, 40.0]))
def test_transposed_tiles_given_give_the_plain_recipe_bits(seed, n, r, c, offset) -> None:
    """``tiles_t`` (the tiles already laid out transposed, as KVarN's token-major K) changes no bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, r, c, generator=g) + offset * (torch.rand(n, 1, c, generator=g) < 0.1)
    got = varn(x, 4, tiles_t=x.transpose(-1, -2).contiguous())
    for name, a, b in zip(("s_row", "s_col", "imbalance", "imbalance_init", "best_iter"), got, _plain_varn(x, 4)):
        assert torch.equal(a.reshape(b.shape), b), name


def test_transposed_tiles_of_another_shape_raise() -> None:
    with pytest.raises(ValueError, match="tiles_t"):
        varn(torch.ones(2, 4, 3), 1, tiles_t=torch.ones(2, 4, 3))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 48), r=st.sampled_from([2, 7, 16, 33, 64, 96, 128]),
       c=st.sampled_from([2, 3, 16, 65, 80, 128]), offset=st.sampled_from([0.0, 40.0]))
def test_matrix_product_row_sums_are_the_mat_vec_bits(seed, n, r, c, offset) -> None:
    """Where the once-per-shape check admits the matrix-product row sums (on its own three tiles), they equal
    torch's batched mat-vec bit for bit on other data and batch sizes too (VarN's one thread)."""
    nt = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assume(varn_mod._row_sums_match(r, c))  # elsewhere VarN keeps the mat-vec
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, r, c, generator=g) * torch.exp(torch.randn(n, r, 1, generator=g)) + offset
        v = torch.exp(torch.randn(n, 1, c, generator=g))
        s1, s2 = varn_mod._row_sums(torch.cat((x, x * x), 1).transpose(-1, -2).contiguous(), v,
                                    torch.empty(n, 2, c))
        want1, want2 = torch.matmul(x, v.transpose(-1, -2)), torch.matmul(x * x, (v * v).transpose(-1, -2))
    finally:
        torch.set_num_threads(nt)
    assert torch.equal(s1, want1) and torch.equal(s2, want2)


# --------------------------------------------------------------------------------------------------
# The compiled path (varn_sums.c via kvqbench.numerics.cbuild): the same bits as the torch path.


def _lib():
    lib = varn_mod._c_kernels()
    if lib is None:
        pytest.skip("no C compiler (or KVQBENCH_KERNELS=0): the compiled VarN kernels are not built")
    return lib


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 40), r=st.sampled_from([8, 16, 64, 96, 128]),
       c=st.sampled_from([2, 3, 16, 64, 80, 128]), offset=st.sampled_from([0.0, 40.0]))
def test_compiled_sums_are_the_torch_products_bits(seed, n, r, c, offset) -> None:
    """Where the once-per-shape check admits the compiled sums (on its own random tiles), they equal torch's
    batched mat-vecs bit for bit on other data and batch sizes too (VarN's one thread)."""
    lib = _lib()
    nt = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assume(varn_mod._c_matches(lib, r, c))  # elsewhere VarN keeps the torch products
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, r, c, generator=g) * torch.exp(torch.randn(n, r, 1, generator=g)) + offset
        w_row = torch.exp(torch.randn(n, r, 1, generator=g))
        w_col = torch.exp(torch.randn(n, 1, c, generator=g))
        got = (*varn_mod._c_col_sums(lib, x, w_row),
               *varn_mod._c_row_sums(lib, x.transpose(-1, -2).contiguous(), w_col))
        wt, ct = w_row.transpose(-1, -2), w_col.transpose(-1, -2)
        want = (torch.matmul(wt, x), torch.matmul(wt * wt, x * x), torch.matmul(x, ct), torch.matmul(x * x, ct * ct))
    finally:
        torch.set_num_threads(nt)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("one_call", [True, False])
def test_compiled_iterations_are_bit_identical_to_torch(monkeypatch, one_call: bool) -> None:
    """KVarN-sized tiles (K's [128, 128], SmolLM2's [64, 128]), some with a large offset (the two-pass
    fallback fires in both half-steps): the compiled iterations — all in one call with MKL's vector math, or
    half-steps between torch's exp/log/sqrt — run and give exactly the torch loop's scales, imbalances and
    iterations (``KVQBENCH_KERNELS=0``)."""
    _lib()
    if one_call and varn_mod._vml() is None:
        pytest.skip("torch's exp/log/sqrt are not MKL's vector math here: the one-call path is not used")
    if not one_call:
        monkeypatch.setitem(varn_mod._VML, "fns", None)
    g = torch.Generator().manual_seed(3)
    calls = []
    real = varn_mod._c_iterations
    monkeypatch.setattr(varn_mod, "_c_iterations", lambda *a, **k: calls.append(1) or real(*a, **k))
    for shape in ((41, 128, 128), (24, 64, 128), (24, 128, 64)):
        x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], shape[1], 1, generator=g))
        x = x + 30.0 * (torch.rand(shape[0], 1, 1, generator=g) < 0.15)
        calls.clear()
        monkeypatch.setenv("KVQBENCH_KERNELS", "1")
        got = varn(x, 16)
        assert calls, "the compiled path was not taken"
        monkeypatch.setenv("KVQBENCH_KERNELS", "0")
        want = varn(x, 16)
        for name, a, b in zip(("s_row", "s_col", "imbalance", "imbalance_init", "best_iter"), got, want):
            assert torch.equal(a, b), (shape, name)


@pytest.mark.parametrize("on", ["1", "0"])
def test_transposed_is_an_exact_transpose(monkeypatch, on: str) -> None:
    monkeypatch.setenv("KVQBENCH_KERNELS", on)
    x = torch.randn(2, 3, 40, 24)
    assert torch.equal(varn_mod.transposed(x), x.transpose(-1, -2))
    out = torch.empty(2, 3, 24, 40)
    assert varn_mod.transposed(x, out=out) is out and torch.equal(out, x.transpose(-1, -2))
    assert torch.equal(varn_mod.transposed(x.transpose(-1, -2)), x)  # a non-contiguous input (torch's copy)
    with pytest.raises(ValueError, match="out must be"):
        varn_mod.transposed(x, out=torch.empty(2, 3, 40, 24))
