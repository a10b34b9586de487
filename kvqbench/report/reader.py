"""Reading one result file, checked before it is used: ``leaderboard.json`` (:func:`read_leaderboard`)
and the per-experiment files ``exp<N>_<source>.json`` (:func:`read_experiment_file`). A file that is not
what it should be raises ``ValueError`` with one line naming it. Torch-free."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kvqbench.report.io import read_json

__all__ = ["leaderboard_problem", "read_leaderboard", "experiment_files", "experiment_file_problem",
           "read_experiment_file", "read_experiment_files", "RECORD_KEYS"]


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
    for key in ("provenance", "sources", "methods", "metrics_catalog"):  # the first two are required
        if key not in doc and key in ("provenance", "sources"):
            return f"no '{key}'"
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


#: a per-experiment file's name: ``exp<N>_<source>.json`` (``exp1_real-gemma3-270m.json``: see
#: :func:`kvqbench.cells.real_source`)
_EXP_FILE = re.compile(r"^(exp\d+)_([\w.-]+)\.json$")

#: what every cell record holds
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
        raise ValueError(f"{p} is not valid JSON ({e}); restore it (e.g. from git) or re-run the benchmark") from None
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
