"""Computations shared between cells (used by the fixtures ``kvq_run`` and ``kvq_seed_rows``): a
real-data cell whose method draws no randomness is computed once for every seed, and exp5 computes a
seed group's cells as one batch. Results go through the session's :class:`kvqbench.memo.ResultMemo`,
which the xdist workers share through a folder the controller makes (:data:`MEMO_DIR_KEY`); sharding
keeps such a group in one shard (:func:`shard_unit`)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from kvqbench.cells import Cell, parse_nodeid, source_kind
from kvqbench.plugin.resume import journal_siblings, stored_result
from kvqbench.plugin.state import Settings

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
def kvq_run(cell: Cell, kvq_method: Any, kvq_data: Any, kvq_settings: Settings, pytestconfig: pytest.Config,
            request: pytest.FixtureRequest):
    """``kvq_run(fn, *args)`` → ``fn(kvq_method, kvq_data, *args)`` (an experiment's ``run_*``), computed
    once per session for the real-data cells of a method that draws no randomness (see
    :func:`seed_free_key` and :mod:`kvqbench.memo`): every seed of such a cell gets its own copy of the
    one result and records ``extra["seeds_share_one_computation"] = True``; the copies of the other seeds
    go to the journal at once (:mod:`kvqbench.plugin.resume`), and a cell whose values an interrupted run
    computed gets those. Not for timings (exp4)."""
    def run(fn: Any, *args: Any) -> Any:
        stored = stored_result(pytestconfig, request.node.nodeid)
        if stored is not None:
            return stored
        cal = getattr(kvq_data, "calibration", None)
        shapes = tuple(tuple(d.k.shape) for d in (kvq_data, cal) if d is not None)
        key = seed_free_key(cell, kvq_method, kvq_settings, fn, args, shapes)
        computed = []

        def compute() -> Any:
            computed.append(True)
            return fn(kvq_method, kvq_data, *args)

        res = _memo(pytestconfig).compute(key, compute)
        if key is not None:
            res.extra[SEEDS_SHARED] = True
            if computed:
                journal_siblings(pytestconfig, request.node.nodeid, {seed: res for seed in kvq_settings.seeds_for(cell.experiment, cell.size)})
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


def shard_unit(nodeid: str, settings: Settings) -> str:
    """The unit a cell is sharded with (:func:`kvqbench.shard.split`): a real-data cell goes with the
    other cells of its seed group (:func:`seed_group`), which share one computation — a method that draws
    no randomness computes every seed once (:func:`kvq_run`), exp5 computes a group's seeds as one batch
    (:func:`kvq_seed_rows`), and in either case the group's first cell to run pays for all of them. Any
    other node id is a unit of its own."""
    node = parse_nodeid(nodeid)
    if node.cell is None or source_kind(node.cell.source) != "real":
        return nodeid
    exp = re.search(r"test_(exp\d+)_", node.base)  # tests/bench/test_exp<N>_<name>.py
    seeds = settings.seeds_for(exp.group(1) if exp else "", node.cell.size)
    group = "_".join(str(g) for g in seed_group(node.cell.seed, seeds))
    return f"{node.base}[{replace(node.cell, seed=0).id}]|seeds{group}"


def seed_rows(cell: Cell, method: Any, s: Settings, memo: Any, fn: Any, siblings: Any = None) -> Any:
    """The logic of :func:`kvq_seed_rows` for ``cell`` (whose configured method is ``method``), with the
    session's settings ``s`` and result store ``memo`` (:class:`kvqbench.memo.ResultMemo`); ``siblings``,
    when given, is called with ``{seed: result}`` of the group's other seeds once computed."""
    from kvqbench.quantizers import create

    group = seed_group(cell.seed, s.seeds_for(cell.experiment, cell.size))
    bits_free = bool(getattr(type(method), "bits_free", False))  # one computation for every bit-width
    bits = ("any", "any") if bits_free else (cell.k_bits, cell.v_bits)
    base = (fn.__module__, fn.__qualname__, cell.experiment, cell.method, *bits,
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
        if seed != cell.seed or bits_free:  # a bits-free group's cells at other bits read every seed
            memo.put(base + (seed,), r)
    memo.release(claim)
    if siblings is not None:
        siblings({seed: r for seed, r in zip(group, results) if seed != cell.seed})
    return results[group.index(cell.seed)]


@pytest.fixture
def kvq_seed_rows(cell: Cell, kvq_method: Any, kvq_settings: Settings, pytestconfig: pytest.Config,
                  request: pytest.FixtureRequest):
    """``kvq_seed_rows(fn)`` → this cell's result of ``fn(methods, seeds)``: a computation of one method's
    cells at several seeds together (``methods[i]`` = the cell's method at ``seeds[i]``; it returns one
    result per seed, each the one its cell would get alone), e.g. as the rows of one batch.

    The first cell of a :func:`seed_group` to run computes every seed of the group; the others take their
    own copy from the session's result store (:mod:`kvqbench.memo`, shared by the xdist workers; the real
    cells run seed 0 first, see :func:`kvqbench.plugin.collection.real_capture_first`); one that starts
    while another worker computes its group waits for that result instead of computing the group again.
    ``fn`` may depend on nothing but the cell's method, bits, variant, source and size and the session
    settings (its results are stored under those; a method whose class says ``bits_free = True``, the fp16
    control, computes a group once for every bit-width). Every result records ``extra["seeds_computed_together"]``.
    The other seeds' results go to the journal at once (:mod:`kvqbench.plugin.resume`), and a cell whose
    values an interrupted run computed gets those. Not for timings."""
    nodeid = request.node.nodeid

    def rows(fn: Any) -> Any:
        stored = stored_result(pytestconfig, nodeid)
        if stored is not None:
            return stored
        return seed_rows(cell, kvq_method, kvq_settings, _memo(pytestconfig), fn,
                         lambda results: journal_siblings(pytestconfig, nodeid, results))

    return rows


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: give every worker the session's shared result folder (see :mod:`kvqbench.memo`),
    made private (``tempfile.mkdtemp``: mode 0700, an unpredictable name; the workers check it before they
    load from it); it is removed when the session ends."""
    import tempfile

    config = node.config
    if MEMO_DIR_KEY not in config.stash:
        config.stash[MEMO_DIR_KEY] = tempfile.mkdtemp(prefix="kvqbench-memo-")
    node.workerinput["kvqbench_memo"] = config.stash[MEMO_DIR_KEY]


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(MEMO_DIR_KEY, None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
