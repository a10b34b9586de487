"""``kl_vs_position_{source}.png`` (exp6): the long decode's next-token KL(p‖p̂) against the decoded
position, one panel per symmetric bit width below 16 (2 and 4 in the long tier), one line per method
through its bins of decoded positions (mean over seeds, from the leaderboard's ``long_decode`` entry,
which holds the cells' ``series["kl_curve"]`` bins), log y. A method whose KL is exactly 0 in every bin
(the fp16 control) has no point on a log axis and is named in a note under its panel instead; a single
bin exactly 0 is left out of its line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvqbench.report.render.figures import save
from kvqbench.report.render.figures.data import Source, symmetric_settings
from kvqbench.report.render.figures.style import legend_outside

__all__ = ["draw"]


def draw(plt: Any, src: Source, out: Path) -> Path | None:
    """Draw the figure; ``None`` when the source holds no long-decode KL curve with a positive bin."""
    curves = (src.summary.get("long_decode") or {}).get("kl_curve") or {}
    settings = symmetric_settings(s for by in curves.values() for s in by)
    # {setting: {method: (bin centres, mean KL)}}, bins whose KL is not positive left out
    lines: dict[str, dict[str, tuple[list[float], list[float]]]] = {s: {} for s in settings}
    for s in settings:
        for m in src.style.in_order(curves):
            c = curves[m].get(s) or {}
            bins = zip(c.get("start", []), c.get("stop", []), c.get("mean", []))
            pts = [((a + b - 1) / 2, y) for a, b, y in bins if y > 0]
            if pts:
                lines[s][m] = ([p[0] for p in pts], [p[1] for p in pts])
    if not any(lines.values()):
        return None
    fig, axes = plt.subplots(1, len(settings), figsize=(5.2 * len(settings), 3.8), squeeze=False, sharey=True)
    for ax, s in zip(axes[0], settings, strict=True):
        for m, (x, y) in lines[s].items():
            st = src.style(m)
            ax.plot(x, y, color=st["color"], marker=st["marker"], linestyle=st["linestyle"], markersize=4, label=m,
                    markerfacecolor=st["facecolor"])
        ax.set_yscale("log")
        ax.set_xlabel("decoded position (tokens; bin centre)")
        ax.set_title(f"{s}", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        zero = [m for m in src.style.in_order(curves) if s in curves[m] and m not in lines[s]]
        if zero:
            ax.text(0.0, -0.2, f"KL exactly 0 in every bin (not drawn on the log axis): {', '.join(zero)}",
                    transform=ax.transAxes, fontsize=8, va="top")
    axes[0][0].set_ylabel("next-token KL(p‖p̂), nats (mean over the bin)")
    legend_outside(axes[0][-1])
    fig.suptitle(f"Long decode: damage against the decoded position ({src.name}; mean over seeds)", fontsize=11)
    return save.finish(fig, out / f"kl_vs_position_{src.name}.png")
