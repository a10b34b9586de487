"""``pareto_{source}.png``: relative MSE against effective bits per element, one marker per method and
setting, the non-dominated front drawn as a black step; each front point labelled in words near its own
marker, or by a number explained in a key where a cluster is too crowded (:mod:`.placement`)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from kvqbench.report.render.figures import save
from kvqbench.report.render.figures.data import Source
from kvqbench.report.render.figures.placement import CORE_RADIUS, place_labels
from kvqbench.report.render.figures.style import bits_axis, legend_outside

__all__ = ["draw"]

#: radius (points) of a front point's ring (scatter size 150, edge 1.4), larger than a method's marker
_RING_RADIUS = 6.9


def draw(plt: Any, src: Source, out: Path) -> Path | None:
    """Draw the figure from the leaderboard's ``pareto`` of ``src``; ``None`` when it holds no point.

    A point with relative MSE exactly 0 (lossless) is drawn on a dashed line a quarter below the
    smallest positive value, which a note names."""
    from matplotlib.cbook import pts_to_poststep

    pf = src.summary.get("pareto") or {}
    style = src.style
    pts = [p for p in pf.get("points", []) if p.get("bits_effective") is not None and p.get("rel_mse") is not None]
    if not pts:
        return None
    pos = [p["rel_mse"] for p in pts if p["rel_mse"] > 0]
    floor = (min(pos) / 4) if pos else 1e-6
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    by_m: dict[str, list[dict]] = defaultdict(list)
    for p in pts:
        by_m[p["method"]].append(p)
    for m in style.in_order(by_m):
        ps = sorted(by_m[m], key=lambda p: p["bits_effective"])
        st = style(m)
        xs = [p["bits_effective"] for p in ps]
        ys = [p["rel_mse"] if p["rel_mse"] > 0 else floor for p in ps]
        ax.plot(xs, ys, color=st["color"], linestyle=":", linewidth=0.8, alpha=0.6)
        ax.scatter(xs, ys, edgecolors=st["color"], facecolors=st["facecolor"], marker=st["marker"], s=42, label=m,
                   zorder=3)
    front = sorted(pf.get("front", []), key=lambda p: p["bits_effective"])
    texts: list[tuple[float, float, str]] = []
    step = []
    if front:
        fx = [p["bits_effective"] for p in front]
        fy = [p["rel_mse"] if p["rel_mse"] > 0 else floor for p in front]
        ax.step(fx, fy, where="post", color="black", linewidth=1.6, label="Pareto front", zorder=2)
        ax.scatter(fx, fy, s=150, facecolors="none", edgecolors="black", linewidths=1.4, zorder=4)
        # one label per distinct front point (identical points, e.g. every method exact at 16 bits, merged)
        labels: dict[tuple[float, float], list[str]] = {}
        for p, y in zip(front, fy, strict=False):
            labels.setdefault((round(p["bits_effective"], 6), y), []).append(f"{p['method']} {p['setting']}")
        texts = [(x, y, names[0] if len(names) == 1 else f"exact ({len(names)} points)" if y == floor else
                  f"{names[0]} +{len(names) - 1}") for (x, y), names in sorted(labels.items())]
        step = [pts_to_poststep(fx, fy)]  # the vertices of the step just drawn: no label covers it
    ax.set_yscale("log")
    if not all(p["rel_mse"] > 0 for p in pts):
        ax.axhline(floor, color="grey", linewidth=0.6, linestyle="--")
        ax.annotate("MSE = 0 (exact) drawn on this line", (min(p["bits_effective"] for p in pts), floor),
                    textcoords="offset points", xytext=(2, -11), fontsize=7, color="grey")
    lo, hi = min(p["bits_effective"] for p in pts), max(p["bits_effective"] for p in pts)
    bits_axis(ax, [t for t in (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if lo * 0.9 <= t <= hi * 1.1])
    ax.set_xlabel("effective bits per element (K and V mean, log₂ scale)")
    ax.set_ylabel("relative MSE, K and V mean (log scale)")
    ax.set_title(f"Quality vs bits — Pareto front ({src.name})")
    ax.grid(True, which="major", alpha=0.3)
    legend_outside(ax)
    # marker radii in points: a scatter marker of size s (points²) spans √s points
    markers = [(p["bits_effective"], p["rel_mse"] if p["rel_mse"] > 0 else floor, CORE_RADIUS) for p in pts]
    markers += [(x, y, _RING_RADIUS) for x, y, _ in texts]
    place_labels(fig, ax, texts, markers, lines=step)
    return save.finish(fig, out / f"pareto_{src.name}.png")
