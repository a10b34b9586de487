"""Re-render a results folder from its saved JSON (torch-free): ``LEADERBOARD.md``, the terminal table
and the figures (when matplotlib is available; see :mod:`kvqbench.report.figures`).

Rendering is a pure function of the saved files, so ``kvqbench report DIR`` reproduces the Markdown a
run wrote byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kvqbench.report.io import read_json, write_text_atomic
from kvqbench.report.markdown import render_markdown, render_terminal

__all__ = ["render_dir", "leaderboard_path", "leaderboard_problem", "read_leaderboard"]

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


def render_dir(path: str | Path, *, echo: bool = True, figures: bool = True, out_dir: str | Path | None = None,
               rebuild: bool = False) -> list[str]:
    """Rebuild ``LEADERBOARD.md`` (and figures) from ``path/leaderboard.json`` (+ ``exp*_*.json``).

    When ``leaderboard.json`` is missing or unreadable (a run killed while writing) or ``rebuild`` is
    true, the whole result set — ``leaderboard.json``, ``summary.json``, ``LEADERBOARD.md``, figures — is
    rebuilt from the per-experiment files ``exp*_*.json`` instead
    (:func:`kvqbench.report.results.write_result_set`; changes made by a ``pytest_kvqbench_update_leaderboard``
    hook are not replayed).

    Args:
        path: a results folder (or its ``leaderboard.json``).
        echo: print the terminal table to stdout.
        figures: also render the PNG figures (skipped with one line when matplotlib is missing).
        out_dir: where to write (default: the folder holding ``leaderboard.json``).
        rebuild: rebuild from the per-experiment files even when ``leaderboard.json`` is fine.

    ``out_dir`` holding another result set: a rebuild keeps that set in ``out_dir/previous/`` (the rules of
    :func:`kvqbench.report.results.write_result_set`); a re-render, which writes only the Markdown and the
    figures, refuses (``ValueError``) rather than mix two sets.

    Every input file is checked before anything is written: each ``exp*_*.json``
    (:func:`kvqbench.report.results.read_experiment_file`) and ``leaderboard.json``
    (:func:`read_leaderboard`); a ``leaderboard.json`` that is not valid JSON (truncated) is rebuilt from
    valid per-experiment files, with one line saying so.

    Returns the written paths. Raises ``FileNotFoundError`` when there is neither a ``leaderboard.json``
    nor ``exp*_*.json`` files and ``ValueError`` when a file is not what it should be (names it;
    nothing written).
    """
    from kvqbench.report.results import experiment_files, read_experiment_file

    d = Path(path)
    folder = d if d.is_dir() else d.parent
    exps = experiment_files(folder) if folder.is_dir() else []
    for f in exps:  # the figures and a rebuild read them: all checked before anything is written
        read_experiment_file(f)
    if exps and (rebuild or not (folder / "leaderboard.json").exists()):
        return _rebuild(folder, out_dir, echo=echo, figures=figures)
    src = leaderboard_path(path)
    out = Path(out_dir) if out_dir is not None else src.parent
    try:
        board = read_leaderboard(src)
    except ValueError:
        if exps and src == folder / "leaderboard.json" and _not_json(src):
            print(f"kvqbench report: {src} is not valid JSON; rebuilding it from {folder}/exp*_*.json",
                  file=sys.stderr)
            return _rebuild(folder, out_dir, echo=echo, figures=figures)
        raise
    if not _same_folder(out, src.parent) and (out / "leaderboard.json").exists():
        raise ValueError(f"{out} holds another result set (its leaderboard.json), whose LEADERBOARD.md and figures "
                         f"this would replace; give --out an empty folder, or render into {src.parent}")
    written = [str(write_text_atomic(out / "LEADERBOARD.md", render_markdown(board)))]
    if echo:
        print(render_terminal(board))
    if figures:
        from kvqbench.report.figures import write_figures

        def log(msg: str) -> None:
            print(msg, file=sys.stderr)

        written += [str(p) for p in write_figures(src.parent, out, log=log, jobs=0)]
    from kvqbench.report.render.html import write_html

    written += [str(p) for p in [write_html(board, out)] if p is not None]  # after the figures it embeds
    return written


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _not_json(file: Path) -> bool:
    """Whether ``file`` is unreadable as JSON (a truncated write), as opposed to JSON of another shape."""
    try:
        read_json(file)
    except ValueError:
        return True
    return False


def _rebuild(folder: Path, out_dir: str | Path | None, *, echo: bool, figures: bool) -> list[str]:
    from kvqbench.report.results import load_result_set, write_result_set

    records, prov, comp, catalog = load_result_set(folder)
    out = Path(out_dir) if out_dir is not None else folder
    # into its own folder: the set replaces itself; elsewhere the rules of any new set apply (a complete
    # set already there is kept in previous/)
    res = write_result_set(records, prov, out, comp=comp, catalog=catalog, figures=figures,
                           in_place=_same_folder(out, folder))
    if echo and res.board is not None:
        print(render_terminal(res.board))
    return res.paths
