"""Compiled butterflies (``c/fwht.c``): the fast version of :func:`kvqbench.numerics.hadamard.fwht`
(``hadamard.fwht``), the normalized Walsh–Hadamard rotation along head_dim.

It applies to fp32 CPU rows wherever the C kernel loads, and runs the reference's operations in the
reference's order (each an fp32 IEEE operation, compiled without contraction), so it agrees with it within
the tolerance ``tests/property/test_kernels_hadamard.py`` states. Rows are read through their stride and
rotated one by one (in place when ``out`` is ``x``).
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import torch

from kvqbench import steps
from kvqbench.kernels import build
from kvqbench.numerics.hadamard import hadamard_blocks

__all__ = ["fwht"]

#: agreement with the reference: every finite output within ``rtol_row · max|row|``; NaN and infinities at the
#: same positions
TOL = {"rtol_row": 2.0**-22}


def _lib() -> ctypes.CDLL | None:
    lib = build.load("fwht.c")
    if lib is not None and not getattr(lib, "_kvq_typed", False):
        vp, lg = ctypes.c_void_p, ctypes.c_long
        lib.fwht_rows.restype = None
        lib.fwht_rows.argtypes = [vp, lg, vp, lg, lg, vp, vp, ctypes.c_int]
        lib._kvq_typed = True
    return lib


@functools.lru_cache(maxsize=32)
def _blocks(d: int) -> tuple[ctypes.Array, ctypes.Array, int]:
    """The kernel's block sizes and scales (``1/√n`` rounded to fp32) for head_dim ``d``."""
    sizes = hadamard_blocks(d)
    return ((ctypes.c_long * len(sizes))(*sizes), (ctypes.c_float * len(sizes))(*(1 / math.sqrt(n) for n in sizes)),
            len(sizes))


@steps.fast("hadamard.fwht", when="fp32 (or fp16/bf16, computed in fp32) CPU tensor, the C kernel loads",
            tol=TOL)
def fwht(x: torch.Tensor, *, out: torch.Tensor | None = None) -> Any:
    """:func:`kvqbench.numerics.hadamard.fwht`, compiled; ``DECLINED`` for fp64, non-CPU, empty or invalid
    arguments (the reference then runs, and raises where it should)."""
    if (not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == torch.float64
            or x.device.type != "cpu" or x.dim() < 1 or x.numel() == 0):
        return steps.DECLINED
    if out is not None and (out.shape != x.shape or out.dtype != torch.float32 or not out.is_contiguous()
                            or out.device.type != "cpu"):
        return steps.DECLINED
    lib = _lib()
    if lib is None:
        return steps.DECLINED
    d = int(x.shape[-1])
    rows = x.reshape(-1, d) if x.dtype == torch.float32 else x.to(torch.float32).reshape(-1, d)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32)
    sizes, scales, nb = _blocks(d)
    lib.fwht_rows(rows.data_ptr(), rows.stride(0), out.data_ptr(), rows.shape[0], d, sizes, scales, nb)
    return out
