"""One computation for the cells that are the same computation (kvqbench.memo, plugin.seed_free_key)."""

import multiprocessing as mp

from kvqbench.cells import Cell
from kvqbench.memo import ResultMemo
from kvqbench.plugin import Settings, seed_free_key
from kvqbench.quantizers import available, create, get


def _cell(method, seed, source="real", bits=2, variant=()):
    return Cell("exp2", method, bits, bits, seed, source, "full", variant)


def _run(method, data, cfg):  # a stand-in experiment function
    return {"cfg": cfg}


def test_real_cells_of_an_unseeded_method_share_one_key_across_seeds_only():
    s = Settings()
    key = lambda c, args=(1,): seed_free_key(c, create(c.method, c.k_bits, c.v_bits, seed=c.seed), s, _run, args)  # noqa: E731
    assert key(_cell("rtn_token", 0)) == key(_cell("rtn_token", 1)) == key(_cell("rtn_token", 7)) is not None
    # anything but the seed tells them apart
    assert key(_cell("rtn_token", 0)) != key(_cell("rtn_token", 0, bits=4))
    assert key(_cell("rtn_token", 0)) != key(_cell("rtn_channel", 0))
    assert key(_cell("rtn_token", 0)) != key(_cell("rtn_token", 0), args=(2,))
    assert key(_cell("kivi", 0, variant=(("group_size", 32),))) != key(_cell("kivi", 0, variant=(("group_size", 64),)))
    # synthetic data is drawn from the seed; a seeded method draws randomness from it
    assert key(_cell("rtn_token", 0, source="synthetic")) is None
    for m in available():
        if get(m).seeded:
            assert key(_cell(m, 0)) is None


def test_builtin_methods_with_randomness_say_so():
    # TurboQuant draws its rotation and KVQuant its k-means subsample from the seed (their docstrings)
    assert get("turboquant").seeded and get("kvquant").seeded
    assert not get("rtn_token").seeded and not get("fp16").seeded


def test_compute_once_and_hand_out_private_copies(tmp_path):
    calls = []

    def fn():
        calls.append(1)
        return {"metrics": {"a": 1.0}}

    memo = ResultMemo(tmp_path)
    first = memo.compute(("k",), fn)
    first["metrics"]["a"] = 99.0  # the caller's copy is its own
    second = memo.compute(("k",), fn)
    assert calls == [1] and second == {"metrics": {"a": 1.0}} and (memo.hits, memo.misses) == (1, 1)
    assert memo.compute(None, fn) == {"metrics": {"a": 1.0}} and len(calls) == 2  # None: never stored


def _worker(folder, q):
    q.put(ResultMemo(folder).compute(("shared",), lambda: "recomputed"))


def test_another_process_reuses_through_the_folder(tmp_path):
    ResultMemo(tmp_path).compute(("shared",), lambda: "first")
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_worker, args=(str(tmp_path), q))
    p.start()
    p.join(60)
    assert q.get(timeout=5) == "first"
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporaries left


def test_an_unreadable_file_counts_as_absent(tmp_path):
    memo = ResultMemo(tmp_path)
    (tmp_path / f"{memo.digest(('x',))}.pkl").write_bytes(b"not a pickle")
    assert memo.compute(("x",), lambda: 5) == 5 and memo.misses == 1
