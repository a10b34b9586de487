"""Fast versions of the scalar-codebook steps of :mod:`kvqbench.numerics.lloyd_max` (``lloyd_max.c``):
:func:`~kvqbench.numerics.lloyd_max.nearest_centroid` as one pass per threshold over cache-sized chunks straight
into ``uint8`` codes (a binary search per value beyond 31 thresholds), and
:func:`~kvqbench.numerics.lloyd_max.reconstruct` as one table read per code.

Comparisons and table reads only, so the results equal the reference's for every non-NaN value on every CPU
(``tests/property/test_kernels_lloyd_max.py``).

Scope (otherwise :data:`~kvqbench.steps.DECLINED`): a C compiler, the CPU, fp32 values and a 1-D fp32 table,
``uint8`` codes, at most 255 thresholds (256 centroids); ``reconstruct`` declines codes beyond the table (the
reference then raises).
"""

from __future__ import annotations

import ctypes

import torch

from kvqbench import steps
from kvqbench.kernels import build

__all__ = ["nearest_centroid", "reconstruct"]


def _lib() -> ctypes.CDLL | None:
    lib = build.load("lloyd_max.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg = ctypes.c_void_p, ctypes.c_long
        lib.lm_count_below.restype = None
        lib.lm_count_below.argtypes = [vp, lg, vp, ctypes.c_int, vp]
        lib.lm_reconstruct.restype = ctypes.c_int
        lib.lm_reconstruct.argtypes = [vp, vp, lg, vp]
        lib._kvq_typed = True
    return lib


@steps.fast("lloyd_max.nearest_centroid", when="CPU, fp32 values, 1-D thresholds (≤ 255), uint8 codes; a C "
            "compiler", tol=steps.EXACT)
def nearest_centroid(x: torch.Tensor, thresholds: torch.Tensor, *, dtype: torch.dtype = torch.int64):
    """:func:`~kvqbench.numerics.lloyd_max.nearest_centroid`: ``uint8`` codes of ``x``'s shape."""
    if not (dtype == torch.uint8 and x.device.type == "cpu" and x.dtype == torch.float32
            and thresholds.device.type == "cpu" and thresholds.dim() == 1 and thresholds.numel() <= 255):
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    xc = x.contiguous()
    thr = thresholds.to(torch.float32).contiguous()  # cast to x's dtype, as the reference does
    idx = torch.empty(x.shape, dtype=torch.uint8)
    lib.lm_count_below(xc.data_ptr(), xc.numel(), thr.data_ptr(), thr.numel(), idx.data_ptr())
    return idx


@steps.fast("lloyd_max.reconstruct", when="CPU, 1-D fp32 table, uint8 codes; a C compiler",
            tol=steps.EXACT)
def reconstruct(centroids: torch.Tensor, idx: torch.Tensor):
    """:func:`~kvqbench.numerics.lloyd_max.reconstruct`: an fp32 tensor of ``idx``'s shape."""
    if not (centroids.device.type == idx.device.type == "cpu" and centroids.dtype == torch.float32
            and centroids.dim() == 1 and 0 < centroids.numel() <= 256 and idx.dtype == torch.uint8):
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    ic = idx.contiguous()
    table = torch.zeros(256)
    table[: centroids.numel()] = centroids
    out = torch.empty(idx.shape)
    top = lib.lm_reconstruct(table.data_ptr(), ic.data_ptr(), ic.numel(), out.data_ptr())
    return out if top < centroids.numel() else steps.DECLINED  # a code beyond the table: the reference raises
