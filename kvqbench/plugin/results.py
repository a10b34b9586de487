"""Writing at the end of a session (controller only): the records are assembled by
:func:`kvqbench.results.write.write_result_set` — the one assembly ``kvqbench merge`` calls too — with
the provenance header, the results folder (:func:`~kvqbench.plugin.state.out_dir`), pytest-benchmark's JSON and a shard's
``shard.json``; files are computed at ``pytest_sessionfinish`` and the summary shown at
``pytest_terminal_summary``."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvqbench.plugin.progress import finish_progress, progress_of
from kvqbench.plugin.resume import reused_count
from kvqbench.plugin.state import SETTINGS_KEY, STATE_KEY, Settings, is_worker, out_dir
from kvqbench.results.write import BENCHMARK_JSON

#: where pytest-benchmark writes this session's JSON before it joins the result set (:func:`_point_benchmark_json`)
BENCH_JSON_KEY = pytest.StashKey[Path]()

def provenance(config: pytest.Config, s: Settings, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Provenance header of every results file (no local paths, no user names)."""
    from kvqbench import __version__

    try:
        dev = s.device
        if dev.startswith("cuda") or "torch" in sys.modules:
            import torch

            torch_version = str(torch.__version__)
            device_name = torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") else (
                f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
        else:  # the xdist controller of a CPU run has no need of torch: its version from the metadata
            from importlib.metadata import version

            torch_version = version("torch")  # the string torch.__version__ holds, local label included
            device_name = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    except Exception:  # pragma: no cover - torch is a dependency
        torch_version, device_name = None, s.device
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=str(config.rootpath),
                                capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:
        commit = None
    shapes = sorted({(r["source"], r["size"], tuple(r.get("data", {}).get("shape_k", ())))
                     for r in records if r.get("data")})
    return {
        "kvqbench_version": __version__,
        "git_commit": commit,
        "torch_version": torch_version,
        "python_version": platform.python_version(),
        "device": s.device,
        "device_name": device_name,
        "seeds": s.seeds,
        "bits": s.bits,
        "model": s.model if s.real else None,
        "capture_dtype": s.dtype if s.real else None,
        "threads": s.threads,
        "shapes": [{"source": a, "size": b, "k": list(c)} for a, b, c in shapes],
        "command": shlex.join(["pytest", *(str(a) for a in config.invocation_params.args)]),
        "start_time": s.start_time,
        **({"shard": f"{s.shard[0]}/{s.shard[1]}"} if s.shard else {}),
        **({"reused_cells": reused_count(config)} if reused_count(config) else {}),  # from an interrupted run
    }


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("kvqbench-benchmark-json"):
        config.pluginmanager.register(_BenchmarkJson(), "kvqbench-benchmark-json")


class _BenchmarkJson:
    """Registered in ``pytest_configure``: its session-finish wrapper runs before pytest-benchmark's own
    (which saves the JSON) and points it at a temporary file that joins the result set."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int):
        _point_benchmark_json(session)
        return (yield)


def _point_benchmark_json(session: pytest.Session) -> None:
    """pytest-benchmark's JSON, when the user gave no ``--benchmark-json`` and it timed something, is
    written to a temporary folder (``BENCH_JSON_KEY`` in the stash) and joins the result set when it is
    written (:func:`write_results`: ``files`` of :func:`~kvqbench.results.write.write_result_set`), so it
    goes wherever the set goes — the results folder, ``incomplete/``, a fallback folder — and a set kept
    in ``previous/`` keeps its own."""
    config = session.config
    bs = getattr(config, "_benchmarksession", None)
    if bs is None or is_worker(config) or STATE_KEY not in config.stash or SETTINGS_KEY not in config.stash:
        return
    if not getattr(bs, "json", None) and not getattr(bs, "disabled", True) and getattr(bs, "benchmarks", None):
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="kvqbench-benchmark-")) / BENCHMARK_JSON
        bs.json = str(path)
        config.stash[BENCH_JSON_KEY] = path


def _end_reason(session: pytest.Session | None, exitstatus: int) -> str | None:
    """Why the session ended before running every cell (``None`` when it did not)."""
    why = getattr(session, "shouldfail", None) or getattr(session, "shouldstop", None)
    why = why if isinstance(why, str) and why else None
    if why and "failure" in why:  # -x / --maxfail (serial: TESTS_FAILED; xdist: INTERRUPTED)
        return f"{why} (-x/--maxfail)"
    if int(exitstatus) == int(pytest.ExitCode.INTERRUPTED):
        return f"interrupted ({why})" if why else "interrupted"
    return why


def write_results(config: pytest.Config, session: pytest.Session | None = None, exitstatus: int = 0):
    """Assemble the session's records and write the result set (controller only; see
    :func:`kvqbench.results.write.write_result_set`). Returns its :class:`~kvqbench.results.write.ResultSet`."""
    from kvqbench.results.write import write_result_set

    s = config.stash[SETTINGS_KEY]
    state = config.stash[STATE_KEY]
    records = [r for r in state.records if r.get("experiment") != "adhoc"]
    hook = config.pluginmanager.hook
    tr = config.pluginmanager.get_plugin("terminalreporter")

    def log(msg: str) -> None:
        if tr is not None:
            if getattr(getattr(tr, "_tw", None), "width_of_current_line", 0):
                tr.write("\n")  # after the progress dots
            tr.write_line(msg, yellow=True)
        else:
            print(msg, file=sys.stderr)

    def extra(board: dict[str, Any], out_dir: Path) -> list[str]:
        paths: list[str] = []
        for ps in hook.pytest_kvqbench_write_extra(config=config, board=board, out_dir=out_dir) or []:
            paths.extend(str(p) for p in (ps or []))
        return paths

    expected, reason = state.expected, _end_reason(session, exitstatus)
    if state.shard is not None:  # a shard's tables cover only its part of the matrix
        expected = state.shard["cells"]
    folder = out_dir(config, s, records, state.expected)
    prov = provenance(config, s, records)
    figures = _figures(s, records)
    if not figures and records and s.figures == "auto":
        log(f"kvqbench: figures skipped for a smoke run (`kvqbench report {folder}` draws them; "
            "or pass --kvq-figures on)")
    bench = config.stash.get(BENCH_JSON_KEY, None)  # this session's pytest-benchmark JSON (temporary folder)
    res = write_result_set(
        records, prov if records else {}, folder, expected=expected, reason=reason,
        update_board=lambda board: hook.pytest_kvqbench_update_leaderboard(config=config, board=board),
        write_extra=extra, figures=figures, log=log, files=[bench] if bench is not None else [],
        shard=None if state.shard is None else state.shard["shard"], keep=config.getoption("--kvq-keep"))
    if bench is not None and bench.parent.is_dir() and not any(bench.parent.iterdir()):
        bench.parent.rmdir()
    if not figures and res.out_dir is not None and Path(res.out_dir) == folder:
        _remove_stale_figures(folder)
    if state.shard is not None:  # the shard's own description, also for a shard that got no cell
        from kvqbench.report.io import write_json_atomic
        from kvqbench.shard import SHARD_FILE

        where = res.out_dir or folder
        res.paths.append(str(write_json_atomic(Path(where) / SHARD_FILE, {**state.shard, "provenance": prov})))
        res.out_dir = res.out_dir or where
    state.written = res.paths
    state.board = res.board
    state.out_dir = str(res.out_dir) if res.out_dir else None
    return res


def _remove_stale_figures(folder: Path) -> None:
    """A run that draws no figures replaced the folder's result set: the figures of the previous set no
    longer describe it, so they go (``kvqbench report`` keeps figures when it only re-renders)."""
    from kvqbench.results.write import OUTPUT_PATTERNS

    for pattern in OUTPUT_PATTERNS:
        if pattern.endswith(".png"):
            for p in folder.glob(pattern):
                if p.is_file():
                    p.unlink()


def _figures(s: Settings, records: list[dict[str, Any]]) -> bool:
    """Whether this session draws the figures (``--kvq-figures``; auto: not when only smoke cells ran)."""
    if s.figures != "auto":
        return s.figures == "on"
    return not records or any(r.get("size") != "smoke" for r in records)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if is_worker(config) or STATE_KEY not in config.stash or config.option.collectonly:
        return  # --collect-only lists the cells (and a shard's share): it runs none and writes nothing
    t_report = time.time()
    prog = progress_of(config)
    if prog is not None and prog.report_started is not None:
        t_report = min(t_report, prog.report_started)  # the report step counts from the last test's end
    try:
        res = write_results(config, session, exitstatus)
        if res.fallback and int(session.exitstatus) == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # saved, but not where asked: CI must notice
    except Exception as e:  # never lose the session to a report bug; say what happened
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"kvqbench: writing results failed: {type(e).__name__}: {e}", red=True)
        raise
    finally:
        finish_progress(config, time.time() - t_report)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if is_worker(config) or STATE_KEY not in config.stash:
        return
    state = config.stash[STATE_KEY]
    if not state.board:
        return
    from kvqbench.report.render.terminal import render_terminal

    terminalreporter.section("kvqbench summary")
    terminalreporter.write_line(render_terminal(state.board))
    terminalreporter.write_line(f"kvqbench: wrote {len(state.written)} files to {state.out_dir}")
