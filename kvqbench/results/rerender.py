"""``kvqbench report DIR``: re-render a results folder from its saved JSON (torch-free) —
``LEADERBOARD.md``, the terminal table, the figures (when matplotlib is available; see
:mod:`kvqbench.report.render.figures`) and the web page ``index.html`` (:mod:`kvqbench.report.render.html`),
or the whole result set rebuilt from its per-experiment files.

Rendering is a pure function of the saved files, so ``kvqbench report DIR`` reproduces the Markdown a
run wrote byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvqbench.report.io import read_json, write_text_atomic
from kvqbench.report.reader import read_experiment_files, read_leaderboard
from kvqbench.report.render.markdown import render_markdown
from kvqbench.report.render.terminal import render_terminal
from kvqbench.results.read import check_result_files, leaderboard_path, load_result_set
from kvqbench.results.write import write_figures_and_page, write_result_set

__all__ = ["render_dir"]


def render_dir(path: str | Path, *, echo: bool = True, figures: bool = True, out_dir: str | Path | None = None,
               rebuild: bool = False) -> list[str]:
    """Rebuild ``LEADERBOARD.md``, the figures and ``index.html`` from ``path/leaderboard.json``
    (+ ``exp*_*.json``).

    When ``leaderboard.json`` is missing or unreadable (a run killed while writing) or ``rebuild`` is
    true, the whole result set — ``leaderboard.json``, ``summary.json``, ``LEADERBOARD.md``, figures, page — is
    rebuilt from the per-experiment files ``exp*_*.json`` instead
    (:func:`kvqbench.results.write.write_result_set`; changes made by a ``pytest_kvqbench_update_leaderboard``
    hook are not replayed).

    Args:
        path: a results folder (or its ``leaderboard.json``).
        echo: print the terminal table to stdout.
        figures: also render the PNG figures (skipped with one line when matplotlib is missing).
        out_dir: where to write (default: the folder holding ``leaderboard.json``).
        rebuild: rebuild from the per-experiment files even when ``leaderboard.json`` is fine.

    ``out_dir`` holding another result set: a rebuild keeps that set in ``out_dir/previous/`` (the rules of
    :func:`kvqbench.results.write.write_result_set`); a re-render, which writes only the Markdown, the
    figures and the page, refuses (``ValueError``) rather than mix two sets.

    Every input file is checked before anything is written: each ``exp*_*.json``
    (:func:`kvqbench.report.reader.read_experiment_file`), ``leaderboard.json`` (:func:`read_leaderboard`)
    and, for a re-render, that the ``exp*_*.json`` are the set ``leaderboard.json`` summarizes
    (:func:`check_result_files`); a ``leaderboard.json`` that is not valid JSON (truncated) is rebuilt from
    valid per-experiment files, with one line saying so.

    Returns the written paths. Raises ``FileNotFoundError`` when there is neither a ``leaderboard.json``
    nor ``exp*_*.json`` files and ``ValueError`` when a file is not what it should be (names it;
    nothing written).
    """
    d = Path(path)
    folder = d if d.is_dir() else d.parent
    exps = read_experiment_files(folder) if folder.is_dir() else {}  # all checked before anything is written
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
    check_result_files(src.parent, board)
    if not _same_folder(out, src.parent) and (out / "leaderboard.json").exists():
        raise ValueError(f"{out} holds another result set (its leaderboard.json), whose LEADERBOARD.md and figures "
                         f"this would replace; give --out an empty folder, or render into {src.parent}")
    written = [str(write_text_atomic(out / "LEADERBOARD.md", render_markdown(board)))]
    if echo:
        print(render_terminal(board))
    return written + [str(p) for p in write_figures_and_page(board, out, figures=figures, data_dir=src.parent)]


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
    records, prov, comp, catalog = load_result_set(folder)
    out = Path(out_dir) if out_dir is not None else folder
    # into its own folder: the set replaces itself; elsewhere the rules of any new set apply (a complete
    # set already there is kept in previous/)
    res = write_result_set(records, prov, out, comp=comp, catalog=catalog, figures=figures,
                           in_place=_same_folder(out, folder))
    if echo and res.board is not None:
        print(render_terminal(res.board))
    return res.paths
