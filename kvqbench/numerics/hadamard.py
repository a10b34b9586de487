"""Walsh–Hadamard rotations along head_dim.

Invariant (tested for every accepted size): the Sylvester matrix ``H_n`` (entries ±1, ``n`` a power of
two) satisfies ``H_n H_nᵀ = n·I`` and ``H_n = H_nᵀ``; hence the normalized ``H_n/√n`` is orthogonal,
symmetric and its own inverse. For a head_dim ``D`` that is not a power of two, the rotation used is
the block-diagonal of normalized Sylvester blocks given by the binary decomposition of ``D``
(``96 = 64 + 32``, ``80 = 64 + 16``, ``192 = 128 + 64``): still orthogonal, symmetric and self-inverse
(``Q Qᵀ = I``), it only mixes channels within each block. A larger Hadamard is never sliced
(``H[:d, :d]`` is not orthogonal).

Used by QuaRot (arXiv:2404.00456, §3–4: online Hadamard on K and V along head_dim, applied by a fast
Walsh–Hadamard kernel: here :func:`fwht`) and KVarN (arXiv:2606.03458, step 1: Sylvester Hadamard scaled
1/√D, no random signs, as a matrix product: :func:`hadamard_transform`).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from kvqbench.kernels import build as cbuild
from kvqbench.numerics import blocks

__all__ = [
    "is_power_of_two",
    "sylvester_hadamard",
    "hadamard_blocks",
    "hadamard_matrix",
    "hadamard_transform",
    "fwht",
    "fwht_compiled_ok",
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


def _fwht_torch(y: torch.Tensor) -> torch.Tensor:
    """:func:`fwht`'s operations in torch on ``y`` ``[rows, d]`` (the compute dtype; overwritten)."""
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


def _fwht_lib() -> ctypes.CDLL | None:
    lib = cbuild.load("fwht.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg = ctypes.c_void_p, ctypes.c_long
        lib.fwht_rows.restype = None
        lib.fwht_rows.argtypes = [vp, lg, vp, lg, lg, vp, vp, ctypes.c_int]
        lib._kvq_typed = True
    return lib


def _fwht_compiled(x: torch.Tensor, out: torch.Tensor) -> bool:
    """The compiled :func:`fwht` of the fp32 CPU rows ``x`` ``[rows, d]`` (unit column stride) into the
    contiguous ``out``; ``False`` (nothing written) where it does not apply."""
    lib = _fwht_lib()
    if (lib is None or x.dtype != torch.float32 or out.dtype != torch.float32 or x.device.type != "cpu"
            or out.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1 or not out.is_contiguous()
            or out.shape != x.shape):
        return False
    rows, d = (int(v) for v in x.shape)
    if rows == 0:
        return True
    sz, sc, nb = _fwht_blocks(d)
    lib.fwht_rows(x.data_ptr(), x.stride(0), out.data_ptr(), rows, d, sz, sc, nb)
    return True


@functools.lru_cache(maxsize=32)
def _fwht_blocks(d: int) -> tuple[ctypes.Array, ctypes.Array, int]:
    """The kernel's block sizes and scales for head_dim ``d`` (built once per ``d``)."""
    sizes = hadamard_blocks(d)
    return ((ctypes.c_long * len(sizes))(*sizes), (ctypes.c_float * len(sizes))(*(1 / math.sqrt(n) for n in sizes)),
            len(sizes))


_FWHT_OK: dict[str, bool] = {}


def fwht_compiled_ok() -> bool:
    """Whether the compiled butterflies (``fwht.c``, :mod:`kvqbench.numerics.cbuild`) give the torch
    butterflies' bits on a probe (head_dims 128, 96, 64, 80, 1, 2; Gaussian rows over six decades of scale,
    subnormal, huge, NaN and infinite values; strided and in-place rows): checked once per process; ``False``
    without a compiled kernel (``KVQBENCH_KERNELS=0``, no C compiler)."""
    if "ok" not in _FWHT_OK:
        _FWHT_OK["ok"] = False
        if _fwht_lib() is None:
            return False
        g = torch.Generator().manual_seed(2404)
        for d in (128, 96, 64, 80, 1, 2):
            x = torch.randn(40, d + 3, generator=g) * torch.exp(torch.randn(40, 1, generator=g) * 3)
            x[1] *= 1e-40
            x[2] *= 1e37
            x[3, 0], x[4, -1], x[5, d // 2] = float("nan"), float("inf"), -float("inf")
            x[6, : d // 2 + 1] = 3e38  # overflows: inf − inf
            x[7, 0], x[7, -1] = float("nan"), -float("nan")  # NaNs of both signs meet
            xs = x[:, 1 : d + 1]  # rows with a stride of d + 3
            want = _fwht_torch(xs.contiguous())
            got = torch.full((40, d), 7.0)
            same = _fwht_compiled(xs, got) and torch.equal(got.view(torch.int32), want.view(torch.int32))
            inplace = xs.contiguous()
            same = same and _fwht_compiled(inplace, inplace) and torch.equal(inplace.view(torch.int32),
                                                                              want.view(torch.int32))
            if not same:
                return False
        _FWHT_OK["ok"] = True
    return _FWHT_OK["ok"]


def fwht(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x`` by :func:`hadamard_matrix` along its last dim with butterflies: the fast Walsh–Hadamard
    transform, ``d·log₂d`` additions per row instead of the ``d²`` multiply-adds of ``x @ Q``.

    Per block of :func:`hadamard_blocks` ``(d)`` (``n`` a power of two): the stages ``h = 1, 2, 4, …, n/2``
    in that order, each replacing every pair ``(y_j, y_{j+h})`` of a run of ``2h`` values by
    ``(y_j + y_{j+h}, y_j − y_{j+h})`` (Sylvester's ``H_n``, natural order), then × ``1/√n`` rounded to the
    compute dtype; a NaN in the result is the canonical quiet NaN (``float("nan")``: which of two NaN
    operands an addition returns depends on the compiled loop). Equal to :func:`hadamard_transform` up to rounding (another order of additions), and its
    bits are fixed by these operations alone — the same on every device, thread count and block of rows
    (each row on its own), compiled (fp32 on the CPU, ``fwht.c``, where :func:`fwht_compiled_ok`) or in
    torch. Applying it twice returns ``x`` up to rounding.

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
    if cdt == torch.float32 and x.device.type == "cpu" and fwht_compiled_ok() and _fwht_compiled(rows, out2):
        return out
    if out2.data_ptr() != rows.data_ptr():
        out2.copy_(rows)
    _fwht_torch(out2)
    return out
