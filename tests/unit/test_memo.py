"""One computation for the cells that are the same computation (kvqbench.memo, kvqbench.plugin.sharing.seed_free_key)."""

import multiprocessing as mp
import os
import pickle
import time
from pathlib import Path

import pytest

from kvqbench.cells import Cell
from kvqbench.memo import ResultMemo
from kvqbench.plugin.sharing import seed_free_key
from kvqbench.plugin.state import Settings
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


def test_a_key_being_computed_elsewhere_is_waited_for_not_computed_again(tmp_path):
    """Two memos on one folder (two workers): the second asks while the first computes; it gets the first's
    value, its own function never runs, and the claim is gone afterwards."""
    import threading

    calls, started = [], threading.Event()

    def slow():
        calls.append("first")
        started.set()
        time.sleep(0.5)
        return {"v": 1}

    first = threading.Thread(target=lambda: ResultMemo(tmp_path).compute(("k",), slow))
    first.start()
    assert started.wait(10)
    second = ResultMemo(tmp_path)
    got = second.compute(("k",), lambda: calls.append("second") or {"v": 2})
    first.join(10)
    assert got == {"v": 1} and calls == ["first"] and second.waited == 1 and second.misses == 0
    assert not list(tmp_path.glob("*.claim"))


def test_a_released_or_dead_claim_is_not_waited_for(tmp_path):
    """A claim released without a result (the computation raised) or left by a process that is gone: the
    waiter computes the value itself."""
    import subprocess
    import sys
    import threading

    memo = ResultMemo(tmp_path)
    claim = tmp_path / f"{memo.digest(('a',))}.claim"
    claim.write_text(str(os.getpid()))  # held by a live process (this one) ...
    threading.Timer(0.2, claim.unlink).start()  # ... and released without a result
    assert memo.compute(("a",), lambda: "mine") == "mine" and memo.misses == 1 and memo.waited == 0

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    claim_b = tmp_path / f"{memo.digest(('b',))}.claim"
    claim_b.write_text(str(dead.pid))
    assert memo.compute(("b",), lambda: "also mine") == "also mine" and not claim_b.exists()


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/stat"), reason="needs Linux /proc")
def test_a_claim_of_an_unreaped_dead_process_is_not_waited_for(tmp_path):
    """A crashed xdist worker stays a zombie until the controller reaps it (``os.kill(pid, 0)`` still finds
    it): its claim is stale, not waited for forever (seen in a main job whose worker was killed)."""
    import subprocess
    import sys
    import time

    memo = ResultMemo(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(500):  # exited but not reaped: a zombie
        if open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.01)
    os.kill(child.pid, 0)  # still "there" for the plain liveness check
    claim = tmp_path / f"{memo.digest(('z',))}.claim"
    claim.write_text(str(child.pid))
    assert memo.compute(("z",), lambda: "computed") == "computed" and not claim.exists()
    child.wait()


def test_a_failing_computation_releases_its_claim(tmp_path):
    memo = ResultMemo(tmp_path)

    def boom():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        memo.compute(("c",), boom)
    assert not list(tmp_path.glob("*.claim")) and memo.compute(("c",), lambda: 3) == 3


def test_kvquant_real_cells_share_a_key_below_its_subsample_size_only():
    """KVQuant's seed only picks k-means' subsample: with the cell's data (and calibration) shapes below
    calib_samples dense values per layer the key is seed-free; above it, or without shapes, it is None."""
    s = Settings()

    def key(seed, shapes):
        return seed_free_key(_cell("kvquant", seed), create("kvquant", 2, 2, seed=seed), s, _run, (1,), shapes)

    small = ((30, 3, 1024, 64), (30, 3, 1024, 64))  # 192 channels · 1014 dense tokens < 2^18
    assert key(0, small) == key(1, small) is not None
    assert key(0, ((30, 3, 1024, 64), (30, 3, 2048, 64))) is None  # the calibration batch subsamples
    assert key(0, ()) is None
    assert seed_free_key(_cell("turboquant", 0), create("turboquant", 2, 2), s, _run, (1,), small) is None


def test_seed_groups_are_runs_of_the_seed_list_whatever_runs_first():
    from kvqbench.plugin.sharing import seed_group

    assert [seed_group(s, [0, 1, 2]) for s in (0, 1, 2)] == [[0, 1, 2]] * 3
    assert [seed_group(s, [4, 0, 3, 1, 2]) for s in (0, 2, 3, 4)] == [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4]]
    assert seed_group(7, [0, 1, 2]) == [7]  # a seed the session does not sweep: alone
    assert seed_group(1, [0, 1, 2], size=1) == [1]


class _Res:
    def __init__(self, seed, method_seed):
        self.metrics = {"seed": float(seed), "method_seed": float(method_seed)}
        self.extra = {}


def test_seed_rows_compute_a_group_once_and_hand_each_seed_its_own_result(tmp_path):
    from kvqbench.plugin.sharing import seed_rows

    calls = []

    def rows(methods, seeds):
        calls.append(list(seeds))
        return [_Res(s, m.seed) for m, s in zip(methods, seeds)]

    s = Settings()
    memo = ResultMemo(tmp_path)
    got = {}
    for seed in (1, 0, 2):  # whichever cell runs first computes the group
        c = _cell("turboquant", seed)
        got[seed] = seed_rows(c, create("turboquant", 2, 2, seed=seed), s, memo, rows)
    assert calls == [[0, 1, 2]]
    for seed, r in got.items():  # each its own seed's result, from a method seeded with it
        assert r.metrics == {"seed": float(seed), "method_seed": float(seed)}
        assert r.extra["seeds_computed_together"] == [0, 1, 2]
    # another process sharing the folder finds the group done; other bits are another group
    assert seed_rows(_cell("turboquant", 2), create("turboquant", 2, 2, seed=2), s, ResultMemo(tmp_path),
                     rows).metrics["seed"] == 2.0 and len(calls) == 1
    seed_rows(_cell("turboquant", 0, bits=4), create("turboquant", 4, 4, seed=0), s, memo, rows)
    assert len(calls) == 2


def test_a_claim_is_one_processes_until_released_and_waiters_get_the_value(tmp_path):
    import threading

    a, b = ResultMemo(tmp_path), ResultMemo(tmp_path)
    assert a.claim(("g",)) and not b.claim(("g",))  # the folder decides: one claimant
    a.release(("g",))
    assert b.claim(("g",)) and ResultMemo().claim(("g",))  # released: claimable; no folder: always own
    threading.Timer(0.3, lambda: b.put(("v",), 42)).start()
    assert a.wait(("v",), ("g",)) == (True, 42)  # the claimant stored it
    b.release(("g",))
    assert a.wait(("w",), ("g",)) == (False, None)  # no claim held: nothing to wait for


def test_seed_rows_started_while_another_worker_computes_the_group_waits_for_it(tmp_path):
    import threading
    import time

    from kvqbench.plugin.sharing import seed_rows

    calls = []

    def rows(methods, seeds):
        calls.append(list(seeds))
        time.sleep(0.5)
        return [_Res(s, m.seed) for m, s in zip(methods, seeds)]

    s = Settings()
    first = threading.Thread(target=seed_rows, args=(_cell("kvquant", 0), create("kvquant", 2, 2, seed=0), s,
                                                     ResultMemo(tmp_path), rows))
    first.start()
    time.sleep(0.2)  # the group is being computed by the other "worker"
    got = seed_rows(_cell("kvquant", 1), create("kvquant", 2, 2, seed=1), s, ResultMemo(tmp_path), rows)
    first.join()
    assert calls == [[0, 1, 2]] and got.metrics == {"seed": 1.0, "method_seed": 1.0}


class _Trap:
    """A pickle that, when loaded, creates ``marker``: proof that a file was unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _plant(folder, key, marker):
    """A result file for ``key`` in ``folder`` that creates ``marker`` when loaded (as another user could plant)."""
    path = Path(folder) / f"{ResultMemo.digest(key)}.pkl"
    path.write_bytes(pickle.dumps(_Trap(marker)))
    return path


def test_a_planted_result_in_the_users_own_folder_is_loaded(tmp_path):
    # the control for the refusals below: a file planted in a private folder IS unpickled
    (tmp_path / "memo").mkdir(mode=0o700)
    _plant(tmp_path / "memo", ("k",), tmp_path / "loaded")
    path = tmp_path / "memo" / f"{ResultMemo.digest(('k',))}.pkl"
    path.chmod(0o600)
    assert ResultMemo(tmp_path / "memo").get(("k",))[0] and (tmp_path / "loaded").exists()


def test_a_world_writable_folder_is_refused_and_recomputed(tmp_path):
    folder = tmp_path / "memo"
    folder.mkdir()
    folder.chmod(0o777)
    _plant(folder, ("k",), tmp_path / "loaded")
    with pytest.warns(RuntimeWarning, match=r"result memo not shared \(folder .* is writable by group or others"):
        memo = ResultMemo(folder)
    assert memo.folder is None
    assert memo.compute(("k",), lambda: "computed") == "computed" and memo.misses == 1
    assert not (tmp_path / "loaded").exists()


def test_a_folder_of_another_user_is_refused(tmp_path):
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    folder = tmp_path / "memo"
    folder.mkdir(mode=0o700)
    _plant(folder, ("k",), tmp_path / "loaded")
    os.chown(folder, 65534, 65534)
    with pytest.warns(RuntimeWarning, match="belongs to another user"):
        memo = ResultMemo(folder)
    assert memo.compute(("k",), lambda: "computed") == "computed" and not (tmp_path / "loaded").exists()


@pytest.mark.parametrize("owner_or_mode", ["mode", "owner"])
def test_a_writable_or_foreign_result_file_is_refused_once_and_recomputed(tmp_path, owner_or_mode):
    folder = tmp_path / "memo"
    folder.mkdir(mode=0o700)
    planted = [_plant(folder, (k,), tmp_path / f"loaded-{k}") for k in ("a", "b")]
    for p in planted:
        if owner_or_mode == "mode":
            p.chmod(0o666)
        elif hasattr(os, "geteuid") and os.geteuid() == 0:
            p.chmod(0o600)
            os.chown(p, 65534, 65534)
        else:
            pytest.skip("giving a file to another user needs root")
    memo = ResultMemo(folder)
    with pytest.warns(RuntimeWarning, match="result memo file refused") as record:
        assert memo.compute(("a",), lambda: "A") == "A" and memo.compute(("b",), lambda: "B") == "B"
    assert len([w for w in record if "result memo" in str(w.message)]) == 1  # said once
    assert memo.misses == 2 and not list(tmp_path.glob("loaded-*"))


def test_seed_rows_compute_a_bits_free_methods_group_once_for_every_bit_width(tmp_path):
    from kvqbench.plugin.sharing import seed_rows

    calls = []

    def rows(methods, seeds):
        calls.append((methods[0].k_bits, list(seeds)))
        return [_Res(s, m.seed) for m, s in zip(methods, seeds)]

    s, memo = Settings(), ResultMemo(tmp_path)
    at2 = seed_rows(_cell("fp16", 0), create("fp16", 2, 2, seed=0), s, memo, rows)
    at4 = {seed: seed_rows(_cell("fp16", seed, bits=4), create("fp16", 4, 4, seed=seed), s, ResultMemo(tmp_path), rows)
           for seed in (0, 1, 2)}
    assert calls == [(2, [0, 1, 2])]  # the fp16 control: one computation for both bit-widths
    assert at4[0].metrics == at2.metrics == {"seed": 0.0, "method_seed": 0.0}
    assert [at4[seed].metrics["seed"] for seed in (1, 2)] == [1.0, 2.0]
    seed_rows(_cell("rtn_token", 0), create("rtn_token", 2, 2, seed=0), s, memo, rows)
    seed_rows(_cell("rtn_token", 0, bits=4), create("rtn_token", 4, 4, seed=0), s, memo, rows)
    assert calls[1:] == [(2, [0, 1, 2]), (4, [0, 1, 2])]  # any other method: a group per bit-width
