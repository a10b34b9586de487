"""Compare two result sets metric by metric (``kvqbench compare BASE NEW``). Torch-free.

For every data source, experiment, method, setting (``k2v2`` …) and metric present in either set,
the change from BASE to NEW is classified with the metric's better-direction, read from the saved
``metrics_catalog`` (BASE's, completed by NEW's): ``lower``/``higher`` as named, ``zero`` by distance
from 0. The *worsening* of a metric is ``(bad(new) − bad(base)) / |bad(base)|`` in percent, where
``bad`` is the value itself (lower), its negation (higher) or its absolute value (zero); a change from
exactly 0 to non-zero counts as an infinite percentage. A real source names its model (``real``,
``real-gemma3-270m``: :func:`kvqbench.cells.real_source`), so one model's cells are compared only with the
same model's; another model's real source is one side's alone.

``--fail-on METRIC:PERCENT`` (repeatable; ``any:PERCENT`` matches every non-timing metric) makes
:func:`main` return 1 when that metric, in any (source, method, setting), worsens by more than PERCENT %.
A metric whose values move between runs of the same seeds (:func:`kvqbench.metrics.varies`: float noise
moves the end-to-end and long-decode metrics; timings) must also be worse *beyond noise*, else it is listed as noise: a model-computed damage metric (``float_noise``, lower or 0 is best)
is paired seed by seed — a seed is a text window or a text — and is worse when the paired 95 % CI of the
geometric-mean ratio NEW/BASE lies wholly above 1 or a seed exact in BASE is not in NEW
(:func:`kvqbench.report.stats.gate.paired_change`); a failure names the cell with that ratio and CI. Any
other such metric (no ratio scale, a timing) is worse when ``|new − base|`` exceeds the *spread*, BASE's
plus NEW's 95 % Student-t half-widths (``ci95``; a side with one seed adds 0). Every other metric is a
deterministic function of its seeds' data, so any change past PERCENT % is the method's. Timing and
memory metrics (:func:`kvqbench.metrics.is_timing`) are skipped unless named, because CPU timings are noise.

A gate (any ``--fail-on``) cannot pass on less than BASE holds. It fails when NEW lacks a source,
method, setting, metric, seed or finite value that BASE has (a CI job that selected one method by
mistake must not pass), unless the comparison is narrowed on purpose: ``methods=`` (``--methods``)
restricts both sets to those methods, ``only_common`` (``--only-common``) compares what both hold. It
also fails on an *incomplete* NEW set (failed, interrupted or missing cells, an unmerged shard): the
cells that did not run could hide the regression the gate is there to catch. What NEW has and BASE lacks
(a new method) is listed, never an error. Without a gate these are warnings.

Exit status of :func:`main`: 0 no threshold crossed; 1 a threshold crossed (beyond noise for a
metric that moves between runs), or a gate on a NEW set that lacks part of BASE or is incomplete; 2
unreadable input, a malformed ``--fail-on``, a ``--fail-on`` or ``--methods`` naming something neither set
knows (the message names the closest known name), or a ``--fail-on`` whose metric neither set recorded
(such a gate would always pass; a metric recorded on one side only, e.g. for a new method, is reported as
compared nothing, not an error).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tabulate import tabulate

from kvqbench.metrics import did_you_mean, is_timing, rank_key, varies
from kvqbench.report.reader import read_leaderboard
from kvqbench.report.render.text import fmt
from kvqbench.report.stats.gate import paired_change
from kvqbench.results.read import check_result_files

__all__ = ["Change", "Comparison", "FailRule", "load_board", "compare_boards", "restrict", "crossings", "violations",
           "parse_fail_on", "unknown_metric", "unknown_method", "main",
           "render_comparison"]

#: changes smaller than this (relative) are "unchanged" — float noise, not a result
REL_EPS = 1e-9


@dataclass(frozen=True)
class FailRule:
    """``metric`` (or ``"any"``) may worsen by at most ``percent`` %."""

    metric: str
    percent: float


@dataclass
class Change:
    """One (source, experiment, method, setting, metric) compared."""

    source: str
    experiment: str
    method: str
    setting: str
    metric: str
    better: str
    base: float
    new: float
    base_ci: float | None  # 95 % half-widths and seed counts of each side
    new_ci: float | None
    base_n: int
    new_n: int
    #: whether the metric's values move between runs of the same seeds (:func:`kvqbench.metrics.varies`)
    noisy: bool = False
    paired: dict[str, Any] | None = None  # paired seed by seed (stats.gate.paired_change); None: not paired

    @property
    def delta(self) -> float:
        return self.new - self.base

    @property
    def worsening_pct(self) -> float:
        """Percent by which NEW is worse than BASE (negative: better)."""
        b, n = rank_key(self.better, self.base), rank_key(self.better, self.new)
        if b == n:
            return 0.0
        if b == 0:
            return math.inf if n > b else -math.inf
        return (n - b) / abs(b) * 100.0

    @property
    def status(self) -> str:
        w = self.worsening_pct
        scale = max(abs(self.base), abs(self.new), 1e-300)
        if abs(self.new - self.base) <= REL_EPS * scale or w == 0:
            return "unchanged"
        return "regressed" if w > 0 else "improved"

    @property
    def spread(self) -> float | None:
        """BASE's plus NEW's 95 % CI half-width (a side with < 2 seeds adds 0); ``None`` when neither has one."""
        cis = [ci for ci, n in ((self.base_ci, self.base_n), (self.new_ci, self.new_n)) if ci is not None and n >= 2]
        return math.fsum(cis) if cis else None

    @property
    def outside_ci(self) -> bool | None:
        """Whether ``|new − base|`` exceeds :attr:`spread`; ``None`` when no spread is measured."""
        spread = self.spread
        return None if spread is None else abs(self.new - self.base) > spread

    @property
    def beyond_noise(self) -> bool | None:
        """NEW worse beyond the paired CI (:attr:`paired` with an interval), else :attr:`outside_ci`."""
        if self.paired is not None and self.paired["worse"] is not None:
            return self.paired["worse"]
        return self.outside_ci

    @property
    def within_noise(self) -> bool:
        """A change of a :attr:`noisy` metric not beyond noise (:attr:`beyond_noise`): never a gate failure."""
        return self.noisy and self.beyond_noise is False


@dataclass
class Comparison:
    """Every change plus what exists on one side only: ``only_base`` and ``only_new`` name a source
    (``source real``), a method, setting or metric (``synthetic/exp1/kivi/k2v2 rel_mse``) or seeds
    (``synthetic/exp1/kivi/k2v2 seed 2``), coarsest first."""

    changes: list[Change] = field(default_factory=list)
    only_base: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: methods BASE holds a value of and NEW none (a subset of what ``only_base`` names)
    methods_only_base: list[str] = field(default_factory=list)


def parse_fail_on(items: Iterable[str]) -> list[FailRule]:
    """``["rel_mse:5", "any:10"]`` → rules.

    Raises:
        ValueError: an item is not ``METRIC:PERCENT`` with a non-negative number.
    """
    rules = []
    for it in items:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*:\s*([0-9]*\.?[0-9]+)\s*%?\s*", str(it))
        if not m:
            raise ValueError(f"--fail-on expects METRIC:PERCENT (e.g. rel_mse:5 or any:10); got {it!r}")
        rules.append(FailRule(m.group(1), float(m.group(2))))
    return rules


def load_board(path: str | Path) -> dict[str, Any]:
    """Read ``path/leaderboard.json`` (a results folder) or ``path`` itself (a JSON file).

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: the file is unreadable or not a kvqbench leaderboard
            (:func:`kvqbench.report.reader.read_leaderboard`, the check ``kvqbench report`` uses).
    """
    p = Path(path)
    f = p / "leaderboard.json" if p.is_dir() else p
    if not f.exists():
        raise FileNotFoundError(f"{f} not found (expected a results folder or a leaderboard.json)")
    board = read_leaderboard(f)
    check_result_files(f.parent, board)  # the exp*_*.json beside it: parse, shape, the cells it counts
    return board


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _shared_keys(base: dict[str, Any], new: dict[str, Any], prefix: str, out: "Comparison") -> list[str]:
    """Keys present on both sides (sorted); the others are listed as one-sided in ``out``."""
    for k in sorted(set(base) - set(new)):
        out.only_base.append(f"{prefix}{k}")
    for k in sorted(set(new) - set(base)):
        out.only_new.append(f"{prefix}{k}")
    return sorted(set(base) & set(new))


def compare_boards(base: dict[str, Any], new: dict[str, Any]) -> Comparison:
    """Compare two leaderboard documents (see module doc)."""
    catalog = {**(new.get("metrics_catalog") or {}), **(base.get("metrics_catalog") or {})}
    out = Comparison()
    bs, ns = base.get("sources") or {}, new.get("sources") or {}
    for src in _shared_keys(bs, ns, "source ", out):
        if bs[src].get("sizes") != ns[src].get("sizes"):
            out.notes.append(f"{src}: cell sizes differ (base {bs[src].get('sizes')}, new {ns[src].get('sizes')}) — "
                             "deltas mix sizes")
        bst, nst = bs[src].get("stats") or {}, ns[src].get("stats") or {}
        for exp in sorted(set(bst) | set(nst)):
            be, ne = bst.get(exp) or {}, nst.get(exp) or {}
            for meth in _shared_keys(be, ne, f"{src}/{exp}/", out):
                for setting in _shared_keys(be[meth], ne[meth], f"{src}/{exp}/{meth}/", out):
                    # only metrics of the catalog count: without a direction there is nothing to judge
                    bm = {k: v for k, v in be[meth][setting].items() if k in catalog}
                    nm = {k: v for k, v in ne[meth][setting].items() if k in catalog}
                    where = f"{src}/{exp}/{meth}/{setting}"
                    _shared_keys(bm, nm, f"{where} ", out)
                    _seeds_one_side(bm, nm, where, out)
                    for name in sorted(set(bm) & set(nm)):
                        spec = catalog[name]
                        b, n = _num(bm[name].get("mean")), _num(nm[name].get("mean"))
                        if not (math.isfinite(b) and math.isfinite(n)):
                            continue
                        out.changes.append(Change(src, exp, meth, setting, name, spec.get("better", "lower"), b, n,
                                                  bm[name].get("ci95"), nm[name].get("ci95"),
                                                  int(bm[name].get("n", 1)), int(nm[name].get("n", 1)),
                                                  varies(name, spec) != "deterministic",
                                                  paired_change(name, spec, bm[name], nm[name])))
    out.methods_only_base = sorted(_method_names(base) - _method_names(new))
    return out


def _seeds_one_side(bm: dict[str, Any], nm: dict[str, Any], where: str, out: "Comparison") -> None:
    """List the seeds a setting holds on one side only (metric by metric, grouped), and the metrics with
    fewer finite values on one side: a failed seed, a non-finite value or a run with fewer seeds leaves a
    mean over other data."""
    shared = sorted(set(bm) & set(nm))
    for a, b, dest in ((bm, nm, out.only_base), (nm, bm, out.only_new)):
        lost: dict[tuple, list[str]] = {}
        fewer = []
        for name in shared:
            miss = tuple(sorted(set(a[name].get("seeds") or ()) - set(b[name].get("seeds") or ())))
            if miss:
                lost.setdefault(miss, []).append(name)
            elif int(b[name].get("n", 0)) < int(a[name].get("n", 0)):
                fewer.append(name)
        for miss, names in lost.items():
            which = "" if len(names) == len(shared) else " of " + ", ".join(names)
            dest.append(f"{where} seed {','.join(str(x) for x in miss)}{which}")
        if fewer:
            dest.append(f"{where} finite values of " + ", ".join(fewer))


def restrict(board: dict[str, Any], methods: Iterable[str]) -> dict[str, Any]:
    """A copy of ``board`` whose ``stats`` hold only ``methods``; a source left with no value of them is
    dropped (so a source neither set ran those methods on is not "missing"). Other keys are shared."""
    keep = set(methods)
    sources = {}
    for name, src in (board.get("sources") or {}).items():
        stats = {exp: {m: v for m, v in by_method.items() if m in keep}
                 for exp, by_method in (src.get("stats") or {}).items()}
        stats = {exp: by_method for exp, by_method in stats.items() if by_method}
        if stats:
            sources[name] = {**src, "stats": stats}
    return {**board, "sources": sources}


def crossings(cmp: Comparison, rules: list[FailRule], catalog: dict[str, Any]) -> list[tuple[FailRule, Change]]:
    """Every (rule, change) where the change worsens past the rule's percent, within noise or not."""
    hits = []
    for rule in rules:
        for c in cmp.changes:
            if rule.metric == "any":
                if is_timing(c.metric, catalog.get(c.metric)):
                    continue
            elif c.metric != rule.metric:
                continue
            if c.worsening_pct > rule.percent:
                hits.append((rule, c))
    return hits


def violations(cmp: Comparison, rules: list[FailRule], catalog: dict[str, Any]) -> list[tuple[FailRule, Change]]:
    """The :func:`crossings` that fail the gate: all but those within noise (:attr:`Change.within_noise`)."""
    return [(r, c) for r, c in crossings(cmp, rules, catalog) if not c.within_noise]


def _pct(w: float) -> str:
    return ("+inf %" if w > 0 else "-inf %") if math.isinf(w) else f"{w:+.2f} %"


def render_comparison(cmp: Comparison, catalog: dict[str, Any], *, rules: list[FailRule] | None = None,
                      show_percent: float = 1.0, max_rows: int = 40) -> str:
    """The text ``kvqbench compare`` prints: a summary line, then regressions and improvements (worst
    first, at least ``show_percent`` % worse/better, timing metrics only when a rule names them)."""
    named = {r.metric for r in (rules or [])}

    def shown(c: Change) -> bool:
        return not is_timing(c.metric, catalog.get(c.metric)) or c.metric in named

    changes = [c for c in cmp.changes if shown(c)]
    reg = sorted((c for c in changes if c.status == "regressed" and c.worsening_pct >= show_percent),
                 key=lambda c: (-c.worsening_pct, c.source, c.method, c.setting, c.metric))
    imp = sorted((c for c in changes if c.status == "improved" and -c.worsening_pct >= show_percent),
                 key=lambda c: (c.worsening_pct, c.source, c.method, c.setting, c.metric))
    n_unch = sum(1 for c in changes if c.status == "unchanged")
    lines = [f"kvqbench compare: {len(changes)} metric values compared — "
             f"{sum(1 for c in changes if c.status == 'regressed')} worse, "
             f"{sum(1 for c in changes if c.status == 'improved')} better, {n_unch} unchanged"
             + (" (timing metrics ignored unless named in --fail-on)" if len(changes) < len(cmp.changes) else "")]
    lines += [f"note: {n}" for n in cmp.notes]
    headers = ["source", "method", "setting", "metric", "better", "base", "new", "change", "beyond noise"]

    def rows(cs: list[Change]) -> list[list[str]]:
        return [[c.source, c.method, c.setting, c.metric, c.better, fmt(c.base), fmt(c.new),
                 _pct(c.worsening_pct).replace("+", "worse +", 1) if c.worsening_pct > 0 else
                 _pct(-c.worsening_pct).replace("+", "better +", 1),
                 {None: "n/a (1 seed)", True: "yes", False: "no"}[c.beyond_noise]] for c in cs[:max_rows]]

    for title, cs in (("Regressions", reg), ("Improvements", imp)):
        lines.append("")
        lines.append(f"{title} (≥ {show_percent:g} %): {len(cs)}" + (f", showing {max_rows}" if len(cs) > max_rows else ""))
        if cs:
            lines.append(tabulate(rows(cs), headers=headers, tablefmt="simple"))
    for label, items in (("only in BASE", cmp.only_base), ("only in NEW", cmp.only_new)):
        if items:
            lines.append("")
            shown_items = items[:30]
            lines.append(f"{label} ({len(items)}): " + ", ".join(shown_items) + (" …" if len(items) > 30 else ""))
    return "\n".join(lines)


def _metric_names(board: dict[str, Any]) -> set[str]:
    """Names of the metrics a leaderboard document holds a value of (any source, method, setting)."""
    return {name for src in (board.get("sources") or {}).values() for exp in (src.get("stats") or {}).values()
            for meth in exp.values() for setting in meth.values() for name in setting}


def _method_names(board: dict[str, Any]) -> set[str]:
    """The methods a leaderboard document holds a value of (any source, experiment)."""
    return {m for src in (board.get("sources") or {}).values() for exp in (src.get("stats") or {}).values() for m in exp}


def unknown_method(methods: Iterable[str], *boards: dict[str, Any]) -> str | None:
    """One line naming the first of ``methods`` that no board holds a value of, with the closest id that
    one does (``None`` when every id is known)."""
    known = sorted(set().union(*map(_method_names, boards)))
    for m in methods:
        if m not in known:
            return f"--methods: neither set holds a value of method '{m}'{did_you_mean(m, known)}"
    return None


def unknown_metric(rules: Iterable[FailRule], catalog: dict[str, Any], *boards: dict[str, Any]) -> str | None:
    """One line naming the first ``--fail-on`` metric that neither the catalog nor any board knows, with
    the closest known names (``None`` when every rule names a known metric or ``any``)."""
    known = set(catalog)
    for b in boards:
        known |= _metric_names(b)
    for r in rules:
        if r.metric == "any" or r.metric in known:
            continue
        hint = did_you_mean(r.metric, known) or " (the known ones: metrics_catalog in leaderboard.json, docs/METRICS.md)"
        return f"--fail-on {r.metric}:{r.percent:g}: unknown metric '{r.metric}'{hint}"
    return None


def _missing_line(cmp: Comparison, *, gate: bool) -> str:
    """One line: what NEW lacks of BASE and, for a gate, how to narrow the comparison on purpose."""
    what = []
    if cmp.methods_only_base:
        ms = cmp.methods_only_base
        what.append(f"method{'s' if len(ms) > 1 else ''} " + ", ".join(ms[:8]) + (" …" if len(ms) > 8 else ""))
    sources = [x.split(" ", 1)[1] for x in cmp.only_base if x.startswith("source ")]
    if sources:
        what.append("source " + ", ".join(sources))
    line = f"NEW lacks {len(cmp.only_base)} result(s) BASE has" + (f" ({'; '.join(what)})" if what else "")
    if not gate:
        return f"kvqbench compare: warning: {line}"
    return (f"FAILED: {line}, so the gate cannot judge them; run them, or narrow the comparison on purpose "
            "with --methods ID,… or --only-common")


def _spread_text(c: Change) -> str:
    p = c.paired or {"exact_lost": [], "worse": None}
    if p["exact_lost"]:
        return f"exact in BASE, not in NEW at seed(s) {', '.join(map(str, p['exact_lost']))}"
    if p["worse"] is not None:
        lo, hi = p["ratio_ci95"]
        return (f"paired over {p['n_units']} {p['unit']}s: {p['ratio']:.3g}× [{lo:.3g}, {hi:.3g}], "
                f"{'wholly above' if p['worse'] else 'not wholly above'} 1")
    if c.outside_ci is None:
        return "no CI (1 seed)"
    return f"|Δ| {fmt(abs(c.delta))} {'>' if c.outside_ci else '≤'} CI spread {fmt(c.spread)}"


def main(base: str | Path, new: str | Path, fail_on: Iterable[str] = (), *, show_percent: float = 1.0,
         max_rows: int = 40, out: Any = None, only_common: bool = False,
         methods: Iterable[str] | None = None) -> int:
    """Compare two result sets, print the table, and return the exit status (see module doc).

    ``methods`` restricts both sets to those method ids; ``only_common`` compares only what both sets
    hold. Either makes results one set lacks a listing, not a failure of the gate.
    """
    out = out or sys.stdout
    methods = list(methods) if methods is not None else None
    try:
        rules = parse_fail_on(fail_on)
        b, n = load_board(base), load_board(new)
    except (FileNotFoundError, ValueError) as e:
        print(f"kvqbench compare: {e}", file=sys.stderr)
        return 2
    catalog = {**(n.get("metrics_catalog") or {}), **(b.get("metrics_catalog") or {})}
    problem = unknown_metric(rules, catalog, b, n) or (unknown_method(methods, b, n) if methods else None)
    if problem:
        print(f"kvqbench compare: {problem}", file=sys.stderr)
        return 2
    if methods:
        b, n = restrict(b, methods), restrict(n, methods)
    cmp = compare_boards(b, n)
    lacking = bool(cmp.only_base) and not only_common
    if lacking:  # the verdict first: a gate on less than BASE holds would pass vacuously
        print(_missing_line(cmp, gate=bool(rules)), file=out)
    for label, board in (("BASE", b), ("NEW", n)):
        comp = board.get("completeness") or {}
        if comp.get("complete") is False:
            print(f"kvqbench compare: warning: {label} is {comp.get('summary', 'incomplete')}", file=out)
    if methods:
        print(f"kvqbench compare: only methods {', '.join(methods)} compared (--methods)", file=out)
    if only_common and cmp.only_base:
        print(f"kvqbench compare: only what both sets hold compared (--only-common): {len(cmp.only_base)} "
              "result(s) only in BASE not judged", file=out)
    print(render_comparison(cmp, catalog, rules=rules, show_percent=show_percent, max_rows=max_rows), file=out)
    idle = [r for r in rules if not any(r.metric in ("any", c.metric) for c in cmp.changes)]
    recorded = _metric_names(b) | _metric_names(n)
    for r in idle:  # a gate that compared nothing would always pass: say so
        print(f"kvqbench compare: --fail-on {r.metric}:{r.percent:g} compared nothing: no setting has "
              f"{'any metric' if r.metric == 'any' else repr(r.metric)} in both sets", file=out)
    # recorded on one side only (e.g. a new method, absent from BASE) is nothing to gate; recorded on
    # neither side, the gate is misconfigured and fails
    idle = [r for r in idle if r.metric != "any" and r.metric not in recorded]
    crossed = crossings(cmp, rules, catalog)
    hits = violations(cmp, rules, catalog)
    noise = [(r, c) for r, c in crossed if c.within_noise]
    if noise:
        print("", file=out)
        print(f"within noise: {len(noise)} value(s) of metrics that move between runs (end-to-end, "
              "timing) worsened past a --fail-on threshold but not beyond noise (the paired 95 % CI of NEW/BASE "
              "over the seeds both scored includes 1, or |Δ| ≤ BASE's plus NEW's 95 % CI half-widths) — "
              "noise, not a failure:", file=out)
        for _, c in noise[:max_rows]:
            print(f"  {c.source}/{c.method}/{c.setting} {c.metric}: {fmt(c.base)} → {fmt(c.new)} "
                  f"({_pct(c.worsening_pct)}; {_spread_text(c)})", file=out)
    if hits:
        print("", file=out)
        print(f"FAILED: {len(hits)} value(s) worsened past a --fail-on threshold (end-to-end and timing metrics: "
              "also beyond noise):", file=out)
        for rule, c in hits[:max_rows]:
            print(f"  {c.source}/{c.method}/{c.setting} {c.metric}: {fmt(c.base)} → {fmt(c.new)} "
                  f"({_pct(c.worsening_pct)} worse > {rule.percent:g} % allowed by {rule.metric}:{rule.percent:g}"
                  + (f"; {_spread_text(c)})" if c.noisy else ")"), file=out)
    if rules and lacking:
        print("", file=out)
        print(_missing_line(cmp, gate=True), file=out)
        return 1
    if hits:
        return 1
    if idle:
        return 2
    ncomp = n.get("completeness") or {}
    if rules and ncomp.get("complete") is False:
        print("", file=out)
        print(f"FAILED: NEW is {ncomp.get('summary', 'incomplete')}: a --fail-on gate needs every cell "
              "(the cells that did not run could hide a regression); rerun or merge the missing cells", file=out)
        return 1
    if rules:
        print("", file=out)
        print("OK: no --fail-on threshold crossed ("
              + ", ".join(f"{r.metric}:{r.percent:g}" for r in rules) + ")", file=out)
    return 0
