"""Handing freed memory back to the operating system.

``kvqbench run`` starts its workers with glibc tunables that keep freed heap memory for reuse
(:data:`kvqbench.perf.STEADY_TUNABLES`: buffers up to 1 GiB come from the heap, which is trimmed only
past 4 GiB of free top), so a worker's resident memory stays at the highest it ever reached. After a
step that frees a lot at once (a model forward and backward, loading a capture, dropping an
experiment's cached values) :func:`release_freed` asks glibc to return the free pages (``malloc_trim``):
the next large buffers fault their pages in again, the values computed are the same.
:func:`release_after` does it after an experiment's cell whenever the process's resident memory grew by
more than :data:`GROWTH_STEP` since the last release, so what a worker keeps of freed memory stays
bounded while cells with small temporaries keep theirs. A no-op off glibc. Torch-free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import platform
import sys
from typing import Any, Callable, TypeVar

__all__ = ["GROWTH_STEP", "release_freed", "release_if_grown", "release_after"]

#: resident growth (bytes) since the last release past which :func:`release_if_grown` releases
GROWTH_STEP = 256 << 20

_TRIM: list = []
#: the resident bytes measured right after the last release
_AFTER_LAST: list[int] = [0]
_F = TypeVar("_F", bound=Callable[..., Any])


def _resident() -> int:
    """This process's resident bytes (Linux ``/proc/self/statm``), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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
    if fn is None:
        return False
    released = bool(fn(0))
    _AFTER_LAST[0] = _resident()
    return released


def release_if_grown(step: int = GROWTH_STEP) -> bool:
    """:func:`release_freed` without the collection, when the resident memory grew by more than ``step``
    bytes since the last release (one read of ``/proc/self/statm`` otherwise).

    Returns:
        whether a release was made.
    """
    fn = _malloc_trim()
    if fn is None or _resident() - _AFTER_LAST[0] <= step:
        return False
    fn(0)
    _AFTER_LAST[0] = _resident()
    return True


def release_after(func: _F) -> _F:
    """Decorator: call :func:`release_if_grown` after each call of ``func`` (also when it raises)."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        finally:
            release_if_grown()

    return wrapper  # type: ignore[return-value]
