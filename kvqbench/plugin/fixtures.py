"""The fixtures a benchmark cell asks for: ``kvq_settings``, ``kvq_data`` (the cell's KV data with an
independent calibration batch, cached per process), ``kvq_model`` (the real model for end-to-end cells)
and ``kvq_method`` (the cell's method instance). ``kvq_run``/``kvq_seed_rows`` live in
:mod:`kvqbench.plugin.sharing`, ``kvq_record`` in :mod:`kvqbench.plugin.recording`."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvqbench.cells import SIZES, Cell, source_kind
from kvqbench.data.memory import release_freed
from kvqbench.plugin.resume import is_reused
from kvqbench.plugin.state import SETTINGS_KEY, STEP_KEY, Settings, is_worker

_DATA_CACHE: dict[tuple, Any] = {}


@pytest.fixture(scope="session")
def kvq_settings(pytestconfig: pytest.Config) -> Settings:
    """The session's resolved kvqbench options."""
    return pytestconfig.stash[SETTINGS_KEY]


@pytest.fixture
def kvq_data(cell: Cell, kvq_settings: Settings, pytestconfig: pytest.Config, request: pytest.FixtureRequest):
    """The cell's :class:`~kvqbench.data.KVData` on the session device (cached per process). The
    real-model capture is timed and reported as its own progress step (not as the cell's duration).
    ``None`` for a cell reused from the journal (:mod:`kvqbench.plugin.resume`), which runs nothing."""
    if is_reused(request.node):
        return None
    _pin_threads(kvq_settings.threads)
    key = (cell.source, cell.size, cell.seed if cell.source == "synthetic" else None, kvq_settings.device,
           kvq_settings.model, kvq_settings.dtype)
    if key in _DATA_FAILED:  # the same data already failed in this process: one line, no retry
        pytest.fail(_DATA_FAILED[key], pytrace=False)
    if source_kind(cell.source) == "real" and is_worker(pytestconfig):
        evict_data("synthetic")
    if key not in _DATA_CACHE:
        t = time.time()
        try:
            _DATA_CACHE[key] = load_data(cell, kvq_settings, pytestconfig)
        except Exception as e:
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
            _DATA_FAILED[key] = (f"kvqbench: {cell.source} data ({cell.size}) unavailable, as for an earlier "
                                 f"cell: {type(e).__name__}: {first}")
            raise  # the first cell shows the full error
        if source_kind(cell.source) == "real":
            release_freed()  # the capture's temporaries (a model forward and backward, or the file read)
            request.node.user_properties.append(
                (STEP_KEY, {"kind": f"capture|real-{cell.size}", "seconds": round(time.time() - t, 4)}))
    return _DATA_CACHE[key]


def evict_data(kind: str) -> bool:
    """Drop the data of ``kind`` (``"synthetic"``: every seed's, ≈ 0.25 GiB at full size; ``"real"``: the
    captures) this process holds and hand its memory back (:func:`~kvqbench.data.memory.release_freed`). An
    xdist worker drops the synthetic data at each real cell, which comes after its synthetic cells, and at
    each model cell the captures too when its model cells come after every cell reading them
    (:func:`kvqbench.plugin.collection.real_capture_first`, :func:`~kvqbench.plugin.collection.model_cells_last`).
    A serial run keeps pytest's order, which alternates them, and keeps the data. A cell that comes later
    anyway loads its data again (from its seed, or the capture cache: the same values). Returns whether
    anything was dropped."""
    gone = [k for k in _DATA_CACHE if (source_kind(k[0]) == "real") == (kind == "real")]
    for k in gone:
        del _DATA_CACHE[k]
    if gone:
        release_freed()
    return bool(gone)


#: data keys whose loading failed in this process → the one-line reason (later cells fail fast)
_DATA_FAILED: dict[tuple, str] = {}


_THREADS_SET: list[int] = []


def _pin_threads(n: int) -> None:
    """Fix torch's CPU thread count once per process (lazily: the plugin never imports torch at load)."""
    if not _THREADS_SET:
        import torch

        torch.set_num_threads(max(1, int(n)))
        _THREADS_SET.append(n)


def capture_cache_dir(config: pytest.Config) -> str:
    """The folder of the content-addressed real-KV capture cache: ``--kvq-capture-cache``, else pytest's
    cache folder (``.pytest_cache/d/kvqbench_capture``), else — pytest's cache plugin off (``-p
    no:cacheprovider``) or its folder not writable (a read-only checkout) — the user's cache folder
    (:func:`kvqbench.privdir.user_cache_dir`, ``~/.cache/kvqbench/capture``), else a private temporary folder
    of this process."""
    s = config.stash.get(SETTINGS_KEY, None)
    if s is not None and s.capture_cache is not None:
        return s.capture_cache
    cache = getattr(config, "cache", None)
    if cache is not None:
        try:
            return str(cache.mkdir("kvqbench_capture"))
        except OSError:
            pass
    from kvqbench.privdir import fallback_dir, user_cache_dir

    try:
        return str(user_cache_dir("capture"))
    except OSError:  # a read-only home, or a folder another user could write (UnsafePathError)
        return str(fallback_dir("capture"))


#: synthetic calibration batches use this seed offset (independent of every evaluation seed)
CALIBRATION_SEED_OFFSET = 1_000_033


def load_data(cell: Cell, s: Settings, config: pytest.Config | None = None):
    """Build the data of a cell (see ``SIZES``) with an independent calibration batch attached:
    synthetic — the same generator at seed ``seed + CALIBRATION_SEED_OFFSET``; real — one capture of
    ``2·seq_len`` tokens, evaluated on the first ``seq_len`` and calibrated on the next ``seq_len``
    (causal attention: the first half equals a ``seq_len``-token capture)."""
    spec = dict(SIZES[cell.size][source_kind(cell.source)])
    if cell.source == "synthetic":
        from kvqbench.data.synthetic import make_synthetic

        data = make_synthetic(seed=cell.seed, device=s.device, **spec)
        data.calibration = make_synthetic(seed=cell.seed + CALIBRATION_SEED_OFFSET, device=s.device, **spec)
        data.meta["calibration"] = f"synthetic seed {cell.seed + CALIBRATION_SEED_OFFSET}"
        return data
    from kvqbench.data.capture import capture_kv

    cache_dir = s.capture_cache if config is None else capture_cache_dir(config)
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
    if isinstance(meta.get("layer_types"), list):
        meta["layer_types"] = [meta["layer_types"][i] for i in idx]
    return dataclasses.replace(data, k=sel(data.k), v=sel(data.v), q=sel(data.q), k_pre=sel(data.k_pre),
                               cos=sel(data.cos), sin=sel(data.sin), k_grad2=sel(data.k_grad2), v_grad2=sel(data.v_grad2), meta=meta)


#: cell sizes whose model source is calibrated like another size's end-to-end window (the long tier
#: like the full-size cells)
CALIBRATION_SIZE: dict[str, str] = {"long": "full"}


@pytest.fixture
def kvq_model(cell: Cell, kvq_settings: Settings, pytestconfig: pytest.Config, request: pytest.FixtureRequest):
    """The real model of ``--kvq-model`` with the calibration capture of the cell's end-to-end window
    (:class:`kvqbench.experiments.endtoend.RealSource`; the model is loaded once per process, the capture
    is disk-cached like the other real data). Runs on the session device with pinned CPU threads. ``None``
    for a cell reused from the journal (:mod:`kvqbench.plugin.resume`)."""
    if is_reused(request.node):
        return None
    from kvqbench.experiments.endtoend import CONFIG_BY_SIZE, load_source, source_loaded

    _pin_threads(kvq_settings.threads)
    if is_worker(pytestconfig):
        from kvqbench.plugin.collection import model_cells_last

        evict_data("synthetic")
        if model_cells_last(kvq_settings) and "kvq_data" not in request.fixturenames:
            evict_data("real")  # no cell reading the capture follows on this worker
    cache_dir = capture_cache_dir(pytestconfig)
    size = CALIBRATION_SIZE.get(cell.size, cell.size)
    where = {"model": kvq_settings.model, "window": CONFIG_BY_SIZE[size].window, "device": kvq_settings.device}
    fresh, t = not source_loaded(**where), time.time()
    src = load_source(**where, cache_dir=cache_dir)
    if fresh:  # the progress ETA counts the load as a step of its own, not as this cell's duration
        release_freed()  # the load's temporaries (the checkpoint read, the calibration capture)
        request.node.user_properties.append(
            (STEP_KEY, {"kind": f"model|{source_kind(cell.source)}-{cell.size}", "seconds": round(time.time() - t, 4)}))
    return src


@pytest.fixture
def kvq_method(cell: Cell):
    """A fresh instance of the cell's method at the cell's bits, seed and variant parameters."""
    from kvqbench.quantizers import create

    return create(cell.method, cell.k_bits, cell.v_bits, seed=cell.seed, **cell.variant_dict())
