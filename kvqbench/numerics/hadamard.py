"""Walsh–Hadamard rotations along head_dim.

Invariant (tested for every accepted size): the Sylvester matrix ``H_n`` (entries ±1, ``n`` a power of
two) satisfies ``H_n H_nᵀ = n·I`` and ``H_n = H_nᵀ``; hence the normalized ``H_n/√n`` is orthogonal,
symmetric and its own inverse. For a head_dim ``D`` that is not a power of two, the rotation used is
the block-diagonal of normalized Sylvester blocks given by the binary decomposition of ``D``
(``96 = 64 + 32``, ``80 = 64 + 16``, ``192 = 128 + 64``): still orthogonal, symmetric and self-inverse
(``Q Qᵀ = I``), it only mixes channels within each block. A larger Hadamard is never sliced
(``H[:d, :d]`` is not orthogonal).

Used by QuaRot (arXiv:2404.00456, §3–4: online Hadamard on K and V along head_dim) and KVarN
(arXiv:2606.03458, step 1: Sylvester Hadamard scaled 1/√D, no random signs).
"""

from __future__ import annotations

import functools
import math

import torch

from kvqbench.numerics import blocks

__all__ = [
    "is_power_of_two",
    "sylvester_hadamard",
    "hadamard_blocks",
    "hadamard_matrix",
    "hadamard_transform",
    "rotation_rows_independent",
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


#: ``(d, dtype, min_rows, block_rows, threads)`` → the answer of :func:`rotation_rows_independent`
_ROWS_INDEPENDENT: dict[tuple[int, torch.dtype, int, int, int], bool] = {}


def rotation_rows_independent(d: int, dtype: torch.dtype = torch.float32, *, min_rows: int = 2,
                              block_rows: int | None = None) -> bool:
    """Whether :func:`hadamard_transform` on the CPU gives the same bits computed on blocks of rows as on
    the whole tensor: ``x[a:b] @ Q`` on one thread, for blocks of ``min_rows`` to ``1.5·block_rows`` rows,
    against ``x @ Q`` at the caller's thread count, for head_dim ``d`` in ``dtype`` (fp32 or fp64).

    Each row of a product is its own dot products with ``Q``'s columns, but a BLAS library picks its
    kernel (and so its order of additions) from the shapes it is given: a one-row product runs as a
    mat-vec and may round differently, and a split across threads could too. So this is checked once per
    process and ``(d, dtype, min_rows, block_rows, thread count)`` on a seeded random probe: its whole
    product against the products of consecutive blocks of ``min_rows``, ``min_rows + 1``, 17,
    ``block_rows`` (default: a cache-sized block, :data:`kvqbench.numerics.blocks.BLOCK_ELEMS` elements)
    and ``block_rows/2 + 3`` rows. A caller that blocks the rotation keeps the whole-tensor product where
    this says ``False``.

    Raises:
        ValueError: ``d`` is not a positive int, or ``min_rows < 1``.
    """
    _check_dim(d)
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    per = max(blocks.BLOCK_ELEMS // d if block_rows is None else int(block_rows), min_rows)
    key = (d, dtype, min_rows, per, torch.get_num_threads())
    if key not in _ROWS_INDEPENDENT:
        sizes = [min_rows, min_rows + 1, 17, per, max(per // 2, min_rows) + 3]
        g = torch.Generator().manual_seed(d)
        x = torch.randn(sum(sizes), d, generator=g, dtype=dtype) * torch.randn(sum(sizes), 1, generator=g,
                                                                                 dtype=dtype).exp()
        q = hadamard_matrix(d, dtype=dtype)
        whole = torch.mm(x, q)
        with blocks.one_cpu_thread(x.device):
            parts = torch.cat([torch.mm(xb, q) for xb in x.split(sizes)])
        _ROWS_INDEPENDENT[key] = torch.equal(parts, whole)
    return _ROWS_INDEPENDENT[key]
