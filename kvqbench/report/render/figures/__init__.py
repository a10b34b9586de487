"""Figures rendered from saved JSON only (``leaderboard.json`` + ``exp*_*.json``). Torch-free.

One set of PNGs per data source, ``{figure}_{source}.png`` for each figure of :data:`FIGURES` (one module
each), written next to the JSON, so real and synthetic never share a figure; and ``kl_models.png``
(:mod:`.models`) when the board pairs two models. Shared: :mod:`.style` (colours, markers, matplotlib
settings, axis words and helpers), :mod:`.series` (finding curves and histograms in a record's
``series``), :mod:`.data` (loading, the headline setting, means over seeds), :mod:`.placement` (labels
that overlap nothing), :mod:`.save` (one deterministic PNG).

A figure whose data is absent (an experiment that did not run) is not drawn. matplotlib is optional:
without it :func:`write_figures` logs one line and returns ``[]``; a figure that fails to render is
skipped with one line of explanation, never blocking the others.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path
from typing import Callable

from kvqbench.report.reader import read_experiment_files, read_leaderboard
from kvqbench.report.render.figures import (
    attn_vs_context,
    cost,
    kl_vs_position,
    models,
    mse_vs_bits,
    norm_diff_density,
    pareto,
    predictivity,
)
from kvqbench.report.render.figures.data import load_sources
from kvqbench.report.render.figures.style import RC, method_order, pyplot

__all__ = ["write_figures", "FIGURES"]

Log = Callable[[str], None]

#: every per-source figure, in the order they are drawn and listed: ``(file name stem, draw(plt, source,
#: out_dir) → the written path or None when the source lacks its data, start rank)``; the parallel pool
#: starts the dearer ones (lower rank) first, so that the last to finish is a cheap one
FIGURES: tuple[tuple[str, Callable[..., Path | None], int], ...] = (
    ("pareto", pareto.draw, 5),
    ("mse_vs_bits", mse_vs_bits.draw, 6),
    ("attn_error_vs_context", attn_vs_context.draw_error, 2),
    ("attn_kl_vs_context", attn_vs_context.draw_kl, 1),
    ("norm_diff_density", norm_diff_density.draw, 0),
    ("cost", cost.draw, 4),
    ("predictivity", predictivity.draw, 3),
    ("kl_vs_position", kl_vs_position.draw, 7),
)

#: the running :func:`write_figures`' jobs ``(file name, start rank, draw())``, read by the forked pool
#: workers (they inherit it, so neither the data nor matplotlib objects are pickled)
_JOBS: list[tuple[str, int, Callable[[], Path | None]]] = []


def _run_job(i: int) -> tuple[Path | None, str | None]:
    """Draw job ``i`` of :data:`_JOBS`: ``(path or None, one-line message or None)``, never raises."""
    import matplotlib.pyplot as plt

    name, _, draw = _JOBS[i]
    try:
        return draw(), None
    except Exception as e:  # one broken figure never blocks the others or the run
        plt.close("all")
        return None, f"kvqbench: figure {name} skipped: {type(e).__name__}: {e}"


def _run_parallel(n_jobs: int) -> list[tuple[Path | None, str | None]] | None:
    """Every job of :data:`_JOBS` drawn by ``n_jobs`` forked processes (results in job order), or
    ``None`` when no process pool can be had here (no ``fork``, a pool that broke): the caller then
    draws serially. Each PNG is the same file, byte for byte, as a serial draw writes."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    if "fork" not in mp.get_all_start_methods():
        return None
    order = sorted(range(len(_JOBS)), key=lambda i: (_JOBS[i][1], i))
    try:
        with ProcessPoolExecutor(max_workers=n_jobs, mp_context=mp.get_context("fork")) as pool:
            done = dict(zip(order, pool.map(_run_job, order), strict=True))
    except Exception:  # BrokenProcessPool, OSError (no processes left): draw serially instead
        return None
    return [done[i] for i in range(len(_JOBS))]


def write_figures(results_dir: str | Path, out_dir: str | Path | None = None, *, log: Log | None = None,
                  jobs: int = 1) -> list[Path]:
    """Render every figure that the saved JSON in ``results_dir`` supports; return the written paths.

    Args:
        results_dir: a folder holding ``leaderboard.json`` and optionally ``exp*_{source}.json``.
        out_dir: where the PNGs go (default ``results_dir``).
        log: one-line messages (missing matplotlib, a figure that failed); default stderr.
        jobs: processes drawing figures side by side (forked, so the JSON is read once); ``0`` = one per
            CPU this process may run on, at most 8; ``1`` (default) draws in this process. The PNGs are the
            same bytes either way; where ``fork`` is unavailable the figures are drawn serially.

    Never raises for a missing matplotlib or a figure that fails to render; raises
    ``FileNotFoundError`` when ``results_dir`` has no ``leaderboard.json`` and ``ValueError`` when it or an
    ``exp*_*.json`` there is not a kvqbench file (:mod:`kvqbench.report.reader`).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    d = Path(results_dir)
    out = Path(out_dir) if out_dir is not None else d
    if not (d / "leaderboard.json").exists():
        raise FileNotFoundError(f"{d / 'leaderboard.json'} not found; point at a folder written by a kvqbench run")
    try:
        plt = pyplot()
    except Exception as e:  # ImportError, or a broken install
        log(f"kvqbench: figures skipped — matplotlib unavailable ({type(e).__name__}); pip install 'kvqbench[plots]'")
        return []
    board = read_leaderboard(d / "leaderboard.json")
    sources = load_sources(board, read_experiment_files(d))
    out.mkdir(parents=True, exist_ok=True)
    jobs_list = [(f"{name}_{src.name}.png", rank, partial(draw, plt, src, out))
                 for src in sources for name, draw, rank in FIGURES]
    pair = (board.get("models") or {}).get("sources") or {}
    by_name = {src.name: src for src in sources}
    if len(pair) == 2 and all(s in by_name for s in pair.values()):  # two models side by side
        # the board's method order, as every other figure and the web page: one method, one colour
        order = method_order(board, {m for src in sources for exp in src.stats.values() for m in exp})
        jobs_list.append((models.FILE, len(FIGURES), partial(
            models.draw_models, {m: by_name[s].stats for m, s in pair.items()}, out, methods=order)))
    if jobs == 0:  # the CPUs this process may run on, at most 8
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        jobs = min(8, len(cpus))
    n_jobs = min(max(1, jobs), len(jobs_list))
    with plt.rc_context(RC):
        _JOBS[:] = jobs_list
        try:
            results = _run_parallel(n_jobs) if n_jobs > 1 else None
            if results is None:
                results = [_run_job(i) for i in range(len(jobs_list))]
        finally:
            _JOBS.clear()
    for _, msg in results:
        if msg is not None:
            log(msg)
    return [p for p, _ in results if p is not None]
