"""Finding an experiment's series in a cell record's ``series`` (pure: no matplotlib), so experiments
need not register anything with the figures.

``series`` is walked recursively:

* a *curve* is a list of numbers under a dict that also holds an x list named one of :data:`X_KEYS`
  (inherited by nested dicts). Per-layer curves (list of
  lists) are averaged over layers.
* a *histogram* is a list of numbers named ``…density``, ``…counts`` or ``…hist`` beside a list of bin
  edges named ``…edges``, with one value fewer than the edges, or two more (an underflow and an
  overflow bin first and last).

The joined path of names (``series`` keys, lower-cased) classifies a curve (:func:`error_kind`,
:func:`regime`): ``kl`` → attention KL (``rev``/``reverse`` → reverse KL); otherwise the first of
``mse``, ``mae``, ``cos`` is the attention error; ``decode``/``pseudo``/``stream`` → pseudo-decode
regime, else static.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

__all__ = ["X_KEYS", "iter_curves", "histograms", "regime", "error_kind"]

#: names of an x list: exp2 writes ``context_lengths``
X_KEYS: tuple[str, ...] = ("context_lengths", "context_len", "x")


def _is_num_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                      for x in v)


def _as_curve(v: Any) -> list[float] | None:
    """A list of numbers as floats; equally long lists of numbers (one per layer): their mean over layers."""
    if _is_num_list(v):
        return [float(x) for x in v]
    if isinstance(v, list) and v and all(_is_num_list(x) for x in v) and len({len(x) for x in v}) == 1:
        return [math.fsum(col) / len(col) for col in zip(*v, strict=False)]
    return None


def iter_curves(series: Any, path: tuple[str, ...] = (), x: list[float] | None = None
                ) -> Iterable[tuple[tuple[str, ...], list[float], list[float]]]:
    """Yield ``(path, x, y)`` for every curve in a record's ``series`` (see module doc)."""
    if not isinstance(series, dict):
        return
    here = next((series[k] for k in X_KEYS if k in series and _is_num_list(series[k])), None)
    xs = [float(v) for v in here] if here is not None else x
    for key in sorted(series):
        if key in X_KEYS:
            continue
        val = series[key]
        if isinstance(val, dict):
            yield from iter_curves(val, path + (str(key),), xs)
            continue
        y = _as_curve(val)
        if xs is not None and y is not None and len(y) == len(xs):
            yield path + (str(key),), xs, y


def histograms(series: Any, path: tuple[str, ...] = ()
               ) -> Iterable[tuple[tuple[str, ...], list[float], list[float], tuple[float, float]]]:
    """Yield ``(path, edges, density, (under, over))`` for every histogram in ``series`` (see module
    doc): the bin ``edges`` (one more than the densities, so bins of unequal width keep their true
    extent), the density (value / total / bin width: integral 1 over the bins, comparable across seeds
    and methods) and the shares of the values in an underflow and an overflow bin (below the first edge,
    above the last; not drawn), ``(0, 0)`` when the list has none."""
    if not isinstance(series, dict):
        return
    found = False
    edge_keys = [k for k in sorted(series) if str(k).endswith("edges") and _is_num_list(series[k])]
    if edge_keys:
        e = [float(v) for v in series[edge_keys[0]]]
        widths = [b - a for a, b in zip(e, e[1:], strict=False)]
        for key in sorted(series):
            vals = _as_curve(series[key]) if any(w in str(key) for w in ("density", "counts", "hist")) else None
            if vals is None or len(vals) not in (len(e) - 1, len(e) + 1) or not math.fsum(vals) > 0:
                continue
            total = math.fsum(vals)
            tails = (vals[0] / total, vals[-1] / total) if len(vals) == len(e) + 1 else (0.0, 0.0)
            inner = vals[1:-1] if len(vals) == len(e) + 1 else vals
            yield path + (str(key),), e, [v / total / w for v, w in zip(inner, widths, strict=True)], tails
            found = True
    if not found:
        for key in sorted(series):
            if isinstance(series[key], dict):
                yield from histograms(series[key], path + (str(key),))


def regime(name: str) -> str:
    """``"pseudo-decode"`` for a series path naming decode/pseudo/stream, else ``"static"``."""
    return "pseudo-decode" if any(w in name for w in ("decode", "pseudo", "stream")) else "static"


def error_kind(name: str) -> str | None:
    """What an exp2 series path measures: ``"kl"``, ``"kl_rev"``, ``"rel_mse"``, ``"mse"``, ``"mae"``,
    ``"cos"``, or ``None`` (a signed gap, a bias, a logit error … that no figure draws)."""
    if re.search(r"(^|[^a-z])kl([^a-z]|$)", name):
        return "kl_rev" if re.search(r"rev", name) else "kl"
    if any(w in name for w in ("signed", "gap", "bias", "var", "slope", "weighted", "logit", "attn_k")):
        return None
    if "rel_mse" in name:
        return "rel_mse"
    for w in ("mse", "mae", "cos"):
        if w in name:
            return w
    return None
