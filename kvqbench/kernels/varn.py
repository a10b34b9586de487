"""Compiled VarN and balanced per-row RTN (``c/varn_sums.c``): the fast versions of
:func:`kvqbench.numerics.varn.varn` (``varn.iterate``) and :func:`kvqbench.numerics.varn.balanced_rtn_rows`
(``varn.balanced_rtn``), KVarN arXiv:2606.03458 §3 steps 2–3.

They apply wherever the C kernel loads (CPU tensors; any CPU, any BLAS) and agree with the references within
the tolerance ``tests/property/test_kernels_varn.py`` states: the stds are one pass over each tile with fp32
sums shifted by the tile's first sample instead of torch's std of the materialized balanced tile, and exp/log
are the C library's. Tiles are read through their strides (KVarN's K tiles are a transposed view), each tile
once into the core's cache. Tiles are independent: at ``torch.get_num_threads()`` > 1 consecutive runs of
tiles go to that many threads (the C calls release the GIL), with the same results at every thread count.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.numerics.varn import DEFAULT_ITERS, LOG_SCALE_CLIP, MIN_FLOOR, STD_CLAMP, VarNResult

__all__ = ["varn", "balanced_rtn_rows"]

#: agreement of ``varn.iterate`` with the reference: the imbalances within relative ``rtol``; ``s_row`` and
#: ``s_col`` within ``rtol`` where both chose the same best iterate, and always the tile's scale
#: ``s_row[r]·s_col[c]`` within ``rtol`` up to one factor per tile; after the reference's per-row RTN on the
#: fast scales, a code may differ where ``(B − lo)/scale`` lies within ``eps_code`` code steps of a boundary
ITERATE_TOL = {"rtol": 1e-4, "eps_code": 2.0**-10}
#: agreement of ``varn.balanced_rtn`` on the same scales: ``lo`` and ``scale`` within relative ``rtol``; a code
#: may differ where the reference's ``(B − lo)/scale`` lies within ``eps_code`` of a rounding boundary
RTN_TOL = {"rtol": 2.0**-20, "eps_code": 2.0**-10}


def _lib() -> ctypes.CDLL | None:
    lib = build.load("varn_sums.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg, fl = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
        lib.varn_tiles.restype = ctypes.c_int
        lib.varn_tiles.argtypes = [vp, lg, lg, lg, lg, lg, lg, lg, fl, fl, fl, fl, fl, vp, vp, vp, vp, vp]
        lib.balanced_rtn_rows.restype = ctypes.c_int
        lib.balanced_rtn_rows.argtypes = [vp, lg, lg, lg, lg, lg, lg, vp, vp, fl, fl, vp, vp, vp]
        lib._kvq_typed = True
    return lib


#: at least this many tile elements per thread (smaller inputs run on the calling thread)
_MIN_PER_THREAD = 1 << 16


def _run(n: int, tile_elems: int, call: Callable[[int, int], int]) -> int:
    """``call(start, stop)`` over the tiles ``0..n`` in ``torch.get_num_threads()`` consecutive runs, in
    threads; the first non-zero status (0 when all succeed)."""
    k = max(1, min(torch.get_num_threads(), n, n * tile_elems // _MIN_PER_THREAD))
    if k == 1:
        return call(0, n)
    bounds = [n * i // k for i in range(k + 1)]
    with ThreadPoolExecutor(k) as pool:
        status = list(pool.map(call, bounds[:-1], bounds[1:]))
    return next((s for s in status if s), 0)


def _as_tiles(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]] | None:
    """``t`` ``[..., R, C]`` as ``n`` fp32 CPU tiles with one stride per axis: ``(view, (tile, row, col)
    strides)``; a copy where the leading dims do not merge into one; ``None`` for an empty or non-CPU tensor."""
    if t.device.type != "cpu" or t.dim() < 2 or t.numel() == 0:
        return None
    r, c = t.shape[-2:]
    x = t.to(torch.float32)
    try:
        x3 = x.view(-1, r, c)
    except RuntimeError:
        x3 = x.reshape(-1, r, c)
    return x3, (x3.stride(0), x3.stride(1), x3.stride(2))


@steps.fast("varn.iterate", when="CPU tensor, the C kernel loads, finite tiles", tol=ITERATE_TOL)
def varn(tiles: torch.Tensor, n_iter: int = DEFAULT_ITERS) -> Any:
    """:func:`kvqbench.numerics.varn.varn`, compiled; ``DECLINED`` for an empty, non-CPU or non-finite
    input or an invalid ``n_iter`` (the reference then runs, and raises where it should)."""
    if not isinstance(n_iter, int) or isinstance(n_iter, bool) or n_iter < 0 or not tiles.is_floating_point():
        return steps.DECLINED
    lib = _lib()
    got = _as_tiles(tiles) if lib is not None else None
    if got is None:
        return steps.DECLINED
    x3, (st, sr, sc) = got
    n, r, c = x3.shape
    s_row, s_col = torch.empty(n, r, 1), torch.empty(n, 1, c)
    imb, imb0 = torch.empty(n), torch.empty(n)
    best_iter = torch.empty(n, dtype=torch.int64)
    f = ctypes.c_float
    ptr = x3.data_ptr()

    def call(i: int, j: int) -> int:
        return lib.varn_tiles(ptr + 4 * i * st, j - i, st, sr, sc, r, c, n_iter, f(STD_CLAMP[0]), f(STD_CLAMP[1]),
                              f(LOG_SCALE_CLIP[0]), f(LOG_SCALE_CLIP[1]), f(MIN_FLOOR), s_row[i].data_ptr(),
                              s_col[i].data_ptr(), imb[i:].data_ptr(), imb0[i:].data_ptr(), best_iter[i:].data_ptr())

    status = _run(n, r * c, call)
    if status:
        return steps.DECLINED
    lead = tiles.shape[:-2]
    return VarNResult(s_row.view(*lead, r, 1), s_col.view(*lead, 1, c), imb.view(lead), imb0.view(lead),
                      best_iter.view(lead))


@steps.fast("varn.balanced_rtn", when="CPU tensors, the C kernel loads, bits 1..8, finite balanced tiles",
            tol=RTN_TOL)
def balanced_rtn_rows(tiles: torch.Tensor, s_col: torch.Tensor, s_row: torch.Tensor, bits: int,
                      floor: float) -> Any:
    """:func:`kvqbench.numerics.varn.balanced_rtn_rows`, compiled, one pass per row; ``DECLINED`` where the
    inputs are not as above (the reference then runs, and raises where it should)."""
    if not isinstance(bits, int) or not 1 <= bits <= 8 or tiles.dtype != torch.float32:
        return steps.DECLINED
    lib = _lib()
    got = _as_tiles(tiles) if lib is not None else None
    if got is None:
        return steps.DECLINED
    x3, (st, sr, sc) = got
    n, r, c = x3.shape
    lead = tiles.shape[:-2]
    if tuple(s_col.shape) != (*lead, 1, c) or tuple(s_row.shape) != (*lead, r, 1):
        return steps.DECLINED
    sc3 = s_col.to(torch.float32).contiguous().view(n, 1, c)
    sr3 = s_row.to(torch.float32).contiguous().view(n, r, 1)
    if sc3.device.type != "cpu" or sr3.device.type != "cpu":
        return steps.DECLINED
    q = torch.empty(n, r, c, dtype=torch.uint8)
    lo, scale = torch.empty(n, r, 1), torch.empty(n, r, 1)
    f = ctypes.c_float
    ptr = x3.data_ptr()

    def call(i: int, j: int) -> int:
        return lib.balanced_rtn_rows(ptr + 4 * i * st, j - i, st, sr, sc, r, c, sc3[i].data_ptr(),
                                     sr3[i].data_ptr(), f(2**bits - 1), f(floor), q[i].data_ptr(), lo[i].data_ptr(),
                                     scale[i].data_ptr())

    if _run(n, r * c, call):
        return steps.DECLINED
    return q.view(*lead, r, c), lo.view(*lead, r, 1), scale.view(*lead, r, 1)
