"""Progress and ETA of a pytest session (pure bookkeeping: no pytest, no torch).

The plugin feeds a :class:`Progress` with the collected node ids, test starts, finished tests (their
setup+call+teardown seconds) and *steps* — work that is not a test of its own but is paid inside one:
the real-model KV capture (timed by the ``kvq_data`` fixture) and the results/figures writing at the end
of the session. It prints one line every ``interval_s`` seconds::

    kvqbench: 120/660 tests, elapsed 1m30s, ETA 6m10s

How the ETA is formed (:meth:`Progress.eta`, a pure function of the events and the clock):

1. **A base duration per test** from the tables (:mod:`kvqbench.eta_tables`: this machine's ``history``,
   else the committed ``prior``): the test's own seconds, else the median of its *kind*, else of the kinds
   of its test function and data source/size (a method the tables lack), else of its file
   (:meth:`Progress.base`).
2. **This machine's speed**, estimated online from the tests finished so far (:meth:`Progress._model`):
   for the whole run and for each folder, file and kind, a recent speed (measured/base, an exponential
   forgetting over :data:`SPEED_MEMORY_S` base seconds of that group's own tests, one test moving it by
   at most ×2). A pending test is charged base × the run's recent speed refined by its folder's, file's
   and kind's (each with weight n / (n + :data:`SHRINK_N`) over the coarser one, n its finished tests):
   so a busier, faster or changing machine is tracked, the remaining cells of a kind run at that kind's
   own recent speed (a phase of other kinds does not drag it), a kind whose table entry is off by a
   large factor is corrected after a few of its tests, and tests of one file or folder that share a
   harness (a spawned pytest, a model load) are charged alike. A test with no base at all, this run's
   median of its kind (or of its kind without the method, or of everything).
3. **The schedule**: each of the ``workers`` (pytest-xdist workers; 1 when serial) first finishes what
   xdist has already sent it (its running test for what its charge has left, then its queue; see
   :meth:`Progress.set_queues`), then the tests not sent yet are dealt, in collection order, to whichever
   worker is free first — so the tail where one worker runs the last long tests is counted; each test
   also costs the per-test overhead seen so far (idle worker-seconds / finished tests: xdist's
   bookkeeping, fixtures).
   A pending real-model capture is charged to the first cell that needs it on each worker, and a pending
   model load (the end-to-end cells' model and calibration capture, once per worker) to the first
   end-to-end cell (:data:`MODEL_TESTS`) on each worker: the run's first of each at the tables' seconds
   for it, the later ones (which read the disk cache the first wrote) at those of a later one
   (:data:`PER_WORKER_STEPS`).
4. **The report step** (results and figures, after the last test, alone) is added at the end: the
   table's seconds × the run's recent speed × this run's benchmark cells / the cells it was measured
   with (the tables keep them in ``step_cells``); it counts down once it has begun (once overrun, a
   quarter of the overrun again).

With a constant-speed machine ``c`` times slower than the table, the ETA is exact once the first tests
have finished (tests/unit/test_progress.py checks this and the schedule's closed forms).
"""

from __future__ import annotations

import heapq
import json
import math
import os
from dataclasses import dataclass, field

from kvqbench.eta_tables import (
    AGAIN,
    coarse_kind_of,
    file_of,
    groups_of,
    kind_of,
    median,
    needs_model,
    new_history,
    run_scale,
    split_id,
)

__all__ = ["Progress", "hms", "schedule_end", "SPEED_MEMORY_S", "SHRINK_N", "QUIET_S", "LATE_FACTOR"]

#: a group's recent speed forgets exponentially over this many base seconds of its finished tests (chosen
#: by replays, docs/ETA.md)
SPEED_MEMORY_S = 20.0
#: one finished test moves a group's recent speed by at most this much (log): an outlier is not a new speed
SPEED_STEP_CLIP = math.log(2.0)
#: a group (kind, file, folder) with ``n`` finished tests has weight ``n / (n + SHRINK_N)`` over its parent
SHRINK_N = 2.0
#: between test reports the progress line waits for this many seconds without one (half an interval if
#: shorter): pytest writes its progress dots as reports arrive, so a line printed then could cut into them.
#: Either a report comes within that window (and the line is printed with it) or the window passes
QUIET_S = 1.0
#: so lines are at most this many intervals apart (plus the printer's tick)
LATE_FACTOR = 1.5


def hms(sec: float) -> str:
    """``3725`` → ``"1h02m05s"``; ``95`` → ``"1m35s"``; ``7`` → ``"7s"`` (rounded to whole seconds)."""
    sec = int(round(max(sec, 0.0)))
    h, rem = divmod(sec, 3600)
    m, s_ = divmod(rem, 60)
    return f"{h}h{m:02d}m{s_:02d}s" if h else (f"{m}m{s_:02d}s" if m else f"{s_}s")


def schedule_end(busy: list[float], costs: list[float], workers: int) -> float:
    """When ``workers`` workers finish: each starts free after its entry of ``busy`` (seconds still
    taken by a running test; missing entries are 0), then takes the next of ``costs`` in order whenever
    it becomes free (list scheduling, as pytest-xdist's load scheduling deals tests). ``0`` for nothing.

    Raises:
        ValueError: ``workers`` < 1.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1; got {workers}")
    free = sorted(max(b, 0.0) for b in busy)
    free = (free + [0.0] * workers)[:max(workers, len(free))]
    if workers == 1 and len(free) == 1:
        return free[0] + sum(costs)
    heapq.heapify(free)
    for c in costs:
        heapq.heapreplace(free, free[0] + c)
    return max(free) if free else 0.0


@dataclass
class Progress:
    """Progress/ETA bookkeeping of one session (see the module doc for the estimate).

    Attributes set by the caller: ``interval_s`` (0 = no lines), ``t0`` (session start), ``t_run``
    (collection end), ``workers`` (pytest-xdist workers, 1 when serial), ``history`` (from a previous
    run: ``{"tests": {nodeid: s}, "kinds": {kind: s}, "steps": {step kind: s}}``) and ``prior`` (the same
    form, the committed table; see :func:`load_prior`).
    """

    interval_s: float = 10.0
    total: int = 0
    done: int = 0
    cells: int = 0  # benchmark cells among the collected tests (ids with a source/size tag)
    t0: float = 0.0
    t_run: float = 0.0
    last: float = 0.0
    workers: int = 1
    history: dict = field(default_factory=dict)
    prior: dict = field(default_factory=dict)
    pending: dict[str, str] = field(default_factory=dict)  # nodeid -> kind, not finished yet
    running: dict[str, float] = field(default_factory=dict)  # nodeid -> start time
    durations: dict[str, list[float]] = field(default_factory=dict)  # kind -> this run's seconds
    coarse: dict[str, list[float]] = field(default_factory=dict)  # coarse kind -> this run's seconds
    measured: dict[str, float] = field(default_factory=dict)  # nodeid -> this run's seconds
    partial: dict[str, float] = field(default_factory=dict)  # nodeid -> seconds of finished phases
    steps: dict[str, list[float]] = field(default_factory=dict)  # step kind -> this run's seconds
    expected_steps: dict[str, int] = field(default_factory=dict)  # step kind -> how many are left
    observed: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, base s, measured s)
    #: per xdist worker, the tests sent to it and not finished yet, in order (see :meth:`set_queues`)
    queues: list[list[str]] | None = None
    busy: float = 0.0
    report_started: float | None = None  # when the last test finished: the session-end report began
    last_report: float = 0.0  # when the controller last received a test report
    debug: str = ""
    #: append every event as a JSON line to this file (``KVQBENCH_PROGRESS_TRACE``), for replaying a real
    #: session through the estimate (``scripts/eta_error.py --replay``)
    trace_path: str | None = field(default_factory=lambda: os.environ.get("KVQBENCH_PROGRESS_TRACE") or None)
    _file_base: dict[str, float] | None = None
    _coarse_base: dict[str, float] | None = None
    _model_cache: tuple | None = None

    def _trace(self, *event: object) -> None:
        """One JSON line ``[session key, event, …]``; the key tells this session from pytest sessions run
        inside its tests (they inherit the variable and append to the same file)."""
        if self.trace_path:
            try:
                with open(self.trace_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps([f"{os.getpid()}-{id(self)}", *event]) + "\n")
            except OSError:
                self.trace_path = None  # an unwritable trace never breaks a run

    # ---------------------------------------------------------------- events
    def collected(self, nodeids: list[str]) -> None:
        """The selected tests (after deselection), in collection order. Expect one real-model capture per
        worker per real data size that has a cell other than the model's (:data:`MODEL_TESTS`), one model
        load per worker per size of those, and one report step at the end."""
        self._trace("collected", self.t0, self.t_run, self.workers, list(nodeids), self.history)
        self.total = len(nodeids)
        self.pending = {n: kind_of(n) for n in nodeids}
        tags = [split_id(n)[2] for n in nodeids]
        # the cells that load the model take no capture: a size whose real cells all do expects none
        sizes = sorted({t[-1] for n, t in zip(nodeids, tags) if "real" in t and len(t) > 1 and not needs_model(n)})
        self.expected_steps = {f"capture|real-{s}": max(1, self.workers) for s in sizes}
        for tag in sorted({"-".join(split_id(n)[2]) for n in nodeids if needs_model(n) and split_id(n)[2]}):
            self.expected_steps[f"model|{tag}"] = max(1, self.workers)
        cells = sorted({"-".join(t) for t in tags if t})
        self.cells = sum(1 for t in tags if t)
        self.expected_steps[self.report_kind(cells, self.cells < len(nodeids))] = 1

    @staticmethod
    def report_kind(cell_tags: list[str], other_tests: bool = False) -> str:
        """The end-of-session step: from the last test's end to the session's end (xdist workers
        shutting down, then for benchmark cells the results and figures): ``report|<source-size,…>``,
        with ``|+tests`` when tests other than cells ran too (the test suite ends differently from
        ``kvqbench run --smoke`` with the same cells)."""
        kind = "report|" + (",".join(sorted(cell_tags)) or "no-cells")
        return kind + "|+tests" if other_tests and cell_tags else kind

    def started(self, nodeid: str, now: float) -> None:
        self._trace("started", nodeid, now)
        if nodeid in self.pending:
            self.running[nodeid] = now

    def step(self, kind: str, seconds: float, now: float | None = None, nodeid: str | None = None) -> None:
        """A step of ``kind`` took ``seconds`` (it was paid inside test ``nodeid``, whose duration it
        leaves: a running test's clock restarts after it)."""
        self._trace("step", kind, seconds, now, nodeid)
        if nodeid in self.running:
            self.running[nodeid] += max(seconds, 0.0)
        self.steps.setdefault(kind, []).append(max(seconds, 0.0))
        if self.expected_steps.get(kind, 0) > 0:
            self.expected_steps[kind] -= 1

    def set_queues(self, queues: list[list[str]] | None, now: float | None = None) -> None:
        """What pytest-xdist has already sent to each worker (its running test first, then its queue):
        those tests run on that worker whatever the others do — at the end of a session one worker may
        still hold several long tests while the other is idle. ``None``: unknown (serial run, or a
        scheduler that does not say); the pending tests are then dealt as workers free up."""
        self._trace("queues", queues, now)
        self.queues = [list(q) for q in queues] if queues is not None else None

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
        b = self.base(nodeid, kind)
        if b is not None and b > 0:
            self.observed.append((kind, b, d))
        self.durations.setdefault(kind, []).append(d)
        self.coarse.setdefault(coarse_kind_of(nodeid), []).append(d)
        self.measured[nodeid] = d
        self._close_capture_steps()

    def _close_capture_steps(self) -> None:
        """Once no real cell of a size is pending or running, no further capture of it will happen (nor a
        model load, once no end-to-end cell of that size is)."""
        for kind in list(self.expected_steps):
            if kind.startswith(("capture|", "model|")):
                tag = kind.split("|", 1)[1]
                model = kind.startswith("model|")
                if not any(k.endswith("|" + tag) and (not model or needs_model(n))
                           for n, k in self.pending.items()):
                    self.expected_steps[kind] = 0

    # ---------------------------------------------------------------- estimate
    def _tables(self) -> tuple[dict, ...]:
        return tuple(t for t in (self.history, self.prior) if t)

    def base(self, nodeid: str, kind: str | None = None) -> float | None:
        """The test's base seconds (history, else prior: the test, else its kind, else the median of the
        kinds of its function and data source/size — a method the tables lack —, else its file's median),
        or ``None`` when neither table knows anything like it."""
        tables = self._tables()
        for t in tables:
            tests = t.get("tests") or {}
            if nodeid in tests:
                return float(tests[nodeid])
        kind = kind or kind_of(nodeid)
        for t in tables:
            kinds = t.get("kinds") or {}
            if kind in kinds:
                return float(kinds[kind])
        if self._coarse_base is None:  # a method the tables lack (a third-party one): its function and data
            by_coarse: dict[str, list[float]] = {}
            for t in reversed(tables):
                for k, v in (t.get("kinds") or {}).items():
                    parts = k.split("|")
                    if len(parts) == 3:  # function|method|source-size
                        by_coarse.setdefault(f"{parts[0]}|{parts[2]}", []).append(float(v))
            self._coarse_base = {c: median(v) for c, v in by_coarse.items()}
        coarse = coarse_kind_of(nodeid)
        if coarse in self._coarse_base:
            return self._coarse_base[coarse]
        if self._file_base is None:
            merged: dict[str, float] = {}
            for t in reversed(tables):  # the history overrides the prior test by test
                merged.update({n: float(v) for n, v in (t.get("tests") or {}).items()})
            by_file: dict[str, list[float]] = {}
            for n, v in merged.items():
                by_file.setdefault(file_of(n), []).append(v)
            self._file_base = {f: median(v) for f, v in by_file.items()}
        return self._file_base.get(file_of(nodeid))

    def _model(self) -> dict[tuple[str, str], list[float]]:
        """Per group of finished tests — the whole run ``("run", "")``, and each folder, file and kind —
        its recent speed (log seconds per base second) and how many tests it has, from the finished tests
        in the order they finished (cached until the next one finishes).

        A group's recent speed is an exponential forgetting over its own tests' base seconds: a new group
        starts at the log speed its coarser group gives it (the run's first test sets the run's outright);
        each of its tests (``x = log(d / b)``) moves it towards ``x`` by
        ``max(1 − exp(−b / SPEED_MEMORY_S), 1 / n)`` of the gap (``n``: its tests so far, so its first
        tests are averaged; the gap clipped to ±:data:`SPEED_STEP_CLIP`). So a change of the machine's
        speed is followed within about :data:`SPEED_MEMORY_S` base seconds, one outlier (a first cell that
        pays a model load) moves a group by at most ×2 and, once it has a few tests, by a few per cent,
        and a group's speed comes from its own tests, not from a phase of other kinds that ran since.
        """
        n = len(self.observed)
        if self._model_cache is not None and self._model_cache[0] == n:
            return self._model_cache[1]
        stats: dict[tuple[str, str], list[float]] = {}  # group -> [log speed, count]
        for kind, b, d in self.observed:
            x = math.log(max(d, 1e-6) / b)
            step = 1.0 - math.exp(-b / SPEED_MEMORY_S)
            parent = None
            for key in (("run", ""), *reversed(groups_of(kind))):
                acc = stats.setdefault(key, [x if parent is None else parent, 0])  # the run's first test sets it
                acc[1] += 1
                acc[0] += max(step, 1.0 / acc[1]) * min(max(x - acc[0], -SPEED_STEP_CLIP), SPEED_STEP_CLIP)
                parent = acc[0] if parent is None else parent + (acc[0] - parent) * acc[1] / (acc[1] + SHRINK_N)
        self._model_cache = (n, stats)
        return stats

    @staticmethod
    def _root(stats: dict[tuple[str, str], list[float]]) -> float:
        """The run's recent log speed (all finished tests): what a test of a group not seen yet, and the
        report, are charged; 0 (the table's own speed) with nothing finished."""
        acc = stats.get(("run", ""))
        return acc[0] if acc else 0.0

    @classmethod
    def _log_speed(cls, stats: dict[tuple[str, str], list[float]], kind: str) -> float:
        """The log speed a test of ``kind`` is charged: the run's recent speed, refined by its folder's,
        then its file's, then its kind's, each with weight ``n / (n + SHRINK_N)`` over the coarser one
        (``n``: that group's finished tests). Tests of one file or folder share a harness (a subprocess
        pytest, a model load) and so run alike; 0 (the table's own speed) with nothing finished."""
        f = cls._root(stats)
        for key in reversed(groups_of(kind)):
            acc = stats.get(key)
            if acc:
                f += (acc[0] - f) * acc[1] / (acc[1] + SHRINK_N)
        return f

    def speed(self) -> float:
        """This run's recent seconds per base second over all its tests (the ``run`` group of
        :meth:`_model`; what the report step is scaled by); 1 before any test with a base has finished.
        Clamped to [0.05, 20]."""
        return min(max(math.exp(self._root(self._model())), 0.05), 20.0) if self.observed else 1.0

    def predict(self, nodeid: str, kind: str | None = None) -> float | None:
        """The seconds a pending test is charged (see the module doc), or ``None`` with nothing to go on."""
        kind = kind or kind_of(nodeid)
        b = self.base(nodeid, kind)
        if b is not None:
            return b * min(max(math.exp(self._log_speed(self._model(), kind)), 0.05), 20.0)
        if self.durations.get(kind):
            return median(self.durations[kind])
        ck = coarse_kind_of(nodeid)
        if self.coarse.get(ck):
            return median(self.coarse[ck])
        if self.done:
            return median([d for v in self.durations.values() for d in v])
        return None

    def _per_worker_steps(self, kind: str, left: int, speed: float) -> list[float]:
        """The seconds of the ``left`` steps of ``kind`` (a capture or model load, once per worker) still to
        come, in the order they happen. The run's first one does the work and writes the disk cache, the
        others read it: the first is charged the tables' ``kind`` (the first of a recorded run), the later
        ones this run's median of its later ones, else the tables' ``kind|again`` (× ``speed``), else as
        the first (a table without it)."""
        seen = self.steps.get(kind) or []
        again = None
        if len(seen) > 1:
            again = median(seen[1:])
        else:
            for t in self._tables():
                v = (t.get("steps") or {}).get(kind + AGAIN)
                if v is not None:
                    again = float(v) * speed
                    break
        first = self._step_prediction(kind, speed) if not seen else None
        later = again if again is not None else self._step_prediction(kind, speed)
        return [first if i == 0 and first is not None else later for i in range(left)]

    def _step_prediction(self, kind: str, speed: float) -> float:
        """A step's seconds: this run's median of it, else the table's seconds × ``speed``; a report step
        also scales with this run's number of benchmark cells over the number it was measured with (its
        results and figures grow with the cells), and a report kind the tables lack (another selection of
        sources) is charged the tables' median seconds per cell × this run's cells; a capture or model load
        of a data size the tables lack, the median of that step at the sizes they have."""
        if self.steps.get(kind):
            return median(self.steps[kind])
        report = kind.startswith("report|")
        # a suite's report (``|+tests``) that the tables lack: as the same cells' report alone
        for k in (kind, kind.removesuffix("|+tests")) if report else (kind,):
            for t in self._tables():
                v = (t.get("steps") or {}).get(k)
                if v is not None:
                    ref = (t.get("step_cells") or {}).get(k)
                    scale = self.cells / ref if report and ref and self.cells else 1.0
                    return float(v) * scale * speed
        if report and self.cells:
            rates = [float(v) / ref for t in self._tables() for k, v in (t.get("steps") or {}).items()
                     if k.startswith("report|") and (ref := (t.get("step_cells") or {}).get(k))]
            return median(rates) * self.cells * speed
        if not report:  # a capture or model load of a data size the tables lack: as those of the sizes they have
            what, _, rest = kind.partition("|")
            same = [float(v) for t in self._tables() for k, v in (t.get("steps") or {}).items()
                    if k.partition("|")[0] == what and k.endswith(AGAIN) == rest.endswith(AGAIN)]
            if same:
                return median(same) * speed
        return 0.0

    def overhead(self, now: float) -> float:
        """Idle worker-seconds per finished test so far (xdist's bookkeeping between tests, fixtures
        outside the timed phases); 0 when serial or before any test finished."""
        if self.workers <= 1 or not self.done:
            return 0.0
        run = max(now - (self.t_run or self.t0), 0.0)
        used = self.busy + sum(sum(v) for k, v in self.steps.items() if not k.startswith("report|")) \
            + sum(max(now - t, 0.0) for t in self.running.values())
        return max(self.workers * run - used, 0.0) / self.done

    def eta(self, now: float) -> float | None:
        """Seconds until the session ends (tests, captures, report), or ``None`` with nothing to go on."""
        if not self.done and not self._tables():
            return None
        speed = self.speed()
        over = self.overhead(now)
        captures = {k.split("|", 1)[1]: v for k, v in self.expected_steps.items()
                    if k.startswith("capture|") and v > 0}
        cap_s = {tag: self._per_worker_steps("capture|" + tag, v, speed) for tag, v in captures.items()}
        models = {k.split("|", 1)[1]: v for k, v in self.expected_steps.items()
                  if k.startswith("model|") and v > 0}
        model_s = {tag: self._per_worker_steps("model|" + tag, v, speed) for tag, v in models.items()}
        charge: dict[str, float] = {}  # pending test -> seconds it still takes (running: what is left)
        for n, kind in self.pending.items():
            p = self.predict(n, kind)
            if p is None:
                return None
            tag = "-".join(split_id(n)[2])
            if captures.get(tag, 0) > 0:  # the first cells of a size on each worker pay its capture
                captures[tag] -= 1
                p += cap_s[tag].pop(0)
            if models.get(tag, 0) > 0 and needs_model(n):  # and the first end-to-end cells its model load
                models[tag] -= 1
                p += model_s[tag].pop(0)
            if n in self.running:
                ran = now - self.running[n]
                # what its charge has left; once overrun, a quarter of the overrun again
                charge[n] = max(p - ran, 0.25 * (ran - p))
            else:
                charge[n] = p + over
        busy, queued = [], set()
        for q in self.queues or ():  # tests already sent to a worker run there, in that order
            mine = [n for n in q if n in charge and n not in queued]
            queued.update(mine)
            busy.append(sum(charge[n] for n in mine))
        # a running test the queues do not list (they were read before it was sent) runs on a worker
        # whose listed work is done: the least busy one — never on a worker of its own
        busy += [0.0] * max(max(self.workers, 1) - len(busy), 0)
        for n in sorted((n for n in self.running if n in charge and n not in queued), key=charge.get,
                        reverse=True):
            i = min(range(len(busy)), key=busy.__getitem__)
            busy[i] += charge[n]
        costs = [c for n, c in charge.items() if n not in queued and n not in self.running]
        tests = schedule_end(busy, costs, len(busy))
        report = sum(self._step_prediction(k, speed) for k, v in self.expected_steps.items()
                     if k.startswith("report|") and v > 0)
        if self.report_started is not None:
            ran = now - self.report_started  # once overrun, a quarter of the overrun again (as for a test)
            report = max(report - ran, 0.25 * (ran - report))
        self.debug = f"tests={tests:.1f} speed={speed:.2f} over={over:.3f} report={report:.1f}"
        return tests + report

    def line_due(self, now: float, *, at_report: bool) -> bool:
        """Whether the progress line is due at ``now``: once :attr:`interval_s` has passed since the last
        line — when a test report has just arrived (``at_report``: printed with it), or on the printer's
        clock once no report has come for :data:`QUIET_S` seconds (half an interval if shorter). Past the
        interval either a report comes within that window or the window passes, so with a printer that
        checks every ``tick`` seconds lines are at most ``LATE_FACTOR · interval_s + tick`` apart whatever
        the reports do, and the printer never speaks while reports (and pytest's dots) are coming
        (tests/unit/test_progress.py checks both). Never with ``interval_s == 0`` or no tests."""
        if self.interval_s <= 0 or not self.total or now - self.last < self.interval_s:
            return False
        return at_report or now - self.last_report >= min(QUIET_S, self.interval_s / 2)

    def line(self, now: float) -> str:
        eta = self.eta(now)
        caps = {k: v for k, v in self.expected_steps.items() if k.startswith("capture|") and v > 0}
        note = ""
        if caps and not any(k.startswith("capture|") for k in self.steps):
            note = " (real-model capture pending)"
        if eta is None and self.done < self.total:
            note += " (no recorded duration for these tests yet: an estimate follows the first to finish)"
        if os.environ.get("KVQBENCH_PROGRESS_DEBUG"):
            note += f" [{self.debug}]"
        return (f"kvqbench: {self.done}/{self.total} tests, elapsed {hms(now - self.t0)}, "
                f"ETA {hms(eta) if eta is not None else '?'}{note}")

    # ---------------------------------------------------------------- history
    def updated_history(self, base: dict | None = None, max_tests: int = 50_000) -> dict:
        """The history to keep for the next run (:func:`~kvqbench.eta_tables.new_history`): this run's seconds
        divided by :func:`~kvqbench.eta_tables.run_scale`, blended into ``base`` (the cache as it is now, which another session may
        have updated meanwhile; default the history this run started with)."""
        return new_history(self.history if base is None else base, self.prior, run_scale(self.observed), self.measured,
                           {k: median(v) for k, v in self.durations.items() if v}, self.steps, self.cells,
                           self.done >= self.total, max_tests)
