"""``attn_error_vs_context_{source}.png`` and ``attn_kl_vs_context_{source}.png`` (exp2): the attention-
output error, or the attention KL(p‖p̂), against the context length at the headline setting; panels
*static* and *pseudo-decode*, one line per method, mean over seeds. One drawing serves both figures.

Under the pseudo-decode panel, for the methods whose fp16 share changes with the length, the newest
tokens held fp16 and the billed bits, and a note that says from the data whether that share explains
their curves' jumps (:mod:`.decode_fp16`). A value exactly 0 on a log axis is a ▽ on the x axis, named
in a note at the foot of its panel.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvqbench.metrics import experiment_of
from kvqbench.report.render.figures import save
from kvqbench.report.render.figures.axes import legend_outside, span_decades
from kvqbench.report.render.figures.data import XY, Source, headline_setting, mean_curves, passed_settings
from kvqbench.report.render.figures.decode_fp16 import all_fp16_at, decode_fp16, draw_fp16_panel
from kvqbench.report.render.figures.labels import CONTEXT_AXIS, ERROR_AXIS, REGIME_TITLE
from kvqbench.report.render.figures.series import context_metric, error_kind, regime

__all__ = ["draw_error", "draw_kl", "exp2_curves"]

#: the kinds each figure draws, preferred first: a figure draws the first one the data hold
_KINDS = {"err": ("rel_mse", "mse", "mae", "cos"), "kl": ("kl", "kl_rev")}
#: height (points) above the x axis of the centre of a ▽ that marks an exact 0 on a log axis: the whole
#: marker (7 points, edge 1.3) stays inside the axes
_ZERO_MARK_Y = 6.0

_ACCUMULATION = experiment_of("static_attn_kl_fwd_nats")


def draw_error(plt: Any, src: Source, out: Path) -> Path | None:
    """``attn_error_vs_context_{source}.png``; ``None`` when exp2 holds no error curve."""
    return _draw(plt, src, out, "err")


def draw_kl(plt: Any, src: Source, out: Path) -> Path | None:
    """``attn_kl_vs_context_{source}.png``; ``None`` when exp2 holds no KL curve."""
    return _draw(plt, src, out, "kl")


def exp2_curves(src: Source, quantity: str) -> tuple[str | None, str | None, dict[tuple[str, str], XY]]:
    """``(setting, kind, {(method, regime): (x, y)})`` for one exp2 quantity (``"err"`` or ``"kl"``) at
    the headline setting: the cells' curves (mean over seeds), then the stats' ``<name>_ctx<N>`` points
    where a cell holds no curve; ``kind`` is the first of the quantity's kinds the data hold."""
    stats_exp = src.stats.get(_ACCUMULATION) or {}
    cells = src.cells(_ACCUMULATION)
    setting = headline_setting(passed_settings(cells) | {s for by in stats_exp.values() for s in by})
    if setting is None:
        return None, None, {}
    prefs = _KINDS[quantity]

    def kind(name: str) -> Any:
        k = error_kind(name)
        return (regime(name), k) if k in prefs else None

    curves = mean_curves(cells, setting, kind)
    for k, v in _stats_curves(stats_exp, setting, kind).items():
        curves.setdefault(k, v)
    chosen = next((p for p in prefs if any(key[1] == p for _, key in curves)), None)
    return setting, chosen, {(m, key[0]): xy for (m, key), xy in curves.items() if key[1] == chosen}


def _stats_curves(stats_exp: dict[str, Any], setting: str, kind: Any) -> dict[tuple[str, Any], XY]:
    """Curves from scalar metrics ``<name>_ctx<N>`` (means over seeds) at ``setting``, two points or more."""
    pts: dict[tuple[str, Any], dict[float, float]] = defaultdict(dict)
    for meth, by_setting in stats_exp.items():
        for name, e in (by_setting.get(setting) or {}).items():
            point = context_metric(name)
            if point is None:
                continue
            key = kind(point[0].lower())
            if key is not None:
                pts[(meth, key)][point[1]] = e["mean"]
    return {k: (sorted(v), [v[x] for x in sorted(v)]) for k, v in pts.items() if len(v) >= 2}


def _draw(plt: Any, src: Source, out: Path, quantity: str) -> Path | None:
    from matplotlib.transforms import blended_transform_factory, offset_copy

    style = src.style
    setting, kind, curves = exp2_curves(src, quantity)
    if not curves or kind is None:
        return None
    regimes = [r for r in ("static", "pseudo-decode") if any(k[1] == r for k in curves)]
    fp16 = decode_fp16(src.cells(_ACCUMULATION), setting) if "pseudo-decode" in regimes else {}
    if fp16:  # a second row: the fp16 tokens and billed bits under the pseudo-decode panel
        fig, grid = plt.subplots(2, len(regimes), figsize=(6 * len(regimes) + 1.5, 7.0), squeeze=False,
                                 gridspec_kw={"height_ratios": [3, 1.5]}, sharex="col")
        axes = grid[:1]
        for ax in grid[0][1:]:
            ax.sharey(grid[0][0])
    else:
        fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes) + 1.5, 4.6), sharey=True,
                                 squeeze=False)
    allv = [y for xs, ys in curves.values() for y in ys]
    log = span_decades(allv) >= 1.5
    handles: dict[str, Any] = {}
    zeros: dict[str, list[tuple[str, list[float]]]] = {}  # regime → (method, lengths where exactly 0)
    n_lines = 0  # the most lines of notes at the foot of a panel
    n_zero_rows = 0  # whether a panel has a row of ▽ (exact 0) under its notes
    for ax, reg in zip(axes[0], regimes, strict=False):
        zero_methods: list[str] = []
        for (m, r), (xs, ys) in sorted(curves.items(), key=lambda kv: style.rank(kv[0][0])):
            if r != reg:
                continue
            pts = [(x, y) for x, y in zip(xs, ys, strict=False) if (y > 0 or not log)]
            if not pts:
                zero_methods.append(m)
                continue
            if len(pts) < len(ys):
                zeros.setdefault(reg, []).append((m, [x for x, y in zip(xs, ys, strict=False) if not y > 0]))
            st = style(m)
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=m, color=st["color"],
                              marker=st["marker"], linestyle=st["linestyle"], markersize=4, linewidth=1.3)
            handles.setdefault(m, line)
        notes = []
        foot = blended_transform_factory(ax.transData, ax.transAxes)
        at_x: dict[float, int] = defaultdict(int)  # ▽ already drawn at a length: the next one beside it
        for m, xs0 in zeros.get(reg, []):  # a point at exactly 0 has no place on a log axis: ▽ on its x axis
            st = style(m)
            for x in xs0:
                # inside the axes: the marker's tip (and its edge) stays above the x axis, never cut by it
                shift = offset_copy(foot, fig=fig, x=7.0 * at_x[x], y=_ZERO_MARK_Y, units="points")
                at_x[x] += 1
                ax.plot([x], [0.0], transform=shift, linestyle="none", marker="v", markersize=7,
                        markerfacecolor="white", markeredgewidth=1.3, color=st["color"], clip_on=False, zorder=5,
                        label=f"_exactly 0: {m}")
            why = all_fp16_at(fp16.get(m), xs0) if reg == "pseudo-decode" else []
            at = ", ".join(f"{x:g}" for x in xs0)
            notes.append(f"▽ {m} at {at} tokens: exactly 0" + (" (every token still fp16)" if why else ""))
        if zero_methods:
            notes.append("exactly 0 at every length (not drawn): " + ", ".join(zero_methods))
        if log:
            ax.set_yscale("log")
        if notes:  # above the row of ▽ where there is one
            lift = 2 * _ZERO_MARK_Y if zeros.get(reg) else 0.0
            ax.text(0.01, 0.02, "\n".join(notes), fontsize=7, color="dimgrey", va="bottom", zorder=6,
                    transform=offset_copy(ax.transAxes, fig=fig, y=lift, units="points"))
            n_lines = max(n_lines, len(notes))
            n_zero_rows = max(n_zero_rows, 1 if zeros.get(reg) else 0)
        xs_all = sorted({x for (m, r), (xs, _) in curves.items() if r == reg for x in xs})
        if xs_all and xs_all[0] > 0 and xs_all[-1] / xs_all[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(CONTEXT_AXIS)
        ax.set_title(REGIME_TITLE[reg], fontsize=10)
        ax.grid(True, alpha=0.3)
    if n_lines:  # an empty band at the foot of the (shared) y axis for the notes: they cover no curve
        height_pt = axes[0][0].get_position().height * fig.get_size_inches()[1] * 72.0
        _foot_room(axes[0][0], 0.045 * n_lines + 0.03 + n_zero_rows * 2 * _ZERO_MARK_Y / height_pt)
    axes[0][0].set_ylabel(ERROR_AXIS.get(kind, kind) + (" (log scale)" if log else ""))
    order = style.in_order(handles)  # every method drawn in any panel
    legend_outside(axes[0][-1], [handles[m] for m in order], order)
    if fp16:
        draw_fp16_panel(grid, regimes, fp16, style, axes, {m: xy for (m, r), xy in curves.items()
                                                           if r == "pseudo-decode"}, kind, src.name)
    what = "Attention KL" if quantity == "kl" else "Attention error"
    fig.suptitle(f"{what} vs context length at {setting} ({src.name}; mean over seeds)", fontsize=11)
    name = "attn_kl_vs_context" if quantity == "kl" else "attn_error_vs_context"
    return save.finish(fig, out / f"{name}_{src.name}.png")


def _foot_room(ax: Any, frac: float) -> None:
    """Lower the y axis so that the bottom ``frac`` of its height holds no data (log or linear)."""
    ax.autoscale_view()
    lo, hi = ax.get_ylim()
    if ax.get_yscale() == "log" and lo > 0:
        span = math.log10(hi / lo)
        ax.set_ylim(lo / 10 ** (span * frac / (1 - frac)), hi)
    else:
        ax.set_ylim(lo - (hi - lo) * frac / (1 - frac), hi)
