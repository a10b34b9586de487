"""``mse_vs_bits_{source}.png``: K and V relative MSE against the bit-width (exp1), one line per method,
mean ± 95 % CI over seeds. A CI reaching 0 has no lower end on the log axis: its whisker stops at
mean / 3 in a ▼, explained under the figure; curves drawn over one another are named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvqbench.metrics import experiment_of
from kvqbench.report.render.figures import save
from kvqbench.report.render.figures.data import Source, setting_bits
from kvqbench.report.render.figures.style import bits_axis, legend_outside

__all__ = ["draw", "coinciding", "COINCIDE_REL"]

#: two curves whose points all differ by less than this share lie on top of each other
#: (a 2 % step is about a line width on a log axis spanning 7 decades)
COINCIDE_REL = 0.02

#: where the lower whisker of a CI that reaches 0 stops on the log axis (mean / this)
_CI_CUT = 3.0


def draw(plt: Any, src: Source, out: Path) -> Path | None:
    """Draw the figure from the exp1 stats of ``src`` (symmetric settings ``kBvB`` only); ``None`` when
    there are none."""
    exp1 = src.stats.get(experiment_of("k_rel_mse")) or {}
    style = src.style
    panels = [("k", "K"), ("v", "V")]
    data: dict[str, dict[str, list[tuple[int, float, float]]]] = {kv: {} for kv, _ in panels}
    for m, by in exp1.items():
        for setting, metrics in by.items():
            b = setting_bits(setting)
            if not b or b[0] != b[1]:
                continue
            for kv, _ in panels:
                e = metrics.get(f"{kv}_rel_mse")
                if e is not None:
                    data[kv].setdefault(m, []).append((b[0], e["mean"], e.get("ci95") or 0.0))
    if not any(data[kv] for kv, _ in panels):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    bits = sorted({b for kv, _ in panels for pts in data[kv].values() for b, y, _ in pts if y > 0})
    zero_note = open_note = False
    for ax, (kv, KV) in zip(axes, panels, strict=False):
        for m in style.in_order(data[kv]):
            pts = sorted(p for p in data[kv][m] if p[1] > 0)
            zero_note |= len(pts) < len(data[kv][m])
            if not pts:
                continue
            st = style(m)
            # a 95 % CI reaching 0 or below (mean − CI ≤ 0: seeds that differ by orders of magnitude) has no
            # lower end on a log axis: its whisker stops at mean / _CI_CUT and ends in a ▾, not in a cap
            # several decades down that would read as a huge error
            open_lo = [p[1] - p[2] <= 0 for p in pts]
            lower = [p[1] * (1 - 1 / _CI_CUT) if o else p[2] for p, o in zip(pts, open_lo, strict=True)]
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[lower, [p[2] for p in pts]],
                        label=m, color=st["color"], marker=st["marker"], linestyle=st["linestyle"],
                        markerfacecolor=st["facecolor"], markersize=5, capsize=2, linewidth=1.2)
            cut = [(p[0], p[1] / _CI_CUT) for p, o in zip(pts, open_lo, strict=True) if o]
            if cut:
                open_note = True
                ax.plot([c[0] for c in cut], [c[1] for c in cut], linestyle="none", marker="v", markersize=5,
                        color=st["color"], label=f"_CI reaches 0: {m}", zorder=4)
        ax.set_yscale("log")
        for i, group in enumerate(coinciding({m: [(b, y) for b, y, _ in pts if y > 0]
                                              for m, pts in data[kv].items()})):
            # curves drawn over one another: only the last one drawn shows, so the others are named
            ax.text(0.02, 0.02 + 0.06 * i, "on top of each other: " + ", ".join(group), transform=ax.transAxes,
                    ha="left", va="bottom", fontsize=8, color="dimgrey")
        bits_axis(ax, [float(b) for b in bits])
        ax.set_xlabel("bits per element (nominal bit-width of the setting)")
        ax.set_title(f"{KV} reconstruction")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("relative MSE = MSE / mean(x²) (log scale)")
    legend_outside(axes[1])
    fig.suptitle(f"Reconstruction error vs bit-width ({src.name}; mean ± 95% CI over seeds"
                 + ("; exact 0 not drawn" if zero_note else "") + ")", fontsize=11)
    if open_note:
        fig.text(0.5, -0.01, f"▼ at a whisker's end: that 95% CI reaches 0 or below (mean − CI ≤ 0: the seeds spread "
                 f"wider than their mean), which a log axis cannot draw;\nits whisker stops at mean / {_CI_CUT:g} "
                 f"and the ▼ says the CI goes on down", ha="center", va="top", fontsize=8, color="dimgrey")
    return save.finish(fig, out / f"mse_vs_bits_{src.name}.png")


def coinciding(curves: dict[str, list[tuple[float, float]]], rel: float = COINCIDE_REL) -> list[list[str]]:
    """Groups (two or more, sorted; groups in order of their first name) of the curves ``{name: [(x, y)]}`` that
    lie on top of each other: the same x values and every y within ``rel`` of the other's (relative to the
    larger). Each curve joins the first group whose first curve it matches."""
    groups: list[list[str]] = []
    pts = {m: sorted(v) for m, v in curves.items() if v}
    for m in sorted(pts):
        for g in groups:
            a, b = pts[g[0]], pts[m]
            if [x for x, _ in a] == [x for x, _ in b] and all(
                    abs(ya - yb) <= rel * max(abs(ya), abs(yb)) for (_, ya), (_, yb) in zip(a, b, strict=True)):
                g.append(m)
                break
        else:
            groups.append([m])
    return [g for g in groups if len(g) > 1]
