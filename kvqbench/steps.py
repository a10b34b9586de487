"""Named reference steps and their fast versions: the registry, on the lowest floor of the package.

A numeric step worth a fast version is declared with :func:`reference` where it is defined
(``kvqbench/numerics/``, or the method file whose paper the step belongs to)::

    @steps.reference("varn.iterate")
    def varn(tiles, n_iter): ...            # plain torch: the definition of the step

and its fast version registers against the same name in ``kvqbench/kernels/<module>.py``, saying when it
applies and how far from the reference it may land::

    @steps.fast("varn.iterate", when="CPU, fp32, contiguous tiles, R·C ≤ 2^20", tol={"rtol": 1e-4})
    def varn_iterate(tiles, n_iter):
        if not ...:                         # the conditions in ``when``
            return steps.DECLINED
        ...

``import kvqbench.kernels`` registers every fast version (``kvqbench.quantizers`` imports it, so every method
and experiment runs with them); this module imports nothing of kvqbench and loads nothing by name. The
contract of a fast version:

* **One way to decline.** It returns :data:`DECLINED` when its conditions do not hold; the reference then
  runs. It never raises for an input the reference accepts.
* **Agreement, not bits.** It agrees with its reference within ``tol``, the bounds it declares (each a named
  non-negative number whose meaning its module's docstring states; an empty ``tol``, :data:`EXACT`, means equal
  results). Its property test (``tests/property/test_kernels_<module>.py``) reads the bounds from
  :func:`lookup` and checks them.
* **Off switch.** ``KVQBENCH_KERNELS=0`` (``off``/``false``/``no``) or :func:`disabled`: every step runs its
  reference.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

__all__ = ["ENV", "DECLINED", "EXACT", "Kernel", "enabled", "disabled", "reference", "fast", "lookup",
           "registered", "references"]

ENV = "KVQBENCH_KERNELS"

#: the tolerance of a fast version whose results equal its reference's
EXACT: Mapping[str, float] = MappingProxyType({})


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
    """A fast version of the reference step ``step``: ``when`` says in words when it applies, ``tol`` how far
    from the reference it may land (named bounds; empty: equal)."""

    step: str
    fn: Callable[..., Any]
    when: str
    tol: Mapping[str, float]


_REFS: dict[str, Callable[..., Any]] = {}
_FAST: dict[str, Kernel] = {}
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


def lookup(step: str) -> Kernel | None:
    """The fast version registered for ``step``, or ``None``. Does not look at :func:`enabled`."""
    return _FAST.get(step)


def registered() -> dict[str, Kernel]:
    """Every registered fast version, by step name."""
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
                k = _FAST.get(step)
                if k is not None:
                    out = k.fn(*args, **kwargs)
                    if out is not DECLINED:
                        return out
            return ref(*args, **kwargs)

        dispatch.reference = ref  # type: ignore[attr-defined]
        dispatch.step = step  # type: ignore[attr-defined]
        return dispatch

    return deco


def fast(step: str, *, when: str, tol: Mapping[str, float]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the fast version of ``step`` (see the module docstring); ``tol``
    maps each bound's name to its value (:data:`EXACT` for equal results).

    Raises:
        ValueError: ``step`` already has a fast version, ``when`` is empty, or a bound is negative or not a
            number.
    """
    if not when.strip():
        raise ValueError(f"fast version of {step!r}: say when it applies")
    bad = {k: v for k, v in tol.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0}
    if bad:
        raise ValueError(f"fast version of {step!r}: each bound of tol is a number >= 0, got {bad}")
    bounds = MappingProxyType(dict(tol))

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if step in _FAST:
            raise ValueError(f"step {step!r} already has a fast version ({_FAST[step].fn.__qualname__})")
        _FAST[step] = Kernel(step, fn, when, bounds)
        return fn

    return deco
