"""KVQuant: stored outliers == billed outliers and reconstruct exactly; NUQ codebooks; Fisher weighting."""

from __future__ import annotations

import pytest
import torch

from kvqbench.quantizers import create
from kvqbench.quantizers.base import StreamPolicy
from kvqbench.quantizers.kvquant import KVQuant, outlier_count_per_tail


def _x(shape=(1, 2, 256, 128), seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _vectors(x: torch.Tensor, kind: str) -> torch.Tensor:
    """[B, H, ·, ·] -> [n_vectors, n]: K channels over tokens, V tokens over channels (independent of the class)."""
    if kind == "k":
        return x.permute(0, 1, 3, 2).reshape(-1, x.shape[2])
    return x.reshape(-1, x.shape[3])


def _bits_closed_form(shape, kind: str, bits: int, frac: float = 0.01) -> float:
    b, h, t, d = shape
    n_vec, n = (b * h * d, t) if kind == "k" else (b * h * t, d)
    n_tail = outlier_count_per_tail(n, frac)
    total = n_vec * n * bits + n_vec * 32 + b * 2**bits * 16
    if n_tail:
        total += n_vec * 2 * n_tail * 32 + (n_vec + 1) * 32
    return total / (b * h * t * d)


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("bits", [2, 4])
def test_stored_outliers_are_billed_and_exact(kind: str, bits: int) -> None:
    x = _x((2, 2, 256, 128), seed=bits)
    x[0, 1, 17, 5] = 40.0  # a planted outlier must be among the stored ones
    q = KVQuant(bits)
    qt = q.quantize(x, kind)
    y = q.dequantize(qt)
    vec_x, vec_y = _vectors(x, kind), _vectors(y, kind)
    n_vec, n = vec_x.shape
    n_tail = outlier_count_per_tail(n, 0.01)
    stored = qt.fields["outlier_value"]
    assert stored.tensor.numel() == n_vec * 2 * n_tail == qt.fields["outlier_index"].tensor.numel()
    # billed: 16-bit value + 16-bit index each, one 32-bit pointer per vector (+1)
    assert stored.total_bits + qt.fields["outlier_index"].total_bits == n_vec * 2 * n_tail * 32
    assert qt.fields["outlier_ptr"].total_bits == (n_vec + 1) * 32
    # the per-vector n_tail largest and smallest entries are reproduced exactly
    order = torch.argsort(vec_x, dim=-1)
    pos = torch.cat([order[:, :n_tail], order[:, n - n_tail :]], -1)
    assert torch.equal(torch.gather(vec_y, 1, pos), torch.gather(vec_x, 1, pos))
    assert float(y[0, 1, 17, 5]) == 40.0
    assert sorted(stored.tensor.tolist()) == sorted(torch.gather(vec_x, 1, pos).reshape(-1).tolist())


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("shape", [(1, 2, 256, 128), (2, 1, 4096, 128), (1, 1, 33, 64)])
def test_effective_bits_closed_form(kind: str, shape) -> None:
    qt = KVQuant(2).quantize(_x(shape), kind)
    assert qt.effective_bits() == pytest.approx(_bits_closed_form(shape, kind, 2), rel=1e-12)


def test_nuq2_one_percent_is_about_2_33() -> None:
    shape = (1, 1, 4096, 128)
    q = KVQuant(2)
    eff = q.quantize(_x(shape), "k").effective_bits()
    assert abs(eff - 2.33) < 0.01
    # nominal bills the half-range as FP8: 8 bits less per vector than stored
    assert q.nominal_bits("k", shape) == pytest.approx(eff - 128 * 8 / (4096 * 128), rel=1e-12)


def test_value_bits_per_token_at_d128() -> None:
    # one outlier per tail (1.56 %) plus per-token midpoint/half-range and pointer: ≈ 3.0 at nuq2
    eff = KVQuant(2).quantize(_x((1, 1, 4096, 128)), "v").effective_bits()
    assert eff == pytest.approx(2 + 32 / 128 + 2 * 32 / 128 + 32 * 4097 / (4096 * 128) + 64 / (4096 * 128))


def test_dense_entries_snap_to_nearest_centroid() -> None:
    x = _x()
    q = KVQuant(3)
    qt = q.quantize(x, "v")
    cb = qt["codebook"][0]
    codes = qt.codes("codes").reshape(-1, 128)
    vec = _vectors(x, "v")
    mid, half = qt["mid"].reshape(-1, 1), qt["half"].reshape(-1, 1)
    y = (vec - mid) / half
    dense = y.abs() <= 1 + 1e-6
    brute = (y[..., None] - cb).abs().argmin(-1)
    assert torch.equal(codes[dense], brute[dense])
    # normalization: the dense part spans exactly [-1, 1]
    assert torch.allclose(torch.where(dense, y, torch.full_like(y, -9)).amax(1), torch.ones(y.shape[0]))


def test_unfitted_quantize_fits_in_sample_without_state() -> None:
    x = _x()
    q = KVQuant(2)
    qt = q.quantize(x, "k")
    assert qt.meta["codebook"] == "in-sample" and q.codebook("k") is None
    q.fit(k=x)
    qt2 = q.quantize(x, "k")
    assert qt2.meta["codebook"] == "calibrated"
    torch.testing.assert_close(qt2["codebook"], q.codebook("k"))
    torch.testing.assert_close(qt["codebook"], qt2["codebook"])  # same data, same seed


def test_dequantize_reads_codebook_from_representation() -> None:
    x = _x()
    q = KVQuant(2).fit(v=x)
    qt = q.quantize(x, "v")
    y = q.dequantize(qt)
    q._codebooks["v"] = q._codebooks["v"] * 10  # tamper with the instance after quantizing
    assert torch.equal(q.dequantize(qt), y)
    assert qt.fields["codebook"].total_bits == 4 * 16  # 2^b fp16 centroids for the one layer


def test_fisher_weighting_moves_centroids() -> None:
    g = torch.Generator().manual_seed(11)
    v = torch.rand(1, 2, 256, 128, generator=g) * 2 - 1
    grad2 = torch.ones_like(v)
    heavy = (v > 0.3) & (v < 0.33)
    grad2[heavy] = 1e4
    plain = KVQuant(2).fit(v=v)
    fisher = KVQuant(2).fit(v=v, v_grad2=grad2)
    assert fisher.fisher_weighted == {"v": True} and plain.fisher_weighted == {"v": False}
    # normalized values of the heavy points (per token, range with outliers excluded)
    qt = plain.quantize(v, "v")
    vec = _vectors(v, "v")
    target = float(((vec - qt["mid"].reshape(-1, 1)) / qt["half"].reshape(-1, 1))[_vectors(heavy.float(), "v") > 0].mean())
    dist_plain = (plain.codebook("v")[0] - target).abs().min()
    dist_fisher = (fisher.codebook("v")[0] - target).abs().min()
    assert dist_fisher < dist_plain
    assert dist_fisher < 0.02
    assert fisher.quantize(v, "v").meta["codebook"] == "fisher"


def test_one_codebook_per_layer() -> None:
    x = _x((3, 1, 128, 64))
    x[2] = x[2] ** 3  # a differently shaped distribution in layer 2
    q = KVQuant(2).fit(k=x)
    cb = q.codebook("k")
    assert cb.shape == (3, 4)
    assert not torch.allclose(cb[0], cb[2], atol=1e-2)
    with pytest.raises(ValueError, match="layers"):
        q.quantize(_x((2, 1, 128, 64)), "k")


def test_attention_sink_keeps_first_token() -> None:
    x = _x((1, 2, 64, 128))
    q = KVQuant(2, attention_sink=True)
    qt = q.quantize(x, "v")
    y = q.dequantize(qt)
    assert torch.equal(y[:, :, 0], x[:, :, 0])
    assert qt.fields["sink"].total_bits == 2 * 128 * 16
    assert qt.effective_bits() == pytest.approx(q.nominal_bits("v", (1, 2, 64, 128)) + 2 * 63 * 8 / (2 * 64 * 128))
    assert q.stream_policy("k") == StreamPolicy(sink_tokens=1)
    one = _x((1, 1, 1, 16))
    assert torch.equal(q.roundtrip(one, "k"), one)


def test_no_outliers_option() -> None:
    q = KVQuant(2, outlier_frac=0.0)
    qt = q.quantize(_x(), "k")
    assert "outlier_value" not in qt.fields
    assert qt.effective_bits() == pytest.approx(_bits_closed_form((1, 2, 256, 128), "k", 2, 0.0))


def test_mse_at_2_and_4_bits() -> None:
    x = _x()
    mse = {b: float(((KVQuant(b).roundtrip(x, "v") - x) ** 2).mean()) for b in (2, 4)}
    # measured ≈ 0.094 (2 bits) and ≈ 0.0061 (4 bits) on this tensor (in-sample codebooks)
    assert 0.05 < mse[2] < 0.13
    assert 0.003 < mse[4] < 0.009


@pytest.mark.parametrize("fill", [0.0, 2.0, -7.5])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_constant_inputs_roundtrip_exactly(fill: float, kind: str) -> None:
    x = torch.full((1, 2, 40, 32), fill)
    assert torch.equal(KVQuant(2).roundtrip(x, kind), x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtype_preserved(dtype: torch.dtype) -> None:
    x = _x((1, 2, 64, 128)).to(dtype)
    y = KVQuant(4).roundtrip(x, "k")
    assert y.dtype == dtype and y.shape == x.shape
    assert ((y.float() - x.float()).norm() / x.float().norm()).item() < 0.15


def test_16_bits_is_exact_and_metadata() -> None:
    x = _x()
    assert torch.equal(KVQuant(16).roundtrip(x, "k"), x)
    q = create("kvquant", 2)
    d = q.describe()
    assert d["k_pre_rope"] is True and d["local_stats"] is False and d["fidelity"] == "approximate"
    assert d["arxiv"] == "2401.18079" and len(d["deltas"]) >= 4
    assert set(q.params()) >= {"k_bits", "v_bits", "seed", "outlier_frac", "attention_sink", "calib_samples"}


def test_deterministic_given_seed() -> None:
    x = _x((1, 8, 512, 128))
    a = KVQuant(2, calib_samples=1000, seed=0).quantize(x, "v")
    b = KVQuant(2, calib_samples=1000, seed=0).quantize(x, "v")
    assert torch.equal(a["codebook"], b["codebook"])


def test_grad_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        KVQuant(2).fit(k=_x(), k_grad2=_x((1, 2, 255, 128)))


@pytest.mark.parametrize("kwargs", [{"outlier_frac": 1.0}, {"outlier_frac": -0.1}, {"attention_sink": 1}, {"calib_samples": 0}])
def test_bad_params_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        KVQuant(2, **kwargs)


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("bits", [2, 4])
def test_zero_head_does_not_move_the_codebook(kind: str, bits: int) -> None:
    """Issue 9: a zero (or constant) head decodes exactly whatever the codebook, so it has no say in it:
    the codebook with an extra zero head equals the codebook of the other heads alone, and its levels
    are distinct (a zero head does not pull levels onto 0)."""
    g = torch.Generator().manual_seed(9)
    live = torch.randn(1, 2, 64, 32, generator=g)
    with_zero = torch.cat([torch.zeros(1, 1, 64, 32), live, torch.full((1, 1, 64, 32), 2.5)], dim=1)
    cb_live = create("kvquant", bits, bits).quantize(live, kind)["codebook"]
    qt = create("kvquant", bits, bits).quantize(with_zero, kind)
    torch.testing.assert_close(qt["codebook"], cb_live, rtol=0, atol=1e-6)
    assert bool((qt["codebook"][:, 1:] > qt["codebook"][:, :-1]).all())
    y = create("kvquant", bits, bits).dequantize(qt)
    assert torch.equal(y[:, 0], with_zero[:, 0]) and torch.equal(y[:, -1], with_zero[:, -1])


def test_constant_layer_codebook_has_distinct_levels() -> None:
    """All vectors constant: no data for k-means; the levels still differ (halving the widest gaps of
    [−1, 1]) and the tensor round-trips exactly."""
    x = torch.full((2, 1, 16, 8), -0.5)
    qt = create("kvquant", 3, 3).quantize(x, "v")
    cb = qt["codebook"]
    assert bool((cb[:, 1:] > cb[:, :-1]).all())
    assert bool((cb >= -1).all() and (cb <= 1).all())
    assert torch.equal(create("kvquant", 3, 3).dequantize(qt), x)
