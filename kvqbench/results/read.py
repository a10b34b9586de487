"""A result folder read back: where its ``leaderboard.json`` is (:func:`leaderboard_path`), its
per-experiment files checked against it (:func:`check_result_files`) and its cell records, provenance,
completeness and catalog (:func:`load_result_set`). Each file is checked by :mod:`kvqbench.report.reader`
first. Torch-free."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvqbench.cells import DEFAULT_MODEL
from kvqbench.metrics import catalog_dict
from kvqbench.report.reader import experiment_files, read_experiment_files

__all__ = ["leaderboard_path", "check_result_files", "load_result_set", "combined_provenance"]


def leaderboard_path(path: str | Path) -> Path:
    """``path/leaderboard.json`` for a folder, ``path`` for a file.

    Raises:
        FileNotFoundError: the file does not exist (names it).
    """
    d = Path(path)
    if not d.exists():
        raise FileNotFoundError(f"{d} does not exist; point at a folder written by a kvqbench run")
    src = d / "leaderboard.json" if d.is_dir() else d
    if not src.exists():
        below = sorted(str(p.parent) for p in d.glob("**/leaderboard.json")) if d.is_dir() else []
        hint = (f"; result sets below it: {', '.join(below[:6])}" + (" …" if len(below) > 6 else "")) if below \
            else "; point at a folder written by a kvqbench run"
        raise FileNotFoundError(f"{src} not found{hint}")
    return src


def check_result_files(folder: str | os.PathLike, board: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Check the per-experiment files of ``folder`` against its leaderboard document ``board``: each file
    parses and is a kvqbench experiment file (:func:`read_experiment_files`), and, when the folder holds
    any, every experiment of every source that ``board`` has statistics of has its file, holding as many
    cells per source as ``board`` counts. Returns the documents (``{(experiment, source): document}``).

    Raises:
        ValueError: one line naming the file that is unreadable, not kvqbench's, missing or holding
            another number of cells than ``leaderboard.json`` counts.
    """
    d = Path(folder)
    docs = read_experiment_files(d)
    if not docs:
        return docs
    for name, src in board["sources"].items():
        missing = [f"{exp}_{name}.json" for exp in sorted(src["stats"]) if (exp, name) not in docs]
        if missing:
            raise ValueError(f"{d / missing[0]} is missing: leaderboard.json has {name} results of "
                             f"{missing[0].split('_')[0]}; re-run the benchmark or restore the file")
        want = sum(v for k, v in src["cells"].items() if k in ("passed", "failed", "skipped"))
        have = {f"{exp}_{s}.json": len(doc["cells"]) for (exp, s), doc in docs.items() if s == name}
        if have and sum(have.values()) != want:
            raise ValueError(f"{d}/exp*_{name}.json hold {sum(have.values())} cells of {name} ("
                             + ", ".join(f"{f}: {n}" for f, n in have.items())
                             + f"), leaderboard.json counts {want}: the files are of another run or incomplete")
    return docs


def load_result_set(folder: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None,
                                                       dict[str, Any]]:
    """Read a result set back from its per-experiment files ``folder/exp*_*.json``.

    Returns ``(records, provenance, completeness, catalog)``: every cell record, the provenance header,
    the completeness the run recorded (``None`` when the files hold none) and the metrics
    catalog (the current :func:`~kvqbench.metrics.catalog_dict` updated with the files' entries).

    Raises:
        FileNotFoundError: no ``exp*_*.json`` in ``folder``.
        ValueError: a file is not valid JSON or not a kvqbench experiment file (names it;
            :func:`read_experiment_file`).
    """
    d = Path(folder)
    if not experiment_files(d):
        raise FileNotFoundError(f"{d} holds no exp*_*.json files; point at a folder written by a kvqbench run")
    records: list[dict[str, Any]] = []
    runs: dict[tuple, dict[str, Any]] = {}  # (start_time, command) → that run's provenance
    comps: dict[tuple, dict[str, Any]] = {}  # the completeness each run recorded
    catalog = catalog_dict()
    for doc in read_experiment_files(d).values():
        records += doc["cells"]
        prov = doc["provenance"]
        run = (prov.get("start_time"), prov.get("command"))
        runs.setdefault(run, prov)
        if doc.get("completeness"):
            comps.setdefault(run, doc["completeness"])
        catalog.update(doc.get("metrics_catalog") or {})
    comp = next(iter(comps.values()), None)
    if len(comps) > 1:  # several runs: their counts add up, and the set is complete when each run was
        cs = list(comps.values())
        status = [r.get("status") for r in records]  # the cells this folder holds (not each run's whole matrix)
        comp = {k: status.count(k) for k in ("passed", "failed", "skipped")}
        comp["not_run"] = sum(c.get("not_run") or 0 for c in cs)
        comp["finished"] = comp["passed"] + comp["failed"] + comp["skipped"]
        comp["expected"] = comp["finished"] + comp["not_run"]
        comp.update(complete=all(c.get("complete") for c in cs) and not comp["failed"],
                    not_run_ids=[i for c in cs for i in c.get("not_run_ids") or []],
                    reason="; ".join(c["reason"] for c in cs if c.get("reason")) or None)
        comp["summary"] = (f"{'complete' if comp['complete'] else 'incomplete'}: {comp['finished']} cells "
                           f"({len(cs)} runs)")
    return records, combined_provenance(list(runs.values())), comp, catalog


def combined_provenance(provs: list[dict[str, Any]]) -> dict[str, Any]:
    """The provenance of a folder holding the files of one run (that run's) or of several runs, e.g. one
    per model: the default model's run's fields, the earliest start time, ``model`` joined by `` + ``
    (the default model first) and ``runs``: each run's model, start time, command and commit."""
    if len(provs) == 1:
        return provs[0]
    provs = sorted(provs, key=lambda p: (p.get("model", DEFAULT_MODEL) != DEFAULT_MODEL, str(p.get("start_time"))))
    out = dict(provs[0])
    models: list[str] = []
    for p in provs:
        m = str(p.get("model") or DEFAULT_MODEL)
        if m not in models:
            models.append(m)
    out["model"] = " + ".join(models)
    out["start_time"] = min(str(p.get("start_time")) for p in provs)
    out["runs"] = [{k: p.get(k) for k in ("model", "start_time", "command", "git_commit")} for p in provs]
    return out
