"""The session's settings and state, kept in ``config.stash`` (like pytest's own ``junitxml``), and what
every part of the plugin asks of a config or an item: is this an xdist worker, is xdist on, which cell
does an item run, which folder do the results go to."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvqbench.cells import DEFAULT_BITS, DEFAULT_MODEL, Cell, parse_nodeid

#: the ``user_properties`` key a cell's record travels under (the channel ``record_property`` uses)
RECORD_KEY = "kvqbench"
#: a test's user property naming a step paid inside it: ``("kvqbench_step", {"kind": ..., "seconds": ...})``
STEP_KEY = "kvqbench_step"


@dataclass
class Settings:
    """Resolved options of one session (kept in ``config.stash``, see :mod:`kvqbench.plugin.options`)."""

    device: str = "cpu"
    out_dir: str | None = None
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    real: bool = False
    model: str = DEFAULT_MODEL
    methods: list[str] | None = None
    bits: list[int] = field(default_factory=lambda: list(DEFAULT_BITS))
    start_time: str = ""
    threads: int = 1
    bits_explicit: bool = False
    shard: tuple[int, int] | None = None  # (index, count), 1-based: --kvq-shard I/N
    durations: str | None = None  # --kvq-durations FILE (default: the committed kvqbench/data/durations.json)
    dtype: str = "float32"  # --kvq-dtype: the dtype the real model is loaded and run in for capture
    capture_cache: str | None = None  # --kvq-capture-cache DIR (default: pytest's cache folder)
    figures: str = "auto"  # --kvq-figures: auto (full runs only), on, off
    windows: list[int] = field(default_factory=lambda: list(range(16)))  # --kvq-windows: exp5's full cells

    def seeds_for(self, experiment: str, size: str) -> list[int]:
        """The seeds a cell of ``experiment`` at ``size`` sweeps: exp5's full cells one per text window
        (``--kvq-windows``), every other cell ``--kvq-seeds``."""
        return self.windows if (experiment, size) == ("exp5", "full") else self.seeds


@dataclass
class SessionState:
    """What the controller gathers during a session: the records, the collected cells, what was written."""

    records: list[dict[str, Any]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    expected: list[str] | None = None  # node ids of the collected cells (controller)
    board: dict[str, Any] | None = None
    out_dir: str | None = None
    t0: float = 0.0
    shard: dict[str, Any] | None = None  # shard.json of a --kvq-shard session (from collection)


SETTINGS_KEY = pytest.StashKey[Settings]()
STATE_KEY = pytest.StashKey[SessionState]()

_CONFIG: dict[str, pytest.Config] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG["config"] = session.config


def session_config() -> pytest.Config | None:
    """The config of the running session (for hooks that are not handed one)."""
    return _CONFIG.get("config")


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def xdist_active(config: pytest.Config) -> bool:
    n = getattr(config.option, "numprocesses", None)
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or (getattr(config.option, "dist", "no") != "no"
                                                          and n not in (None, 0))


def cell_of(item: Any) -> Cell | None:
    """The :class:`~kvqbench.cells.Cell` a collected item runs, or ``None`` for any other test."""
    callspec = getattr(item, "callspec", None)
    cell = None if callspec is None else callspec.params.get("cell")
    return cell if isinstance(cell, Cell) else None


def out_dir(config: pytest.Config, s: Settings, records: list[dict[str, Any]] | None,
            expected: list[str] | None = None) -> Path:
    """The results folder: ``--kvq-out``, else ``results/`` (``results/smoke/`` when only smoke cells
    ran; ``…/shards/shard-I-of-N`` for ``--kvq-shard I/N``), relative to the invocation folder."""
    out = s.out_dir
    if out is None:
        state = config.stash[STATE_KEY]
        ids = expected or (state.shard or {}).get("cells")  # an empty shard: the cells of the whole matrix
        if ids:
            smoke = all(_size(i) == "smoke" for i in ids)
        else:
            smoke = bool(records) and all(r["size"] == "smoke" for r in records)
        out = "results/smoke" if smoke else "results"
        if s.shard is not None:
            from kvqbench.shard import shard_dir_name

            out = f"{out}/shards/{shard_dir_name(*s.shard)}"
    folder = Path(out)
    if not folder.is_absolute():
        folder = Path(config.invocation_params.dir) / folder
    return folder


def _size(nodeid: str) -> str | None:
    cell = parse_nodeid(nodeid).cell
    return None if cell is None else cell.size


#: pytest sessions configured and not yet unconfigured in this process (a pytester run inside the test
#: suite nests one session in another)
_SESSIONS = [0]


def pytest_configure(config: pytest.Config) -> None:
    _SESSIONS[0] += 1


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    _SESSIONS[0] -= 1
    if _SESSIONS[0] <= 0:
        _freeze_for_exit()


def _freeze_for_exit() -> None:
    """The outermost session is over and the process is about to exit: move every live object to the
    garbage collector's permanent generation (``gc.freeze``), so the interpreter's final collection does
    not walk torch's hundreds of thousands of objects in every process (the serial run, the xdist controller
    and each worker). Only the objects alive now are frozen; nothing is skipped (atexit handlers, flushes
    and finalizers run as usual)."""
    import gc

    gc.freeze()
