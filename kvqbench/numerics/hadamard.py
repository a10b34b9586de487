"""Walsh–Hadamard rotations along head_dim.

Invariant (tested for every accepted size): the Sylvester matrix ``H_n`` (entries ±1, ``n`` a power of
two) satisfies ``H_n H_nᵀ = n·I`` and ``H_n = H_nᵀ``; hence the normalized ``H_n/√n`` is orthogonal,
symmetric and its own inverse. For a head_dim ``D`` that is not a power of two, the rotation used is
the block-diagonal of normalized Sylvester blocks given by the binary decomposition of ``D``
(``96 = 64 + 32``, ``80 = 64 + 16``, ``192 = 128 + 64``): still orthogonal, symmetric and self-inverse
(``Q Qᵀ = I``), it only mixes channels within each block. A larger Hadamard is never sliced
(``H[:d, :d]`` is not orthogonal).

Two ways to apply the same rotation: :func:`hadamard_transform`, the matrix product ``x @ Q``, and
:func:`fwht`, the butterflies of the fast Walsh–Hadamard transform (``d·log₂d`` additions per row), equal up
to rounding. :func:`fwht` is the reference step ``hadamard.fwht`` (plain torch); its compiled version
(:mod:`kvqbench.kernels.hadamard`) agrees with it within the tolerance of
``tests/property/test_kernels_hadamard.py``. Used by QuaRot (arXiv:2404.00456, §3–4: online Hadamard on K
and V along head_dim, a fast Walsh–Hadamard kernel) and KVarN (arXiv:2606.03458 §3, step 1: Sylvester
Hadamard scaled 1/√D, no random signs), both through :func:`fwht`.
"""

from __future__ import annotations

import functools
import math

import torch

from kvqbench import steps

__all__ = [
    "is_power_of_two",
    "sylvester_hadamard",
    "hadamard_blocks",
    "hadamard_matrix",
    "hadamard_transform",
    "fwht",
]


def is_power_of_two(n: int) -> bool:
    """``True`` for 1, 2, 4, 8, …"""
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


def _check_dim(d: int) -> int:
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"Hadamard size must be a positive int, got {d!r}")
    return d


@functools.lru_cache(maxsize=32)
def _sylvester_f64(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def sylvester_hadamard(n: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """The unnormalized Sylvester Hadamard matrix of order ``n`` (entries ±1, ``H Hᵀ = n·I``).

    ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, −H_n]]``.

    Args:
        n: a power of two.
    Returns:
        ``(n, n)`` tensor of ``dtype`` on ``device`` (a fresh copy).
    Raises:
        ValueError: ``n`` is not a power of two (a ±1 Sylvester matrix exists only for powers of two).
    """
    _check_dim(n)
    if not is_power_of_two(n):
        raise ValueError(
            f"a Sylvester Hadamard matrix exists only for powers of two, got {n}; "
            "use hadamard_matrix(n) for the block-diagonal orthogonal construction"
        )
    return _sylvester_f64(n).to(dtype=dtype, device=device).clone()


def hadamard_blocks(d: int) -> tuple[int, ...]:
    """Block sizes of the rotation for head_dim ``d``: the powers of two of its binary decomposition,
    largest first (``128 → (128,)``, ``96 → (64, 32)``, ``80 → (64, 16)``).

    Raises:
        ValueError: ``d`` is not a positive int.
    """
    _check_dim(d)
    return tuple(1 << i for i in range(d.bit_length() - 1, -1, -1) if d >> i & 1)


@functools.lru_cache(maxsize=64)
def _normalized(d: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    q = torch.zeros(d, d, dtype=torch.float64)
    start = 0
    for n in hadamard_blocks(d):
        q[start : start + n, start : start + n] = _sylvester_f64(n) / math.sqrt(n)
        start += n
    return q.to(dtype=dtype, device=torch.device(device))


def hadamard_matrix(
    d: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> torch.Tensor:
    """The normalized rotation ``Q`` of order ``d`` (cached; do not modify the returned tensor).

    For ``d`` a power of two, ``Q = H_d/√d`` (Sylvester); otherwise the block-diagonal of normalized
    Sylvester blocks :func:`hadamard_blocks` ``(d)``. In both cases ``Q`` is orthogonal and symmetric,
    so ``Q Q = I`` (self-inverse).

    Returns:
        ``(d, d)`` tensor of ``dtype`` on ``device`` (default CPU), built in fp64 then cast.
    Raises:
        ValueError: ``d`` is not a positive int.
    """
    _check_dim(d)
    dev = torch.device("cpu") if device is None else torch.device(device)
    return _normalized(d, dtype, str(dev))


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by :func:`hadamard_matrix` along its last dim: ``x @ Q`` (= ``x @ Qᵀ``).

    Applying it twice returns ``x`` (up to rounding). Works on any leading shape, e.g.
    ``(batch, kv_heads, seq_len, head_dim)``.

    Args:
        x: floating tensor; computed in fp32 (fp64 stays fp64).
    Returns:
        Tensor of ``x``'s shape in the compute dtype (fp32, or fp64 for fp64 input).
    Raises:
        TypeError: ``x`` is not a floating tensor.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("hadamard_transform expects a floating torch.Tensor")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = hadamard_matrix(int(x.shape[-1]), dtype=cdt, device=x.device)
    return torch.matmul(x.to(cdt), q)


def _fwht_torch(y: torch.Tensor) -> torch.Tensor:
    """The butterflies of :func:`fwht` on ``y`` ``[rows, d]`` (the compute dtype; overwritten)."""
    rows, d = y.shape
    start = 0
    for n in hadamard_blocks(d):
        blk = y[:, start : start + n]
        h = 1
        while h < n:
            v = blk.reshape(rows, n // (2 * h), 2, h)
            a, b = v[:, :, 0, :], v[:, :, 1, :]
            blk = torch.stack((a + b, a - b), dim=2).reshape(rows, n)
            h *= 2
        y[:, start : start + n] = blk * torch.tensor(1 / math.sqrt(n), dtype=y.dtype, device=y.device)
        start += n
    if not bool(torch.isfinite(y).all()):  # NaNs canonical: which NaN operand an addition returns is the loop's
        y.masked_fill_(torch.isnan(y), float("nan"))
    return y


@steps.reference("hadamard.fwht")
def fwht(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x`` by :func:`hadamard_matrix` along its last dim with butterflies: the fast Walsh–Hadamard
    transform, ``d·log₂d`` additions per row instead of the ``d²`` multiply-adds of ``x @ Q``.

    Per block of :func:`hadamard_blocks` ``(d)`` (``n`` a power of two): the stages ``h = 1, 2, 4, …, n/2``
    in that order, each replacing every pair ``(y_j, y_{j+h})`` of a run of ``2h`` values by
    ``(y_j + y_{j+h}, y_j − y_{j+h})`` (Sylvester's ``H_n``, natural order), then × ``1/√n`` rounded to the
    compute dtype; a NaN in the result is the canonical quiet NaN (``float("nan")``). Each row is rotated on
    its own. Equal to :func:`hadamard_transform` up to rounding (another order of additions); applying it
    twice returns ``x`` up to rounding.

    Args:
        x: floating tensor ``(..., d)``, e.g. ``(batch, kv_heads, seq_len, head_dim)``; computed in fp32
            (fp64 stays fp64).
        out: optional contiguous tensor of ``x``'s shape in the compute dtype, written and returned (may be
            ``x`` itself when ``x`` is contiguous in the compute dtype).
    Returns:
        Tensor of ``x``'s shape in the compute dtype.
    Raises:
        TypeError: ``x`` is not a floating tensor.
        ValueError: ``out`` has another shape or dtype, or is not contiguous.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError("fwht expects a floating torch.Tensor")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = int(x.shape[-1])
    if out is None:
        out = torch.empty(x.shape, dtype=cdt, device=x.device)
    elif out.shape != x.shape or out.dtype != cdt or not out.is_contiguous():
        raise ValueError(f"fwht: out must be a contiguous {cdt} tensor of shape {tuple(x.shape)}")
    if x.numel() == 0:
        return out
    rows = x.reshape(-1, d) if x.dtype == cdt else x.to(cdt).reshape(-1, d)
    out2 = out.view(-1, d)
    if out2.data_ptr() != rows.data_ptr():
        out2.copy_(rows)
    _fwht_torch(out2)
    return out
