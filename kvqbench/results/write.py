"""Assemble and write one *result set* — the per-experiment JSON, ``leaderboard.json``, ``summary.json``,
``LEADERBOARD.md`` and the figures — from cell records. Torch-free.

One function does it for every caller:

- the pytest plugin at session end (with the session's records and the cells it collected),
- ``kvqbench report DIR`` (records read back from ``DIR/exp*_*.json``,
  :func:`kvqbench.results.read.load_result_set`),
- a merge of several shards (their records concatenated, their expected cells summed).

Nothing computed is lost and a complete result set is never replaced by a partial one:

- every file is first written into a staging folder inside the destination and moved in only when all
  of them exist (a kill while writing leaves the previous files in place);
- a result set is *incomplete* when cells failed, were not run (interrupted, ``-x``) or a ``reason`` is
  given; its ``leaderboard.json``/``summary.json`` carry ``"completeness"`` as their first key and its
  ``LEADERBOARD.md`` says so in its first lines (``incomplete: 78 of 435 cells finished, interrupted``);
- an incomplete set never replaces a complete one: when the destination already holds a complete set,
  the new one goes to ``DEST/incomplete/`` and the old one is left alone (a later complete set removes
  that ``incomplete/`` folder);
- a complete set never deletes the complete set it replaces, and no set deletes a finished shard's set: that one moves to
  ``DEST/previous/<UTC start of its run>-<digest>/`` with one line saying where, and ``previous/`` keeps
  the newest 5 such sets (``keep``; ``--kvq-keep N``, ``KVQBENCH_KEEP=N``), naming each one it removes
  (:mod:`kvqbench.results.previous`);
- when the destination cannot be written at all, everything goes to a fresh temporary folder whose path
  is logged.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from kvqbench.metrics import catalog_dict
from kvqbench.report.board import assemble, summary_of
from kvqbench.report.io import read_json, write_json_atomic, write_text_atomic
from kvqbench.report.render.markdown import render_markdown
from kvqbench.results.previous import DEFAULT_KEEP, PREVIOUS_DIR, keep_count, keep_displaced_set

__all__ = ["write_result_set", "completeness", "holds_complete_set", "check_writable", "run_folder_problem",
           "PUBLISHED_MARKER", "ResultSet", "OUTPUT_PATTERNS", "INCOMPLETE_DIR", "PREVIOUS_DIR", "BENCHMARK_JSON",
           "record_sort_key", "write_figures_and_page"]

#: the files a result set consists of; writing a new set removes these first, so a folder never mixes runs
OUTPUT_PATTERNS = ("exp[0-9]*_*.json", "shard.json", "leaderboard.json", "summary.json", "LEADERBOARD.md", "index.html", "pareto_*.png",
                   "mse_vs_bits_*.png", "attn_error_vs_context_*.png", "attn_kl_vs_context_*.png",
                   "norm_diff_density_*.png", "cost_*.png", "predictivity_*.png")
#: pytest-benchmark's JSON of exp4's timed round trips, beside the results (serial sessions; a merge joins the shards')
BENCHMARK_JSON = "benchmark_exp4.json"
#: what a shard's result set says about itself
SHARD_HINT = "join the shards with kvqbench merge"
#: where an incomplete set goes when the destination already holds a complete one
INCOMPLETE_DIR = "incomplete"

Log = Callable[[str], None]
UpdateBoard = Callable[[dict[str, Any]], None]
WriteExtra = Callable[[dict[str, Any], Path], Iterable[str | os.PathLike] | None]


@dataclass
class ResultSet:
    """What :func:`write_result_set` did: the written ``paths``, the ``board`` (leaderboard document),
    the folder they are in (``out_dir``; may differ from the one asked, see ``note``) and ``completeness``."""

    paths: list[str] = field(default_factory=list)
    board: dict[str, Any] | None = None
    out_dir: Path | None = None
    completeness: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    #: the destination could not be written: the set is in a temporary folder (``out_dir``; ``note`` says so)
    fallback: bool = False


def record_sort_key(r: dict[str, Any]) -> tuple:
    """Deterministic order of records in every file (source, experiment, method, bits, variant, seed, …)."""
    return (r["source"], r["experiment"], r["method"], r["k_bits"], r["v_bits"],
            sorted((r.get("variant") or {}).items()), r["seed"], r["size"], r.get("nodeid", ""))


def completeness(records: list[dict[str, Any]], expected: int | Iterable[str] | None = None,
                 reason: str | None = None, *, shard: str | None = None) -> dict[str, Any]:
    """How complete a result set is.

    Args:
        records: every cell record (any ``status``).
        expected: the cells the run was asked for — a count, or their node ids (then the ids that have no
            record are listed as ``not_run_ids``); ``None`` when unknown (only failures then make it
            incomplete).
        reason: why the run ended early (``"interrupted"``, ``"stopped after 1 failure (-x)"``…), or ``None``.
        shard: ``"I/N"`` for the set of one shard of a sharded run (``expected`` = the whole run's cells):
            never complete; a shard that ran its share without failure or ``reason`` says so instead of
            looking like an alarming incomplete set.

    Returns ``{"complete", "summary", "expected", "finished", "passed", "failed", "skipped", "not_run",
    "reason", ["not_run_ids"]}``; ``complete`` is true when no cell failed, none is missing and no reason
    is given (skipped cells are deliberate and do not make a set incomplete). ``summary`` is one line,
    e.g. ``"incomplete: 78 of 435 cells finished, interrupted"`` or ``"complete: 435 cells"``.
    """
    own_reason = reason
    if shard is not None:  # a shard's tables cover only its part of the matrix: say so
        reason = f"shard {shard} ({SHARD_HINT})" + (f", {reason}" if reason else "")
    counts = {s: sum(1 for r in records if r.get("status") == s) for s in ("passed", "failed", "skipped")}
    finished = len(records)
    ids: list[str] | None = None
    if expected is None:
        n_expected = None
    elif isinstance(expected, int):
        n_expected = int(expected)
    else:
        ids = list(expected)
        n_expected = len(ids)
    not_run = None if n_expected is None else max(n_expected - finished, 0)
    complete = counts["failed"] == 0 and not not_run and not reason
    out: dict[str, Any] = {"complete": complete, "expected": n_expected, "finished": finished, **counts,
                           "not_run": not_run, "reason": reason}
    if ids is not None:
        seen = {r.get("nodeid") for r in records}
        out["not_run_ids"] = [i for i in ids if i not in seen]
    total = n_expected if n_expected is not None else finished
    if complete:
        out["summary"] = f"complete: {total} cells" + (f" ({counts['skipped']} skipped)" if counts["skipped"] else "")
    else:
        why = [f"{counts['failed']} failed"] if counts["failed"] else []
        if not_run:
            why.append(f"{not_run} not run")
        if reason:
            why.append(reason)
        out["summary"] = f"incomplete: {finished} of {total} cells finished, " + ", ".join(why)
        if shard is not None and own_reason is None and not counts["failed"]:  # one step of a sharded run
            out["summary"] = f"shard {shard}: {finished} of {total} cells, this shard's share of the run ({SHARD_HINT})"
            out["shard_done"] = shard  # a finished step: kept like a complete set when another set replaces it
    return out


def _completeness_in(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The completeness record of ``folder/leaderboard.json`` (``{}`` when it holds none); ``None`` when
    there is no readable leaderboard document."""
    try:
        doc = read_json(Path(folder) / "leaderboard.json")
    except (OSError, ValueError):
        return None
    return (doc.get("completeness") or {}) if isinstance(doc, dict) else None


def holds_finished_shard(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds the set of one shard that ran its share without failure
    (:func:`completeness`'s ``shard_done``): not complete, but finished work that no other set may delete."""
    return bool((_completeness_in(folder) or {}).get("shard_done"))


def holds_complete_set(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a complete result set: a readable ``leaderboard.json`` that does not say it
    is incomplete (one without a completeness record counts as complete)."""
    comp = _completeness_in(folder)
    return comp is not None and comp.get("complete", True) is not False


#: the line ``kvqbench publish`` writes into a published leaderboard folder's README.md
PUBLISHED_MARKER = "Generated by `kvqbench publish"


def run_folder_problem(folder: str | os.PathLike) -> str | None:
    """Why a run may not write its results into ``folder`` (one line), or ``None``: an empty name (it would
    mean the current folder), a published leaderboard (a README.md with :data:`PUBLISHED_MARKER`: only
    ``kvqbench publish`` writes there), or :func:`check_writable`'s reasons."""
    if not str(folder).strip():
        return "an empty folder name (it would write into the current folder)"
    readme = Path(folder) / "README.md"
    try:
        published = readme.is_file() and PUBLISHED_MARKER in readme.read_text(encoding="utf-8", errors="replace")
    except OSError:
        published = False
    if published:
        return (f"{folder} holds a published leaderboard ({readme} says so): run into another folder and "
                f"publish from there with kvqbench publish")
    return check_writable(folder)


def check_writable(folder: str | os.PathLike) -> str | None:
    """Why results could not be written into ``folder`` (one line), or ``None`` when they can.

    Checks that ``folder`` is a folder (or can be created: its nearest existing ancestor is a folder) and
    that a file can be created there: the permission bits, then a temporary file removed at once (root
    passes every permission check, yet cannot write to a read-only file system or ``/proc``)."""
    p = Path(folder)
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if p.exists() and not p.is_dir():
        return f"{p} is a file, not a folder"
    if probe != p and not probe.is_dir():
        return f"{p} cannot be created: {probe} is a file, not a folder"
    why = f"{probe} is not writable" if probe == p else f"{p} cannot be created: {probe} is not writable"
    if not os.access(probe, os.W_OK | os.X_OK):
        return why
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:  # e.g. /proc: the permission bits allow it, the file system refuses any new file
        where = f"{probe} accepts no new file" if probe == p else f"{p} cannot be created: {probe} accepts no new file"
        return f"{where} (creating a test file there failed: {e.strerror or e})"
    return None


def _remove_stale_outputs(out_dir: Path, *, keep_figures: bool = False, also: tuple[str, ...] = ()) -> None:
    """Remove the previous result set's files (and those named ``also``); ``keep_figures`` leaves its PNGs
    (a write without figures must not delete the ones already drawn)."""
    if not out_dir.is_dir():
        return
    for pattern in (*OUTPUT_PATTERNS, *also):
        if keep_figures and pattern.endswith(".png"):
            continue
        for p in out_dir.glob(pattern):
            if p.is_file():
                p.unlink()


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def _write_all(records: list[dict[str, Any]], provenance: dict[str, Any], comp: dict[str, Any], folder: Path,
               catalog: dict[str, Any], update_board: UpdateBoard | None, write_extra: WriteExtra | None,
               figures: bool, log: Log) -> tuple[list[Path], dict[str, Any]]:
    written: list[Path] = []
    for exp in sorted({r["experiment"] for r in records}):
        for src in sorted({r["source"] for r in records if r["experiment"] == exp}):
            cells = [r for r in records if r["experiment"] == exp and r["source"] == src]
            doc = {"provenance": provenance, "completeness": comp, "experiment": exp, "source": src,
                   "metrics_catalog": {k: v for k, v in catalog.items() if v.get("experiment") == exp},
                   "cells": cells}
            written.append(write_json_atomic(folder / f"{exp}_{src}.json", doc))
    board = assemble(records, catalog, provenance)
    board["completeness"] = comp
    if update_board is not None:
        update_board(board)
    brief = {k: v for k, v in comp.items() if k != "not_run_ids"}  # the ids stay in leaderboard.json
    written.append(write_json_atomic(folder / "summary.json", {**summary_of(board), "completeness": brief}))
    written.append(write_text_atomic(folder / "LEADERBOARD.md", render_markdown(board)))
    written.append(write_json_atomic(folder / "leaderboard.json", board))
    written += write_figures_and_page(board, folder, figures=figures, log=log)
    if write_extra is not None:
        for p in write_extra(board, folder) or []:
            written.append(Path(p))
    return written, board


def write_figures_and_page(board: dict[str, Any], out: Path, *, figures: bool = True, log: Log | None = None,
                           data_dir: Path | None = None) -> list[Path]:
    """Draw the PNG figures from the result files in ``data_dir`` (default ``out``) into ``out`` when
    ``figures`` (matplotlib imported only then), then write ``out/index.html`` for ``board``, which embeds
    them; the written paths. A figure or page that fails is one line on ``log`` (default stderr): neither
    ever costs the results."""
    log = log or _stderr
    written: list[Path] = []
    if figures:
        try:
            from kvqbench.report.render.figures import write_figures

            written += [Path(p) for p in write_figures(data_dir or out, out, log=log, jobs=0)]
        except Exception as e:
            log(f"kvqbench: figures skipped: {type(e).__name__}: {e}")
    from kvqbench.report.render.html import write_html

    return written + [p for p in [write_html(board, out, log=log)] if p is not None]


def _move_in(staging: Path, dest: Path, written: list[Path], *, keep_figures: bool = False,
             also: tuple[str, ...] = ()) -> list[str]:
    """Replace ``dest``'s result files (and those named ``also``) by the staged ones; the leaderboard moves
    last."""
    _remove_stale_outputs(dest, keep_figures=keep_figures, also=also)
    entries = sorted(staging.iterdir(), key=lambda p: (p.name == "leaderboard.json", p.name))
    for e in entries:
        target = dest / e.name
        if e.is_dir() and target.is_dir():
            shutil.rmtree(target)
        os.replace(e, target)
    staging.rmdir()
    for old in dest.glob(".kvqbench-staging-*"):  # left by a run killed while writing; superseded now
        shutil.rmtree(old, ignore_errors=True)
    out = []
    for p in written:
        try:
            out.append(str(dest / Path(p).relative_to(staging)))
        except ValueError:  # a hook wrote outside the staging folder
            out.append(str(p))
    return out


def write_result_set(records: Iterable[dict[str, Any]], provenance: dict[str, Any], out_dir: str | os.PathLike, *,
                     expected: int | Iterable[str] | None = None, reason: str | None = None,
                     comp: dict[str, Any] | None = None, catalog: dict[str, Any] | None = None,
                     update_board: UpdateBoard | None = None, write_extra: WriteExtra | None = None,
                     figures: bool = True, in_place: bool = False, log: Log | None = None,
                     files: Iterable[str | os.PathLike] | None = None, shard: str | None = None,
                     keep: int | None = None) -> ResultSet:
    """Write the result set of ``records`` into ``out_dir`` (see the module docstring for the rules).

    Args:
        records: cell records (the plugin's, or read back by :func:`kvqbench.results.read.load_result_set`); records of
            experiment ``"adhoc"`` are ignored. Any order (they are sorted).
        provenance: the provenance header of every file.
        out_dir: the destination folder (created when missing).
        expected: the cells asked for (a count or node ids; see :func:`completeness`).
        reason: why the run ended early, or ``None``.
        shard: ``"I/N"`` when the set is one shard's (see :func:`completeness`).
        comp: a ready completeness dict (e.g. read back from the files) instead of ``expected``/``reason``.
        catalog: the metrics catalog (default :func:`kvqbench.metrics.catalog_dict`).
        update_board: called with the leaderboard document before any derived file is written (the
            plugin forwards it to ``pytest_kvqbench_update_leaderboard``).
        write_extra: called as ``write_extra(board, folder)`` after the standard files exist in
            ``folder``; returns the paths it wrote (the plugin forwards it to ``pytest_kvqbench_write_extra``).
        figures: render the PNG figures (skipped with one logged line when matplotlib is missing).
        in_place: write into ``out_dir`` even when it holds a complete set and this one is incomplete
            (``kvqbench report`` rebuilding a folder from its own files).
        log: one-line messages (default stderr).
        files: a session's own files written elsewhere that belong to its set (pytest-benchmark's JSON,
            :data:`BENCHMARK_JSON`, written to a temporary folder): moved into the set and wherever it
            goes — ``incomplete/``, a fallback folder — and a displaced set kept in ``previous/`` keeps its own. Given (even
            empty), the destination's files of those names from an earlier set are replaced or removed with
            it; ``None`` (a re-render, a merge) leaves them.
        keep: how many complete sets displaced by complete ones ``out_dir/previous/`` keeps (default
            ``KVQBENCH_KEEP``, else 5; see :mod:`kvqbench.results.previous`).

    Returns a :class:`ResultSet`; ``paths`` is empty when there are no records; ``note`` holds every line
    logged about where sets went (one per line). Exceptions raised by the
    hooks propagate (the files written so far stay in the staging folder, whose path is logged); an ``OSError`` writing the
    destination does not: the set is written to a temporary folder instead and ``note`` says where.
    """
    log = log or _stderr
    recs = sorted((r for r in records if r.get("experiment") != "adhoc"), key=record_sort_key)
    if not recs:
        return ResultSet()
    comp = dict(comp) if comp is not None else completeness(recs, expected, reason, shard=shard)
    catalog = catalog if catalog is not None else catalog_dict()
    dest = Path(out_dir)
    note = None
    try:
        n_keep = keep_count(keep)
    except ValueError as e:  # a bad KVQBENCH_KEEP never costs the results
        n_keep = DEFAULT_KEEP
        log(f"kvqbench: {e}; keeping the newest {n_keep}")
    if not comp["complete"] and not in_place and holds_complete_set(dest):
        note = (f"kvqbench: {comp['summary']} — the complete results in {dest} are kept; "
                f"this run's results are in {dest / INCOMPLETE_DIR}")
        dest = dest / INCOMPLETE_DIR
    own = [Path(f) for f in files] if files is not None else None
    also = (BENCHMARK_JSON,) if own is not None else ()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".kvqbench-staging-", dir=dest))
    except OSError as e:
        return _fallback(recs, provenance, comp, catalog, update_board, write_extra, figures, log, dest, e, own)
    written: list[Path] = []
    try:
        written, board = _write_all(recs, provenance, comp, staging, catalog, update_board, write_extra, figures, log)
        written += _take_files(own, staging)
        kept = [] if in_place else _keep_displaced_set(dest, comp, n_keep, log)
        paths = _move_in(staging, dest, written, keep_figures=not figures and not kept, also=also)
    except OSError as e:
        if own:  # the session's own files out of the staging folder before it goes (or where they still are)
            staged = [staging / f.name for f in own if (staging / f.name).is_file()]
            rescued = _take_files(staged, Path(tempfile.mkdtemp(prefix="kvqbench-own-"))) if staged else []
            own = rescued + [f for f in own if f.is_file()]
        shutil.rmtree(staging, ignore_errors=True)
        return _fallback(recs, provenance, comp, catalog, update_board, write_extra, figures, log, dest, e, own)
    except BaseException:  # a hook failed or the write was interrupted: keep what was written, say where
        if staging.exists() and any(staging.iterdir()):
            log(f"kvqbench: results written so far are kept in {staging}")
        else:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    stale = dest / INCOMPLETE_DIR
    if comp["complete"] and not in_place and (stale / "leaderboard.json").exists() and not holds_complete_set(stale):
        shutil.rmtree(stale, ignore_errors=True)  # an earlier partial run, superseded by this complete one
    if note:
        log(note)
    note = "\n".join(n for n in (note, *kept) if n) or None
    return ResultSet(paths, board, dest, comp, note)


def _keep_displaced_set(dest: Path, comp: dict[str, Any], keep: int, log: Log) -> list[str]:
    """Before a complete set replaces the complete set in ``dest`` (a rerun, a narrower or broader
    selection, a merge), or any set replaces a finished shard's set (another shard run into the same
    folder): move the old one's files to ``dest/previous/<id>/`` and apply the retention
    (:func:`kvqbench.results.previous.keep_displaced_set`); the lines logged. Nothing for an incomplete new
    set over a complete one (it goes to ``incomplete/``) or a ``dest`` without either."""
    if not (comp.get("complete") and holds_complete_set(dest)) and not holds_finished_shard(dest):
        return []
    return keep_displaced_set(dest, (*OUTPUT_PATTERNS, BENCHMARK_JSON), keep, log)


def _take_files(files: list[Path] | None, folder: Path) -> list[Path]:
    """Move the existing ``files`` into ``folder``; their new paths."""
    out = []
    for f in files or ():
        if f.is_file():
            shutil.move(str(f), folder / f.name)
            out.append(folder / f.name)
    return out


def _fallback(recs, provenance, comp, catalog, update_board, write_extra, figures, log, dest: Path,
              err: OSError, own: list[Path] | None = None) -> ResultSet:
    fb = Path(tempfile.mkdtemp(prefix="kvqbench-results-"))
    written, board = _write_all(recs, provenance, comp, fb, catalog, update_board, write_extra, figures, log)
    written += _take_files(own, fb)
    note = (f"kvqbench: could not write results to {dest} ({type(err).__name__}: {err.strerror or err}); "
            f"saved them to {fb} instead")
    log(note)
    return ResultSet([str(p) for p in written], board, fb, comp, note, fallback=True)
