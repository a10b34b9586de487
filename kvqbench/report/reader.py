"""Reading a result set back, every file checked before it is used: ``leaderboard.json``
(:func:`read_leaderboard`) and the per-experiment files ``exp<N>_<source>.json``
(:func:`read_experiment_file`, :func:`load_result_set`). A file that is not what it should be raises
``ValueError`` with one line naming it. Torch-free."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kvqbench.cells import DEFAULT_MODEL
from kvqbench.metrics import catalog_dict
from kvqbench.report.io import read_json

__all__ = ["leaderboard_problem", "read_leaderboard", "leaderboard_path", "experiment_files", "experiment_file_problem",
           "read_experiment_file", "read_experiment_files", "check_result_files", "load_result_set",
           "combined_provenance", "RECORD_KEYS"]


#: what every entry of ``sources`` must hold (as dicts) for the renderers and ``compare`` to use it
SOURCE_KEYS = ("stats", "rankings", "cells")


def leaderboard_problem(doc: Any) -> str | None:
    """What is wrong with ``doc`` as a kvqbench leaderboard document, or ``None`` when its shape is
    right: a dict with a ``provenance`` dict and a ``sources`` dict whose values are dicts holding
    ``stats`` (experiment → method → setting → metric → dict), ``rankings`` (metric → dict with a
    ``by_setting`` dict) and ``cells`` (state → count) dicts; ``methods`` and ``metrics_catalog``,
    when present, are dicts."""
    if not isinstance(doc, dict):
        return f"top level is a JSON {type(doc).__name__}, not an object"
    for key in ("provenance", "sources"):
        if key not in doc:
            return f"no '{key}'"
        if not isinstance(doc[key], dict):
            return f"'{key}' is a {type(doc[key]).__name__}, not an object"
    for key in ("methods", "metrics_catalog"):
        if key in doc and not isinstance(doc[key], dict):
            return f"'{key}' is a {type(doc[key]).__name__}, not an object"
    for name, src in doc["sources"].items():
        if not isinstance(src, dict):
            return f"sources.{name} is a {type(src).__name__}, not an object"
        for key in SOURCE_KEYS:
            if key not in src:
                return f"sources.{name} has no '{key}'"
            if not isinstance(src[key], dict):
                return f"sources.{name}.{key} is a {type(src[key]).__name__}, not an object"
        for exp, by_method in src["stats"].items():
            if not isinstance(by_method, dict) or not all(
                    isinstance(by_setting, dict) and all(isinstance(m, dict) for m in by_setting.values())
                    for by_setting in by_method.values()):
                return f"sources.{name}.stats.{exp} is not method → setting → metric objects"
        for metric, r in src["rankings"].items():
            if not isinstance(r, dict) or not isinstance(r.get("by_setting"), dict):
                return f"sources.{name}.rankings.{metric} has no 'by_setting' object"
    return None


def read_leaderboard(file: str | Path) -> dict[str, Any]:
    """Read and check a ``leaderboard.json`` file (see :func:`leaderboard_problem`).

    Raises:
        ValueError: unreadable (truncated, not JSON, not UTF-8) or not shaped like a kvqbench leaderboard;
            the message names the file and what is wrong.
    """
    try:
        doc = read_json(file)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        problem: str | None = f"not valid JSON: {e}"
    else:
        problem = leaderboard_problem(doc)
    if problem is not None:
        raise ValueError(f"{file} is not a kvqbench leaderboard ({problem}); re-run the benchmark or point at "
                         "a folder it wrote")
    return doc


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


#: a per-experiment file's name: ``exp<N>_<source>.json`` (``exp1_real-gemma3-270m.json``: see
#: :func:`kvqbench.cells.real_source`)
_EXP_FILE = re.compile(r"^(exp\d+)_([\w.-]+)\.json$")

#: what every cell record holds (:func:`record_sort_key` orders by them)
RECORD_KEYS = ("experiment", "source", "method", "k_bits", "v_bits", "seed", "size")


def experiment_files(folder: str | os.PathLike) -> list[Path]:
    """The per-experiment files of a result set: ``folder/exp<N>_*.json``, sorted by name."""
    return sorted(p for p in Path(folder).glob("exp[0-9]*_*.json") if p.is_file())


def experiment_file_problem(path: Path, doc: Any) -> str | None:
    """What is wrong with ``doc``, read from ``path``, as a per-experiment file, or ``None``: its name is
    ``exp<N>_<source>.json``; it is an object with a ``provenance`` object, the ``experiment`` and
    ``source`` of its name, ``metrics_catalog`` and ``completeness`` objects when present and a ``cells``
    list of records, each an object holding :data:`RECORD_KEYS` with the file's experiment and source."""
    m = _EXP_FILE.match(path.name)
    if m is None:
        return "its name is not exp<N>_<source>.json"
    if not isinstance(doc, dict):
        return f"top level is a JSON {type(doc).__name__}, not an object"
    if not isinstance(doc.get("provenance"), dict):
        return "no 'provenance' object"
    for key, want in (("experiment", m.group(1)), ("source", m.group(2))):
        if doc.get(key) != want:
            return f"'{key}' is {doc.get(key)!r}, not {want!r} as its name says"
    for key in ("metrics_catalog", "completeness"):
        if doc.get(key) is not None and not isinstance(doc[key], dict):
            return f"'{key}' is a {type(doc[key]).__name__}, not an object"
    if not isinstance(doc.get("cells"), list):
        return "no 'cells' list"
    for i, cell in enumerate(doc["cells"]):
        if not isinstance(cell, dict):
            return f"cell {i} is a {type(cell).__name__}, not an object"
        missing = [k for k in RECORD_KEYS if k not in cell]
        if missing:
            return f"cell {i} has no {', '.join(repr(k) for k in missing)}"
        if (cell["experiment"], cell["source"]) != (m.group(1), m.group(2)):
            return f"cell {i} is of {cell['experiment']}/{cell['source']}, not {m.group(1)}/{m.group(2)}"
    return None


def read_experiment_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check one per-experiment file (see :func:`experiment_file_problem`).

    Raises:
        ValueError: it is not valid JSON (truncated, not UTF-8) or not a kvqbench experiment file; one line
            naming the file and what is wrong.
        OSError: it cannot be read.
    """
    p = Path(path)
    try:
        doc = read_json(p)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{p} is not valid JSON ({e}); delete it or re-run the benchmark") from None
    problem = experiment_file_problem(p, doc)
    if problem is not None:
        raise ValueError(f"{p} is not a kvqbench experiment file ({problem}); move it out of the folder or "
                         "re-run the benchmark")
    return doc


def read_experiment_files(folder: str | os.PathLike) -> dict[tuple[str, str], dict[str, Any]]:
    """Every per-experiment file of ``folder``, read and checked (:func:`read_experiment_file`):
    ``{(experiment, source): document}``, in file-name order.

    Raises:
        ValueError, OSError: as :func:`read_experiment_file`, for the first file that fails.
    """
    return {(doc["experiment"], doc["source"]): doc for doc in map(read_experiment_file, experiment_files(folder))}


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
