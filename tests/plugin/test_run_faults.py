"""Faults at the run level (issue 9): an interrupted or failing run never replaces a complete result set
and says it is incomplete; a bad results folder and an unloadable model stop the run before any cell with
one line. pytester subprocesses, a few seconds each."""

from __future__ import annotations

import importlib.util
import json

import pytest

# torch (and numpy) imported before any in-process pytester run: pytester drops the modules first
# imported inside a run, and neither can be imported twice in one process
import torch  # noqa: F401

from tests.plugin import inner_session

pytest_plugins = ["pytester"]

# STOP_AT: the node id fragment at which a cell raises KeyboardInterrupt (Ctrl-C) / fails
CELL_TEST = '''
import os, pathlib
import pytest
from kvqbench.experiments.reconstruction import run_reconstruction

pytestmark = pytest.mark.kvq(experiment="exp1")

def test_reconstruction(request, cell, kvq_method, kvq_data, kvq_record, benchmark):
    pathlib.Path(os.environ["RAN_MARKER"]).write_text("a cell ran")
    benchmark.pedantic(kvq_method.roundtrip, args=(kvq_data.k, "k"), rounds=1, iterations=1)
    if os.environ.get("STOP_AT") and os.environ["STOP_AT"] in request.node.nodeid:
        raise KeyboardInterrupt
    if os.environ.get("FAIL_AT") and os.environ["FAIL_AT"] in request.node.nodeid:
        raise RuntimeError("injected failure")
    kvq_record(run_reconstruction(kvq_method, kvq_data))
'''

ARGS = ["-p", "no:cacheprovider", "-m", "smoke", "--kvq-methods", "fp16,kivi", "--kvq-bits", "2,16",
        "--kvq-seeds", "2",  # 2 methods × 2 bits × 2 seeds = 8 cells
        "--kvq-fresh"]  # every run computes its cells: the faults come from the environment, which no reuse key holds


@pytest.fixture
def run(pytester, monkeypatch):
    args = inner_session(pytester, monkeypatch, ARGS, CELL_TEST)
    marker = pytester.path / "ran"
    monkeypatch.setenv("RAN_MARKER", str(marker))

    def go(*extra, **env):
        for k in ("STOP_AT", "FAIL_AT"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        if marker.exists():
            marker.unlink()
        return pytester.runpytest_subprocess(*args, *extra)

    go.marker = marker
    return go


def _files(folder):
    """The files of the result set in ``folder`` (the run journal beside it is no part of it)."""
    from kvqbench.journal import JOURNAL_NAME

    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != JOURNAL_NAME}


def test_two_narrowing_runs_keep_both_broader_sets_in_previous(pytester, run):
    """The issue's sequence: a complete run, then ``-k kivi``, then ``-k "kivi and k2v2"``. Each displaced
    complete set moves, with pytest-benchmark's JSON of that set, to a folder of its own under previous/,
    and one line says where; the folder then holds the narrowest set with its own timings."""
    out = pytester.path / "out"
    run("--kvq-out", str(out)).assert_outcomes(passed=8)
    complete = _files(out)
    res = run("--kvq-out", str(out), "-k", "kivi")
    assert res.ret == 0
    kivi = _files(out)
    (first,) = (out / "previous").iterdir()
    assert _files(first) == complete  # every file of the broader set, its timings included
    res.stdout.fnmatch_lines([f"kvqbench: the complete set of 8 cells (run * UTC) that was in {out} is kept in {first}"])
    res = run("--kvq-out", str(out), "-k", "kivi and k2v2", "--kvq-keep", "2")
    assert res.ret == 0
    second = next(p for p in (out / "previous").iterdir() if p != first)
    assert _files(first) == complete and _files(second) == kivi  # both kept
    res.stdout.fnmatch_lines([f"kvqbench: the complete set of 4 cells (run * UTC) that was in {out} is kept in {second}"])
    narrow = json.loads((out / "benchmark_exp4.json").read_text())["benchmarks"]
    assert len(narrow) == 2 and all("kivi-k2v2" in b["fullname"] for b in narrow)
    assert json.loads((out / "leaderboard.json").read_text())["completeness"]["expected"] == 2


def test_interrupt_and_x_keep_the_complete_set_and_stamp_the_partial_one(pytester, run):
    out = pytester.path / "out"
    run("--kvq-out", str(out)).assert_outcomes(passed=8)
    complete = _files(out)
    assert json.loads(complete["leaderboard.json"])["completeness"]["summary"] == "complete: 8 cells"
    assert len(json.loads(complete["benchmark_exp4.json"])["benchmarks"]) == 8  # pytest-benchmark's own JSON

    res = run("--kvq-out", str(out), STOP_AT="kivi-k2v2-seed1")  # Ctrl-C in the 6th cell
    assert res.ret == pytest.ExitCode.INTERRUPTED
    assert _files(out) == complete  # the complete set is untouched
    inc = out / "incomplete"
    board = json.loads((inc / "leaderboard.json").read_text())
    assert board["completeness"]["complete"] is False
    assert board["completeness"]["summary"] == "incomplete: 5 of 8 cells finished, 3 not run, interrupted"
    assert (inc / "summary.json").read_text().splitlines()[1].strip() == '"completeness": {'
    assert "incomplete: 5 of 8 cells finished" in (inc / "LEADERBOARD.md").read_text().splitlines()[2]
    assert len(json.loads((inc / "benchmark_exp4.json").read_text())["benchmarks"]) == 6  # beside its own set (the 6th cell timed before its Ctrl-C)
    res.stdout.fnmatch_lines(["*the complete results in*are kept*incomplete*",
                              "kvqbench: incomplete: 5 of 8 cells finished, 3 not run, interrupted"])

    res = run("--kvq-out", str(out), "-x", FAIL_AT="fp16-k16v16-seed0")  # -x: stops after the 3rd cell
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    assert _files(out) == complete
    comp = json.loads((inc / "summary.json").read_text())["completeness"]
    assert comp["summary"] == "incomplete: 3 of 8 cells finished, 1 failed, 5 not run, stopping after 1 failures (-x/--maxfail)"

    res = run("--kvq-out", str(out), "-n", "2", FAIL_AT="kivi-k2v2-seed0")  # xdist, one failed cell
    res.assert_outcomes(passed=7, failed=1)
    assert _files(out) == complete
    comp = json.loads((inc / "leaderboard.json").read_text())["completeness"]
    assert comp["summary"] == "incomplete: 8 of 8 cells finished, 1 failed"


@pytest.mark.parametrize("case", ["file", "under_file", "read_only"])
def test_a_bad_results_folder_stops_the_run_before_any_cell(pytester, run, case):
    import os

    target = pytester.path / "target"
    if case == "read_only":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            pytest.skip("root can write into read-only folders")
        target.mkdir()
        target.chmod(0o555)
        want = f"{target} is not writable"
    else:
        target.write_text("a file")
        want = f"{target} is a file, not a folder"
        if case == "under_file":
            target = target / "sub"
            want = f"{target} cannot be created: {target.parent} is a file, not a folder"
    try:
        res = run("--kvq-out", str(target))
    finally:
        if case == "read_only":
            target.chmod(0o755)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert not run.marker.exists(), "a cell ran before the folder check"
    errors = [ln for ln in res.stderr.lines if ln.startswith("ERROR:")]
    assert errors == [f"ERROR: kvqbench: cannot write results: {want} (pass --kvq-out DIR with a folder of your own)"]


@pytest.mark.parametrize("case", ["empty", "published"])
def test_an_empty_or_published_results_folder_stops_the_run_before_any_cell(pytester, run, case):
    """``--kvq-out ''`` would write into the current folder, and a published leaderboard folder is written
    only by ``kvqbench publish``: both are one line before any cell, and a published folder is untouched."""
    from kvqbench.results.publish import _FOLDER_README

    if case == "empty":
        target, want = "", "an empty folder name (it would write into the current folder)"
    else:
        pub = pytester.path / "leaderboard"
        pub.mkdir()
        (pub / "README.md").write_text(_FOLDER_README)
        target = str(pub)
        want = (f"{pub} holds a published leaderboard ({pub / 'README.md'} says so): run into another folder "
                "and publish from there with kvqbench publish")
    res = run("--kvq-out", target)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert not run.marker.exists(), "a cell ran before the folder check"
    errors = [ln for ln in res.stderr.lines if ln.startswith("ERROR:")]
    assert errors == [f"ERROR: kvqbench: cannot write results: {want} (pass --kvq-out DIR with a folder of your own)"]
    if case == "published":
        assert sorted(q.name for q in pub.iterdir()) == ["README.md"]


def test_pytest_help_lists_the_options(pytester) -> None:
    """``pytest --help`` shows the plugin's options (no configure-time error on unparsed defaults)."""
    res = pytester.runpytest_subprocess("--help")
    assert res.ret == 0
    assert any("--kvq-progress" in ln for ln in res.outlines)


def test_a_model_without_real_cells_stops_the_run_before_any_cell(pytester, run):
    """``--kvq-model`` without ``--kvq-real`` (``kvqbench run --smoke`` or ``--no-real``): no cell would use
    the model, so the run stops with one line instead of running synthetic cells as if it had."""
    res = run("--kvq-model", "/nonexistent", "--kvq-out", str(pytester.path / "o"))
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert not run.marker.exists(), "a cell ran before the model check"
    errors = [ln for ln in res.stderr.lines if ln.startswith("ERROR:")]
    assert errors == ["ERROR: kvqbench: --kvq-model /nonexistent is the model of the real-model cells, and none runs "
                      "without --kvq-real (kvqbench run --smoke and --no-real run synthetic cells only): add "
                      "--kvq-real, or drop --kvq-model"]
    res = run("--kvq-real", "--kvq-model", "/nonexistent", "--kvq-out", str(pytester.path / "o"))
    assert res.ret == pytest.ExitCode.USAGE_ERROR and not run.marker.exists()
    errors = [ln for ln in res.stderr.lines if ln.startswith("ERROR:")]
    assert len(errors) == 1 and "/nonexistent" in errors[0], res.stderr.str()


def test_a_bad_keep_count_in_the_environment_stops_the_run_before_any_cell(pytester, run):
    res = run("--kvq-out", str(pytester.path / "o"), KVQBENCH_KEEP="lots")
    assert res.ret == pytest.ExitCode.USAGE_ERROR and not run.marker.exists()
    errors = [ln for ln in res.stderr.lines if ln.startswith("ERROR:")]
    assert errors == ["ERROR: kvqbench: KVQBENCH_KEEP expects a count >= 0 of kept result sets; got 'lots'"]
    res = run("--kvq-out", str(pytester.path / "o"), "--kvq-keep", "2", KVQBENCH_KEEP="lots")  # the option wins
    res.assert_outcomes(passed=8)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (kvqbench[real])")
def test_an_unloadable_model_stops_the_run_once_before_any_cell(pytester, run, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = run("--kvq-real", "--kvq-model", "kvqbench-test/no-such-model", "--kvq-out", str(pytester.path / "o"))
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert not run.marker.exists(), "a cell ran before the model check"
    errors = [ln for ln in res.stderr.lines if ln.startswith("ERROR:")]
    assert len(errors) == 1 and "--kvq-model kvqbench-test/no-such-model" in errors[0]
    assert "cannot be loaded" in errors[0] and "offline" in errors[0]
    assert len(res.stderr.lines) < 10, res.stderr.str()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (kvqbench[real])")
def test_a_model_id_with_no_cache_and_no_hub_stops_at_once_in_one_line(pytester, run, monkeypatch):
    """Offline without HF_HUB_OFFLINE (here: a hub endpoint that refuses connections): the model check probes
    the hub once instead of letting the hub client retry (~25 s and a dozen lines), and says what to do."""
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    t0 = time.monotonic()
    res = run("--kvq-real", "--kvq-model", "kvqbench-test/no-such-model", "--kvq-out", str(pytester.path / "o"))
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert not run.marker.exists(), "a cell ran before the model check"
    errors = [ln for ln in res.stderr.lines if ln.startswith("ERROR:")]
    assert len(errors) == 1 and "is not in the local Hugging Face cache and 127.0.0.1 cannot be reached" in errors[0]
    assert len(res.stderr.lines) < 10 and time.monotonic() - t0 < 60, res.stderr.str()


# `kvqbench run` itself (a subprocess, as a user starts it): WAIT_AT makes a cell write WAITING_MARKER and
# sleep until it is killed
RUN_CELL_TEST = CELL_TEST.replace('''    if os.environ.get("STOP_AT")''', '''    if os.environ.get("WAIT_AT") and os.environ["WAIT_AT"] in request.node.nodeid:
        import time
        pathlib.Path(os.environ["WAITING_MARKER"]).write_text("waiting")
        time.sleep(120)
    if os.environ.get("STOP_AT")''')


@pytest.fixture
def kvqbench_run(pytester, monkeypatch):
    """``kvqbench_run(*args, **popen_kwargs)`` → the ``kvqbench run --smoke`` process over 8 cells (see
    :data:`ARGS`) of a test folder of its own, importing this checkout."""
    import os
    import subprocess
    import sys
    from importlib.metadata import entry_points
    from pathlib import Path

    assert RUN_CELL_TEST != CELL_TEST
    pytester.makepyfile(test_cells=RUN_CELL_TEST)
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID",
                        "PYTEST_ADDOPTS", "WAIT_AT")}
    env.update(PYTHONPATH=os.pathsep.join([str(root), env.get("PYTHONPATH", "")]), RAN_MARKER=str(pytester.path / "ran"),
               WAITING_MARKER=str(pytester.path / "waiting"))
    plugin = [] if any(ep.name == "kvqbench" for ep in entry_points(group="pytest11")) else ["-p", "kvqbench.plugin"]

    def go(*extra, wait_at=None, **kwargs):
        cmd = [sys.executable, "-m", "kvqbench.cli", "run", "--smoke", "--tests", str(pytester.path), *plugin,
               *ARGS[2:], *extra]
        return subprocess.Popen(cmd, cwd=pytester.path, env={**env, **({"WAIT_AT": wait_at} if wait_at else {})},
                                **kwargs)

    go.waiting = pytester.path / "waiting"
    return go


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_sigterm_ends_a_run_as_ctrl_c_does(pytester, kvqbench_run, workers):
    """``kill`` (SIGTERM) of ``kvqbench run`` stops it like Ctrl-C: the cells that finished are written as an
    incomplete set stamped "interrupted", the exit status is pytest's for an interruption, no worker is
    left running."""
    import signal
    import subprocess
    import time

    out = pytester.path / "out"
    proc = kvqbench_run("--kvq-out", str(out), *workers, wait_at="kivi-k2v2-seed1",
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not kvqbench_run.waiting.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its cell waited"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, text
    summary = json.loads((out / "leaderboard.json").read_text())["completeness"]["summary"]
    assert summary.startswith("incomplete: ") and summary.endswith(", interrupted"), summary
    assert f"kvqbench: {summary}" in text
    assert "Traceback" not in text, text


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_output_cut_short_by_the_reader_keeps_the_results(pytester, kvqbench_run, workers):
    """``kvqbench run … | head``: the reader goes away before the run has written its first line; the run
    still runs every cell and writes its complete set, exits 0 and prints no traceback."""
    import subprocess

    out = pytester.path / "out"
    proc = kvqbench_run("--kvq-out", str(out), *workers, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command writes its first line: every write meets a closed pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["completeness"]["summary"] == "complete: 8 cells"
