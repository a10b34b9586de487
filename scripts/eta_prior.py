#!/usr/bin/env python3
"""Make the committed ETA prior (``kvqbench/data/eta_prior.json``) from measured runs.

The prior gives a user's first run (no pytest cache yet) a duration for every test. Regenerate it after
tests or cells change a lot, on a fresh clone so that caches are cold as on a user's first run::

    git clone . /tmp/fresh && cd /tmp/fresh
    python -m pytest -n auto            # the test suite, as CI runs it
    kvqbench run                        # the main job
    python scripts/eta_prior.py .pytest_cache/v/kvqbench/durations -o kvqbench/data/eta_prior.json

Each argument is a history file that kvqbench keeps in pytest's cache (``{"tests": {nodeid: s},
"kinds": …, "steps": …, "step_cells": {report step: cells}}``); later files override earlier ones test by
test (and step by step). The kinds are recomputed
as the medians of the merged tests. Durations are rounded to milliseconds and keys sorted, so the file
diffs well. Only relative durations matter: each run scales them by its own measured speed.
Standard library only (plus kvqbench.progress for the kinds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvqbench.progress import kind_of  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("history", nargs="+", type=Path, help="pytest-cache history files (.pytest_cache/v/kvqbench/durations)")
    ap.add_argument("-o", "--out", type=Path, default=None, help="write here (default: stdout)")
    a = ap.parse_args(argv)
    try:
        docs = [json.loads(p.read_text(encoding="utf-8")) for p in a.history]
    except (OSError, ValueError) as e:
        print(f"eta_prior: {e}", file=sys.stderr)
        return 2
    if not all(isinstance(d, dict) and d.get("version") == 1 for d in docs):
        print("eta_prior: not a kvqbench durations history (version 1)", file=sys.stderr)
        return 2
    text = json.dumps(merge(docs), indent=0) + "\n"
    if a.out is None:
        sys.stdout.write(text)
    else:
        a.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
