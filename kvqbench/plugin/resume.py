"""Resume: every cell's values go to the results folder's journal (:mod:`kvqbench.journal`) when they exist,
and a rerun into that folder reuses what an interrupted run of the same code, settings and data left there
(unless ``--kvq-fresh``).

- A cell whose test passed is journaled with its whole record by the process that ran it (its report, in
  ``pytest_runtest_makereport``). Values computed ahead of their own cell — a seed group's other seeds
  (``kvq_seed_rows``), the other seeds of a seed-free computation (``kvq_run``) — are journaled when
  computed, as values whose checks have not run (:func:`journal_siblings`).
- At collection every process (the xdist controller from the workers' node ids) opens the journal of the
  folder the results will go to (:func:`kvqbench.plugin.state.out_dir`) and reads what earlier sessions
  wrote under this session's run context. A cell with a stored record is *reused*: it is collected, sharded
  and scheduled like any other, but its data and model fixtures load nothing and its test body is not
  called (:func:`pytest_pyfunc_call`); it passes with the stored record, which reaches the result files
  unchanged (its ``duration_s`` that of the run that computed it). A cell with stored values only runs its
  test, whose ``kvq_run``/``kvq_seed_rows`` hand it those values (:func:`stored_result`): its checks run,
  its computation does not. The controller says how many in one line.
- Once a session has written a complete result set (or a shard its whole share) into the folder, the
  journal is removed: it only ever serves a run that did not finish.

Timing cells (exp4) are reused like any other: they were measured by this code on this machine (the run
context holds the CPU model or GPU names); pytest-benchmark's JSON holds only the round trips timed in
this session.
"""

from __future__ import annotations

import os
import platform
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from kvqbench.cells import parse_nodeid, source_kind
from kvqbench.plugin.state import RECORD_KEY, SETTINGS_KEY, STATE_KEY, Settings, cell_of, is_worker, out_dir, \
    session_config

#: a test's user property marking a cell reused from the journal (its record is the stored one)
REUSED_KEY = "kvqbench_reused"


@dataclass
class Resume:
    """This process's view of the journal (``config.stash``)."""

    session: str
    fresh: bool = False
    journal: Any = None  # kvqbench.journal.Journal, once the collected cells are known
    keys: dict[str, str] = field(default_factory=dict)  # node id of every collected cell -> its reuse key
    reused: set[str] = field(default_factory=set)  # cells with a stored record: not run
    stored: set[str] = field(default_factory=set)  # cells with stored values only: checks run, computation not
    count: int = 0  # controller: reused cells reported


RESUME_KEY = pytest.StashKey[Resume]()


@dataclass
class StoredResult:
    """An experiment's result read back from the journal (the attributes a cell's test and ``kvq_record``
    read: plain JSON types)."""

    metrics: dict[str, Any]
    per_layer: dict[str, Any]
    series: dict[str, Any]
    extra: dict[str, Any]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("kvqbench").addoption(
        "--kvq-fresh", action="store_true", default=False,
        help="compute every cell. By default a run into a results folder where a run of the same code, settings "
             "and data was interrupted reuses the cells that run finished (kept in the folder's "
             ".kvqbench-journal.jsonl) and computes only the rest")


def pytest_configure(config: pytest.Config) -> None:
    session = getattr(config, "workerinput", {}).get("kvqbench_session") or uuid.uuid4().hex
    config.stash[RESUME_KEY] = Resume(session=session, fresh=bool(config.getoption("--kvq-fresh", False)))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: the workers' lines carry the controller's session id (a session never reuses its own)."""
    st = node.config.stash.get(RESUME_KEY, None)
    if st is not None:
        node.workerinput["kvqbench_session"] = st.session


def _resume(config: pytest.Config | None) -> Resume | None:
    return None if config is None else config.stash.get(RESUME_KEY, None)


# ---------------------------------------------------------------- the reuse key
def _device_names(s: Settings) -> list[str]:
    """What the cells ran on: the CPU's model name, architecture and core count; on CUDA every visible GPU's
    name (the same in every xdist worker, whatever ``cuda:I`` it was given)."""
    if s.device.startswith("cuda"):
        import torch

        return sorted(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return [cpu or platform.processor(), platform.machine(), str(os.cpu_count())]


def run_context(s: Settings) -> dict[str, Any]:
    """Everything of a session, besides the cell itself, that determines a cell's values: the code (every
    file of the ``kvqbench`` package), the Python and library versions, the methods registered from other
    packages, the device and its name, capture dtype, threads, the seed and window lists (a seed group's rows
    depend on them) and the kernels switch."""
    from importlib.metadata import PackageNotFoundError, entry_points, version

    from kvqbench.journal import source_digest

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    methods = sorted((ep.name, ep.value, ver(ep.dist.name) if ep.dist else None)
                     for ep in entry_points(group="kvqbench.methods"))
    return {"kvqbench": source_digest(), "python": platform.python_version(),
            "packages": {n: ver(n) for n in ("torch", "numpy", "scipy", "transformers", "gguf")},
            "methods": methods, "device": s.device.split(":")[0], "device_names": _device_names(s),
            "dtype": s.dtype, "threads": s.threads, "seeds": list(s.seeds), "windows": list(s.windows),
            "env": {k: os.environ.get(k) for k in ("KVQBENCH_KERNELS", "CC")}}


def _data_identity(source: str, s: Settings, memo: dict[str, str]) -> str:
    """``"synthetic"`` (drawn by the code from the seed), or the real model's name and weights fingerprint."""
    if source_kind(source) != "real":
        return source
    if source not in memo:
        from kvqbench.data.capture.models import model_fingerprint

        memo[source] = f"{source}|{s.model}|{model_fingerprint(s.model)}"
    return memo[source]


def _open(config: pytest.Config, ids: list[str]) -> Resume | None:
    """Open the journal of the folder this session's results go to and find the reusable cells among ``ids``
    (the collected cells; the same in every process of the session)."""
    from kvqbench.journal import Journal, cell_key, context_digest, file_digest

    st = _resume(config)
    if st is None or st.journal is not None or not ids or config.option.collectonly:
        return st
    s = config.stash[SETTINGS_KEY]
    folder = out_dir(config, s, None, ids)
    context = context_digest(run_context(s))
    st.journal = Journal(folder, context, st.session)
    data: dict[str, str] = {}
    for nodeid in ids:
        node = parse_nodeid(nodeid)
        if node.cell is not None:
            st.keys[nodeid] = cell_key(context, file_digest(config.rootpath / node.path),
                                       _data_identity(node.cell.source, s, data), nodeid)
    if not st.fresh:
        st.journal.load(set(st.keys.values()))
    for nodeid, key in st.keys.items():
        if st.journal.record(key) is not None:
            st.reused.add(nodeid)
        elif st.journal.result(key) is not None:
            st.stored.add(nodeid)
    return st


def _announce(config: pytest.Config, st: Resume | None) -> None:
    """The controller's one line about what it reuses (or why it reuses nothing of a journal it found)."""
    if st is None or st.journal is None:
        return
    where = st.journal.path.parent
    try:
        where = where.relative_to(config.invocation_params.dir)
    except ValueError:
        pass
    msg = None
    if st.reused or st.stored:
        more = f"; {len(st.stored)} more computed there rerun only their checks" if st.stored else ""
        msg = (f"kvqbench: reusing {len(st.reused)} of {len(st.keys)} cells from {where}/ (interrupted run of the "
               f"same code and settings{more}); --kvq-fresh recomputes all")
    elif st.journal.nodeids & set(st.keys):  # journaled under other keys
        msg = (f"kvqbench: {where}/ holds an interrupted run of other code, settings or data: its cells are "
               "computed again")
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if msg and tr is not None:
        if getattr(getattr(tr, "_tw", None), "width_of_current_line", 0):
            tr.write("\n")
        tr.write_line(msg, yellow=True)


@pytest.hookimpl(tryfirst=True)  # before the progress line counts the cells to run
def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    st = _open(config, [it.nodeid for it in session.items if cell_of(it) is not None])
    for it in session.items:  # nothing is timed in a reused cell, deliberately: no pytest-benchmark warning
        if st is not None and it.nodeid in st.reused and "benchmark" in getattr(it, "fixturenames", ()):
            it.add_marker(pytest.mark.filterwarnings("ignore:Benchmark fixture was not used at all"))
    if not is_worker(config):
        _announce(config, st)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    config = session_config()
    st = _resume(config)
    if config is not None and st is not None and st.journal is None:
        _announce(config, _open(config, [i for i in ids if parse_nodeid(i).cell is not None]))


def reused_ids(config: pytest.Config | None) -> set[str]:
    """The collected cells this session reuses from the journal (not run)."""
    st = _resume(config)
    return set() if st is None else st.reused


def is_reused(item: Any) -> bool:
    """Whether ``item`` is a cell reused from the journal: its fixtures load nothing, its body is not called."""
    st = _resume(getattr(item, "config", None))
    return st is not None and item.nodeid in st.reused


# ---------------------------------------------------------------- values computed ahead of their cell
def stored_result(config: pytest.Config, nodeid: str) -> StoredResult | None:
    """The values an earlier session computed for cell ``nodeid`` ahead of its own test, or ``None``."""
    st = _resume(config)
    if st is None or nodeid not in st.stored:
        return None
    doc = st.journal.result(st.keys[nodeid])
    return StoredResult(**{k: dict(doc.get(k) or {}) for k in ("metrics", "per_layer", "series", "extra")})


def journal_siblings(config: pytest.Config, nodeid: str, results: dict[int, Any]) -> None:
    """Journal ``results`` (seed → an experiment's result), computed by cell ``nodeid`` for the cells of the
    same test and setting at those seeds; the seeds whose cell this session did not collect are left out."""
    st = _resume(config)
    cell = parse_nodeid(nodeid).cell
    if st is None or st.journal is None or cell is None:
        return
    from kvqbench.report.io import to_jsonable

    base = parse_nodeid(nodeid).base
    for seed, res in results.items():
        sibling = f"{base}[{replace(cell, seed=seed).id}]"
        if sibling != nodeid and sibling in st.keys:
            st.journal.add(st.keys[sibling], sibling, result=to_jsonable(
                {k: dict(getattr(res, k, None) or {}) for k in ("metrics", "per_layer", "series", "extra")}))


# ---------------------------------------------------------------- running and recording
@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A reused cell: its stored record instead of its body."""
    st = _resume(pyfuncitem.config)
    if st is None or pyfuncitem.nodeid not in st.reused:
        return None
    stored = dict(st.journal.record(st.keys[pyfuncitem.nodeid]))
    rec = next((v for k, v in pyfuncitem.user_properties if k == RECORD_KEY), None)
    if rec is None:
        pyfuncitem.user_properties.append((RECORD_KEY, stored))
    else:
        rec.clear()
        rec.update(stored)
    pyfuncitem.user_properties.append((REUSED_KEY, True))
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Journal the record of a cell whose test has just passed (in the process that ran it)."""
    outcome = yield
    report = outcome.get_result()
    st = _resume(item.config)
    if (st is None or st.journal is None or report.when != "call" or not report.passed
            or item.nodeid not in st.keys or item.nodeid in st.reused):
        return
    rec = next((v for k, v in item.user_properties if k == RECORD_KEY), None)
    if rec is not None:  # already plain JSON (kvqbench.plugin.recording); status and duration as the controller sets them
        st.journal.add(st.keys[item.nodeid], item.nodeid,
                       record={**rec, "status": "passed", "duration_s": round(float(report.duration), 6)})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    st = _resume(session_config())
    if st is not None and report.when == "call" and any(k == REUSED_KEY for k, _ in report.user_properties):
        st.count += 1


def reused_count(config: pytest.Config) -> int:
    """How many cells of this session's records were reused (controller)."""
    st = _resume(config)
    return 0 if st is None else st.count


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int):
    """Once the result set is written: remove the journal of a folder that now holds a complete set (or a
    shard's whole share)."""
    res = yield
    config = session.config
    st, state = _resume(config), config.stash.get(STATE_KEY, None)
    if is_worker(config) or st is None or st.journal is None or state is None or not state.board:
        return res
    comp = state.board.get("completeness") or {}
    if (comp.get("complete") or comp.get("shard_done")) and state.out_dir \
            and Path(state.out_dir).resolve() == st.journal.path.parent.resolve():
        st.journal.remove()
    return res
