#!/usr/bin/env python3
"""Make the committed ETA prior (``kvqbench/data/eta_prior.json``) from measured runs.

The prior gives a user's first run (no pytest cache yet) a duration for every test. Regenerate it after
tests or cells change a lot, on a fresh clone so that caches are cold as on a user's first run::

    git clone . /tmp/fresh && cd /tmp/fresh
    python -m pytest -n auto            # the test suite, as CI runs it
    kvqbench run                        # the main job
    kvqbench run --smoke                # the documented smoke commands
    kvqbench run --smoke --kvq-real
    python scripts/eta_prior.py .pytest_cache/v/kvqbench/durations -o kvqbench/data/eta_prior.json

The long tier (``kvqbench run --long``, about 80 s a cell) is too long to rerun for the prior: its cells'
seconds come from a run's result file, e.g. the published one, added after the other files::

    python scripts/eta_prior.py kvqbench/data/eta_prior.json leaderboard/exp6_real.json -o kvqbench/data/eta_prior.json

Each argument is a history file that kvqbench keeps in pytest's cache (``{"tests": {nodeid: s},
"kinds": …, "steps": …, "step_cells": {report step: cells}}``) or the trace of a session
(``KVQBENCH_PROGRESS_TRACE=FILE``: that session's own seconds — a history blends every run with the
earlier ones, so traces of fresh-clone runs are the better source); later files override earlier ones test by
test (and step by step). With ``--median`` the files are instead several runs of the same tests under
different conditions (a quiet host, a loaded one, a slow phase): each run is first rescaled to the others'
speed (by the median ratio over the tests it shares with them) and every test and step gets the median
of its rescaled values, so one run's odd phase (a host that slowed down halfway, a report step that ran
at another speed than the tests) does not become the prior. The kinds are recomputed as the medians of
the merged tests. Durations are rounded to milliseconds and keys sorted, so the file
diffs well. Only relative durations matter: each run scales them by its own measured speed.
Standard library only (plus kvqbench.progress for the kinds).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvqbench.eta_tables import kind_of  # noqa: E402


def merge(histories: list[dict]) -> dict:
    """The prior made of ``histories`` (later ones win per test and per step)."""
    tests: dict[str, float] = {}
    steps: dict[str, float] = {}
    cells: dict[str, int] = {}
    for h in histories:
        tests.update({str(k): float(v) for k, v in (h.get("tests") or {}).items()})
        steps.update({str(k): float(v) for k, v in (h.get("steps") or {}).items()})
        cells.update({str(k): int(v) for k, v in (h.get("step_cells") or {}).items()})
    by_kind: dict[str, list[float]] = {}
    for n, v in tests.items():
        by_kind.setdefault(kind_of(n), []).append(v)
    return {"version": 1,
            "tests": {k: round(tests[k], 3) for k in sorted(tests)},
            "kinds": {k: round(float(statistics.median(v)), 3) for k, v in sorted(by_kind.items())},
            "steps": {k: round(steps[k], 3) for k in sorted(steps)},
            "step_cells": {k: cells[k] for k in sorted(cells) if k in steps}}


def _rescaled(histories: list[dict], rounds: int = 3) -> list[tuple[dict, dict, dict]]:
    """Each history's ``(tests, steps, step_cells)`` rescaled to a common speed: a run's factor is the
    median, over its tests that another run also has, of (median of all runs' values) / its own value —
    iterated, as the medians move with the factors. A run that shares no test keeps factor 1."""
    raw = [({str(k): float(v) for k, v in (h.get("tests") or {}).items()},
            {str(k): float(v) for k, v in (h.get("steps") or {}).items()},
            {str(k): int(v) for k, v in (h.get("step_cells") or {}).items()}) for h in histories]
    factors = [1.0] * len(raw)
    for _ in range(rounds):
        values: dict[str, list[float]] = {}
        for f, (tests, _, _) in zip(factors, raw):
            for k, v in tests.items():
                values.setdefault(k, []).append(v * f)
        for i, (tests, _, _) in enumerate(raw):
            ratios = [statistics.median(values[k]) / v for k, v in tests.items()
                      if v > 0 and len(values[k]) > 1]
            if ratios:
                factors[i] = float(statistics.median(ratios))
    return [({k: v * f for k, v in t.items()}, {k: v * f for k, v in s.items()}, c)
            for f, (t, s, c) in zip(factors, raw)]


def merge_median(histories: list[dict]) -> dict:
    """The prior of several runs: per test and per step the median of the runs' rescaled values (see
    :func:`_rescaled`). A report step that every run having it measured with a cell count is taken per
    cell (its seconds over those cells) and billed at the last such run's count."""
    tests: dict[str, list[float]] = {}
    steps: dict[str, list[tuple[float, int | None]]] = {}
    for t, s, c in _rescaled(histories):
        for k, v in t.items():
            tests.setdefault(k, []).append(v)
        for k, v in s.items():
            steps.setdefault(k, []).append((v, c.get(k) if k.startswith("report|") else None))
    merged_steps: dict[str, float] = {}
    cells: dict[str, int] = {}
    for k, vals in steps.items():
        if all(n for _, n in vals):
            cells[k] = int(vals[-1][1])
            merged_steps[k] = statistics.median(v / n for v, n in vals) * cells[k]
        else:
            merged_steps[k] = statistics.median(v for v, _ in vals)
    return merge([{"version": 1, "tests": {k: statistics.median(v) for k, v in tests.items()},
                   "steps": merged_steps, "step_cells": cells}])


@functools.lru_cache(maxsize=1)
def _eta_error():
    """scripts/eta_error.py as a module (its session replay), loaded once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eta_error", Path(__file__).resolve().parent / "eta_error.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_run(path: Path) -> dict:
    """A history file (``{"version": 1 or 2, "tests": …}``); a trace of one session (JSON lines,
    ``KVQBENCH_PROGRESS_TRACE``) turned into the history of that session alone: its tests' and steps' own
    seconds (replayed without tables, so nothing is rescaled or blended); or an experiment's result file
    (``exp6_real.json``): each cell's ``duration_s`` under its node id (no steps), for cells no history holds
    (the long tier's, from a published run). A history keeps every run's seconds
    on its tables' scale, blended with earlier runs (:func:`kvqbench.eta_tables.new_history`): a
    trace gives a prior the raw seconds of a fresh-clone run.

    Raises:
        ValueError: neither a history nor a trace.
    """
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("cells"), list) and "experiment" in doc:
        return {"version": 1, "tests": {c["nodeid"]: float(c["duration_s"]) for c in doc["cells"]
                                        if isinstance(c, dict) and c.get("nodeid") and c.get("duration_s")}}
    if isinstance(doc, dict):
        if doc.get("version") not in (1, 2):
            raise ValueError(f"{path}: not a kvqbench durations history (version 1 or 2)")
        return doc
    eta_error = _eta_error()
    try:
        events = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    except ValueError as e:
        raise ValueError(f"{path}: neither a durations history nor a progress trace ({e})") from None
    _, _, prog = eta_error._feed(events, {}, {}, 1e9)
    return {**prog.updated_history(base={}), "version": 1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("history", nargs="+", type=Path,
                    help="pytest-cache history files (.pytest_cache/v/kvqbench/durations), traces of runs "
                         "(KVQBENCH_PROGRESS_TRACE files: their own measured seconds), or experiment result "
                         "files (exp6_real.json: each cell's duration_s)")
    ap.add_argument("-o", "--out", type=Path, default=None, help="write here (default: stdout)")
    ap.add_argument("--median", action="store_true",
                    help="the files are several runs: rescale each to a common speed and take per test and "
                         "step the median (default: later files override earlier ones)")
    a = ap.parse_args(argv)
    try:
        docs = [load_run(p) for p in a.history]
    except (OSError, ValueError) as e:
        print(f"eta_prior: {e}", file=sys.stderr)
        return 2
    text = json.dumps((merge_median if a.median else merge)(docs), indent=0) + "\n"
    if a.out is None:
        sys.stdout.write(text)
    else:
        a.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
