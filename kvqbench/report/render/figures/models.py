"""``kl_models.png``: the end-to-end KL of one model against another's, one point per method × bits (means
over seeds, log axes, the diagonal y = x dashed), Spearman ρ between the models in the title. Points on
the diagonal damage both models alike; a method's distance from the others along the diagonal is its rank.
Drawn from two models' statistics (:mod:`kvqbench.report.stats.models`), not from one result set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvqbench.report.render.figures import save
from kvqbench.report.render.figures.data import setting_bits
from kvqbench.report.render.figures.style import RC, Style, legend_outside, pyplot
from kvqbench.report.stats.models import kl_points, rank_table
from kvqbench.report.stats.predictivity import PREDICTIVITY_TARGETS

__all__ = ["draw_models", "FILE"]

FILE = "kl_models.png"
#: a point's marker tells its key bit-width; its colour, the method (the legend names every point)
_SHAPES = {2: "o", 3: "s", 4: "^", 8: "D"}


def draw_models(stats_by_model: dict[str, Any], out: str | Path, *, methods: list[str] | None = None
                ) -> Path | None:
    """Draw KL(model A) against KL(model B) into ``out/kl_models.png``.

    Args:
        stats_by_model: ``{model name: stats of its real source}``, exactly two (A on x, B on y).
        out: the folder to write into.
        methods: the board's method order (:func:`~kvqbench.report.render.figures.style.method_order`), which
            fixes each method's colour as in every other figure (default: the methods found, sorted).

    Returns the path, or ``None`` when no (method, setting) has a non-exact KL on both models.

    Raises:
        ValueError: not exactly two models. ImportError: matplotlib is missing.
    """
    import matplotlib

    target = PREDICTIVITY_TARGETS[0]
    table = rank_table(stats_by_model, target=target)
    a, b = table["models"]
    pa, pb = (kl_points(stats_by_model[n], target=target) for n in (a, b))
    both = sorted(k for k in pa if k in pb)
    if not both:
        return None
    style = Style(methods or sorted({m for m, _ in both}))
    plt = pyplot()
    with matplotlib.rc_context(RC):
        fig, ax = plt.subplots(figsize=(5.2, 4.6))
        for m in style.in_order({m for m, _ in both}):
            for s in sorted(s for mm, s in both if mm == m):
                bits = setting_bits(s)
                st = style(m)
                ax.scatter([pa[(m, s)]["mean"]], [pb[(m, s)]["mean"]], edgecolors=st["color"],
                           facecolors=st["facecolor"], s=30, marker=_SHAPES.get(bits[0] if bits else 0, "v"), label=f"{m} {s}")
        lo = min(min(pa[k]["mean"], pb[k]["mean"]) for k in both)
        hi = max(max(pa[k]["mean"], pb[k]["mean"]) for k in both)
        ax.plot([lo, hi], [lo, hi], color="0.5", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"{a}: end-to-end KL(p‖p̂), nats")
        ax.set_ylabel(f"{b}: end-to-end KL(p‖p̂), nats")
        rho = "; ".join(f"{s} ρ = {v['rho']:+.2f}" for s, v in table["rho"].items() if v["rho"] is not None)
        ax.set_title(f"Does the damage carry over? ({target}; Spearman {rho or 'ρ: too few methods'})", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        legend_outside(ax, ncol=2)
        return save.finish(fig, Path(out) / FILE)
