"""``predictivity_{source}.png`` (exp5): the tensor metrics that best predict the end-to-end KL, one
panel per metric against that KL, one point per method × bits (means over seeds), log axes, Spearman ρ
with its 95 % CI in each panel's title. A signed metric is drawn by magnitude, and its axis says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvqbench.metrics import experiment_of
from kvqbench.report.render.figures import save
from kvqbench.report.render.figures.data import Source, setting_bits
from kvqbench.report.render.figures.style import legend_outside
from kvqbench.report.stats.predictivity import PREDICTIVITY_TARGETS

__all__ = ["draw"]

#: a point's marker tells its key bit-width (bits mod 5 pick one); its colour, the method
_SHAPES = ["o", "s", "^", "D", "v"]
#: how many of the best predictors get a panel
_TOP = 4


def draw(plt: Any, src: Source, out: Path) -> Path | None:
    """Draw the :data:`_TOP` best predictors of the leaderboard's ``predictivity`` of ``src`` (pooled over
    groups where pooled exists); ``None`` when there is none or exp5 did not run."""
    style = src.style
    pr = src.summary.get("predictivity") or {}
    target = PREDICTIVITY_TARGETS[0]
    by_group = (pr.get("targets") or {}).get(target) or {}
    group = "pooled" if "pooled" in by_group else next(iter(by_group), None)
    rows = [r for r in by_group.get(group, []) if r["rho"] is not None][:_TOP] if group else []
    stats = src.stats
    e2e = stats.get(experiment_of(target)) or {}
    if not rows or not e2e:
        return None
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows) + 1.6, 3.8), squeeze=False)
    for ax, r in zip(axes[0], rows, strict=False):
        negative = False  # a signed metric (a slope, a bias) is drawn as |value| on the log axis: say so
        for m in style.in_order(e2e):
            for setting, metrics in sorted(e2e[m].items()):
                x = (stats.get(r["experiment"], {}).get(m, {}).get(setting, {}).get(r["metric"]) or {}).get("mean")
                y = (metrics.get(target) or {}).get("mean")
                if x is None or y is None or not (abs(x) > 0 and y > 0):
                    continue
                b = setting_bits(setting)
                negative |= x < 0
                st = style(m)
                ax.scatter([abs(x)], [y], edgecolors=st["color"], facecolors=st["facecolor"], s=28,
                           marker=_SHAPES[(b[0] if b else 0) % len(_SHAPES)],
                           label=f"{m} {setting}" if ax is axes[0][-1] else None)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"|{r['metric']}| ({r['experiment']}; negative values drawn by magnitude)" if negative
                      else f"{r['metric']} ({r['experiment']})", fontsize=9 if negative else None)
        ci = f" [{r['ci95'][0]:+.2f}, {r['ci95'][1]:+.2f}]" if r.get("ci95") else ""
        ax.set_title(f"ρ = {r['rho']:+.2f}{ci}", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel(f"end-to-end KL(p‖p̂), nats ({target})")
    legend_outside(axes[0][-1], ncol=2)
    fig.suptitle(f"Which tensor metrics predict model damage ({src.name}; one point per method × bits, "
                 f"Spearman ρ {group})", fontsize=11)
    return save.finish(fig, out / f"predictivity_{src.name}.png")
