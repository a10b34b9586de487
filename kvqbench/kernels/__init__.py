"""Fast versions of named reference steps — the one home for speed.

The numerics of every method are plain torch, written as the paper's steps (``kvqbench/numerics/`` and
``kvqbench/quantizers/``). A step that is worth a fast version is declared with :func:`reference`::

    @kernels.reference("varn.iterate")
    def varn(tiles, n_iter): ...            # plain torch: the definition of the step

and a fast version registers against the same name in ``kvqbench/kernels/<prefix>.py`` (the prefix is the
part of the step name before the first dot; that module is imported on the step's first call)::

    @kernels.fast("varn.iterate", when="CPU, fp32, contiguous tiles, R·C ≤ 2^20")
    def varn_iterate(tiles, n_iter):
        if not ...:                         # the conditions in ``when``
            return kernels.DECLINED
        ...

The contract:

* **One carrier.** Fast versions are C, compiled on first use and loaded with :mod:`ctypes`
  (:mod:`kvqbench.kernels.build`); no build step at install time, no torch headers, no vendor library.
* **One way to decline.** A fast version returns :data:`DECLINED` when its conditions do not hold; the
  reference then runs. It never raises for an input the reference accepts.
* **Agreement, not bits.** A fast version agrees with its reference within the tolerance its property test
  states (``tests/property/test_kernels_<prefix>.py``): integer codes equal except where the reference value lies
  within a few ulps of a rounding boundary, values within a stated bound. Nothing decides speed by probing
  whether this machine's BLAS sums in some order.
* **Off switch.** ``KVQBENCH_KERNELS=0`` (``off``/``false``/``no``), :func:`disabled`, or no C compiler:
  every step runs its reference and everything still works and passes.

Layering: ``numerics/`` and ``quantizers/`` name their steps here; ``kernels/<prefix>.py`` may import them
(for constants and shared helpers); nothing here imports a method.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["ENV", "DECLINED", "Kernel", "enabled", "disabled", "reference", "fast", "lookup", "registered",
           "references"]

ENV = "KVQBENCH_KERNELS"


class _Declined:
    """The value a fast version returns when its conditions do not hold (the reference then runs)."""

    _instance: "_Declined | None" = None

    def __new__(cls) -> "_Declined":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "DECLINED"

    def __bool__(self) -> bool:
        return False


DECLINED: Any = _Declined()


@dataclass(frozen=True)
class Kernel:
    """A fast version of the reference step ``step``; ``when`` says in words when it applies."""

    step: str
    fn: Callable[..., Any]
    when: str


_REFS: dict[str, Callable[..., Any]] = {}
_FAST: dict[str, Kernel] = {}
_LOADED: dict[str, bool] = {}
_LOCK = threading.Lock()
_OFF = threading.local()


def enabled() -> bool:
    """Whether fast versions may be used: ``$KVQBENCH_KERNELS`` is not ``0``/``off``/``false``/``no`` and no
    :func:`disabled` block is active in this thread."""
    if getattr(_OFF, "depth", 0):
        return False
    return os.environ.get(ENV, "").strip().lower() not in ("0", "off", "false", "no")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run every step's reference inside the block (this thread only)."""
    _OFF.depth = getattr(_OFF, "depth", 0) + 1
    try:
        yield
    finally:
        _OFF.depth -= 1


def _load(prefix: str) -> None:
    with _LOCK:
        if prefix in _LOADED:
            return
        _LOADED[prefix] = True
    try:
        importlib.import_module(f"{__name__}.{prefix}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{prefix}":
            raise


def lookup(step: str) -> Kernel | None:
    """The fast version registered for ``step`` (importing ``kvqbench.kernels.<prefix>`` once), or ``None``.
    Does not look at :func:`enabled`."""
    _load(step.split(".", 1)[0])
    return _FAST.get(step)


def registered() -> dict[str, Kernel]:
    """Every fast version, by step name (imports every kernel module of a declared reference step)."""
    for step in list(_REFS):
        lookup(step)
    return dict(_FAST)


def references() -> dict[str, Callable[..., Any]]:
    """Every declared reference step, by name (those of the modules imported so far)."""
    return dict(_REFS)


def reference(step: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the decorated plain-torch function as the reference of ``step``. Calls go to the step's fast
    version when one is registered, :func:`enabled`, and does not decline; else to the function itself.
    The undecorated function stays reachable as ``.reference``.

    Raises:
        ValueError: ``step`` already has a reference.
    """

    def deco(ref: Callable[..., Any]) -> Callable[..., Any]:
        if step in _REFS:
            raise ValueError(f"step {step!r} already has a reference ({_REFS[step].__qualname__})")
        _REFS[step] = ref

        @functools.wraps(ref)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            if enabled():
                k = lookup(step)
                if k is not None:
                    out = k.fn(*args, **kwargs)
                    if out is not DECLINED:
                        return out
            return ref(*args, **kwargs)

        dispatch.reference = ref  # type: ignore[attr-defined]
        dispatch.step = step  # type: ignore[attr-defined]
        return dispatch

    return deco


def fast(step: str, *, when: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the fast version of ``step`` (see the module docstring).

    Raises:
        ValueError: ``step`` already has a fast version, or ``when`` is empty.
    """
    if not when.strip():
        raise ValueError(f"fast version of {step!r}: say when it applies")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if step in _FAST:
            raise ValueError(f"step {step!r} already has a fast version ({_FAST[step].fn.__qualname__})")
        _FAST[step] = Kernel(step, fn, when)
        return fn

    return deco
