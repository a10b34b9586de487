"""Handing freed memory back to the operating system.

``kvqbench run`` starts its workers with glibc tunables that keep freed heap memory for reuse
(:data:`kvqbench.perf.STEADY_TUNABLES`: buffers up to 1 GiB come from the heap, which is trimmed only
past 4 GiB of free top), so a worker's resident memory stays at the highest it ever reached. After a
step that frees a lot at once (a model forward and backward, loading a capture, dropping an
experiment's cached values) :func:`release_freed` asks glibc to return the free pages (``malloc_trim``):
the next large buffers fault their pages in again, the values computed are the same. A no-op off
glibc. Torch-free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import platform
import sys

__all__ = ["release_freed"]

_TRIM: list = []


def _malloc_trim():
    if not _TRIM:
        fn = None
        if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
            try:
                fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _TRIM.append(fn)
    return _TRIM[0]


def release_freed() -> bool:
    """Collect unreachable Python objects (:func:`gc.collect`), then return the free pages of this
    process's heap to the operating system (glibc ``malloc_trim(0)``).

    Returns:
        whether glibc released any memory (``False`` also off glibc, where nothing is done).
    """
    gc.collect()
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
