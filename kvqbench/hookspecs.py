"""Hooks for users who customise kvqbench's output (registered by the plugin via ``pytest_addhooks``).

Implement them in a ``conftest.py`` or a plugin; see ``docs/HOOKS.md`` for examples. Both run on the
pytest-xdist controller only, at session end, after every cell has reported:

1. :func:`pytest_kvqbench_update_leaderboard` — mutate the leaderboard document in place before any
   file is written (add a ranking, drop a method, attach notes). ``leaderboard.json``, ``summary.json``
   and ``LEADERBOARD.md`` are all derived from the mutated document.
2. :func:`pytest_kvqbench_write_extra` — after the standard files and figures are written, write your
   own files into ``out_dir`` and return their paths; they are listed among the written files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

__all__ = ["pytest_kvqbench_update_leaderboard", "pytest_kvqbench_write_extra"]


@pytest.hookspec
def pytest_kvqbench_update_leaderboard(config: pytest.Config, board: dict[str, Any]) -> None:
    """Mutate or extend ``board`` (the ``leaderboard.json`` document) before it is written.

    Args:
        config: the pytest config.
        board: ``{"provenance", "metrics_catalog", "methods", "sources": {source: {stats, rankings,
            pareto, matched_budget, data_quality, cells, failures, …}}}``; keep it JSON-able.

    Every implementation is called (in pytest's plugin order); return values are ignored.
    """


@pytest.hookspec
def pytest_kvqbench_write_extra(config: pytest.Config, board: dict[str, Any], out_dir: Path) -> list[str | Path] | None:
    """Write extra output files into ``out_dir`` and return their paths (or ``None``).

    Called after ``leaderboard.json``, ``summary.json``, ``LEADERBOARD.md``, the experiment JSON and
    the figures exist in ``out_dir``. An exception here is reported and fails the session like any
    other results-writing error, so keep extras robust.
    """
