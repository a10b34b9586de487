"""The progress line (``kvqbench: done/total tests, elapsed, ETA``, every ``--kvq-progress`` seconds) of the
controller: the ETA model is :class:`kvqbench.progress.Progress`; here it is fed from pytest's hooks,
printed by a thread while a long test runs (:class:`_PrintThread`), kept clear of pytest's own output
(:data:`_PROGRESS_LOCK`, the phase wrappers) and remembered between runs in pytest's cache."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from typing import Any

import pytest

from kvqbench.eta_tables import HISTORY_VERSION, load_prior
from kvqbench.plugin.resume import reused_ids
from kvqbench.plugin.state import STEP_KEY, is_worker, session_config
from kvqbench.progress import Progress, hms

#: the controller's :class:`~kvqbench.progress.Progress` (none on xdist workers)
PROGRESS_KEY = pytest.StashKey[Progress]()
#: pytest cache key of the per-test / per-kind / per-step durations kept between runs
DURATIONS_CACHE_KEY = "kvqbench/durations"


def _progress_interval(text: str) -> float:
    try:
        v = float(text)
        if v < 0 or v != v:
            raise ValueError
        return v
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kvq-progress expects seconds >= 0 (0 = off); got {text!r}") from None


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kvqbench", "kvqbench — KV-cache quantization benchmark")
    g.addoption("--kvq-progress", action="store", default=10, type=_progress_interval, metavar="SECONDS",
                help="print 'kvqbench: done/total tests, elapsed, ETA' at most every SECONDS (default 10; 0 = off)")


def pytest_configure(config: pytest.Config) -> None:
    if not is_worker(config):
        config.stash[PROGRESS_KEY] = Progress(interval_s=config.getoption("--kvq-progress"), t0=time.time(),
                                              last=time.time(), history=_load_history(config), prior=load_prior())
        if config.getoption("--kvq-progress") > 0:
            _open_terminal(config)


def progress_of(config: pytest.Config | None) -> Progress | None:
    if config is None or is_worker(config):
        return None
    return config.stash.get(PROGRESS_KEY, None)


def _start_progress(config: pytest.Config, nodeids: list[str], workers: int) -> None:
    prog = progress_of(config)
    if prog is None or prog.total or config.option.collectonly:  # --collect-only runs nothing
        return
    reused = reused_ids(config)  # cells reused from the journal run nothing: neither counted nor timed
    with _PROGRESS_LOCK:
        prog.workers = max(1, workers)
        prog.t_run = time.time()
        prog.collected([n for n in nodeids if n not in reused])
    if prog.interval_s > 0 and prog.total:
        _PrintThread(config, prog).start()


@pytest.hookimpl(trylast=True)  # after the collection plugin has checked the results folder
def pytest_collection_finish(session: pytest.Session) -> None:
    if not is_worker(session.config) and session.items:
        _start_progress(session.config, [it.nodeid for it in session.items], 1)


@pytest.hookimpl(optionalhook=True, trylast=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    config = session_config()
    if config is not None:
        n = getattr(config.option, "numprocesses", None)
        _start_progress(config, list(ids), n if isinstance(n, int) and n > 0 else 1)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    prog = progress_of(session_config())
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
        # While reports arrive, the main thread prints (in pytest_runtest_logreport) so lines do not cut into pytest's
        # own dots; this thread speaks when the line is due and no report has come for a moment (a long
        # test, the real-model capture, the closing report): Progress.line_due. Not before the first test has
        # started: until then the main thread may be writing the session's header (xdist's "2 workers [N
        # items]" line), which a line from this thread would cut in two.
        tick = min(0.5, self.prog.interval_s / 4)
        while not self.stop.wait(tick):
            with _PROGRESS_LOCK:
                now = time.time()
                if self.stop.is_set():
                    return
                if (self.prog.running or self.prog.done) and self.prog.line_due(now, at_report=False):
                    _print_progress(self.config, self.prog, now)


def xdist_queues(config: pytest.Config) -> list[list[str]] | None:
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
    config.add_cleanup(functools.partial(_close_terminal, config.stash[TERMINAL_KEY]))


def _close_terminal(terminal: Any) -> None:
    try:
        terminal.close()
    except BrokenPipeError:  # the reader went away (`kvqbench run … | head`): nothing left to show
        pass


def _flush_reporter() -> None:
    """Push what pytest's reporter has buffered to the terminal. Its stdout is block-buffered when it is
    a pipe (CI, a log file): a line left there would reach the terminal after the lines the printer
    writes past the capture, and inside the capture file if flushed while a test phase runs."""
    config = session_config()
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
    prog.set_queues(xdist_queues(config), now)
    tw = getattr(tr, "_tw", None)
    terminal = config.stash.get(TERMINAL_KEY, None)
    if _IN_PHASE.is_set() and terminal is not None and not terminal.closed:
        # a test phase is running here (serial run): write past pytest's capture, on a line of its own,
        # and let the reporter start its next line afresh (it writes the file's path again)
        lead = "\n" if getattr(tw, "width_of_current_line", 0) else ""  # after pytest's dots
        try:
            terminal.write(f"{lead}{prog.line(now)}\n")
            terminal.flush()
        except BrokenPipeError:  # the reader went away (`kvqbench run … | head`): no more progress lines
            _close_terminal(terminal)
            config.stash[TERMINAL_KEY] = None
            return
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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Count the finished test (and any step paid inside its setup) and print the line when it is due."""
    prog = progress_of(session_config())
    if prog is None or report.nodeid in reused_ids(session_config()):
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
                _print_progress(session_config(), prog, now)


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


def finish_progress(config: pytest.Config, report_s: float) -> None:
    """Stop the progress line, keep this run's durations for the next ETA, print the closing line."""
    _stop_progress(config)
    prog = progress_of(config)
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
