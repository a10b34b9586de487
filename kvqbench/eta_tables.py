"""The duration tables the ETA reads and keeps (pure bookkeeping: no pytest, no torch).

Two tables give each test its *base* seconds: ``history`` (this machine's previous runs, kept in pytest's
cache by the plugin: :func:`new_history`) and ``prior`` (the committed ``kvqbench/data/eta_prior.json``,
measured on a fresh clone, so a user's first run has one too: :func:`load_prior`). Both have the form
``{"tests": {nodeid: s}, "kinds": {kind: s}, "steps": {step: s}, "step_cells": {report step: cells}}``.
A *kind* is the test function plus, for benchmark cells, the method and the data source/size in the id
(``tests/bench/x.py::test_a|kivi|real-full``): cells of one kind cost about the same.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from kvqbench.cells import parse_nodeid

__all__ = ["kind_of", "coarse_kind_of", "file_of", "split_id", "needs_model", "groups_of", "median",
           "weighted_median", "run_scale", "load_prior", "new_history", "PRIOR_PATH", "PER_WORKER_STEPS", "AGAIN",
           "HISTORY_VERSION", "HISTORY_NEW", "MODEL_TESTS", "TAGS"]

#: the data source/size tags of a benchmark cell id
TAGS = ("real", "synthetic", "full", "smoke", "long")

#: the committed per-test durations of a fresh-clone run of the test suite and of the main job
#: (the form of :func:`new_history`'s tables; regenerate with ``scripts/eta_prior.py``)
PRIOR_PATH = Path(__file__).resolve().parent / "data" / "eta_prior.json"
#: steps paid once per worker (the real-model capture, the end-to-end model load): the run's first does
#: the work and fills the disk cache, the later ones read it; tables keep the first as ``kind`` and the
#: median of the later ones as ``kind + AGAIN``
PER_WORKER_STEPS: tuple[str, ...] = ("capture|", "model|")
AGAIN = "|again"
#: the format of :func:`new_history` (2: every run's seconds on the tables' scale, blended);
#: a history of another version is not read
HISTORY_VERSION = 2
#: the weight of a run's (rescaled) seconds against the value already kept (the prior's for an entry new to the
#: history), in the log: one run's odd phase moves an entry a third of the way (chosen by replays, docs/ETA.md)
HISTORY_NEW = 1 / 3
#: test functions whose cells run the real model itself (experiments 5 and 6): the first of them on each worker
#: pays the ``model|<source-size>`` step (the plugin's ``kvq_model`` fixture times it)
MODEL_TESTS: tuple[str, ...] = ("test_endtoend", "test_longdecode", "test_longdecode_smoke")


def groups_of(kind: str) -> tuple[tuple[str, str], ...]:
    """A kind's groups, finest first: the kind, its file, its folder."""
    f = file_of(kind)
    return (("kind", kind), ("file", f), ("dir", f.rsplit("/", 1)[0]))


def needs_model(nodeid: str) -> bool:
    """Whether the test runs the real model itself (:data:`MODEL_TESTS`)."""
    return parse_nodeid(nodeid).function in MODEL_TESTS


def split_id(nodeid: str) -> tuple[str, str, list[str]]:
    """``(test function's id, its parameters, the data source/size tags among them)``."""
    node = parse_nodeid(nodeid)
    tags = [t for t in TAGS if f"-{t}" in f"-{node.params}"]
    return node.base, node.params, tags


def coarse_kind_of(nodeid: str) -> str:
    """The test function plus the data source/size tags of a benchmark cell id (no method)."""
    base, _, tags = split_id(nodeid)
    return base + ("|" + "-".join(tags) if tags else "")


def kind_of(nodeid: str) -> str:
    """The test function plus, for benchmark cells (ids ending ``-<source>-<size>``), the method id and
    the data source/size: cells of one method, function and size cost about the same."""
    base, params, tags = split_id(nodeid)
    if not tags:
        return base
    cell = parse_nodeid(nodeid).cell
    method = cell.method if cell is not None else params.split("-", 1)[0]
    return f"{base}|{method}|{'-'.join(tags)}"


def file_of(nodeid: str) -> str:
    """The test file of a node id (``tests/unit/t.py::test_a[1]`` → ``tests/unit/t.py``)."""
    return parse_nodeid(nodeid).path


def median(v: list[float]) -> float:
    """The median of ``v``; 0 for none."""
    return float(statistics.median(v)) if v else 0.0


def weighted_median(values: list[float], weights: list[float]) -> float:
    """The smallest value whose cumulative weight reaches half the total (values sorted ascending).

    Raises:
        ValueError: empty input, lengths differ, or no positive weight.
    """
    if not values or len(values) != len(weights):
        raise ValueError("weighted_median needs equally many values and weights (at least one)")
    total = sum(w for w in weights if w > 0)
    if total <= 0:
        raise ValueError("weighted_median needs a positive weight")
    acc = 0.0
    for v, w in sorted(zip(values, weights)):
        acc += max(w, 0.0)
        if acc >= total / 2:
            return float(v)
    return float(max(values))  # pragma: no cover - rounding only


def run_scale(observed: list[tuple[str, float, float]]) -> float:
    """A run's seconds per table second from its finished tests ``(kind, base s, measured s)``: the median of
    measured/base, weighted by the base seconds (so a slow phase of short tests does not decide it); 1 with
    none. Clamped to [0.05, 20]."""
    obs = [(d / b, b) for _, b, d in observed if b > 0 and d > 0]
    if not obs:
        return 1.0
    return min(max(weighted_median([r for r, _ in obs], [w for _, w in obs]), 0.05), 20.0)


def load_prior(path: str | Path | None = None) -> dict:
    """The committed prior (``{"tests": {nodeid: s}, "kinds": {kind: s}, "steps": {step: s}}``), or
    ``{}`` when the file is missing or unreadable (the ETA then learns from this run alone)."""
    try:
        doc = json.loads(Path(path or PRIOR_PATH).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) and doc.get("version") == 1 else {}


def new_history(old: dict, prior: dict, scale: float, tests: dict[str, float], kinds: dict[str, float],
                steps: dict[str, list[float]], cells: int, complete: bool, max_tests: int = 50_000) -> dict:
    """The history to keep for the next run, on the tables' scale: a run's seconds (per test ``tests``, per kind
    ``kinds``, per step every occurrence ``steps``) divided by ``scale`` (that run's seconds per table second),
    so a run on a busy or slower machine keeps its tests' *relative* durations and the next run measures its
    own speed; each blended with the value already kept for it in ``old``, or ``prior``'s for an entry new to
    the history — ``exp(HISTORY_NEW·log new + (1 − HISTORY_NEW)·log old)``, so one run's odd phase (a load that
    came and went) moves an entry only part of the way — and merged over ``old``. A once-per-worker step
    (:data:`PER_WORKER_STEPS`) keeps the run's first and the median of the later ones (``kind + AGAIN``); a
    run that did not finish every test (``complete`` False: interrupted, ``-x``) keeps no report step, as its
    results and figures cover only part of the ``cells`` benchmark cells. At most ``max_tests`` tests, the
    newest."""
    old = old or {}

    def merged(table: dict, new: dict[str, float], part: str) -> dict:
        out = dict(table or {})
        start = (prior or {}).get(part) or {}
        for k, v in new.items():
            v = max(v, 0.0) / scale
            prev = out.get(k, start.get(k))  # an entry new to the history starts from the prior's
            if isinstance(prev, (int, float)) and prev > 0 and v > 0:
                v = math.exp(HISTORY_NEW * math.log(v) + (1 - HISTORY_NEW) * math.log(float(prev)))
            out.pop(k, None)  # re-inserted: the newest entries last (kept when trimming)
            out[k] = round(v, 4)
        return out

    kept = merged(old.get("tests"), tests, "tests")
    if len(kept) > max_tests:  # keep the newest entries
        kept = dict(list(kept.items())[-max_tests:])
    new_steps: dict[str, float] = {}
    for k, v in steps.items():
        if not v or (k.startswith("report|") and not complete):
            continue
        if k.startswith(PER_WORKER_STEPS):  # a once-per-worker step: the run's first (the work), the others
            new_steps[k] = v[0]
            if len(v) > 1:
                new_steps[k + AGAIN] = median(v[1:])
        else:
            new_steps[k] = median(v)
    step_cells = {**(old.get("step_cells") or {}),
                  **{k: cells for k in new_steps if k.startswith("report|") and cells}}
    return {"version": HISTORY_VERSION, "tests": kept, "kinds": merged(old.get("kinds"), kinds, "kinds"),
            "steps": merged(old.get("steps"), new_steps, "steps"), "step_cells": step_cells}
