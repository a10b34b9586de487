"""How every figure looks: resolution, colours and markers per method, the matplotlib setup, and the
axis helpers and words that several figures share.

The PNGs are deterministic: the Agg backend, a fixed DPI, and no timestamp or version metadata.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

__all__ = ["DPI", "COLORS", "MARKERS", "LINESTYLES", "RC", "CONTEXT_AXIS", "Style", "method_order", "pyplot",
           "legend_outside", "bits_axis", "span_decades"]

#: dots per inch of every PNG
DPI = 110

#: the method colours: Paul Tol's colour-blind-safe qualitative scheme "muted" (nine colours, distinct
#: under the common colour-vision deficiencies; P. Tol, "Colour schemes", SRON technical note
#: SRON/EPS/TN/09-002, https://personal.sron.nl/~pault/), in its order. fp16, the reference, is black.
COLORS = ["#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255", "#AA4499"]
#: one marker per method (none of them fp16's circle), so methods that share a colour still differ
MARKERS = ["s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p", "8", "d", "o"]
#: the line style of each pass through the colours (past nine methods a colour comes back, dash-dotted
#: and with hollow markers)
LINESTYLES = ["-", "-.", ":"]

#: matplotlib settings every figure is drawn under (``svg.hashsalt``: fixed ids, no randomness)
RC: dict[str, Any] = {"font.size": 9, "axes.titlesize": 10, "figure.dpi": DPI, "savefig.dpi": DPI,
                      "path.simplify": False, "svg.hashsalt": "kvqbench", "axes.spines.top": False,
                      "axes.spines.right": False}

#: x axis of every figure drawn against the context length
CONTEXT_AXIS = "context length (tokens)"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'kvqbench[plots]'``); any other error of a
            broken install propagates as raised.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def method_order(board: dict[str, Any] | None, extra: Any) -> list[str]:
    """The leaderboard's methods in its order, then any method of ``extra`` it does not list, sorted."""
    order = list((board or {}).get("methods", {}))
    for m in sorted(set(extra)):
        if m not in order:
            order.append(m)
    return order


class Style:
    """Colour, marker, line style and marker face of each method, fixed by its place in ``methods``
    among the methods other than fp16 (the reference: black, dashed, circles); a method not listed takes
    the next free place. Every figure and the web page draw with the board's method order
    (:func:`method_order`), so a method has one look everywhere."""

    def __init__(self, methods: list[str]) -> None:
        self.idx = {m: i for i, m in enumerate(methods)}
        self.slot = {m: j for j, m in enumerate(m for m in methods if m != "fp16")}

    def __call__(self, m: str) -> dict[str, Any]:
        """``{"color", "marker", "linestyle", "facecolor"}`` of method ``m`` (matplotlib names; ``facecolor``
        is ``"white"`` for a hollow marker)."""
        self.idx.setdefault(m, len(self.idx))
        if m == "fp16":
            return {"color": "black", "marker": "o", "linestyle": "--", "facecolor": "black"}
        j = self.slot.setdefault(m, len(self.slot))
        color, lap = COLORS[j % len(COLORS)], j // len(COLORS)
        return {"color": color, "marker": MARKERS[j % len(MARKERS)], "linestyle": LINESTYLES[lap % len(LINESTYLES)],
                "facecolor": "white" if lap % 2 else color}

    def rank(self, m: str) -> int:
        """Sort key: a method's place in the order (an unlisted one after every listed one)."""
        return self.idx.get(m, 99)

    def in_order(self, methods: Any) -> list[str]:
        """``methods`` in this order (unlisted ones last, in their given order)."""
        return sorted(methods, key=self.rank)


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
    return math.log10(max(pos) / min(pos)) if len(pos) >= 2 else 0.0
