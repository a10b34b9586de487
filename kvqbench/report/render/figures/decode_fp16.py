"""What pseudo-decode holds in fp16 (exp2), drawn under the pseudo-decode panel of the attention figures.

Some methods keep tokens in fp16 while decoding — attention sinks, a recent window, a partly filled last
tile — and how many changes with the length, so do the billed bits and the error. Per such method the
panel shows the newest tokens still fp16 and the billed bits per length, and a note says, from the data
alone, whether the error is lower wherever the newest tokens are fp16 (the share explains the curve's
jumps) or not.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

from kvqbench.report.render.figures.data import XY, mean_curves, passed_at
from kvqbench.report.render.figures.series import regime
from kvqbench.report.render.figures.style import CONTEXT_AXIS, Style

__all__ = ["decode_fp16", "all_fp16_at", "draw_fp16_panel", "fp16_note"]


def decode_fp16(cells: list[dict[str, Any]], setting: str) -> dict[str, dict[str, Any]]:
    """What pseudo-decode holds in fp16, per method whose billed bits change with the length by more
    than 5 % (its fp16 share — attention sinks, a recent window, a partly filled last tile — changes
    with it): ``{method: {"x": lengths, "bits": billed bits/element, "share": share of the tokens in
    fp16 or None, "newest": the newest tokens held in fp16 (mean of K and V) or None}}``. The newest
    are the fp16 tokens that are not sink tokens: ``share · L − sink`` (sinks from the cells'
    ``extra.decode.policy``; None where a cell records no policy), all ``L`` where every token is fp16.
    Empty when no method qualifies."""

    def kind(name: str) -> Any:
        last = name.split("/")[-1]
        if regime(name) != "pseudo-decode":
            return None
        return "bits" if last in ("bits_effective", "bits") else "share" if last == "fp16_token_share" else None

    mean = mean_curves(cells, setting, kind)
    out: dict[str, dict[str, Any]] = {}
    for (m, key), (xs, ys) in mean.items():
        lo, hi = min(ys), max(ys)
        if key != "bits" or not (lo > 0 and (hi - lo) / lo > 0.05):
            continue
        share = mean.get((m, "share"))
        share_y = share[1] if share is not None and share[0] == xs else None
        sinks = None
        for c in passed_at(cells, setting):
            pol = ((c.get("extra") or {}).get("decode") or {}).get("policy") or {}
            if c.get("method") == m and pol:
                sinks = [p.get("sink_tokens", 0) for p in pol.values()]
                break
        newest = None
        if share_y is not None and sinks:  # every token fp16 (nothing quantized yet): all L are the newest
            newest = [float(x) if f >= 1.0 - 1e-9 else
                      max(0.0, round(2 * (f * x - math.fsum(min(sk, x) for sk in sinks) / len(sinks))) / 2)
                      for x, f in zip(xs, share_y, strict=False)]
        out[m] = {"x": xs, "bits": ys, "share": share_y, "newest": newest}
    return out


def all_fp16_at(info: dict[str, Any] | None, xs0: list[float]) -> bool:
    """Whether every token is fp16 at each of the lengths ``xs0`` (fp16 share 1 there)."""
    if not info or info.get("share") is None:
        return False
    at = dict(zip(info["x"], info["share"], strict=False))
    return all(x in at and at[x] >= 1.0 - 1e-9 for x in xs0)


def draw_fp16_panel(grid: Any, regimes: list[str], fp16: dict[str, dict[str, Any]], style: Style,
                    decode_curves: dict[str, XY], kind: str, src: str) -> None:
    """In the second row of ``grid`` (one column per regime of ``regimes``), under the pseudo-decode
    panel: per method whose fp16 share changes with the length, the newest tokens still in fp16 (solid,
    left axis) and the billed bits/element (dashed, right axis); beside it, a note that says, from the
    data, why those curves jump between neighbouring lengths."""
    from matplotlib.lines import Line2D

    ax = grid[1][regimes.index("pseudo-decode")]
    methods = style.in_order(fp16)
    with_newest = [m for m in methods if fp16[m]["newest"] is not None]
    bits_ax = ax.twinx() if with_newest else ax
    if with_newest:
        bits_ax.spines["right"].set_visible(True)
    for m in methods:
        st = style(m)
        info = fp16[m]
        if info["newest"] is not None:
            ax.plot(info["x"], info["newest"], color=st["color"], marker=st["marker"], linestyle="-", markersize=4,
                    linewidth=1.3, label=m)
        bits_ax.plot(info["x"], info["bits"], color=st["color"], marker=st["marker"], markersize=4,
                     linestyle="--" if with_newest else "-", linewidth=0.9 if with_newest else 1.3,
                     markerfacecolor="white" if with_newest else st["color"],
                     label=f"{m} billed bits" if with_newest else m)
    ax.set_xlabel(CONTEXT_AXIS)
    ax.grid(True, alpha=0.3)
    bits_ax.set_ylabel("billed bits/element" + (" (dashed)" if with_newest else ""), fontsize=8)
    if with_newest:
        ax.set_ylabel("newest tokens in fp16\n(solid)", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.set_title("pseudo-decode fp16: the newest tokens still fp16 (solid, left) and the billed bits "
                     "(dashed, right)", fontsize=8)
        handles = [Line2D([], [], color=style(m)["color"], marker=style(m)["marker"], markersize=4) for m in methods]
        handles += [Line2D([], [], color="black", linestyle="-"), Line2D([], [], color="black", linestyle="--",
                                                                          marker="o", markerfacecolor="white",
                                                                          markersize=4)]
        labels = methods + ["newest tokens in fp16", "billed bits/element"]
        ax.legend(handles, labels, fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.12, 1.0))
    else:
        ax.set_title("billed bits in pseudo-decode (fp16 sink / residual / partial-tile tokens at 16 bits)",
                     fontsize=8)
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    grid[0][regimes.index("pseudo-decode")].set_xlabel("")
    note = fp16_note(fp16, methods, decode_curves, kind, src)
    for i, reg in enumerate(regimes):
        if reg != "pseudo-decode":
            a = grid[1][i]
            a.axis("off")
            grid[0][i].tick_params(labelbottom=True)  # its lower neighbour is a note, not an axis
            grid[0][i].set_xlabel(CONTEXT_AXIS)
            a.text(0.0, 0.95, "\n".join(line for para in note for line in (textwrap.wrap(para, 82) or [""])),
                   transform=a.transAxes, fontsize=8, va="top")


def fp16_note(fp16: dict[str, dict[str, Any]], methods: list[str],
               decode_curves: dict[str, XY], kind: str, src: str) -> list[str]:
    """The note beside the fp16 panel, as paragraphs, every claim from the data: what changes with the
    length (which tokens stay fp16), then, for each method whose newest tokens are all fp16 at some
    lengths and all quantized at others, the lengths of each case with its error there and what the
    data say about it: lower wherever the newest tokens are fp16 (the fp16 share explains the jumps),
    or ranges that overlap (it does not). ``src`` (``synthetic``, ``real`` …) names the data."""
    what = "KL" if kind in ("kl", "kl_rev") else "error"
    paras = [f"Pseudo-decode, {', '.join(methods)}: which tokens stay fp16 (attention sinks, a recent window, "
             "a partly filled last tile) changes with the length, and so do the bits billed. The panel to the "
             "right of this note (below the pseudo-decode curves) shows, at each length, the newest tokens "
             "still fp16 and the bits billed."]

    def rng(vals: list[float]) -> str:
        if not vals:
            return ""
        lo, hi = f"{min(vals):.2g}", f"{max(vals):.2g}"
        return f"{what} {lo}" if lo == hi else f"{what} {lo}–{hi}"

    for m in methods:
        info = fp16[m]
        if info["newest"] is None:
            continue
        ys = dict(zip(*decode_curves[m], strict=False)) if m in decode_curves else {}
        every, none = [], []  # lengths where every token is fp16; where none of the newest is
        some: dict[float, list[float]] = {}  # the newest n tokens fp16 → lengths
        for x, n in zip(info["x"], info["newest"], strict=False):
            if all_fp16_at(info, [x]):
                every.append(x)
            elif n > 0:
                some.setdefault(n, []).append(x)
            else:
                none.append(x)
        if not none or not (some or every):
            continue  # the newest tokens are fp16 at every length (or at none): no jump to explain
        parts = []
        if every:
            parts.append(f"every token fp16 at {', '.join(f'{x:g}' for x in every)} ({what} exactly 0)")
        for n, xs in sorted(some.items(), key=lambda kv: -kv[0]):
            parts.append(f"the newest {n:g} fp16 at {', '.join(f'{x:g}' for x in xs)} "
                         f"({rng([ys[x] for x in xs if x in ys])})")
        parts.append(f"none at {', '.join(f'{x:g}' for x in none)}, where the length fills its last tile "
                     f"({rng([ys[x] for x in none if x in ys])})")
        with_fp16 = [ys[x] for xs in some.values() for x in xs if x in ys]
        without = [ys[x] for x in none if x in ys]
        verdict = ""
        if with_fp16 and without:
            verdict = f"on this {src} data the "
            if max(with_fp16) < min(without):
                verdict += (f"{what} is {min(without) / max(with_fp16):.2g}–{max(without) / min(with_fp16):.2g}× "
                            "higher wherever none of the newest tokens are fp16: the fp16 share explains the jumps")
            elif max(without) <= min(with_fp16):
                verdict += (f"{what} is no higher where none of the newest tokens are fp16: the fp16 share does "
                            "not explain the curve's shape")
            else:
                verdict += "two ranges overlap: the fp16 share does not explain the curve's shape"
        paras.append(f"{m}: " + "; ".join(parts) + (f". So {verdict}." if verdict else "."))
    return paras
