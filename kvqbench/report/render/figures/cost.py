"""``cost_{source}.png`` (exp4): per method, quantize/dequantize latency bars and bits-per-element bars
(nominal vs effective), mean ± 95 % CI over seeds. The bits axis is fitted to the compressed methods:
a bar far above them (fp16's 16 bits) is cut at the top, hatched, and keeps its value as a label."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvqbench.metrics import experiment_of, varies
from kvqbench.report.render.figures import save
from kvqbench.report.render.figures.data import Source, headline_setting
from kvqbench.report.render.figures.style import COLORS, span_decades

__all__ = ["draw"]

_COST = experiment_of("quant_latency_ms")


def draw(plt: Any, src: Source, out: Path) -> Path | None:
    """Draw the figure from the exp4 stats of ``src`` at the headline setting (or the first setting
    that ran); ``None`` when exp4 did not run or holds neither latencies nor bits."""
    catalog = src.catalog
    exp4 = src.stats.get(_COST) or {}
    settings = {s for by in exp4.values() for s in by}
    if not settings:
        return None
    setting = headline_setting(settings) or sorted(settings)[0]
    names = sorted({n for by in exp4.values() for n in (by.get(setting) or {})})
    # the latencies: timing metrics in milliseconds (not throughputs, not multiples of a clone)
    lat = sorted((n for n in names if varies(n, catalog.get(n)) == "timing" and _unit(n, catalog) == "ms"),
                 key=lambda n: ("dequant" in n, n))
    bit_names = sorted((n for n in names if "bits" in n and n not in lat), key=lambda n: ("effective" in n, n))
    methods = src.style.in_order(exp4)
    panels = [p for p in (("latency", lat), ("bits", bit_names)) if p[1]]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels) + 1, 4.8), squeeze=False)
    unreliable = any((c.get("extra") or {}).get("unreliable_timing") for c in src.cells(_COST))
    for ax, (kind, metric_names) in zip(axes[0], panels, strict=False):
        w = 0.8 / len(metric_names)
        drawn: list[tuple[Any, list[float], list[float]]] = []
        for j, n in enumerate(metric_names):
            xs, ys, es = [], [], []
            for i, m in enumerate(methods):
                e = ((exp4.get(m) or {}).get(setting) or {}).get(n)
                if e is not None:
                    xs.append(i + (j - (len(metric_names) - 1) / 2) * w)
                    ys.append(e["mean"])
                    es.append(e.get("ci95") or 0.0)
            unit = _unit(n, catalog)
            bars = ax.bar(xs, ys, width=w, yerr=es, capsize=2, label=f"{n} [{unit}]" if unit else n,
                          color=COLORS[j % len(COLORS)], alpha=0.85)
            drawn.append((bars, ys, es))
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=35, ha="right", fontsize=8)
        if kind == "latency":
            if span_decades(y for _, ys, _ in drawn for y in ys) >= 1.5:
                ax.set_yscale("log")
            units = sorted({_unit(n, catalog) for n in metric_names} - {""})
            ax.set_ylabel(f"latency [{', '.join(units) or 'time'}]" + (" (log scale)" if ax.get_yscale() == "log" else ""))
            ax.set_title("Quantize / dequantize latency (median of repeats)"
                         + ("\nCPU timing: indicative only (unreliable_timing)" if unreliable else ""), fontsize=10)
        else:
            ax.set_ylabel("bits per element (value on each bar)")
            ax.set_title("Bits per element (nominal vs effective)", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
        if kind == "bits":  # after the legend, whose swatches stay plain
            _clip_tall_bars(ax, drawn, methods)
    fig.suptitle(f"Cost at {setting} ({src.name}; mean ± 95% CI over seeds)", fontsize=11)
    fig.tight_layout()
    return save.finish(fig, out / f"cost_{src.name}.png")


def _unit(name: str, catalog: dict[str, Any]) -> str:
    return catalog.get(name, {}).get("unit", "")


def _clip_tall_bars(ax: Any, drawn: list[tuple[Any, list[float], list[float]]], methods: list[str]) -> None:
    """Bits bars on a linear scale fitted to the compressed methods: a bar taller than 2.5× the
    median (fp16's 16 bits beside ~2-bit methods) is cut at the top of the axis, hatched, and keeps
    its value as a label; every bar carries its value (8 points, upright along the bar), so 2.0 vs 2.7
    bits reads at a glance. The line under the title says what is cut and where the axis ends.
    ``methods``: the x tick names (bar ``i`` of a series is at tick ``round(x)``), to name the cut bars."""
    vals = [y for _, ys, _ in drawn for y in ys]
    if not vals:
        return
    med = sorted(vals)[len(vals) // 2]
    tall = [y > 2.5 * med for y in vals]
    rest = [y + e for _, ys, es in drawn for y, e in zip(ys, es, strict=False) if not y > 2.5 * med]
    top = 1.4 * max(rest) if any(tall) and rest else None  # headroom: values above the bars, the legend
    cut: dict[str, float] = {}
    for bars, ys, _ in drawn:
        for bar, y in zip(bars, ys, strict=False):
            x = bar.get_x() + bar.get_width() / 2
            if top is not None and y > 2.5 * med:
                bar.set_height(top * 0.93)
                bar.set_hatch("//")
                cut[methods[int(round(x))]] = y
                ax.annotate(f"{y:.3g} ↑", (x, top * 0.93), textcoords="offset points", xytext=(0, -3),
                            ha="center", va="top", fontsize=8, fontweight="bold", rotation=90,
                            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                                  "alpha": 0.85})
            else:
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 2), ha="center",
                            va="bottom", fontsize=8, rotation=90)
    if top is not None:
        ax.set_ylim(0, top)
        # between the title and the axes, where no bar, value or legend can be
        ax.set_title(ax.get_title(), fontsize=ax.title.get_fontsize(), pad=16)
        names = ", ".join(f"{m} {v:.3g}" for m, v in cut.items())
        ax.annotate(f"hatched bars ({names} bits) are cut at the top of this 0–{top:.2g}-bit axis, their value "
                    f"written on them", (0.5, 1.0), xycoords="axes fraction", xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8, color="dimgrey")
