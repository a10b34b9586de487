"""Walsh–Hadamard rotation: H Hᵀ = D·I for every accepted size, clear errors otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from kvqbench.numerics.hadamard import (
    hadamard_blocks,
    hadamard_matrix,
    hadamard_transform,
    is_power_of_two,
    sylvester_hadamard,
)

POWERS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
NON_POWERS = [3, 5, 6, 7, 12, 20, 24, 40, 80, 96, 112, 160, 192]


@pytest.mark.parametrize("n", POWERS)
def test_sylvester_is_hadamard(n: int) -> None:
    h = sylvester_hadamard(n, dtype=torch.float64)
    assert torch.equal(h.abs(), torch.ones(n, n, dtype=torch.float64))
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    assert torch.equal(h, h.T)


@pytest.mark.parametrize("n", [2, 4, 64, 128])
def test_sylvester_matches_scipy(n: int) -> None:
    # scipy.linalg.hadamard is an independent Sylvester construction
    assert np.array_equal(sylvester_hadamard(n, dtype=torch.float64).numpy(), scipy.linalg.hadamard(n).astype(float))


@pytest.mark.parametrize("n", NON_POWERS)
def test_sylvester_rejects_non_power_of_two(n: int) -> None:
    with pytest.raises(ValueError, match="powers of two"):
        sylvester_hadamard(n)


@pytest.mark.parametrize("d", POWERS + NON_POWERS)
def test_normalized_rotation_is_orthogonal_symmetric_involution(d: int) -> None:
    q = hadamard_matrix(d, dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    torch.testing.assert_close(q @ q.T, eye, rtol=0, atol=1e-12)
    assert torch.equal(q, q.T)
    torch.testing.assert_close(q @ q, eye, rtol=0, atol=1e-12)


@pytest.mark.parametrize("d", POWERS)
def test_power_of_two_rotation_is_scaled_sylvester(d: int) -> None:
    q = hadamard_matrix(d, dtype=torch.float64)
    h = q * d**0.5  # H Hᵀ = D·I for the unnormalized matrix
    torch.testing.assert_close(h @ h.T, d * torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-9)


@pytest.mark.parametrize(("d", "blocks"), [(96, (64, 32)), (80, (64, 16)), (192, (128, 64)), (128, (128,)), (7, (4, 2, 1))])
def test_blocks_are_binary_decomposition(d: int, blocks: tuple[int, ...]) -> None:
    assert hadamard_blocks(d) == blocks
    assert sum(blocks) == d and all(is_power_of_two(b) for b in blocks)


def test_non_power_of_two_is_not_a_slice_of_a_larger_hadamard() -> None:
    sliced = hadamard_matrix(128, dtype=torch.float64)[:96, :96]
    assert not torch.allclose(sliced @ sliced.T, torch.eye(96, dtype=torch.float64))  # why slicing is wrong
    q = hadamard_matrix(96, dtype=torch.float64)
    assert torch.count_nonzero(q[:64, 64:]) == 0 and torch.count_nonzero(q[64:, :64]) == 0
    torch.testing.assert_close(q[:64, :64], hadamard_matrix(64, dtype=torch.float64))
    torch.testing.assert_close(q[64:, 64:], hadamard_matrix(32, dtype=torch.float64))


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, None])
def test_bad_sizes_raise(bad) -> None:
    with pytest.raises(ValueError):
        hadamard_matrix(bad)
    with pytest.raises(ValueError):
        sylvester_hadamard(bad)


def _fwht(x: np.ndarray) -> np.ndarray:
    """Independent butterfly Walsh–Hadamard transform along the last axis, normalized 1/√n."""
    y = x.astype(np.float64).copy()
    n = y.shape[-1]
    h = 1
    while h < n:
        for i in range(0, n, 2 * h):
            a = y[..., i : i + h].copy()
            b = y[..., i + h : i + 2 * h].copy()
            y[..., i : i + h] = a + b
            y[..., i + h : i + 2 * h] = a - b
        h *= 2
    return y / np.sqrt(n)


def test_transform_matches_butterfly_and_is_self_inverse() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 128, generator=g, dtype=torch.float64)
    y = hadamard_transform(x)
    np.testing.assert_allclose(y.numpy(), _fwht(x.numpy()), rtol=0, atol=1e-12)
    torch.testing.assert_close(hadamard_transform(y), x, rtol=0, atol=1e-12)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_transform_of_basis_vector_is_flat() -> None:
    e0 = torch.zeros(1, 64)
    e0[0, 0] = 1.0
    torch.testing.assert_close(hadamard_transform(e0), torch.full((1, 64), 1 / 8.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_transform_computes_in_fp32(dtype: torch.dtype) -> None:
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = hadamard_transform(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(hadamard_transform(y), x.float(), rtol=0, atol=1e-5)


def test_transform_rejects_integer_tensors() -> None:
    with pytest.raises(TypeError):
        hadamard_transform(torch.ones(2, 4, dtype=torch.int64))
