"""QuaRot: a loop-based second implementation, bits accounting, constant-row guard, dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from kvqbench.quantizers import create
from kvqbench.quantizers.quarot import QuaRot


def _x(shape=(1, 2, 256, 128), seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _loop_quarot_rows(rows: np.ndarray, bits: int, include_zero: bool, clip: float = 0.95) -> np.ndarray:
    """Straightforward per-row QuaRot fake-quant, in Python floats (round() is half-to-even like torch)."""
    maxq = 2**bits - 1
    out = np.empty_like(rows)
    for i, row in enumerate(rows):
        lo, hi = float(min(row)), float(max(row))
        if include_zero:
            lo, hi = min(lo, 0.0), max(hi, 0.0)
        lo, hi = lo * clip, hi * clip
        scale = (hi - lo) / maxq
        z = round(-lo / scale)
        for j, v in enumerate(row):
            q = min(max(round(float(v) / scale) + z, 0), maxq)
            out[i, j] = scale * (q - z)
    return out


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_matches_loop_reference(bits: int, kind: str) -> None:
    x = _x((1, 1, 6, 64), seed=bits).double()
    h = scipy.linalg.hadamard(64) / 8.0  # independent rotation
    rot = x[0, 0].numpy() @ h
    # give one row a strictly positive rotated range so K's forced zero matters
    rot[0] = np.abs(rot[0]) + 0.5
    x = torch.from_numpy(rot @ h).reshape(1, 1, 6, 64)
    y = QuaRot(bits).roundtrip(x, kind)
    want = _loop_quarot_rows(rot, bits, include_zero=(kind == "k"))
    np.testing.assert_allclose(y[0, 0].numpy() @ h, want, rtol=0, atol=1e-9)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_effective_bits_b_plus_quarter_at_d128(bits: int) -> None:
    q = QuaRot(bits)
    x = _x()
    for kind in ("k", "v"):
        qt = q.quantize(x, kind)
        assert qt.effective_bits() == bits + 0.25  # fp16 scale + fp16-billed integer zero per 128
        assert q.nominal_bits(kind, tuple(x.shape)) == bits + 24 / 128


def test_group_size_accounting() -> None:
    q = QuaRot(2, group_size=32)
    qt = q.quantize(_x(), "v")
    assert qt.effective_bits() == 2 + 32 / 32
    assert q.nominal_bits("v", (1, 2, 256, 128)) == 2 + 24 / 32
    assert QuaRot.grouped and q.params()["group_size"] == 32
    # partial last group: 128 = 48 + 48 + 32 -> 3 groups per token
    q3 = QuaRot(2, group_size=48)
    qt3 = q3.quantize(_x(), "k")
    assert qt3.effective_bits() == 2 + 3 * 32 / 128
    assert torch.isfinite(q3.dequantize(qt3)).all()


def test_mse_at_2_and_4_bits() -> None:
    x = _x()
    mse = {b: float(((QuaRot(b).roundtrip(x, "v") - x) ** 2).mean()) for b in (2, 4)}
    # measured 0.2285 (2 bits) and 0.00935 (4 bits) on this tensor
    assert 0.15 < mse[2] < 0.26
    assert 0.006 < mse[4] < 0.012


def test_constant_rotated_rows_roundtrip_exactly() -> None:
    # x = c·√D·e0 rotates to the constant row c; V's range does not include 0, so the guard applies
    d = 128
    vals = torch.tensor([2.5, -1.25, 0.0, 7.0], dtype=torch.float64)
    x = torch.zeros(1, 1, 4, d, dtype=torch.float64)
    x[0, 0, :, 0] = vals * d**0.5
    for bits in (1, 2, 4):
        y = QuaRot(bits).roundtrip(x, "v")
        torch.testing.assert_close(y, x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("fill", [0.0, 3.0, -2.0])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_constant_and_zero_inputs_no_nan(fill: float, kind: str) -> None:
    x = torch.full((1, 2, 16, 64), fill)
    y = QuaRot(2).roundtrip(x, kind)
    assert torch.isfinite(y).all()
    if fill == 0.0:
        assert torch.equal(y, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtype_shape_device_preserved(dtype: torch.dtype) -> None:
    x = _x((2, 2, 33, 128)).to(dtype)
    y = QuaRot(4).roundtrip(x, "k")
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    rel = ((y.float() - x.float()).norm() / x.float().norm()).item()
    assert rel < 0.15


def test_16_bits_is_exact() -> None:
    x = _x()
    assert torch.equal(QuaRot(16).roundtrip(x, "k"), x)


def test_non_power_of_two_head_dim() -> None:
    x = _x((1, 1, 32, 96))
    qt = QuaRot(4).quantize(x, "v")
    y = QuaRot(4).dequantize(qt)
    assert y.shape == x.shape
    assert ((y - x).norm() / x.norm()).item() < 0.15
    assert qt.effective_bits() == 4 + 32 / 96


def test_codes_are_packed_and_within_range() -> None:
    q = QuaRot(3)
    qt = q.quantize(_x(), "k")
    codes = qt.codes("codes")
    assert codes.min() >= 0 and codes.max() <= 7
    assert qt.fields["codes"].tensor.dtype == torch.uint8
    assert torch.all(qt["zero"] == torch.round(qt["zero"]))  # integer zero-points


def test_metadata_and_registry() -> None:
    q = create("quarot", 2)
    assert isinstance(q, QuaRot)
    d = q.describe()
    assert d["arxiv"] == "2404.00456" and d["rotation"] is True and d["fidelity"] == "faithful"
    assert len(d["deltas"]) >= 3
    assert set(q.params()) >= {"k_bits", "v_bits", "seed", "group_size", "clip_ratio"}


@pytest.mark.parametrize("kwargs", [{"group_size": 0}, {"group_size": 2.5}, {"clip_ratio": 0.0}, {"clip_ratio": 1.5}])
def test_bad_params_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        QuaRot(2, **kwargs)


def test_unsupported_bit_width_raises() -> None:
    with pytest.raises(ValueError):
        QuaRot(12)


def _paths(x: torch.Tensor, kind: str, *, threads: int, block_elems: int | None = None, **params):
    """QuaRot's round trip of ``x`` on the whole-tensor path and on the row-block path (size threshold at
    0), at ``threads`` torch threads: ``[(qt, reconstruction), (qt, reconstruction)]``."""
    from unittest import mock

    from kvqbench.numerics import blocks
    from kvqbench.quantizers import quarot as quarot_mod

    nt = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = []
    try:
        for whole_max in (1 << 62, 0):
            with mock.patch.object(quarot_mod, "_WHOLE_MAX_ELEMS", whole_max), \
                    mock.patch.object(quarot_mod, "_WHOLE_MAX_ELEMS_THREADED", whole_max), \
                    mock.patch.object(blocks, "BLOCK_ELEMS", block_elems or blocks.BLOCK_ELEMS):
                q = QuaRot(2, **params)
                qt = q.quantize(x, kind)
                out.append((qt, q.dequantize(qt)))
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(nt)
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_row_blocks_at_real_size_give_the_whole_tensor_bytes(threads: int, kind: str) -> None:
    """At the benchmark's size (8 heads × 4100 tokens × 128: seven blocks of 4096 rows and one of 4128) the
    row-block round trip stores and reconstructs the bytes of the whole-tensor one, at 1 and 2 threads."""
    from kvqbench.quantizers import quarot as quarot_mod

    assert [sl.stop - sl.start for sl in quarot_mod._spans(8 * 4100, 128)] == [4096] * 7 + [4128]
    x = _x((1, 8, 4100, 128), seed=threads) * torch.rand(1, 8, 4100, 1).add(0.1)
    (qt1, rec1), (qt2, rec2) = _paths(x, kind, threads=threads)
    assert set(qt1.fields) == set(qt2.fields) == {"codes", "scale", "zero"}
    for name in qt1.fields:
        assert _same_bytes(qt1[name], qt2[name]), name
    assert _same_bytes(rec1, rec2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_row_blocks_reject_nan_inf_with_the_whole_tensor_error(bad: float) -> None:
    """check_finite on the blocked path (after the block loop, from every group's minimum and maximum)
    raises the whole-tensor path's error."""
    from unittest import mock

    from kvqbench.quantizers import quarot as quarot_mod

    x = _x((1, 2, 300, 64))
    x[0, 1, 250, 3] = bad  # in the last block
    with mock.patch.object(quarot_mod, "_WHOLE_MAX_ELEMS", 0), \
            mock.patch.object(quarot_mod, "_WHOLE_MAX_ELEMS_THREADED", 0), \
            mock.patch.object(quarot_mod.blocks, "BLOCK_ELEMS", 4096):
        assert quarot_mod._blocked(x.device, x.numel(), 64, torch.float32)
        with pytest.raises(ValueError, match=r"^K contains 1 NaN/Inf values"):
            QuaRot(2).quantize(x, "k")
    with pytest.raises(ValueError, match=r"^K contains 1 NaN/Inf values"):
        QuaRot(2).quantize(x, "k")  # the whole-tensor path: the same message


def test_row_blocks_accept_finite_data_whose_rotated_range_overflows() -> None:
    """Finite input is never rejected, even where a group's rotated maximum overflows (the check then
    reads the input itself), and both paths store the same bytes."""
    x = _x((1, 2, 300, 64))
    x[..., :32] = 3e38  # finite; the rotation overflows to inf (a group maximum of inf)
    (qt1, rec1), (qt2, rec2) = _paths(x, "v", threads=1, block_elems=4096)
    for name in qt1.fields:
        assert _same_bytes(qt1[name], qt2[name]), name
    assert _same_bytes(rec1, rec2)


def test_row_blocks_need_no_probe_the_butterflies_rotate_row_by_row() -> None:
    """QuaRot rotates with fwht, each row on its own: its row-block path runs above its threshold whatever
    the matrix product's row-block probe would say, and stores and decodes the whole-tensor path's bytes."""
    from unittest import mock

    from kvqbench.numerics import hadamard
    from kvqbench.quantizers import quarot as quarot_mod

    with mock.patch.object(hadamard, "rotation_rows_independent", return_value=False):
        assert quarot_mod._blocked(torch.device("cpu"), (1 << 22) + 128, 128, torch.float32)
    x = _x((1, 2, 300, 64))
    for threads in (1, 2):
        (qt1, rec1), (qt2, rec2) = _paths(x, "k", threads=threads, block_elems=4096)
        for name in qt1.fields:
            assert _same_bytes(qt1[name], qt2[name]), name
        assert _same_bytes(rec1, rec2)


def test_blocked_from_its_threshold_at_one_thread_and_from_2_22_elements_at_more() -> None:
    """The blocked round trip runs on one thread: at one torch thread it takes tensors above
    _WHOLE_MAX_ELEMS (2^16), at more threads only above _WHOLE_MAX_ELEMS_THREADED (2^22), where the
    whole-tensor path's threads no longer win."""
    from kvqbench.quantizers import quarot as quarot_mod

    nt = torch.get_num_threads()
    cpu = torch.device("cpu")
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            limit = 1 << 16 if threads == 1 else 1 << 22
            assert not quarot_mod._blocked(cpu, limit, 128, torch.float32)
            assert quarot_mod._blocked(cpu, limit + 128, 128, torch.float32)
            assert not quarot_mod._blocked(torch.device("meta"), 1 << 30, 128, torch.float32)
    finally:
        torch.set_num_threads(nt)
