"""Figures rendered from saved JSON only (``leaderboard.json`` + ``exp*_*.json``). Torch-free.

One set of PNGs per data source, written next to the JSON (real and synthetic never share a figure),
one module per figure:

==========================================  ==========================================================
``pareto_{source}.png``                     :mod:`.pareto`: rel. MSE vs effective bits, Pareto front
``mse_vs_bits_{source}.png``                :mod:`.mse_vs_bits`: K and V rel. MSE vs bit-width (exp1)
``attn_error_vs_context_{source}.png``      :mod:`.attn_vs_context`: attention error vs context (exp2)
``attn_kl_vs_context_{source}.png``         :mod:`.attn_vs_context`: attention KL vs context (exp2)
``norm_diff_density_{source}.png``          :mod:`.norm_diff_density`: ‖k̂‖−‖k‖ densities (exp3)
``cost_{source}.png``                       :mod:`.cost`: latency and bits per method (exp4)
``predictivity_{source}.png``               :mod:`.predictivity`: best tensor metrics vs e2e KL (exp5)
``kl_vs_position_{source}.png``             :mod:`.kl_vs_position`: long-decode KL vs position (exp6)
==========================================  ==========================================================

Shared: :mod:`.style` (colours, markers, matplotlib settings), :mod:`.labels` (axis and metric words),
:mod:`.series` (finding curves and histograms in a record's ``series``), :mod:`.data` (loading, the
headline setting — the lowest ``kXvX`` below 16 that ran —, means over seeds), :mod:`.axes`,
:mod:`.placement` (labels that overlap nothing), :mod:`.save` (one deterministic PNG).

A figure whose data is absent (an experiment that did not run) is simply not drawn. matplotlib is
optional: without it :func:`write_figures` logs one line and returns ``[]``; it never raises for a
rendering problem of one figure either (that figure is skipped with one line of explanation). Output
is deterministic (Agg backend, fixed DPI, no timestamp or version metadata in the PNG).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

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
from kvqbench.report.render.figures.data import Source, load_sources
from kvqbench.report.render.figures.series import X_KEYS, iter_curves, iter_histograms
from kvqbench.report.render.figures.style import DPI, RC, method_order, pyplot

__all__ = ["write_figures", "figure_names", "default_jobs", "FIGURES", "iter_curves", "iter_histograms", "X_KEYS",
           "DPI"]

Log = Callable[[str], None]


@dataclass(frozen=True)
class Figure:
    """One kind of figure: its file name stem, how it is drawn (``draw(plt, source, out_dir)`` → the
    written path, or ``None`` when the source lacks its data), and its place in the parallel pool's
    start order (dearer first, so that the last to finish is a cheap one)."""

    name: str
    draw: Callable[[Any, Source, Path], Path | None]
    start_rank: int


#: every figure, in the order they are drawn and listed; ``start_rank`` from their relative cost on the
#: main job's data
FIGURES: tuple[Figure, ...] = (
    Figure("pareto", pareto.draw, 5),
    Figure("mse_vs_bits", mse_vs_bits.draw, 6),
    Figure("attn_error_vs_context", attn_vs_context.draw_error, 2),
    Figure("attn_kl_vs_context", attn_vs_context.draw_kl, 1),
    Figure("norm_diff_density", norm_diff_density.draw, 0),
    Figure("cost", cost.draw, 4),
    Figure("predictivity", predictivity.draw, 3),
    Figure("kl_vs_position", kl_vs_position.draw, 7),
)


def figure_names(source: str) -> list[str]:
    """Every figure file name this package may write for ``source``."""
    return [f"{f.name}_{source}.png" for f in FIGURES]


def default_jobs() -> int:
    """How many processes draw figures when the caller asks for ``jobs=0`` (automatic): the CPUs this
    process may run on (``os.sched_getaffinity``), at most 8."""
    import os

    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


#: the figure jobs ``(figure, source, out_dir)`` of the running :func:`write_figures`, read by the forked
#: pool workers (they inherit it, so neither the data nor matplotlib objects are pickled)
_JOBS: list[tuple[Figure, Source, Path]] = []


def _run_job(i: int) -> tuple[Path | None, str | None]:
    """Draw figure ``i`` of :data:`_JOBS`; ``(path or None, one-line message or None)``, never raises."""
    import matplotlib.pyplot as plt

    figure, src, out = _JOBS[i]
    try:
        return figure.draw(plt, src, out), None
    except Exception as e:  # one broken figure never blocks the others or the run
        plt.close("all")
        return None, f"kvqbench: figure {figure.name}_{src.name}.png skipped: {type(e).__name__}: {e}"


def _run_parallel(n_jobs: int) -> list[tuple[Path | None, str | None]] | None:
    """Every job of :data:`_JOBS` drawn by ``n_jobs`` forked processes (results in job order), or
    ``None`` when no process pool can be had here (no ``fork`` start method, a pool that broke): the
    caller then draws serially. Forked workers inherit the loaded JSON and the rc settings; each PNG
    is the same file, byte for byte, as a serial draw writes."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    if "fork" not in mp.get_all_start_methods():
        return None
    order = sorted(range(len(_JOBS)), key=lambda i: (_JOBS[i][0].start_rank, i))
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
            available CPU (:func:`default_jobs`); ``1`` (default) draws in this process. The PNGs are the
            same bytes either way; where ``fork`` is unavailable the figures are drawn serially.

    Never raises for a missing matplotlib or a figure that fails to render; raises
    ``FileNotFoundError`` when ``results_dir`` has no ``leaderboard.json`` and ``ValueError`` when it or an
    ``exp*_*.json`` there is not a kvqbench file (:mod:`kvqbench.report.reader`).
    """
    log = log or _stderr
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
    jobs_list = [(figure, src, out) for src in sources for figure in FIGURES]
    n_jobs = min(default_jobs() if jobs == 0 else max(1, jobs), len(jobs_list))
    with plt.rc_context(RC):
        _JOBS[:] = jobs_list
        try:
            results = _run_parallel(n_jobs) if n_jobs > 1 else None
            if results is None:
                results = [_run_job(i) for i in range(len(jobs_list))]
        finally:
            _JOBS.clear()
    written: list[Path] = []
    pair = (board.get("models") or {}).get("sources") or {}
    by_name = {src.name: src for src in sources}
    # the board's method order, as every other figure and the web page: one method, one colour
    order = method_order(board, {m for src in sources for exp in src.summary["stats"].values() for m in exp})
    if len(pair) == 2 and all(s in by_name for s in pair.values()):  # two models side by side
        try:
            with plt.rc_context(RC):
                results.append((models.draw_models({m: by_name[s].summary["stats"] for m, s in pair.items()}, out,
                                                   methods=order), None))
        except Exception as e:
            results.append((None, f"kvqbench: figure kl_models.png skipped: {type(e).__name__}: {e}"))
    for p, msg in results:
        if msg is not None:
            log(msg)
        if p is not None:
            written.append(p)
    return written


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)
