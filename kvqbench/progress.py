"""Progress and ETA of a pytest session (pure bookkeeping: no pytest, no torch).

The plugin feeds a :class:`Progress` with the collected node ids, test starts, finished tests (their
setup+call+teardown seconds) and *steps* — work that is not a test of its own but is paid inside one:
the real-model KV capture (timed by the ``kvq_data`` fixture) and the results/figures writing at the end
of the session. It prints one line every ``interval_s`` seconds::

    kvqbench: 120/660 tests, elapsed 1m30s, ETA 6m10s

How the ETA is formed. Each pending test is charged a predicted duration: its own duration in the
previous runs (``history``, kept in pytest's cache by the plugin), else the median of its *kind* in the
history, else the median of its kind in this run, else the median of everything finished so far. A kind
is the test function plus, for benchmark cells, the method and the data source/size in the id
(``tests/bench/x.py::test_a|kivi|real-full``). History predictions are scaled by this run's speed
(measured seconds / predicted seconds of the tests finished so far), so a busier or faster machine is
accounted for. A test that is running is charged what its prediction has left. Pending captures of the
real model and the report step are charged their history (or, without one, a capture's measured time
in this run). The sum is divided by the parallelism observed so far (busy test-seconds per wall second
since collection ended, at most the number of workers), and the report step, which runs alone at the
end, is added undivided.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field

__all__ = ["Progress", "kind_of", "coarse_kind_of", "hms"]

_TAGS = ("real", "synthetic", "full", "smoke")


def hms(sec: float) -> str:
    """``3725`` → ``"1h02m05s"``; ``95`` → ``"1m35s"``; ``7`` → ``"7s"`` (rounded to whole seconds)."""
    sec = int(round(max(sec, 0.0)))
    h, rem = divmod(sec, 3600)
    m, s_ = divmod(rem, 60)
    return f"{h}h{m:02d}m{s_:02d}s" if h else (f"{m}m{s_:02d}s" if m else f"{s_}s")


def _split(nodeid: str) -> tuple[str, str, list[str]]:
    base, _, params = nodeid.partition("[")
    params = params[:-1] if params.endswith("]") else params
    tags = [t for t in _TAGS if f"-{t}" in f"-{params}"]
    return base, params, tags


def coarse_kind_of(nodeid: str) -> str:
    """The test function plus the data source/size tags of a benchmark cell id (no method)."""
    base, _, tags = _split(nodeid)
    return base + ("|" + "-".join(tags) if tags else "")


def kind_of(nodeid: str) -> str:
    """The test function plus, for benchmark cells (ids ending ``-<source>-<size>``), the method id and
    the data source/size: cells of one method, function and size cost about the same."""
    base, params, tags = _split(nodeid)
    if not tags:
        return base
    return f"{base}|{params.split('-', 1)[0]}|{'-'.join(tags)}"


def _median(v: list[float]) -> float:
    return float(statistics.median(v)) if v else 0.0


@dataclass
class Progress:
    """Progress/ETA bookkeeping of one session (see the module doc for the estimate).

    Attributes set by the caller: ``interval_s`` (0 = no lines), ``t0`` (session start), ``t_run``
    (collection end), ``workers`` (pytest-xdist workers, 1 when serial), ``history`` (from a previous
    run: ``{"tests": {nodeid: s}, "kinds": {kind: s}, "steps": {step kind: s}}``).
    """

    interval_s: float = 10.0
    total: int = 0
    done: int = 0
    t0: float = 0.0
    t_run: float = 0.0
    last: float = 0.0
    workers: int = 1
    history: dict = field(default_factory=dict)
    pending: dict[str, str] = field(default_factory=dict)  # nodeid -> kind, not finished yet
    running: dict[str, float] = field(default_factory=dict)  # nodeid -> start time
    durations: dict[str, list[float]] = field(default_factory=dict)  # kind -> this run's seconds
    coarse: dict[str, list[float]] = field(default_factory=dict)  # coarse kind -> this run's seconds
    measured: dict[str, float] = field(default_factory=dict)  # nodeid -> this run's seconds
    partial: dict[str, float] = field(default_factory=dict)  # nodeid -> seconds of finished phases
    steps: dict[str, list[float]] = field(default_factory=dict)  # step kind -> this run's seconds
    expected_steps: dict[str, int] = field(default_factory=dict)  # step kind -> how many are left
    busy: float = 0.0
    hist_pred: float = 0.0  # history predictions of finished tests …
    hist_actual: float = 0.0  # … and what they really took
    report_started: float | None = None  # when the last test finished: the session-end report began
    last_report: float = 0.0  # when the controller last received a test report
    debug: str = ""
    #: append every event as a JSON line to this file (``KVQBENCH_PROGRESS_TRACE``), for replaying a real
    #: session through the estimate (``scripts/eta_error.py --replay``)
    trace_path: str | None = field(default_factory=lambda: os.environ.get("KVQBENCH_PROGRESS_TRACE") or None)

    def _trace(self, *event: object) -> None:
        if self.trace_path:
            try:
                with open(self.trace_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(event) + "\n")
            except OSError:
                self.trace_path = None  # an unwritable trace never breaks a run

    # ---------------------------------------------------------------- events
    def collected(self, nodeids: list[str]) -> None:
        """The selected tests (after deselection). Expect one real-model capture per worker per real
        data size, and one report step at the end."""
        self._trace("collected", self.t0, self.t_run, self.workers, list(nodeids), self.history)
        self.total = len(nodeids)
        self.pending = {n: kind_of(n) for n in nodeids}
        tags = [_split(n)[2] for n in nodeids]
        sizes = sorted({t[-1] for t in tags if "real" in t and len(t) > 1})
        self.expected_steps = {f"capture|real-{s}": max(1, self.workers) for s in sizes}
        cells = sorted({"-".join(t) for t in tags if t})
        self.expected_steps[self.report_kind(cells)] = 1

    @staticmethod
    def report_kind(cell_tags: list[str]) -> str:
        """The end-of-session step: from the last test's end to the session's end (xdist workers
        shutting down, then for benchmark cells the results and figures): ``report|<source-size,…>``."""
        return "report|" + (",".join(sorted(cell_tags)) or "no-cells")

    def started(self, nodeid: str, now: float) -> None:
        self._trace("started", nodeid, now)
        if nodeid in self.pending:
            self.running[nodeid] = now

    def step(self, kind: str, seconds: float, now: float | None = None) -> None:
        """A step of ``kind`` took ``seconds`` (it was paid inside a test, whose duration it leaves)."""
        self._trace("step", kind, seconds, now)
        self.steps.setdefault(kind, []).append(max(seconds, 0.0))
        if self.expected_steps.get(kind, 0) > 0:
            self.expected_steps[kind] -= 1

    def finished(self, nodeid: str, duration_s: float, now: float | None = None) -> None:
        """A test is over (at ``now``); ``duration_s`` is its setup+call+teardown seconds minus any step
        inside. When it is the last one, the report step starts."""
        self._trace("finished", nodeid, duration_s, now)
        d = max(float(duration_s), 0.0)
        if self.done + 1 >= self.total and now is not None:
            self.report_started = now
        kind = self.pending.pop(nodeid, None) or kind_of(nodeid)
        self.running.pop(nodeid, None)
        self.done += 1
        self.busy += d
        hp = self._history_of(nodeid, kind)
        if hp is not None:
            self.hist_pred += hp
            self.hist_actual += d
        self.durations.setdefault(kind, []).append(d)
        self.coarse.setdefault(coarse_kind_of(nodeid), []).append(d)
        self.measured[nodeid] = d
        self._close_capture_steps()

    def _close_capture_steps(self) -> None:
        """Once no real cell of a size is pending or running, no further capture of it will happen."""
        for kind in list(self.expected_steps):
            if kind.startswith("capture|"):
                tag = kind.split("|", 1)[1]
                if not any(k.endswith("|" + tag) for k in self.pending.values()):
                    self.expected_steps[kind] = 0

    # ---------------------------------------------------------------- estimate
    def _history_of(self, nodeid: str, kind: str) -> float | None:
        tests = self.history.get("tests") or {}
        if nodeid in tests:
            return float(tests[nodeid])
        kinds = self.history.get("kinds") or {}
        return float(kinds[kind]) if kind in kinds else None

    def _known(self, nodeid: str, kind: str) -> bool:
        return self._history_of(nodeid, kind) is not None or len(self.durations.get(kind, ())) >= 3

    def speed(self) -> float:
        """This run's seconds per history-predicted second (1 without history), clamped to [0.2, 5]."""
        if self.hist_pred <= 0 or self.hist_actual <= 0:
            return 1.0
        return min(max(self.hist_actual / self.hist_pred, 0.2), 5.0)

    def predict(self, nodeid: str, kind: str | None = None) -> float | None:
        kind = kind or kind_of(nodeid)
        hp = self._history_of(nodeid, kind)
        if hp is not None:
            return hp * self.speed()
        if self.durations.get(kind):
            return _median(self.durations[kind])
        ck = coarse_kind_of(nodeid)
        if self.coarse.get(ck):
            return _median(self.coarse[ck])
        if self.done:
            return _median([d for v in self.durations.values() for d in v])
        return None

    def _step_prediction(self, kind: str) -> float:
        hist = (self.history.get("steps") or {}).get(kind)
        if hist is not None:
            return float(hist) * self.speed()
        return _median(self.steps.get(kind, []))

    def eta(self, now: float) -> float | None:
        """Seconds until the session ends (tests, captures, report), or ``None`` with nothing to go on."""
        if not self.done and not self.history:
            return None
        left = 0.0
        tail = 0.0
        for n, kind in self.pending.items():
            p = self.predict(n, kind)
            if p is None:
                return None
            if n in self.running:
                ran = now - self.running[n]
                # a known duration counts down; an unknown one (no history, kind rarely seen) is expected
                # to run at least as long again as it has run so far
                p = max(p - ran, 0.1 * p) if self._known(n, kind) else max(p - ran, ran)
                tail = max(tail, p)
            left += p
        report = 0.0
        for kind, k in self.expected_steps.items():
            if k <= 0:
                continue
            if kind.startswith("report|"):
                report = self._step_prediction(kind)
            else:
                left += k * self._step_prediction(kind)
        if self.report_started is not None:
            report = max(report - (now - self.report_started), 0.0)
        run = max(now - (self.t_run or self.t0), 1e-9)
        busy = self.busy + sum(sum(v) for k, v in self.steps.items() if not k.startswith("report|")) \
            + sum(max(now - t, 0.0) for t in self.running.values())  # running tests are busy too
        par = min(max(busy / run, 0.1), max(self.workers, 1)) if busy > 0 else max(self.workers, 1)
        self.debug = f"left={left:.1f} par={par:.2f} speed={self.speed():.2f} tail={tail:.1f} report={report:.1f}"
        return max(left / par, tail) + report

    def line(self, now: float) -> str:
        eta = self.eta(now)
        caps = {k: v for k, v in self.expected_steps.items() if k.startswith("capture|") and v > 0}
        note = ""
        if caps and not any(k.startswith("capture|") for k in self.steps):
            note = " (real-model capture pending)"
        if os.environ.get("KVQBENCH_PROGRESS_DEBUG"):
            note += f" [{self.debug}]"
        return (f"kvqbench: {self.done}/{self.total} tests, elapsed {hms(now - self.t0)}, "
                f"ETA {hms(eta) if eta is not None else '?'}{note}")

    # ---------------------------------------------------------------- history
    def updated_history(self, base: dict | None = None, max_tests: int = 50_000) -> dict:
        """The history to keep for the next run: this run's per-test seconds merged over ``base`` (the
        cache as it is now, which another session may have updated meanwhile; default the history this
        run started with), per-kind medians, and per-step medians."""
        old = (self.history if base is None else base) or {}
        tests = {**(old.get("tests") or {}), **{k: round(v, 4) for k, v in self.measured.items()}}
        if len(tests) > max_tests:  # keep the newest entries
            tests = dict(list(tests.items())[-max_tests:])
        kinds = {**(old.get("kinds") or {}), **{k: round(_median(v), 4) for k, v in self.durations.items() if v}}
        steps = {**(old.get("steps") or {}), **{k: round(_median(v), 4) for k, v in self.steps.items() if v}}
        return {"version": 1, "tests": tests, "kinds": kinds, "steps": steps}
