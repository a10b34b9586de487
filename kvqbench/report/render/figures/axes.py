"""Axis helpers shared by several figures."""

from __future__ import annotations

import math
from typing import Any, Iterable

__all__ = ["legend_outside", "bits_axis", "span_decades"]


def legend_outside(ax: Any, handles: list[Any] | None = None, labels: list[str] | None = None, **kw: Any) -> None:
    """A legend to the right of ``ax``, top-aligned, no frame: of ``handles``/``labels``, or by default
    of every labelled artist of ``ax`` (none drawn when there is none)."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False, **kw)


def bits_axis(ax: Any, ticks: list[float]) -> None:
    """A log₂ x axis for bits per element, ticked at ``ticks`` (plain numbers, no minor ticks)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.minorticks_off()


def span_decades(vals: Iterable[float]) -> float:
    """How many decades the positive finite values span (0 for fewer than two); a figure draws a log
    axis from 1.5 decades on."""
    pos = [v for v in vals if v > 0 and math.isfinite(v)]
    if len(pos) < 2:
        return 0.0
    return math.log10(max(pos) / min(pos))
