"""Recording: a cell calls the ``kvq_record`` fixture; the record (a JSON-able dict) lives in
``item.user_properties`` under :data:`~kvqbench.plugin.state.RECORD_KEY` — the channel ``record_property``
uses — so pytest-xdist ships it from workers to the controller with the test report. The controller
takes each record from its report (``pytest_runtest_logreport``) into the session state; a cell that
fails or is skipped before recording keeps its identity and the reason."""

from __future__ import annotations

from typing import Any

import pytest

from kvqbench.plugin.resume import REUSED_KEY, is_reused
from kvqbench.plugin.state import RECORD_KEY, STATE_KEY, cell_of, session_config


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
    cell = cell_of(item)
    if cell is None:
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
    if is_reused(request.node):  # its stored record replaces this one (kvqbench.plugin.resume)
        return Recorder(rec)
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
    recs = [v for k, v in getattr(report, "user_properties", []) if k == RECORD_KEY]
    if not recs:
        return
    final = report.when == "call" or (report.when == "setup" and report.outcome != "passed")
    if not final:
        return
    config = session_config()
    if config is None:
        return
    state = config.stash[STATE_KEY]
    reused = any(k == REUSED_KEY for k, _ in report.user_properties)
    for rec in recs:
        rec = dict(rec)
        rec["status"] = report.outcome
        if not reused:  # a reused record keeps the duration of the run that computed it
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
