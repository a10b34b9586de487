"""What the figures draw from: one :class:`Source` per data source, the
headline setting, and series averaged over seeds."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from kvqbench.cells import Setting
from kvqbench.report.render.figures.series import histograms, iter_curves
from kvqbench.report.render.figures.style import Style, method_order
from kvqbench.report.stats.aggregate import setting_key

__all__ = ["Source", "load_sources", "setting_bits", "symmetric_settings", "headline_setting",
           "passed_settings", "passed_at", "mean_curves", "mean_histograms"]

#: ``(x, y)`` of one curve; a histogram's x are its bin edges (one more than its y)
XY = tuple[list[float], list[float]]

@dataclass(frozen=True)
class Source:
    """Everything the figures of one data source read.

    Attributes:
        name: the data source, ``"synthetic"``, ``"real"`` or another model's ``"real-<model>"`` (part of
            every file name).
        summary: ``leaderboard.json``'s ``sources[name]``: ``stats`` (experiment → method → setting →
            metric → ``{mean, ci95, …}``), ``pareto``, ``predictivity``.
        style: each method's colour and marker, in the leaderboard's method order.
        experiments: experiment id (``"exp2"``) → the document of ``exp2_{name}.json`` (its ``cells``).
        catalog: the leaderboard's metrics catalog (metric → ``unit``, …).
    """

    name: str
    summary: dict[str, Any]
    style: Style
    experiments: dict[str, dict[str, Any]]
    catalog: dict[str, Any]

    @property
    def stats(self) -> dict[str, Any]:
        return self.summary.get("stats") or {}

    def cells(self, experiment: str) -> list[dict[str, Any]]:
        """The cell records of ``exp{N}_{name}.json`` (none when the experiment did not run)."""
        return (self.experiments.get(experiment) or {}).get("cells") or []


def load_sources(board: dict[str, Any], experiments: dict[tuple[str, str], dict[str, Any]]) -> list[Source]:
    """One :class:`Source` per source of the leaderboard document ``board``, sorted by name, with its
    per-experiment documents (``{(experiment, source): document}``,
    :func:`kvqbench.report.reader.read_experiment_files`)."""
    catalog = board.get("metrics_catalog") or {}
    out = []
    for src, sd in sorted((board.get("sources") or {}).items()):
        extra = {m for exp in (sd.get("stats") or {}).values() for m in exp}
        out.append(Source(src, sd, Style(method_order(board, extra)),
                          {exp: doc for (exp, s), doc in experiments.items() if s == src}, catalog))
    return out


def setting_bits(setting: str) -> tuple[int, int] | None:
    """``(k_bits, v_bits)`` of a plain setting ``"k2v4"``; ``None`` for a setting with variant axes
    (``"k2v2-group_size64"``) or anything else (:meth:`kvqbench.cells.Setting.parse`)."""
    p = Setting.parse(setting)
    return p.bits if p is not None and p.plain else None


def symmetric_settings(settings: Iterable[str]) -> list[str]:
    """The plain symmetric settings below 16 bits among ``settings`` (``"k2v2"``, ``"k4v4"`` …), by bits."""
    return sorted({s for s in settings if (b := setting_bits(s)) and b[0] == b[1] and b[0] < 16}, key=setting_bits)


def headline_setting(settings: Iterable[str]) -> str | None:
    """The lowest symmetric bit-width below 16 among ``settings`` (``"k2v2"`` in the default sweep)."""
    sym = symmetric_settings(settings)
    return sym[0] if sym else None


def passed_settings(cells: list[dict[str, Any]]) -> set[str]:
    """The settings of the cells that passed."""
    return {setting_key(c) for c in cells if c.get("status") == "passed"}


def passed_at(cells: list[dict[str, Any]], setting: str) -> list[dict[str, Any]]:
    """The cells that passed at ``setting``, in their order."""
    return [c for c in cells if c.get("status") == "passed" and setting_key(c) == setting]


def _first_per_cell(cells: list[dict[str, Any]], setting: str, kind: Callable[[str], Any],
                    walk: Callable[[Any], Iterable[tuple]]) -> dict[tuple[str, Any], list[tuple]]:
    """``{(method, key): [what walk yields after the path, one per passed cell at setting]}``; ``key``
    is ``kind(path joined by "/", lower-cased)``, the first series of each key in a cell counts."""
    acc: dict[tuple[str, Any], list[tuple]] = defaultdict(list)
    for c in passed_at(cells, setting):
        found: dict[Any, tuple] = {}
        for path, *item in walk(c.get("series") or {}):
            key = kind("/".join(path).lower())
            if key is not None and key not in found:
                found[key] = tuple(item)
        for key, item in found.items():
            acc[(c["method"], key)].append(item)
    return acc


def _mean_y(xys: list[tuple]) -> XY:
    """The first series' x and the mean y over the series with those same x."""
    xs = xys[0][0]
    same = [xy[1] for xy in xys if xy[0] == xs]
    return xs, [math.fsum(col) / len(col) for col in zip(*same, strict=False)]


def mean_curves(cells: list[dict[str, Any]], setting: str, kind: Callable[[str], Any]
                ) -> dict[tuple[str, Any], XY]:
    """``{(method, key): (x, mean y over seeds)}`` of the curves (:func:`series.iter_curves`) of the
    passed cells at ``setting``; ``key = kind(path)``, a path whose kind is ``None`` is left out."""
    return {k: _mean_y(v) for k, v in _first_per_cell(cells, setting, kind, iter_curves).items()}


def mean_histograms(cells: list[dict[str, Any]], setting: str, kind: Callable[[str], Any]
                    ) -> tuple[dict[tuple[str, Any], XY], dict[tuple[str, Any], tuple[float, float]]]:
    """Like :func:`mean_curves` for histograms: ``({(method, key): (edges, mean density)}, {(method,
    key): (under, over)})``, the second the mean shares of tokens below the first edge and above the
    last (:func:`series.histograms`)."""
    acc = _first_per_cell(cells, setting, kind, histograms)
    curves = {k: _mean_y(v) for k, v in acc.items()}
    tails = {k: (math.fsum(t[0] for *_, t in v) / len(v), math.fsum(t[1] for *_, t in v) / len(v))
             for k, v in acc.items()}
    return curves, tails
