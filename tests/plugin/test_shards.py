"""Sharded runs: ``--kvq-shard I/N`` partitions the cell matrix the same way on every machine, and
``kvqbench merge`` of the shards gives what one session gives — through the command line, through a
local Ray instance (``kvqbench run --ray``) and through a real Ray cluster the test starts as a user would
(``ray start --head``) and joins by its address (``--ray HOST:PORT`` and ``--ray ray://HOST:PORT``).

The single-session run and the three shards are made once per test session (under pytest-xdist too: the
first worker makes them under a file lock in the session's shared temporary folder, as pytest-xdist
documents for session fixtures) and reused by the tests below.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import given
from hypothesis import strategies as st

from kvqbench.metrics import NONDETERMINISTIC_METRICS
from kvqbench.report.render.markdown import render_markdown
from kvqbench.shard import split

ROOT = Path(__file__).resolve().parents[2]
#: a lean smoke matrix: exp1 reconstruction and exp4 cost (which has timing metrics), two methods, one seed
SELECT = ["tests/bench", "-m", "smoke", "--kvq-methods", "fp16,rtn_token", "--kvq-seeds", "1",
          "-k", "reconstruction or cost", "--kvq-progress", "0", "-p", "no:cacheprovider", "-q"]
N_CELLS = 14


#: an inner pytest is a session of its own: under an outer `-n auto` the worker's variables would make
#: pytest-benchmark think it runs under xdist and switch itself off (no benchmark_exp4.json)
XDIST_VARS = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID")


def _pytest(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in XDIST_VARS}
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


def _kvqbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvqbench.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, worker_id) -> Path:
    """``single/`` (one session, serial) and ``shard1..3/`` (``--kvq-shard i/3``) of the same matrix,
    each in its own process (so each under its own random hash seed)."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # xdist: the session's folder above the workers' own
        shared = shared.parent
    base = shared / "kvqbench-shard-runs"
    with FileLock(str(base) + ".lock"):
        if not (base / "done").exists():
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir()
            r = _pytest(*SELECT, "--kvq-out", str(base / "single"))
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
            for i in (1, 2, 3):
                r = _pytest(*SELECT, "--kvq-shard", f"{i}/3", "--kvq-out", str(base / f"shard{i}"))
                assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
            (base / "done").write_text("")
    return base


def _load(p: Path):
    return json.loads(p.read_text(encoding="utf-8"))


def _without_timings(board: dict) -> dict:
    """The leaderboard with the run-to-run timing metrics and the provenance (start time, command)
    taken out: what must be identical between any two runs of the same cells."""
    b = copy.deepcopy(board)
    b["provenance"] = {}
    for src in b["sources"].values():
        for by_method in src["stats"].values():
            for by_setting in by_method.values():
                for metrics in by_setting.values():
                    for m in NONDETERMINISTIC_METRICS:
                        metrics.pop(m, None)
        for m in NONDETERMINISTIC_METRICS:
            src["rankings"].pop(m, None)
    return b


def _result(folder: Path) -> tuple[dict, dict, str]:
    """(cells by file: identity, status, metrics without timings, per-layer values and series;
    the leaderboard without timings; its Markdown)."""
    cells = {}
    for f in sorted(folder.glob("exp*_*.json")):
        cells[f.name] = [(c["nodeid"], c["status"], {k: v for k, v in c["metrics"].items() if k not in NONDETERMINISTIC_METRICS},
                          c.get("per_layer"), c.get("series")) for c in _load(f)["cells"]]
    board = _load(folder / "leaderboard.json")
    # the Markdown on disk is exactly the leaderboard rendered, so comparing rendered boards compares the files
    assert (folder / "LEADERBOARD.md").read_text(encoding="utf-8") == render_markdown(board)
    b = _without_timings(board)
    return cells, b, render_markdown(b)


def _assert_same_run(merged: Path, single: Path) -> None:
    cells_m, board_m, md_m = _result(merged)
    cells_s, board_s, md_s = _result(single)
    assert sum(len(v) for v in cells_s.values()) == N_CELLS
    assert cells_m == cells_s  # every metric value, per-layer value and series, in the same order
    for src in board_s["sources"]:
        assert board_m["sources"][src]["rankings"] == board_s["sources"][src]["rankings"]
    assert board_m == board_s
    assert md_m == md_s  # byte-identical Markdown, timings aside
    assert board_m["completeness"]["complete"] is True


# ------------------------------------------------------------------------------------------------
@given(durations=st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=0, max_size=40),
       count=st.integers(1, 7))
def test_split_is_a_balanced_partition(durations, count):
    ids = [f"tests/bench/t.py::test_x[c{i}]" for i in range(len(durations))]
    d = dict(zip(ids, durations))
    shards = split(ids, count, d)
    assert len(shards) == count
    flat = [n for s in shards for n in s]
    assert sorted(flat) == sorted(ids) and len(flat) == len(set(flat))  # each cell in exactly one shard
    for s in shards:  # collection order kept inside a shard
        assert s == [n for n in ids if n in set(s)]
    # greedy list scheduling (Graham 1966): the most loaded shard exceeds the mean load by at most one cell
    loads = [sum(d[n] for n in s) for s in shards]
    assert max(loads) <= sum(durations) / count + max(durations, default=0.0) + 1e-9
    assert split(ids, count, d) == shards  # a pure function of its inputs


@given(durations=st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=0, max_size=40),
       labels=st.lists(st.integers(0, 9), min_size=40, max_size=40), count=st.integers(1, 7))
def test_split_keeps_each_unit_in_one_shard_and_balances_the_units(durations, labels, count):
    ids = [f"tests/bench/t.py::test_x[c{i}]" for i in range(len(durations))]
    d = dict(zip(ids, durations))
    unit = {n: f"u{labels[i]}" for i, n in enumerate(ids)}
    shards = split(ids, count, d, unit=unit.__getitem__)
    flat = [n for s in shards for n in s]
    assert sorted(flat) == sorted(ids) and len(flat) == len(set(flat))
    for s in shards:
        assert s == [n for n in ids if n in set(s)]
    where = {unit[n]: i for i, s in enumerate(shards) for n in s}
    assert all(where[unit[n]] == i for i, s in enumerate(shards) for n in s)  # a unit never straddles shards
    unit_load: dict[str, float] = {}
    for n in ids:
        unit_load[unit[n]] = unit_load.get(unit[n], 0.0) + d[n]
    loads = [sum(d[n] for n in s) for s in shards]  # Graham's bound, over the units
    assert max(loads, default=0.0) <= sum(durations) / count + max(unit_load.values(), default=0.0) + 1e-9
    assert split(ids, count, d, unit=unit.__getitem__) == shards


def test_real_seed_groups_are_one_shard_unit():
    from kvqbench.plugin.sharing import seed_group, shard_unit
    from kvqbench.plugin.state import Settings

    seeds = [0, 1, 2, 3, 4]
    s = Settings(seeds=seeds, windows=seeds)
    real = "tests/bench/test_exp5_endtoend.py::test_endtoend[kivi-k2v2-seed{}-real-full]"
    units = {n: shard_unit(real.format(n), s) for n in seeds}
    for a in seeds:  # same unit exactly when the seeds are computed together
        for b in seeds:
            assert (units[a] == units[b]) == (b in seed_group(a, seeds))
    synthetic = real.replace("-real-", "-synthetic-")
    assert len({shard_unit(synthetic.format(n), s) for n in seeds}) == len(seeds)  # independent cells


def test_shards_are_the_same_under_any_hash_seed_and_cover_the_matrix(runs):
    # the three shard sessions ran in separate processes, each with a random hash seed
    shards = [_load(runs / f"shard{i}" / "shard.json")["selected"] for i in (1, 2, 3)]
    flat = [n for s in shards for n in s]
    assert len(flat) == len(set(flat)) == N_CELLS and all(shards)
    assert sorted(flat) == sorted(_load(runs / "shard1" / "shard.json")["cells"])
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    before = _tree(ROOT / "results")
    r = _pytest(*SELECT, "--collect-only", "--kvq-shard", "2/3", env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [ln for ln in r.stdout.splitlines() if "::" in ln] == shards[1]
    assert _tree(ROOT / "results") == before and "kvqbench: wrote" not in r.stdout  # listing writes nothing


def _tree(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` with its modification time (ns)."""
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else {}


def test_three_shards_merge_to_the_single_session(runs, tmp_path):
    for i in (1, 2, 3):
        doc = _load(runs / f"shard{i}" / "shard.json")
        assert doc["shard"] == f"{i}/3" and len(doc["cells"]) == N_CELLS
        board = _load(runs / f"shard{i}" / "leaderboard.json")
        assert board["completeness"]["complete"] is False  # a shard alone is stamped as a part
    r = _kvqbench("merge", *(str(runs / f"shard{i}") for i in (3, 1, 2)), "--out", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "complete: 14 cells" in r.stdout
    _assert_same_run(tmp_path / "merged", runs / "single")
    prov = _load(tmp_path / "merged" / "leaderboard.json")["provenance"]
    assert prov["merged"]["shards"] == 3 and "--kvq-shard" not in prov["command"]
    assert "reconstruction or cost" in shlex.split(prov["command"])  # the -k expression, still one argument
    # exp4's pytest-benchmark records: the merged file holds exactly the timed cells of the single session
    bench = [_load(runs / f"shard{i}" / "benchmark_exp4.json")["benchmarks"]
             for i in (1, 2, 3) if (runs / f"shard{i}" / "benchmark_exp4.json").is_file()]
    single = _load(runs / "single" / "benchmark_exp4.json")["benchmarks"]
    merged = _load(tmp_path / "merged" / "benchmark_exp4.json")["benchmarks"]
    assert single and sorted(b["fullname"] for b in merged) == sorted(b["fullname"] for b in single)
    assert len(merged) == sum(len(b) for b in bench)


def test_merge_lists_missing_cells_and_stamps_the_result_incomplete(runs, tmp_path):
    r = _kvqbench("merge", str(runs / "shard1"), str(runs / "shard3"), "--out", str(tmp_path / "m"), "--no-figures")
    assert r.returncode == 1
    missing = set(_load(runs / "shard2" / "shard.json")["selected"])
    assert f"{len(missing)} of {N_CELLS} cells missing" in r.stderr
    assert all(n in r.stderr for n in list(missing)[:10])
    board = _load(tmp_path / "m" / "leaderboard.json")
    assert board["completeness"]["complete"] is False
    assert set(board["completeness"]["not_run_ids"]) == missing
    assert "missing shard(s) 2" in board["completeness"]["summary"]
    assert "INCOMPLETE" in (tmp_path / "m" / "LEADERBOARD.md").read_text()


def test_merge_refuses_shards_of_different_runs_in_one_line(runs, tmp_path):
    other = tmp_path / "other2"
    shutil.copytree(runs / "shard2", other)
    doc = _load(other / "shard.json")
    doc["provenance"]["git_commit"] = "0123456789ab"
    (other / "shard.json").write_text(json.dumps(doc))
    r = _kvqbench("merge", str(runs / "shard1"), str(other), "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and not (tmp_path / "m").exists()
    assert len(r.stderr.strip().splitlines()) == 1 and "differ in git commit" in r.stderr and "0123456789ab" in r.stderr

    doc["provenance"]["git_commit"] = _load(runs / "shard1" / "shard.json")["provenance"]["git_commit"]
    doc["provenance"]["seeds"] = [0, 1]
    (other / "shard.json").write_text(json.dumps(doc))
    r = _kvqbench("merge", str(runs / "shard1"), str(other), "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and "differ in seeds: [0, 1] vs [0]" in r.stderr

    r = _kvqbench("merge", str(runs / "shard1"), str(runs / "shard1"), "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and "shard 1/3 given twice" in r.stderr

    dup = tmp_path / "dup"  # shard 1's cells relabelled as shard 2: every cell twice
    shutil.copytree(runs / "shard1", dup)
    d = _load(dup / "shard.json")
    d.update(index=2, shard="2/3")
    (dup / "shard.json").write_text(json.dumps(d))
    r = _kvqbench("merge", str(runs / "shard1"), str(dup), "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and "appear in more than one folder" in r.stderr

    r = _kvqbench("merge", str(runs / "single"), "--out", str(tmp_path / "m"))
    assert r.returncode == 2 and "no shard.json" in r.stderr


def test_ray_run_on_a_local_cluster_merges_to_the_single_session(runs, tmp_path):
    pytest.importorskip("ray", reason="needs Ray (pip install -e '.[dist]')")
    out = tmp_path / "ray"
    r = subprocess.run([sys.executable, "-m", "kvqbench.cli", "run", "--ray", "--shards", "2", "--smoke",
                        "--no-real", *SELECT[3:], "--kvq-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "started a local Ray instance" in r.stdout
    for i in (1, 2):
        assert f"shard {i}/2 finished" in r.stdout
        assert (out / "shards" / f"shard-{i}-of-2" / "shard.json").is_file()
    _assert_same_run(out, runs / "single")
    # smoke, as in one session: no pytest-benchmark table from the shards, no figures from the merge
    assert "Name (time in" not in r.stdout + r.stderr and not list(out.glob("*.png"))
    # what the user reads: each shard's own kvqbench lines and pytest summary, headed by the shard, no colour
    # codes in a pipe, no Ray start-up notes; the shards' whole output is in their pytest.log
    text = r.stdout + r.stderr
    assert "\x1b[" not in text and "Token authentication" not in text and "repeated" not in text
    assert "test session starts" not in text
    for i in (1, 2):
        assert f"shard {i}/2: kvqbench: wrote" in r.stdout
        assert re.search(rf"shard {i}/2: \d+ passed, \d+ deselected in [0-9.]+s", r.stdout), r.stdout
        log = (out / "shards" / f"shard-{i}-of-2" / "pytest.log").read_text()
        assert "kvqbench: wrote" in log and "passed" in log and len(log.splitlines()) > 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_cluster():
    """A one-CPU Ray cluster started as a user starts one (``ray start --head --block`` in its own
    session, Ray's token authentication on, with a token of its own rather than ~/.ray's), and the
    environment a driver needs to join it; ended by SIGTERM to that process (it stops what it started;
    not ``ray stop``, which would end every Ray instance of this user on the machine)."""
    pytest.importorskip("ray", reason="needs Ray (pip install -e '.[dist]')")
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        pytest.skip(f"no `ray` command beside {sys.executable}")
    tmp = Path(tempfile.mkdtemp(prefix="kvq-ray-"))  # short: Ray's socket paths live under it
    port, client_port = _free_port(), _free_port()
    env = {**{k: v for k, v in os.environ.items() if k not in XDIST_VARS and k != "RAY_ADDRESS"},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    log = open(tmp / "ray-start.log", "w+")
    proc = subprocess.Popen([str(ray_bin), "start", "--head", "--port", str(port), "--ray-client-server-port",
                             str(client_port), "--num-cpus", "1", "--temp-dir", str(tmp / "ray"),
                             "--include-dashboard=false", "--disable-usage-stats", "--block"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 90
        while "Ray runtime started" not in (tmp / "ray-start.log").read_text():
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("ray start --head did not start:\n" + (tmp / "ray-start.log").read_text()[-3000:])
            time.sleep(0.5)
        yield {"address": f"127.0.0.1:{port}", "client": f"ray://127.0.0.1:{client_port}", "env": env}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session ray start made for itself above
            proc.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_run_through_a_started_clusters_address_merges_to_the_single_session(runs, ray_cluster, tmp_path):
    for form in ("address", "client"):
        address, out = ray_cluster[form], tmp_path / form
        r = subprocess.run([sys.executable, "-m", "kvqbench.cli", "run", "--ray", address, "--smoke", "--no-real",
                            *SELECT[3:], "--kvq-out", str(out)], cwd=ROOT, capture_output=True, text=True,
                           timeout=180, env=ray_cluster["env"])
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"joined {address} (1 CPU)" in r.stdout and "shard 1/1 finished" in r.stdout
        assert r.stdout.startswith("kvqbench run --ray: pytest tests/bench -m smoke")  # what runs, once joined
        assert (out / "shards" / "shard-1-of-1" / "shard.json").is_file()
        _assert_same_run(out, runs / "single")
    # the same cluster without the token: Ray refuses the join; one line says what to set (one retry)
    env = {k: v for k, v in ray_cluster["env"].items() if not k.startswith("RAY_AUTH")}
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "kvqbench.cli", "run", "--ray", ray_cluster["address"], "--smoke",
                        "--no-real", "--kvq-out", str(tmp_path / "refused")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**env, "RAY_gcs_server_port_wait_time_s": "1"})
    lines = (r.stdout + r.stderr).splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    assert "token authentication: set RAY_AUTH_MODE=token" in lines[0] and time.time() - t0 < 60
    assert not (tmp_path / "refused").exists()


SBATCH_STANDIN = r'''#!/usr/bin/env bash
# a stand-in for Slurm's sbatch (the Slurm contract the script relies on): options, then the script and
# its arguments; --array=A-B runs the script once per index with SLURM_ARRAY_TASK_ID set; --parsable prints
# the job id. It runs every job at once, in the foreground, in submission order.
array=""; out=/dev/null
while [[ "$1" == --* ]]; do
    case "$1" in --array=*) array="${1#--array=}" ;; --output=*) out="${1#--output=}" ;; esac
    echo "$1" >> "$SBATCH_LOG"
    shift
done
if [ -n "$array" ]; then
    range="${array%%\%*}"
    for i in $(seq "${range%-*}" "${range#*-}"); do
        SLURM_ARRAY_TASK_ID=$i bash "$@" > "${out//%a/$i}" 2>&1 || true
    done
else
    bash "$@" > "$out" 2>&1 || true
fi
echo "$RANDOM"
'''


def test_slurm_array_script_runs_the_shards_and_a_dependent_merge(tmp_path):
    standin = tmp_path / "bin"
    standin.mkdir()
    (standin / "sbatch").write_text(SBATCH_STANDIN)
    (standin / "sbatch").chmod(0o755)
    out = tmp_path / "results"
    env = {**os.environ, "PATH": f"{standin}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "KVQ_OUT": str(out), "KVQ_VENV": str(tmp_path / "no-venv"), "SBATCH_LOG": str(tmp_path / "sbatch.log"),
           "KVQ_SBATCH_ARGS": "--gres=gpu:1"}
    # 3 shards of 2 cells: one shard gets none (exit 5 from pytest is not a failure)
    r = subprocess.run(["bash", "scripts/slurm_array.sh", "3", "--smoke", "--no-real", "-n", "0",
                        "--kvq-methods", "fp16", "--kvq-bits", "2,4", "--kvq-seeds", "1", "-k", "reconstruction",
                        "--kvq-progress", "0", "-p", "no:cacheprovider"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "merge job" in r.stdout
    opts = (tmp_path / "sbatch.log").read_text().splitlines()
    assert "--array=1-3" in opts and "--gres=gpu:1" in opts and any(o.startswith("--dependency=afterany:") for o in opts)
    merge_log = (out / "slurm" / "merge.log").read_text()
    assert "complete: 2 cells" in merge_log, merge_log + "".join(
        (out / "slurm" / f"shard-{i}.log").read_text()[-1500:] for i in (1, 2, 3))
    assert sorted(p.name for p in (out / "shards").iterdir()) == [f"shard-{i}-of-3" for i in (1, 2, 3)]
    board = _load(out / "leaderboard.json")
    assert board["completeness"]["complete"] is True and board["completeness"]["expected"] == 2
    assert sorted(board["sources"]["synthetic"]["stats"]["exp1"]["fp16"]) == ["k2v2", "k4v4"]


def test_missing_cells_note_counts_per_test_and_lists_one_per_line():
    from kvqbench.results.merge import missing_cells_note

    ids = [f"tests/bench/test_exp{e}.py::test_exp{e}[m-k2v2-seed{s}-synthetic-smoke]" for e in (1, 5) for s in range(7)]
    text = missing_cells_note(ids, 50)
    lines = text.splitlines()
    assert lines[0] == "kvqbench merge: 14 of 50 cells missing (test_exp1 ×7, test_exp5 ×7):"
    assert lines[1:11] == [f"  {n}" for n in ids[:10]]
    assert lines[11] == "  … and 4 more (all in leaderboard.json: completeness.not_run_ids)" and len(lines) == 12
    assert missing_cells_note(ids[:2], 50).splitlines()[1:] == [f"  {n}" for n in ids[:2]]


def test_a_failing_shard_prints_the_end_of_its_output_and_keeps_all_of_it(capsys):
    """shard_task (what a Ray task runs; plain Python) forwards kvqbench's and pytest's summary lines only;
    when the shard fails it also prints the last lines of its output, and returns the whole of it as the
    shard's pytest.log."""
    from kvqbench.dist import SHARD_LOG, shard_task

    r = shard_task(1, 2, ["tests/bench", "-m", "smoke", "--kvq-bits", "2,,4", "-p", "no:cacheprovider"], str(ROOT))
    out = capsys.readouterr().out
    assert r["rc"] == 4  # pytest's usage error
    log = r["files"][SHARD_LOG].decode()
    assert "--kvq-bits expects a comma list" in log
    assert "shard 1/2 | " in out and "--kvq-bits expects a comma list" in out
