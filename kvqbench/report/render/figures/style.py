"""How every figure looks: resolution, colours and markers per method, and the matplotlib setup.

The PNGs are deterministic: the Agg backend, a fixed DPI, and no timestamp or version metadata.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DPI", "COLORS", "MARKERS", "RC", "Style", "method_order", "pyplot"]

#: dots per inch of every PNG
DPI = 110

#: one colour and one marker per method, in the leaderboard's method order (cycled past the end)
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf", "#393b79", "#ad494a", "#637939", "#843c39"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p", "8", "d"]

#: matplotlib settings every figure is drawn under (``svg.hashsalt``: fixed ids, no randomness)
RC: dict[str, Any] = {"font.size": 9, "axes.titlesize": 10, "figure.dpi": DPI, "savefig.dpi": DPI,
                      "path.simplify": False, "svg.hashsalt": "kvqbench", "axes.spines.top": False,
                      "axes.spines.right": False}


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
    """Colour, marker and line style of each method, fixed by its place in ``methods`` (fp16, the
    reference, is black and dashed); a method not listed takes the next free place."""

    def __init__(self, methods: list[str]) -> None:
        self.idx = {m: i for i, m in enumerate(methods)}

    def __call__(self, m: str) -> dict[str, Any]:
        i = self.idx.setdefault(m, len(self.idx))
        if m == "fp16":
            return {"color": "black", "marker": "o", "linestyle": "--"}
        return {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)], "linestyle": "-"}

    def rank(self, m: str) -> int:
        """Sort key: a method's place in the order (an unlisted one after every listed one)."""
        return self.idx.get(m, 99)

    def in_order(self, methods: Any) -> list[str]:
        """``methods`` in this order (unlisted ones last, in their given order)."""
        return sorted(methods, key=self.rank)
