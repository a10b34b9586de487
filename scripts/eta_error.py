#!/usr/bin/env python3
"""How wrong was the ETA? Reads the output of a kvqbench/pytest run and scores its progress lines.

Usage::

    kvqbench run 2>&1 | tee run.log            # or: python -m pytest -n auto 2>&1 | tee suite.log
    python scripts/eta_error.py run.log [--from 0.2] [--floor 10]

Every ``kvqbench: D/T tests, elapsed E, ETA R`` line gives a prediction R at time E (both counted from
the session start). The run's end is the closing ``kvqbench: finished D/T tests, elapsed E_end`` line
(else pytest's ``… in 123.45s`` summary). The truth at a line is ``E_end − E``; the relative error is
``(R − truth) / truth``. Lines from ``--from`` (default 20 %) of the run's duration onwards are scored.
``--floor S`` also reports the share within max(30 % of the truth, S seconds) — near the end a second
of rounding is a large relative error.

Prints one row per scored line and a summary (max |error|, median |error|, share within ±30 %); exit
status 0. Standard library only.

``--replay TRACE`` scores the estimate of :mod:`kvqbench.progress` on a recorded session instead: a run
with ``KVQBENCH_PROGRESS_TRACE=TRACE`` writes every progress event (collection, test starts and ends,
steps) with its time; the replay feeds them to a fresh :class:`~kvqbench.progress.Progress` on the
recorded clock and asks for the ETA every ``--every`` seconds. ``--history FILE`` / ``--prior FILE``
choose what it knows beforehand (a pytest-cache history or prior table; ``none`` for nothing; defaults:
the history the recorded run had, and the committed prior), so one recorded run answers "how good would
the ETA have been on a first run / a second run" without running it again. ``--scale-prior TEXT FACTOR``
(repeatable) multiplies every prior/history entry (test, kind, step) whose key contains TEXT by FACTOR —
a prior that is off for one kind, e.g. ``--scale-prior test_exp5 2`` — and reports, besides the summary,
the share of lines within ±30 % from the 10th finished test matching TEXT on (does the ETA converge once
that kind runs?). ``--after TRACE`` (repeatable) replays other traced sessions first, in order, each keeping
its history as the plugin does at a session's end, and scores LOG from the history they left: "how good is
the ETA of a run that follows a loaded run and an interrupted one?".
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(r"kvqbench: (\d+)/(\d+) tests, elapsed ([0-9hms]+), ETA ([0-9hms]+|\?)")
END = re.compile(r"kvqbench: finished (\d+)/(\d+) tests, elapsed ([0-9hms]+)")
PYTEST_END = re.compile(r" in (\d+(?:\.\d+)?)s(?: \(|\s*=|$)")


def seconds(text: str) -> float:
    """``1h02m05s`` / ``3m07s`` / ``12s`` → seconds. Raises ValueError on anything else."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text.strip().rstrip(","))
    if not m or not any(m.groups()):
        raise ValueError(f"not a duration: {text!r}")
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    return 3600 * h + 60 * mi + s


def parse(text: str) -> tuple[list[tuple[int, int, float, float | None]], float]:
    """``([(done, total, elapsed_s, eta_s or None), …], end_s)`` of a run's output.

    Raises:
        ValueError: no progress line, or no end of run in the text.
    """
    rows = []
    ends: dict[int, float] = {}  # total → the closing line's elapsed (first one per total)
    pytest_end = None
    for ln in text.splitlines():
        ln = ln.strip()
        if not ln.startswith("kvqbench: "):  # e.g. progress lines quoted inside a failure report
            m = PYTEST_END.search(ln)
            if m and ln.startswith("=") and ("passed" in ln or "failed" in ln):
                pytest_end = float(m.group(1))
            continue
        try:
            m = END.match(ln)
            if m:
                ends.setdefault(int(m.group(2)), seconds(m.group(3)))
                continue
            m = LINE.match(ln)
            if m:
                eta = m.group(4)
                rows.append((int(m.group(1)), int(m.group(2)), seconds(m.group(3)),
                             None if eta.startswith("?") else seconds(eta)))
        except ValueError:
            continue
    if not rows:
        raise ValueError("no 'kvqbench: D/T tests, elapsed …, ETA …' line in the log")
    # the run's own lines have the largest total (a pytester run inside the test suite is a small one
    # whose lines may be quoted in a failure report)
    total = max(r[1] for r in rows)
    rows = [r for r in rows if r[1] == total]
    end = ends.get(total, pytest_end)
    if end is None:
        raise ValueError("no end of run ('kvqbench: finished …' or pytest's '… in Ns') in the log")
    return rows, end


def score(rows: list[tuple[int, int, float, float | None]], end: float, start_share: float = 0.2,
          floor_s: float = 0.0) -> dict:
    """Relative errors of the ETA lines from ``start_share`` of the run onwards (see module doc)."""
    scored = []
    for done, total, el, eta in rows:
        truth = end - el
        if el < start_share * end or truth <= 0:
            continue
        err = None if eta is None else (eta - truth) / truth
        ok_floor = eta is not None and abs(eta - truth) <= max(0.3 * truth, floor_s)
        scored.append({"done": done, "total": total, "elapsed": el, "eta": eta, "truth": truth, "err": err,
                       "ok_floor": ok_floor})
    errs = [abs(r["err"]) for r in scored if r["err"] is not None]
    return {
        "end_s": end, "lines": len(rows), "scored": len(scored),
        "unknown": sum(r["eta"] is None for r in scored),
        "max_abs_err": max(errs) if errs else None,
        "median_abs_err": statistics.median(errs) if errs else None,
        "within_30": sum(e <= 0.3 for e in errs) / len(scored) if scored else None,
        "within_30_or_floor": sum(r["ok_floor"] for r in scored) / len(scored) if scored else None,
        "rows": scored,
    }


def replay(events: list[list], history: dict | None = None, prior: dict | None = None,
           every: float = 10.0) -> tuple[list[tuple[int, int, float, float | None]], float]:
    """Rows ``(done, total, elapsed_s, eta_s)`` every ``every`` seconds of a traced session and its end
    (the last event), as :func:`parse` gives them for a log. ``history=None`` keeps the recorded one.

    Raises:
        ValueError: no ``collected`` event in the trace.
    """
    rows, end, _ = _feed(events, history, prior, every)
    return rows, end


def history_after(traces: list[list[list]], history: dict | None = None, prior: dict | None = None) -> dict:
    """The history the plugin would keep after the traced sessions ``traces`` ran one after the other
    (each starting from the history the previous one kept, the first from ``history``, default none):
    :func:`kvqbench.eta_tables.new_history` at the end of each."""
    h = history or {}
    for events in traces:
        _, _, p = _feed(events, h, prior, 1e9)
        h = p.updated_history(base=h)
    return h


def _feed(events: list[list], history: dict | None, prior: dict | None, every: float):
    """:func:`replay`'s rows and end, and the :class:`~kvqbench.progress.Progress` fed with the session."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvqbench.eta_tables import load_prior
    from kvqbench.progress import Progress

    head = next((e for e in events if "collected" in e[:2]), None)
    if head is None:
        raise ValueError("no 'collected' event in the trace")
    if head[0] == "collected":  # an early trace without session keys: keep the first session's tests
        _, t0, t_run, workers, ids, hist = head
        known = set(ids)
        reports = [i for i, e in enumerate(events) if e[0] == "step" and str(e[1]).startswith("report|")]
        seen: set[tuple[str, str]] = set()  # inner sessions may run the same node ids later: keep the first
        kept = []
        for i, e in enumerate(events):
            if e[0] in ("started", "finished"):
                if e[1] in known and (e[0], e[1]) not in seen:
                    seen.add((e[0], e[1]))
                    kept.append(e)
            elif e[0] == "step" and (i == reports[-1] or not str(e[1]).startswith("report|")):
                kept.append(e)
        events = kept
    else:
        _, _, t0, t_run, workers, ids, hist = head
        events = [e[1:] for e in events if e[0] == head[0] and e[1] != "collected"]
    p = Progress(interval_s=0, t0=t0, t_run=t_run, workers=workers, trace_path=None,
                 history=hist if history is None else history, prior=load_prior() if prior is None else prior)
    p.collected(ids)
    def when(e: list) -> float | None:
        return {"started": e[2], "queues": e[2]}.get(e[0], e[3] if len(e) > 3 else None)

    end = max(when(e) for e in events if when(e) is not None)
    rows, t = [], t0 + every
    for e in events:
        now = when(e)
        while now is not None and t < now:
            rows.append((p.done, p.total, t - t0, p.eta(t)))
            t += every
        if e[0] == "started":
            p.started(e[1], e[2])
        elif e[0] == "finished":
            p.finished(e[1], e[2], e[3])
        elif e[0] == "queues":
            p.set_queues(e[1], e[2])
        elif e[0] == "step":
            p.step(e[1], e[2], e[3], e[4] if len(e) > 4 else None)
    return rows, end - t0, p


def scaled(table: dict, text: str, factor: float) -> dict:
    """``table`` (a prior/history) with every test, kind and step whose key contains ``text`` times
    ``factor``."""
    out = dict(table)
    for part in ("tests", "kinds", "steps"):
        out[part] = {k: (float(v) * factor if text in k else v) for k, v in (table.get(part) or {}).items()}
    return out


def _table(path: str | None) -> dict | None:
    if path is None:
        return None
    if path == "none":
        return {}
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path, help="captured output of the run (stdout+stderr)")
    ap.add_argument("--from", dest="start", type=float, default=0.2, help="score from this share of the run (0.2)")
    ap.add_argument("--floor", type=float, default=10.0, help="absolute tolerance floor in seconds (10)")
    ap.add_argument("-q", "--quiet", action="store_true", help="summary only")
    ap.add_argument("--replay", action="store_true",
                    help="LOG is a KVQBENCH_PROGRESS_TRACE file: replay it through kvqbench.progress")
    ap.add_argument("--history", default=None, metavar="FILE",
                    help="with --replay: the history to start from (pytest cache file, or 'none'; default: the recorded one)")
    ap.add_argument("--prior", default=None, metavar="FILE",
                    help="with --replay: the prior table (default: the committed kvqbench/data/eta_prior.json; 'none')")
    ap.add_argument("--after", action="append", default=[], metavar="TRACE",
                    help="with --replay: first replay this traced session (repeatable, in order), each keeping its "
                         "history as the plugin would, starting from --history (default: none); LOG then starts "
                         "from the history they kept — how good is the ETA after such runs?")
    ap.add_argument("--every", type=float, default=10.0, help="with --replay: seconds between ETA lines (10)")
    ap.add_argument("--scale-prior", nargs=2, action="append", default=[], metavar=("TEXT", "FACTOR"),
                    help="with --replay: multiply the prior/history entries whose key contains TEXT by FACTOR "
                         "(repeatable), and score the lines from the 10th finished test matching TEXT on")
    a = ap.parse_args(argv)
    try:
        if a.replay:
            events = [json.loads(ln) for ln in a.log.read_text().splitlines() if ln.strip()]
            history, prior = _table(a.history), _table(a.prior)
            if a.scale_prior:
                sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
                from kvqbench.eta_tables import load_prior

                prior = load_prior() if prior is None else prior
                for text, factor in a.scale_prior:
                    prior = scaled(prior, text, float(factor))
                    history = None if history is None else scaled(history, text, float(factor))
            if a.after:
                history = history_after([[json.loads(ln) for ln in Path(t).read_text().splitlines() if ln.strip()]
                                         for t in a.after], history, prior)
            rows, end = replay(events, history, prior, a.every)
        else:
            rows, end = parse(a.log.read_text(errors="replace"))
    except (OSError, ValueError) as e:
        print(f"eta_error: {e}", file=sys.stderr)
        return 2
    res = score(rows, end, a.start, a.floor)
    converge = None
    if a.replay and a.scale_prior:  # from the 10th finished test of the scaled kind on
        text = a.scale_prior[0][0]
        head = next(e for e in events if "collected" in e[:2])
        t0, key = (head[1], None) if head[0] == "collected" else (head[2], head[0])
        fins = sorted(e[-1] - t0 for e in events if "finished" in e[:2] and (key is None or e[0] == key)
                      and text in str(e[e.index("finished") + 1]))
        if len(fins) >= 10:
            late = [r for r in res["rows"] if r["elapsed"] >= fins[9] and r["err"] is not None]
            converge = (fins[9], sum(abs(r["err"]) <= 0.3 for r in late), len(late))
    if not a.quiet:
        print(f"{'done':>11} {'elapsed':>8} {'ETA':>7} {'truth':>7} {'error':>8}")
        for r in res["rows"]:
            err = "?" if r["err"] is None else f"{r['err']:+.0%}"
            eta = "?" if r["eta"] is None else f"{r['eta']:.0f}"
            print(f"{r['done']:>5}/{r['total']:<5} {r['elapsed']:>8.0f} {eta:>7} {r['truth']:>7.0f} {err:>8}")

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0%}"

    print(f"run {end:.0f} s, {res['lines']} progress lines, {res['scored']} from {a.start:.0%} of the run on: "
          f"max |error| {fmt(res['max_abs_err'])}, median |error| {fmt(res['median_abs_err'])}, "
          f"within ±30 % {fmt(res['within_30'])}, within max(±30 %, {a.floor:g} s) {fmt(res['within_30_or_floor'])}"
          + (f", {res['unknown']} lines without an ETA" if res["unknown"] else ""))
    if converge is not None:
        print(f"from the 10th finished '{a.scale_prior[0][0]}' test ({converge[0]:.0f} s) on: "
              f"{converge[1]}/{converge[2]} lines within ±30 %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
