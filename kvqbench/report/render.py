"""Re-render a results folder from its saved JSON (torch-free): ``LEADERBOARD.md`` and the terminal
table, plus figures when matplotlib is available (see :mod:`kvqbench.report.plots`)."""

from __future__ import annotations

from pathlib import Path

from kvqbench.report.io import read_json, write_text_atomic
from kvqbench.report.markdown import render_markdown, render_terminal

__all__ = ["render_dir"]


def render_dir(path: str | Path, *, echo: bool = True) -> list[str]:
    """Rebuild ``LEADERBOARD.md`` in ``path`` from ``path/leaderboard.json``.

    Raises:
        FileNotFoundError: no ``leaderboard.json`` in ``path`` (names the file).
    """
    d = Path(path)
    src = d / "leaderboard.json" if d.is_dir() else d
    if not src.exists():
        raise FileNotFoundError(f"{src} not found; point at a folder written by a kvqbench run")
    board = read_json(src)
    out = [str(write_text_atomic(src.parent / "LEADERBOARD.md", render_markdown(board)))]
    if echo:
        print(render_terminal(board))
    return out
