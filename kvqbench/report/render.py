"""Re-render a results folder from its saved JSON (torch-free): ``LEADERBOARD.md``, the terminal table
and the figures (when matplotlib is available; see :mod:`kvqbench.report.plots`).

Rendering is a pure function of the saved files, so ``kvqbench report DIR`` reproduces the Markdown a
run wrote byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvqbench.report.io import read_json, write_text_atomic
from kvqbench.report.markdown import render_markdown, render_terminal

__all__ = ["render_dir", "leaderboard_path"]


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
        raise FileNotFoundError(f"{src} not found; point at a folder written by a kvqbench run")
    return src


def render_dir(path: str | Path, *, echo: bool = True, figures: bool = True, out_dir: str | Path | None = None
               ) -> list[str]:
    """Rebuild ``LEADERBOARD.md`` (and figures) from ``path/leaderboard.json`` (+ ``exp*_*.json``).

    Args:
        path: a results folder (or its ``leaderboard.json``).
        echo: print the terminal table to stdout.
        figures: also render the PNG figures (skipped with one line when matplotlib is missing).
        out_dir: where to write (default: the folder holding ``leaderboard.json``).

    Returns the written paths. Raises ``FileNotFoundError`` when there is no ``leaderboard.json``.
    """
    src = leaderboard_path(path)
    out = Path(out_dir) if out_dir is not None else src.parent
    board = read_json(src)
    written = [str(write_text_atomic(out / "LEADERBOARD.md", render_markdown(board)))]
    if echo:
        print(render_terminal(board))
    if figures:
        from kvqbench.report.plots import write_figures

        def log(msg: str) -> None:
            print(msg, file=sys.stderr)

        written += [str(p) for p in write_figures(src.parent, out, log=log)]
    return written
