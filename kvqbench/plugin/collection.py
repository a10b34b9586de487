"""Collection: each ``@pytest.mark.kvq`` test is parametrized into its benchmark cells (one
:class:`~kvqbench.cells.Cell` per id), ``--kvq-shard`` keeps one shard of them, workers order them so the
real-model capture and a seed group's first cell come early, and a selection that leaves no cell is
explained. Keeps the collected cells in the session state (``expected``) and the selection counts under
:data:`SELECTION_KEY`."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvqbench.cells import Cell, parse_nodeid, real_source, source_kind
from kvqbench.plugin.state import (
    SETTINGS_KEY,
    STATE_KEY,
    Settings,
    cell_of,
    is_worker,
    out_dir,
    session_config,
)

#: the counts of benchmark cells before and after the selection (see :func:`no_cell_message`)
SELECTION_KEY = pytest.StashKey[dict]()


def _source(item: Any) -> str | None:
    cell = cell_of(item)
    return None if cell is None else cell.source


#: the most bytes a model's weights may take for a worker to hold them beside the captured data (see
#: :func:`model_cells_last`)
SHARED_WEIGHTS_LIMIT = 768 << 20


def model_cells_last(settings: Settings) -> bool:
    """Whether a worker runs the real model's cells only after every cell that reads the captured data and
    drops that data at its first model cell (:func:`kvqbench.plugin.fixtures.kvq_model`), so that it never
    holds the two together: for a model whose weights take more than :data:`SHARED_WEIGHTS_LIMIT` in float32,
    the dtype the model cells run it in (Gemma 3 270M: 268 M weights, 1.0 GiB; with the 2,048-token capture
    beside them and a cell's working memory a worker peaked at 3.3 GB, docs/PERFORMANCE.md), and for a model
    whose size is not registered (a ``.gguf`` file or folder of the user's, a Hugging Face id). A smaller
    registered model (SmolLM2-135M: 0.5 GiB) keeps the spread order, which is faster: its model cells fill
    in between the other real cells, and a cell reading a result another seed computes finds it done."""
    from kvqbench.data.capture.registry import registered

    known = registered(settings.model)
    return known is None or not known.params or known.params * 4 > SHARED_WEIGHTS_LIMIT


#: how many cells xdist hands a worker at a time (``--maxschedchunk``) in the model-cells-last order
LEAN_CHUNK = 4


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """xdist controller: in the model-cells-last order (:func:`model_cells_last`), unless the user set
    ``--maxschedchunk``, deal the cells :data:`LEAN_CHUNK` at a time. xdist otherwise deals consecutive
    cells by the hundred: a worker on cheap cells then runs far ahead of one on costly cells and draws a
    seed whose shared result the other is still computing (:func:`kvqbench.plugin.sharing.seed_free_key`,
    a seed group's other seed), and waits for it (docs/PERFORMANCE.md)."""
    s = config.stash.get(SETTINGS_KEY, None)
    if (s is None or is_worker(config) or not s.real or getattr(config.option, "maxschedchunk", 0) is not None
            or not model_cells_last(s)):
        return
    config.option.maxschedchunk = LEAN_CHUNK


def real_capture_first(items: list[Any], settings: Settings | None = None) -> list[Any]:
    """The order xdist workers run the cells in: the first real cell that needs the captured data
    (``kvq_data``), then every item that needs no real data, then the other real cells by seed (seed 0 of
    every real cell before seed 1, so the cells that share one computation across seeds, see
    :func:`kvqbench.plugin.sharing.seed_free_key`, find it done), and last the seeds of each seed group
    other than its first (:func:`~kvqbench.plugin.sharing.seed_group` of the cell's seeds in ``settings``),
    which only read what the group's first cell (:func:`~kvqbench.plugin.sharing.kvq_seed_rows`, exp5)
    stored.

    The other real cells come in one of two orders. *Spread* (the default): the cells that compute a whole
    seed group spread evenly among the rest from the start. xdist deals consecutive cells to a worker in
    chunks: spread out, the heavy group cells fall into every chunk alike, and a worker never draws a
    group's other seed while the other worker still computes that group (it would wait for it, idle).
    *Model cells last* (when :func:`model_cells_last` says so for ``settings``): every cell that reads the
    captured data, then every cell of the real model (``kvq_model`` without ``kvq_data``). A worker's
    cells are in this order too, so once it has run a model cell no cell reading the capture follows, and
    it drops the capture there (:func:`kvqbench.plugin.fixtures.evict_data`); xdist then deals the cells a
    few at a time (:func:`pytest_configure`), so that the workers stay close together in the order. That
    holds under xdist's default ``--dist load``; with ``--dist worksteal`` a worker may take a capture cell
    after a model cell and load the capture again (the same values, more memory and time).

    On a run whose capture is not cached yet, the worker that draws the first cell runs the model once
    while the others work through synthetic cells instead of waiting on the capture lock; with a cached
    capture the order changes nothing but when cells run.
    Deterministic, so every worker collects the same order. Without a cell that needs the capture (e.g.
    ``-k endtoend``) the real cells still come last, in the same order.
    """
    from kvqbench.plugin.sharing import seed_group

    def role(it: Any) -> int:  # 0: computes a seed group, 1: an ordinary real cell, 2: reads a group's result
        cell = cell_of(it)
        if "kvq_seed_rows" not in getattr(it, "fixturenames", ()):
            return 1
        seeds = settings.seeds_for(cell.experiment, cell.size) if settings is not None else [0]
        return 0 if cell.seed == seed_group(cell.seed, list(seeds))[0] else 2

    def real(it: Any) -> bool:
        return source_kind(_source(it) or "") == "real"

    def needs_data(it: Any) -> bool:
        return "kvq_data" in getattr(it, "fixturenames", ())

    first = next((i for i, it in enumerate(items) if real(it) and needs_data(it)), None)
    head, rest = ([], items) if first is None else ([items[first]], items[:first] + items[first + 1:])
    by_role: dict[int, list[Any]] = {0: [], 1: [], 2: []}
    for it in sorted((it for it in rest if real(it)), key=lambda it: cell_of(it).seed):  # stable
        by_role[role(it)].append(it)
    groups, plain = by_role[0], by_role[1]
    if settings is not None and model_cells_last(settings):
        model = sorted(groups + [it for it in plain if not needs_data(it)], key=lambda it: cell_of(it).seed)
        middle = [it for it in plain if needs_data(it)] + model
    else:
        middle = []
        for i, it in enumerate(groups):  # group cell i before the plain cells of its share
            middle += [it] + plain[i * len(plain) // len(groups):(i + 1) * len(plain) // len(groups)]
    return head + [it for it in rest if not real(it)] + (middle or plain) + by_role[2]


def _expect_cells(config: pytest.Config, nodeids: list[str]) -> None:
    """Remember the collected cells (controller) and, when there are any, check before the first one runs
    that the results folder can be written (a one-line usage error otherwise)."""
    from kvqbench.results.write import run_folder_problem

    state = config.stash.get(STATE_KEY, None)
    if state is None or state.expected is not None:
        return
    state.expected = list(nodeids)
    problem = long_context_problem(config.stash[SETTINGS_KEY], nodeids)
    if problem:
        raise pytest.UsageError(problem)
    if nodeids:
        out = out_dir(config, config.stash[SETTINGS_KEY], None, state.expected)
        problem = run_folder_problem(out)
        if problem:
            raise pytest.UsageError(f"kvqbench: cannot write results: {problem} "
                                    "(pass --kvq-out DIR with a folder of your own)")


def long_context_problem(s: Settings, nodeids: list[str]) -> str | None:
    """One line when the collected cells hold long-tier cells (size ``long``) and the real model's context
    is shorter than they need (:func:`kvqbench.experiments.longtext.check_context`); ``None`` otherwise."""
    cells = [parse_nodeid(n).cell for n in nodeids]
    if not s.real or not any(c is not None and c.size == "long" for c in cells):
        return None
    from kvqbench.experiments.longtext import CONFIG_BY_SIZE, check_context

    try:
        check_context(s.model, CONFIG_BY_SIZE["long"].context)
    except (ImportError, OSError, ValueError) as e:
        return f"kvqbench: --kvq-model {s.model}: {e}"
    return None


def _apply_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--kvq-shard I/N``: keep shard I of the collected (and -k/-m selected) items, deselect the rest
    (see :mod:`kvqbench.shard`). Runs after pytest's own -k/-m deselection (from the
    ``pytest_collection_modifyitems`` wrapper below)."""
    s = config.stash.get(SETTINGS_KEY, None)
    if s is None or s.shard is None:
        return
    from kvqbench import shard as sh
    from kvqbench.eta_tables import coarse_kind_of
    from kvqbench.plugin.sharing import shard_unit

    index, count = s.shard
    try:
        durations = sh.load_durations(s.durations)
    except (FileNotFoundError, ValueError) as e:
        raise pytest.UsageError(f"--kvq-shard: {e}") from None
    matrix = [it.nodeid for it in items]
    est = sh.estimate_durations(matrix, durations, coarse_kind_of)
    keep = set(sh.split(matrix, count, est, unit=lambda n: shard_unit(n, s))[index - 1])
    selected = [it for it in items if it.nodeid in keep]
    deselected = [it for it in items if it.nodeid not in keep]
    doc = sh.shard_doc(index, count, matrix, [it.nodeid for it in items if cell_of(it) is not None],
                       [it.nodeid for it in selected if cell_of(it) is not None],
                       "kvqbench/data/durations.json" if s.durations is None else os.path.basename(s.durations),
                       sum(est[it.nodeid] for it in selected))
    config.stash[STATE_KEY].shard = doc
    if is_worker(config):
        config.workeroutput["kvqbench_shard"] = doc  # type: ignore[attr-defined]
    items[:] = selected
    if deselected:
        config.hook.pytest_deselected(items=deselected)


#: the K/V shape ``(batch, kv_heads, seq_len, head_dim)`` on which a marker's ``budget_bits`` are held
#: against the largest matched budget: a 64-wide head over 1024 tokens (SmolLM2's head, the narrowest of
#: the models, where per-element overheads weigh most)
BUDGET_SHAPE = (1, 1, 1024, 64)


def fits_largest_budget(method: str, bits: int) -> bool:
    """Whether ``method`` at ``bits`` (K and V) can be a matched-budget point: its nominal bits per element
    on :data:`BUDGET_SHAPE`, mean of K and V, are at most the largest budget
    (:data:`kvqbench.cells.BUDGETS`)."""
    from kvqbench.cells import BUDGETS
    from kvqbench.quantizers import create

    q = create(method, bits)
    return (q.nominal_bits("k", BUDGET_SHAPE) + q.nominal_bits("v", BUDGET_SHAPE)) / 2 <= BUDGETS[-1] + 1e-9


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
    # widths an experiment adds only for the methods that can be a matched-budget point there (its marker's
    # ``budget_bits``, e.g. 8: the largest budget, 8.25 bits, fits only the leanest methods at 8 bits)
    extra = [] if s.bits_explicit else [b for b in marker.kwargs.get("budget_bits") or () if b not in bits]
    variants: dict[str, tuple] = marker.kwargs.get("variants") or {}
    combos: list[tuple[tuple[str, Any], ...]] = [()]
    for axis, values in variants.items():
        combos = [c + ((axis, v),) for c in combos for v in values]
    single = bool(marker.kwargs.get("single_seed"))
    sources = ["synthetic"] + ([real_source(s.model)] if s.real else [])
    only_sources = marker.kwargs.get("sources")  # e.g. ("real",): an experiment that needs the real model
    if only_sources:
        sources = [src for src in sources if source_kind(src) in only_sources]
    sizes = marker.kwargs.get("sizes") or ("smoke", "full")
    cells = []
    fits: dict[tuple[str, int], bool] = {}
    for size in sizes:
        for src in sources:
            for m in methods:
                for kb, vb in pairs + [(b, b) for b in extra if fits.setdefault((m, b), fits_largest_budget(m, b))]:
                    for var in combos:
                        for seed in s.seeds[:1] if single else s.seeds_for(exp, size):
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
        if source_kind(c.source) == "real":
            marks.append(pytest.mark.real)
        params.append(pytest.param(c, id=c.id, marks=marks))
    metafunc.parametrize("cell", params)


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
    if is_worker(config):
        items[:] = real_capture_first(items, config.stash[SETTINGS_KEY])
    cells_left = sum(1 for it in items if cell_of(it) is not None)
    other_left = sum(1 for it in items if it.get_closest_marker("kvq") is None)
    sel = {"kvq_items": len(kvq), "cells_left": cells_left, "other_left": other_left,
           "experiments": {e: sorted(v) for e, v in sorted(experiments.items())}}
    if is_worker(config):
        config.workeroutput["kvqbench_selection"] = sel  # type: ignore[attr-defined]
    else:
        config.stash[SELECTION_KEY] = sel


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: take what a worker computed at collection — the shard description and the
    selection counts."""
    config = session_config()
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
            "Cell ids read test_<name>[<method>-k<bits>v<bits>-seed<n>-<synthetic|real[-<model>]>-<smoke|full>]; "
            "real cells need --kvq-real (of a model other than the default, --kvq-model), full-size ones -m full.")


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The explanation of a selection that left no cell (:func:`no_cell_message`), before the summary."""
    if is_worker(config) or STATE_KEY not in config.stash:
        return
    msg = no_cell_message(config, config.stash.get(SELECTION_KEY, {}))
    if msg:
        terminalreporter.write_line(msg, yellow=True, bold=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not is_worker(session.config):
        _expect_cells(session.config, [it.nodeid for it in session.items if cell_of(it) is not None])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    config = session_config()
    if config is not None:
        _expect_cells(config, [i for i in ids if parse_nodeid(i).cell is not None])
