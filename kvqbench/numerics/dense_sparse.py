"""Compiled dense-and-sparse split of vectors fused with the nearest-level codes of their dense part.

One pass per vector of a cache-sized block (``dense_sparse.c``, built on first use by
:mod:`kvqbench.numerics.cbuild`) instead of two ``topk`` selections, three scatters, a sort, a normalization
and one comparison pass per threshold over the block (KVQuant's per-vector outliers and non-uniform codes,
arXiv:2401.18079 §3.4). Per vector ``x`` of ``n`` fp32 values and ``k`` outliers per tail::

    hi = (k+1)-th largest of x,  lo = (k+1)-th smallest           (the dense maximum and minimum)
    outliers = {i : x_i > hi or x_i < lo}, by ascending index, with their values
    mid = (hi + lo) / 2,  half = (hi − lo) / 2
    y = (x − mid) / half  (0 where half ≤ 0),   code = #{j : mids_j < y}

each step one fp32 IEEE operation (no fused multiply-add). A building block: the caller owns the method's
torch code and checks these bits against it before relying on them (:mod:`kvqbench.quantizers.kvquant`).
:func:`quantize_rows` returns ``None`` (nothing usable written) where the kernel is unavailable (no C compiler,
``KVQBENCH_KERNELS=0``) or the inputs are outside its scope, and flags as declined (the caller redoes them)
the vectors with tied values at a tail's boundary (which index is the outlier would then depend on the
selection algorithm), a zero ``lo`` or ``hi`` (its sign would depend on the order of the comparisons), a NaN or
an infinity.
"""

from __future__ import annotations

import ctypes

import torch

from kvqbench.kernels import build as cbuild

__all__ = ["available", "quantize_rows"]


def _lib() -> ctypes.CDLL | None:
    lib = cbuild.load("dense_sparse.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg = ctypes.c_void_p, ctypes.c_long
        lib.ds_quantize.restype = ctypes.c_long
        lib.ds_quantize.argtypes = [vp, lg, lg, lg, lg, lg, vp, ctypes.c_int, vp, lg, vp, vp, vp, vp, vp, vp, vp]
        lib._kvq_typed = True
    return lib


def available() -> bool:
    """Whether the compiled kernel can be used in this process (:mod:`kvqbench.numerics.cbuild`)."""
    return _lib() is not None


def quantize_rows(x: torch.Tensor, k: int, mids: torch.Tensor, codes: torch.Tensor
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None:
    """Split every vector of ``x`` and write the codes of its dense part (module doc).

    Args:
        x: ``[B, rows, n]`` fp32 on the CPU, each ``[rows, n]`` layer contiguous (``n ≥ 2k + 1``).
        k: outliers per tail, ``≥ 1``.
        mids: ``[B, m]`` fp32 ascending thresholds per layer (``m ≤ 255``), contiguous.
        codes: ``[B, rows, n]`` uint8 receiving the codes, each layer contiguous.
    Returns:
        ``((idx [B, rows, 2k] int64, lo, mid, half [B, rows, 1] fp32, values [B, rows, 2k] fp32), declined)``
        — the outliers' indices (ascending) and values, the dense minimum, midpoint and half-range; then
        ``None`` when every vector was done, else a ``[B, rows]`` bool mask of the declined vectors, whose
        outputs and codes are meaningless (module doc) — or ``None`` where the kernel does not apply
        (nothing usable written; ``codes`` untouched).
    """
    if (x.dim() != 3 or x.dtype != torch.float32 or x.device.type != "cpu" or k < 1
            or mids.dtype != torch.float32 or not mids.is_contiguous() or mids.dim() != 2
            or codes.dtype != torch.uint8 or codes.shape != x.shape):
        return None
    b_, rows, n = (int(s) for s in x.shape)
    m = int(mids.shape[1])
    if int(mids.shape[0]) != b_ or m > 255 or n < 2 * k + 1 or b_ * rows == 0:
        return None
    if not all(t.stride(2) == 1 and t.stride(1) == n for t in (x, codes)):
        return None
    lib = _lib()
    if lib is None:
        return None
    idx = torch.empty(b_, rows, 2 * k, dtype=torch.int64)
    val = torch.empty(b_, rows, 2 * k, dtype=torch.float32)
    lo, mid, half = (torch.empty(b_, rows, 1, dtype=torch.float32) for _ in range(3))
    declined = torch.empty(b_, rows, dtype=torch.uint8)
    work = torch.empty(2 * (k + 1), dtype=torch.float32)  # held here while the kernel writes to it
    rc = lib.ds_quantize(x.data_ptr(), b_, x.stride(0), rows, n, k, mids.data_ptr(), m, codes.data_ptr(),
                         codes.stride(0), idx.data_ptr(), val.data_ptr(), lo.data_ptr(), mid.data_ptr(),
                         half.data_ptr(), declined.data_ptr(), work.data_ptr())
    if rc < 0:
        return None
    return (idx, lo, mid, half, val), (declined.bool() if rc else None)
