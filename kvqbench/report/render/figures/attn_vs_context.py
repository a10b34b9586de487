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
from kvqbench.report.render.figures.data import XY, Source, headline_setting, mean_curves, passed_settings
from kvqbench.report.render.figures.decode_fp16 import all_fp16_at, decode_fp16, draw_fp16_panel
from kvqbench.report.render.figures.series import error_kind, regime
from kvqbench.report.render.figures.style import CONTEXT_AXIS, legend_outside, span_decades

__all__ = ["draw_error", "draw_kl"]

#: the kinds each figure draws, preferred first: a figure draws the first one the data hold
_KINDS = {"err": ("rel_mse", "mse", "mae", "cos"), "kl": ("kl", "kl_rev")}
#: height (points) above the x axis of the centre of a ▽ that marks an exact 0 on a log axis: the whole
#: marker (7 points, edge 1.3) stays inside the axes
_ZERO_MARK_Y = 6.0

#: y axis per kind of error (keys of :func:`series.error_kind`)
_ERROR_AXIS = {"rel_mse": "attention-output relative MSE Σ(Ô−O)²/ΣO²", "mse": "attention-output MSE",
               "mae": "attention-output MAE", "cos": "cosine drift 1−cos(O, Ô)",
               "kl": "attention KL(p‖p̂) [nats]", "kl_rev": "reverse attention KL(p̂‖p) [nats]"}
#: panel title per regime (keys of :func:`series.regime`)
_REGIME_TITLE = {"static": "static (whole prefix quantized at once)",
                 "pseudo-decode": "pseudo-decode (quantized block by block as it arrives)"}

_ACCUMULATION = experiment_of("static_attn_kl_fwd_nats")


def draw_error(plt: Any, src: Source, out: Path) -> Path | None:
    """``attn_error_vs_context_{source}.png``; ``None`` when exp2 holds no error curve."""
    return _draw(plt, src, out, "err")


def draw_kl(plt: Any, src: Source, out: Path) -> Path | None:
    """``attn_kl_vs_context_{source}.png``; ``None`` when exp2 holds no KL curve."""
    return _draw(plt, src, out, "kl")


def _curves(src: Source, quantity: str) -> tuple[str | None, str | None, dict[tuple[str, str], XY]]:
    """``(setting, kind, {(method, regime): (x, y)})`` for one quantity (``"err"`` or ``"kl"``) at the
    headline setting, means over seeds; ``kind`` is the first of the quantity's kinds the data hold."""
    cells = src.cells(_ACCUMULATION)
    setting = headline_setting(passed_settings(cells))
    if setting is None:
        return None, None, {}
    prefs = _KINDS[quantity]

    def kind(name: str) -> Any:
        k = error_kind(name)
        return (regime(name), k) if k in prefs else None

    curves = mean_curves(cells, setting, kind)
    chosen = next((p for p in prefs if any(key[1] == p for _, key in curves)), None)
    return setting, chosen, {(m, key[0]): xy for (m, key), xy in curves.items() if key[1] == chosen}


def _draw(plt: Any, src: Source, out: Path, quantity: str) -> Path | None:
    from matplotlib.transforms import blended_transform_factory, offset_copy

    style = src.style
    setting, kind, curves = _curves(src, quantity)
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
    log = span_decades(y for _, ys in curves.values() for y in ys) >= 1.5
    handles: dict[str, Any] = {}
    n_lines = 0  # the most lines of notes at the foot of a panel
    zero_row = False  # whether a panel has a row of ▽ (exact 0) under its notes
    for ax, reg in zip(axes[0], regimes, strict=False):
        zero_at: list[tuple[str, list[float]]] = []  # (method, lengths where exactly 0)
        zero_methods: list[str] = []  # exactly 0 at every length
        for m in style.in_order([m for m, r in curves if r == reg]):
            xs, ys = curves[(m, reg)]
            pts = [(x, y) for x, y in zip(xs, ys, strict=False) if y > 0 or not log]
            if not pts:
                zero_methods.append(m)
                continue
            if len(pts) < len(ys):
                zero_at.append((m, [x for x, y in zip(xs, ys, strict=False) if not y > 0]))
            st = style(m)
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=m, color=st["color"],
                              marker=st["marker"], linestyle=st["linestyle"], markersize=4, linewidth=1.3)
            handles.setdefault(m, line)
        notes = []
        foot = blended_transform_factory(ax.transData, ax.transAxes)
        at_x: dict[float, int] = defaultdict(int)  # ▽ already drawn at a length: the next one beside it
        for m, xs0 in zero_at:
            st = style(m)
            for x in xs0:  # a point at exactly 0 has no place on a log axis: ▽ inside the axes, on its x
                shift = offset_copy(foot, fig=fig, x=7.0 * at_x[x], y=_ZERO_MARK_Y, units="points")
                at_x[x] += 1
                ax.plot([x], [0.0], transform=shift, linestyle="none", marker="v", markersize=7,
                        markerfacecolor="white", markeredgewidth=1.3, color=st["color"], clip_on=False, zorder=5,
                        label=f"_exactly 0: {m}")
            why = reg == "pseudo-decode" and all_fp16_at(fp16.get(m), xs0)
            at = ", ".join(f"{x:g}" for x in xs0)
            notes.append(f"▽ {m} at {at} tokens: exactly 0" + (" (every token still fp16)" if why else ""))
        if zero_methods:
            notes.append("exactly 0 at every length (not drawn): " + ", ".join(zero_methods))
        if log:
            ax.set_yscale("log")
        if notes:  # above the row of ▽ where there is one
            lift = 2 * _ZERO_MARK_Y if zero_at else 0.0
            ax.text(0.01, 0.02, "\n".join(notes), fontsize=7, color="dimgrey", va="bottom", zorder=6,
                    transform=offset_copy(ax.transAxes, fig=fig, y=lift, units="points"))
            n_lines = max(n_lines, len(notes))
            zero_row |= bool(zero_at)
        xs_all = sorted({x for (m, r), (xs, _) in curves.items() if r == reg for x in xs})
        if xs_all and xs_all[0] > 0 and xs_all[-1] / xs_all[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(CONTEXT_AXIS)
        ax.set_title(_REGIME_TITLE[reg], fontsize=10)
        ax.grid(True, alpha=0.3)
    if n_lines:  # an empty band at the foot of the (shared) y axis for the notes: they cover no curve
        height_pt = axes[0][0].get_position().height * fig.get_size_inches()[1] * 72.0
        _foot_room(axes[0][0], 0.045 * n_lines + 0.03 + zero_row * 2 * _ZERO_MARK_Y / height_pt)
    axes[0][0].set_ylabel(_ERROR_AXIS.get(kind, kind) + (" (log scale)" if log else ""))
    order = style.in_order(handles)  # every method drawn in any panel
    legend_outside(axes[0][-1], [handles[m] for m in order], order)
    if fp16:
        decode = {m: xy for (m, r), xy in curves.items() if r == "pseudo-decode"}
        draw_fp16_panel(grid, regimes, fp16, style, decode, kind, src.name)
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
