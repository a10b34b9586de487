"""Optional fused kernels for the elementwise core of asymmetric RTN (``torch.compile``).

The eager quantize ``clamp(round((x − lo)/scale), 0, 2^b − 1)`` and dequantize ``q·scale + lo`` each make
several passes over the tensor (one per operator); compiled, each becomes one loop that reads its inputs
once and writes one output. The compiled code performs the same IEEE operations in the same order per
element (subtract, divide, round half to even, clamp; multiply, add), so its results are bit-identical to
eager (tested), only faster.

Off by default: set ``KVQBENCH_FUSED=1`` (or ``kvqbench perf --fused``). It is used only where a compiler
exists — a C++ compiler on the CPU (``$CXX``, ``g++``, ``c++`` or ``clang++`` on ``PATH``), Triton on CUDA —
and any compile or run failure falls back to eager for good, with one warning. The first call per shape
pays the compilation (tens of seconds on a small CPU).
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from typing import Callable

import torch

__all__ = ["ENV", "enabled", "compiler_available", "quantize_codes", "dequantize_codes", "set_enabled"]

ENV = "KVQBENCH_FUSED"
_STATE: dict[str, bool | None] = {"enabled": None, "broken": False}


def compiler_available(device_type: str = "cpu") -> bool:
    """Whether ``torch.compile`` can generate code for ``device_type`` here."""
    if device_type == "cuda":
        try:
            from torch.utils._triton import has_triton

            return bool(has_triton())
        except Exception:  # noqa: BLE001
            return False
    names = [os.environ.get("CXX") or "", "g++", "c++", "clang++"]
    return any(n and shutil.which(n) for n in names)


def set_enabled(on: bool | None) -> None:
    """Force the fused path on/off for this process (``None``: follow ``$KVQBENCH_FUSED``)."""
    _STATE["enabled"] = on


def enabled(device_type: str = "cpu") -> bool:
    """Whether the fused kernels are used for tensors on ``device_type``."""
    on = _STATE["enabled"]
    if on is None:
        on = os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return bool(on) and not _STATE["broken"] and compiler_available(device_type)


def _quantize_eager(x: torch.Tensor, lo: torch.Tensor, safe: torch.Tensor, levels: int,
                    dtype: torch.dtype) -> torch.Tensor:
    return torch.clamp(torch.round((x - lo) / safe), 0, levels).to(dtype)


def _dequantize_eager(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.to(lo.dtype) * scale + lo


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _run(fn: Callable, *args):
    try:
        return _compiled(fn)(*args)
    except Exception as e:  # noqa: BLE001 - any backend problem: eager from now on
        _STATE["broken"] = True
        warnings.warn(f"kvqbench: fused kernels disabled ({type(e).__name__}: {e}); using eager",
                      RuntimeWarning, stacklevel=3)
        return fn(*args)


def quantize_codes(x: torch.Tensor, lo: torch.Tensor, safe: torch.Tensor, levels: int,
                   dtype: torch.dtype = torch.uint8, *, fused: bool | None = None) -> torch.Tensor:
    """``clamp(round((x − lo)/safe), 0, levels)`` as ``dtype`` (``safe > 0`` everywhere; ``+inf`` gives 0).

    ``fused``: ``None`` = :func:`enabled`; ``True``/``False`` force the compiled/eager version.
    """
    use = enabled(x.device.type) if fused is None else fused
    return _run(_quantize_eager, x, lo, safe, levels, dtype) if use else _quantize_eager(x, lo, safe, levels, dtype)


def dequantize_codes(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, *,
                     fused: bool | None = None) -> torch.Tensor:
    """``codes·scale + lo`` in ``lo``'s dtype (see :func:`quantize_codes` for ``fused``)."""
    use = enabled(codes.device.type) if fused is None else fused
    return _run(_dequantize_eager, codes, lo, scale) if use else _dequantize_eager(codes, lo, scale)
