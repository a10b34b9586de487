"""``norm_diff_density_{source}.png`` (exp3): per method a small panel with the density of the per-token
norm difference (‖x̂‖ − ‖x‖) / RMS token norm, K solid and V dashed, at the headline setting.

Each panel's x-range comes from quantiles of its own data (the central 98 % of the tokens inside the
bins); any share off scale, past the last bin included, is named in the panel, and fine bins that
zig-zag are merged (and the panel says so). A histogram is any series whose path names ``norm`` or
``diff``; a ``v``/``v_…`` path segment selects V.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from kvqbench.metrics import experiment_of
from kvqbench.report.render.figures import save
from kvqbench.report.render.figures.data import Source, headline_setting, mean_histograms, passed_settings

__all__ = ["draw", "mass_range", "merge_factor", "merge_bins"]


def draw(plt: Any, src: Source, out: Path) -> Path | None:
    """Draw the figure from the exp3 cells of ``src`` at the headline setting; ``None`` when they hold
    no norm-difference histogram."""
    style = src.style
    cells = src.cells(experiment_of("k_offdiag_mass"))
    setting = headline_setting(passed_settings(cells))
    if setting is None:
        return None
    curves, tails = mean_histograms(cells, setting, _k_or_v)
    if not curves:
        return None
    methods = style.in_order({m for m, _ in curves})
    kvs = [kv for kv in ("K", "V") if any(k == kv for _, k in curves)]
    ncol = min(4, len(methods))
    nrow = math.ceil(len(methods) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.2 * ncol + 0.5, 2.5 * nrow + 0.8), squeeze=False)
    for i, m in enumerate(methods):
        ax = axes[i // ncol][i % ncol]
        st = style(m)
        drawn = {kv: curves[(m, kv)] for kv in kvs if (m, kv) in curves}
        lo, hi = mass_range(list(drawn.values()))
        outside = []
        merged = set()
        one_bin: dict[tuple[float, float], list[str]] = {}  # a density all in one bin: below the resolution
        for kv, (edges, dens) in drawn.items():
            shares = [d * (b - a) for a, b, d in zip(edges, edges[1:], dens, strict=False)]
            top = max(range(len(shares)), key=shares.__getitem__, default=None)
            if top is not None and shares[top] >= 0.995:
                one_bin.setdefault((edges[top], edges[top + 1]), []).append(kv)
            # the drawn density integrates to the share inside the bins: the rest is under/overflow
            share_out = 1.0 - _mass_within(edges, dens, lo, hi)
            if share_out > 0.005:
                under, over = tails.get((m, kv), (0.0, 0.0))
                beyond = [f"{v:.0%} {sign} {edge:g}" if v >= 0.01 else f"<1% {sign} {edge:g}"
                          for v, sign, edge in ((under, "<", edges[0]), (over, ">", edges[-1])) if v > 0.005]
                outside.append((f"{kv} {share_out:.0%}" if share_out >= 0.01 else f"{kv} <1%")
                               + (f" ({', '.join(beyond)}, past the last bin)" if beyond else ""))
            k = merge_factor(edges, dens, lo, hi)
            if k > 1:
                merged.add(k)
                edges, dens = merge_bins(edges, dens, k)
            ax.stairs(dens, edges, fill=True, alpha=0.35 if kv == "K" else 0.15, color=st["color"])
            ax.stairs(dens, edges, color=st["color"], linewidth=1.0, linestyle="-" if kv == "K" else "--", label=kv)
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(plt.MaxNLocator(5))
        ax.axvline(0, color="grey", linewidth=0.6)
        lines = [f"{', '.join(kvs_)}: all tokens in [{a:g}, {b:g})" for (a, b), kvs_ in one_bin.items()]
        if outside:
            line = ", ".join(outside)
            lines += ["off scale: " + line] if len(line) <= 28 else ["off scale: " + outside[0], *outside[1:]]
        if merged:
            lines.append(f"bins merged ×{max(merged)} (fine bins zig-zag)")
        if lines:  # in the upper corner where the drawn densities are lower, above the highest bin
            text = "\n".join(lines)
            ax.set_ylim(0, ax.get_ylim()[1] * (1 + 0.12 * len(lines)))
            third = (hi - lo) / 3
            left = max((d for e, ds in drawn.values() for a, d in zip(e, ds, strict=False) if a < lo + third),
                       default=0.0)
            right = max((d for e, ds in drawn.values() for a, b, d in zip(e, e[1:], ds, strict=False)
                         if b > hi - third), default=0.0)
            x_note, ha = (0.02, "left") if left <= right else (0.98, "right")
            ax.text(x_note, 0.97, text, transform=ax.transAxes, fontsize=7, va="top", ha=ha, color="dimgrey",
                    zorder=5, bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none",
                                    "alpha": 0.8})
        ax.set_title(m, fontsize=9, color=st["color"])
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.25)
        if len(kvs) > 1 and i == 0:
            ax.legend(fontsize=7, frameon=False, loc="upper right")
    for j in range(len(methods), nrow * ncol):
        axes[j // ncol][j % ncol].axis("off")
    for j in range(ncol):  # the x label on the lowest drawn panel of each column
        axes[(len(methods) - 1 - j) // ncol][j].set_xlabel("(‖x̂‖ − ‖x‖) / RMS token norm", fontsize=8)
    for row in axes:
        row[0].set_ylabel("density", fontsize=8)
    fig.suptitle(f"Per-token norm-difference density at {setting} ({src.name}; K solid, V dashed; 0 = norm preserved)\n"
                 "x-range per method: the central 98 % of its tokens inside the histogram's bins (quantiles "
                 "from the data); a panel names any share off scale, bins included", fontsize=11)
    fig.tight_layout()
    return save.finish(fig, out / f"norm_diff_density_{src.name}.png")


def _k_or_v(name: str) -> str | None:
    """``"K"`` or ``"V"`` for a norm-difference histogram's path (a word ``v``, as in ``v_norm_diff``: V),
    else ``None``."""
    if "norm" not in name and "diff" not in name:
        return None
    return "V" if "v" in re.split(r"[^a-z0-9]+", name) else "K"


def _mass_within(edges: list[float], dens: list[float], lo: float, hi: float) -> float:
    """Share of a density (on ``edges``) inside ``[lo, hi]`` (partial bins pro rata)."""
    tot = 0.0
    for a, b, d in zip(edges, edges[1:], dens, strict=False):
        overlap = max(0.0, min(b, hi) - max(a, lo))
        tot += d * overlap
    return tot


def _quantile(edges: list[float], mass: list[float], q: float) -> float:
    """The ``q`` quantile of a histogram (``mass`` per bin on ``edges``; uniform inside each bin)."""
    total = math.fsum(mass)
    target, acc = q * total, 0.0
    for a, b, w in zip(edges, edges[1:], mass, strict=False):
        if w > 0 and acc + w >= target:
            return a + (b - a) * max(0.0, target - acc) / w
        acc += w
    return edges[-1]


def mass_range(hists: list[tuple[list[float], list[float]]], keep: float = 0.98, min_span: float = 0.1
                ) -> tuple[float, float]:
    """An x-range chosen from the data: from the ``(1 − keep) / 2`` to the ``(1 + keep) / 2`` quantile of
    the tokens inside each histogram's bins (the widest over the histograms; quantiles interpolated
    inside a bin, so one wide tail bin does not stretch the axis to its far edge), always including 0,
    at least ``min_span`` wide, padded by 5 %. Tokens past the first or last edge (under/overflow) are
    not in the bins and do not stretch it either: the figure names their share. Falls back to the
    edges' span."""
    los, his = [], []
    for edges, dens in hists:
        mass = [d * (b - a) for a, b, d in zip(edges, edges[1:], dens, strict=False)]
        if math.fsum(mass) <= 0:
            continue
        los.append(_quantile(edges, mass, (1.0 - keep) / 2))
        his.append(_quantile(edges, mass, (1.0 + keep) / 2))
    if not los:
        e = hists[0][0] if hists else [-1.0, 1.0]
        return e[0], e[-1]
    lo, hi = min(min(los), 0.0), max(max(his), 0.0)
    if hi - lo < min_span:  # e.g. everything in the bin at 0 (fp16): show some room around it
        mid = (hi + lo) / 2
        lo, hi = min(lo, mid - min_span / 2), max(hi, mid + min_span / 2)
    pad = 0.05 * (hi - lo)
    return lo - pad, hi + pad


def merge_factor(edges: list[float], dens: list[float], lo: float, hi: float, most: int = 4) -> int:
    """How many neighbouring bins to merge (1 = none) so that the density inside ``[lo, hi]`` reads as a
    curve. A turn is a rise then a fall, or a fall then a rise, each step over 10 % of the peak; a
    smooth curve with up to three modes has at most 3. Where the fine bins make more (sampling noise,
    or bins finer than the values' own grain), the smallest factor up to ``most`` that brings them to 3
    or fewer, else the one with the fewest turns — but only a factor that removes turns: where they
    come from bins that cannot merge (a wider tail), none."""
    def turns(k: int) -> int:
        e, d = merge_bins(edges, dens, k) if k > 1 else (edges, dens)
        seen = [v for a, b, v in zip(e, e[1:], d, strict=False) if b > lo and a < hi]
        if len(seen) < 4:
            return 0
        peak = max(seen)
        steps = [b - a for a, b in zip(seen, seen[1:], strict=False) if abs(b - a) > 0.1 * peak]
        return sum((a > 0) != (b > 0) for a, b in zip(steps, steps[1:], strict=False))

    counts = {k: turns(k) for k in range(1, most + 1)}
    if counts[1] <= 3:
        return 1
    enough = [k for k in counts if counts[k] <= 3]
    best = enough[0] if enough else min(counts, key=lambda k: (counts[k], k))
    return best if counts[best] < counts[1] else 1


def merge_bins(edges: list[float], dens: list[float], k: int) -> tuple[list[float], list[float]]:
    """Merge runs of ``k`` neighbouring bins of equal width into one (density = their mass over their
    width, so the mass is kept); runs are aligned on the edge nearest 0 so that 0 stays an edge; bins
    of another width (a wider tail) are kept as they are."""
    z = min(range(len(edges)), key=lambda i: abs(edges[i]))
    ne, nd = [edges[0]], []
    i, n = 0, len(dens)
    while i < n:
        w = edges[i + 1] - edges[i]
        run = i + k <= n and (i - z) % k == 0 and all(
            abs((edges[j + 1] - edges[j]) - w) <= 1e-9 * max(abs(w), 1.0) for j in range(i, i + k))
        if run:
            ne.append(edges[i + k])
            nd.append(math.fsum(dens[j] * (edges[j + 1] - edges[j]) for j in range(i, i + k)) / (edges[i + k] - edges[i]))
            i += k
        else:
            ne.append(edges[i + 1])
            nd.append(dens[i])
            i += 1
    return ne, nd
