"""How the renderers write numbers, intervals and lists. Torch-free.

Rendering is a pure function of the document's *content*: the document is first put in its saved form
(:func:`canonical`: strict JSON with sorted keys), so the Markdown a run writes from the in-memory board
and the one ``kvqbench report DIR`` writes from the saved ``leaderboard.json`` are byte-identical.
"""

from __future__ import annotations

import json
from typing import Any

from kvqbench.cells import is_plain_setting, setting_order
from kvqbench.metrics import CATALOG
from kvqbench.report.io import to_jsonable
from kvqbench.report.stats.aggregate import CELL_STATES
from kvqbench.report.stats.headline import unit_of
from kvqbench.report.stats.paired import ALPHA

__all__ = ["canonical", "fmt", "value_text", "missing_text", "cells_text", "rho_text", "listed", "plain_settings",
           "completeness_banner", "ratio_text", "best_text", "compared_text", "RANKING_RULE", "rank_text", "ties_text",
           "seeds_text", "methods_in", "standing_text"]


def canonical(board: dict[str, Any]) -> dict[str, Any]:
    """``board`` as it reads back from ``leaderboard.json`` (sorted keys, strict JSON values)."""
    return json.loads(json.dumps(to_jsonable(board), sort_keys=True, allow_nan=False))


def fmt(x: Any, ci: Any = None, digits: int = 4) -> str:
    """``1.234e-03 ± 5.6e-05`` style; ``—`` for missing."""
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if x == 0:
        s = "0"
    elif 1e-3 <= abs(x) < 1e4:
        s = f"{x:.{digits}g}"
    else:
        s = f"{x:.{digits - 1}e}"
    if ci:
        s += f" ± {ci:.2g}"
    return s


def value_text(e: dict[str, Any] | None) -> str:
    """``mean ± ci``, with ``(n=2/3)`` when the entry has fewer seeds than asked; ``—`` without an entry."""
    if not e:
        return "—"
    text = fmt(e["mean"], e["ci95"])
    if e.get("n", 0) < e.get("n_asked", 0):
        text += f" (n={e['n']}/{e['n_asked']})"
    return text


def missing_text(src: dict[str, Any], exp: str, method: str, setting: str) -> str:
    """Why a (method, setting) of ``exp`` has no value: ``failed``, ``skipped`` or ``not run`` (from the
    source's ``setting_cells``); ``—`` when the cells ran but gave no finite value of the metric."""
    c = (src.get("setting_cells") or {}).get(exp, {}).get(method, {}).get(setting)
    if not c:
        return "not run"
    if c.get("failed") and not c.get("passed"):
        return "failed"
    if c.get("skipped") and not c.get("passed"):
        return "skipped"
    return "—"


def cells_text(cells: dict[str, Any]) -> str:
    """``passed 10, failed 1, skipped 0`` (+ any other states)."""
    keys = [k for k in CELL_STATES if k in cells] + sorted(k for k in cells if k not in CELL_STATES)
    return ", ".join(f"{k} {cells[k]}" for k in keys)


def rho_text(rho: Any, ci: Any) -> str:
    """``+0.83 [+0.61, +0.95]``: a Spearman ρ and its CI; ``—`` when undefined."""
    if rho is None:
        return "—"
    return f"{rho:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")


#: the ranking tables' rule in words (:func:`kvqbench.report.stats.paired.paired_ranking`)
RANKING_RULE = (f"Ranked by the paired rule (docs/METRICS.md, \"Paired comparisons\"): listed by mean log value "
                f"(ratio-scale metrics; else mean value), every pair tested by a one-sided paired t-test on the units "
                f"they share, Holm over the table's pairs at α = {ALPHA}; \"tied with\" = not separated by it; rank = "
                f"1 + the methods listed above that are separated from it (never below the rank above)")


def rank_text(r: dict[str, Any]) -> Any:
    """A ranking row's rank; ``n=2/3`` for a short entry, ``—`` without a verdict."""
    return f"n={r['n']}/{r['n_asked']}" if r.get("short") else "—" if r.get("rank") is None else r["rank"]


def ties_text(r: dict[str, Any]) -> str:
    """A ranking row's ties, or why it has none: ``not ranked: n=2 of 3 seeds``, ``no verdict (…)``."""
    return (f"not ranked: n={r['n']} of {r['n_asked']} seeds" if r.get("short") else
            f"no verdict ({r['no_verdict']})" if r.get("no_verdict") else ", ".join(r.get("ties") or []))


def seeds_text(src: dict[str, Any]) -> str:
    """What each experiment of a source ran on, from its statistics: ``seeds 0–2 (exp1, exp2), windows 0–15
    (exp5)`` (the unit of :func:`kvqbench.report.stats.headline.unit_of`); ``?`` without any."""
    groups: dict[tuple[str, tuple], list[str]] = {}
    for exp, by_method in sorted((src.get("stats") or {}).items()):
        es = {n: e for by in by_method.values() for ms in by.values() for n, e in ms.items()}
        sd = sorted({x for by in by_method.values() for ms in by.values() for e in ms.values() for x in e.get("seeds") or []})
        if sd:
            span = f"{sd[0]}–{sd[-1]}" if len(sd) > 2 and sd == list(range(sd[0], sd[-1] + 1)) else ", ".join(map(str, sd))
            unit = next((unit_of(n) for n in es if n in CATALOG), "seed") + ("s" if len(sd) > 1 else "")
            groups.setdefault((unit, span), []).append(exp)
    return ", ".join(f"{unit} {span} ({', '.join(exps)})" for (unit, span), exps in groups.items()) or "?"


def ratio_text(c: dict[str, Any], best_setting: str | None = None) -> str:
    """``kvarn 1.66× [1.39, 1.98]``: a comparison's method (and its setting where it is not
    ``best_setting``), its damage as a multiple of the best's and the paired 95 % CI (``(1 unit)`` when
    there is no interval)."""
    r, ci = c.get("ratio"), c.get("ratio_ci95")
    name = c["method"] + (f" {c['setting']}" if c.get("setting") and c.get("setting") != best_setting else "")
    if r is None:
        return name
    return f"{name} {r:.3g}×" + (f" [{ci[0]:.3g}, {ci[1]:.3g}]" if ci else " (1 unit)")


def standing_text(b: dict[str, Any]) -> str:
    """A budget row's rank interval and probability of ranking first: ``rank 1–2, P(best) 0.83``."""
    iv, pb = b.get("rank_interval"), b.get("p_best")
    rank = (f"rank {iv[0]}" if iv[0] == iv[1] else f"rank {iv[0]}–{iv[1]}") if iv else None
    return ", ".join(x for x in (rank, f"P(best) {pb:.2f}" if pb is not None else None) if x)


def best_text(b: dict[str, Any]) -> str:
    """The best of a budget row and its ties: ``kvquant (rank 1–2, P(best) 0.83) = kitty`` (method ids in backticks)."""
    if not b.get("method"):
        return "—"
    what = standing_text(b)
    return f"`{b['method']}`" + (f" ({what})" if what else "") + "".join(f" = `{t['method']}`" for t in b.get("ties") or [])


def compared_text(b: dict[str, Any], tied_ones: bool, most: int = 4) -> str:
    """The tied (``tied_ones``) or the separated comparisons of a budget row, ``; ``-joined
    (:func:`ratio_text`); separated ones beyond ``most`` are counted (``… +5 more``; all are in
    ``leaderboard.json``). A row without a paired verdict gives its reason in the tied column."""
    if b.get("no_verdict"):
        return f"no paired verdict: {b['no_verdict']}" if tied_ones else "—"
    cs = [c for c in b.get("comparisons") or [] if bool(c.get("tied")) == tied_ones]
    shown = cs if tied_ones else cs[:most]
    more = f"; … +{len(cs) - len(shown)} more" if len(cs) > len(shown) else ""
    return "; ".join(ratio_text(c, b.get("setting")) for c in shown) + more if cs else "—"


def methods_in(board: dict[str, Any], present: Any) -> list[str]:
    """The methods of ``present`` in the board's method order, then those the board does not list, sorted."""
    order = [m for m in board.get("methods", {}) if m in present]
    return order + sorted(m for m in present if m not in order)


def listed(items: list, n: int = 5) -> str:
    return "; ".join(map(str, items[:n])) + (" …" if len(items) > n else "")


def plain_settings(by_method: dict[str, Any]) -> list[str]:
    """The settings without variant axes of ``method → setting → …``, in setting order."""
    return sorted({s for by in by_method.values() for s in by if is_plain_setting(s)}, key=setting_order)


def completeness_banner(board: dict[str, Any]) -> str | None:
    """``**INCOMPLETE** — incomplete: 78 of 435 cells finished, interrupted …`` for a partial result set
    (``board["completeness"]``, see :func:`kvqbench.results.write.completeness`), else ``None``."""
    comp = board.get("completeness") or {}
    if not comp or comp.get("complete", True):
        return None
    return (f"**INCOMPLETE RESULT SET** — {comp.get('summary', 'incomplete')}. Settings with fewer seeds than "
            "asked are marked with their n and are not ranked; compare with care.")
