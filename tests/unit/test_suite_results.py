"""The test suite never writes into the repository's results/: the smoke cells it runs (tests/bench,
selected by pytest.ini's ``-m "not full"``) write into pytest's temporary folder (root conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _snapshot(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*")} if folder.exists() else {}


def test_a_suite_session_writes_its_smoke_results_into_pytests_temporary_folder(tmp_path):
    """A session over a benchmark module and a unit module (as ``python -m pytest`` collects both): the
    results land in ``<basetemp>/kvqbench-results``; the repository's results/ is left as it was."""
    before = _snapshot(ROOT / "results")
    base = tmp_path / "bt"
    res = subprocess.run([sys.executable, "-m", "pytest", "tests/bench/test_exp1_reconstruction.py",
                          "tests/unit/test_hadamard.py", "-k", "fp16-k16v16 or test_hadamard", "--kvq-seeds", "1",
                          "--kvq-progress", "0", "-p", "no:cacheprovider", "-q", f"--basetemp={base}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = base / "kvqbench-results"
    assert "wrote" in res.stdout and str(out) in res.stdout
    assert (out / "leaderboard.json").is_file() and (out / "exp1_synthetic.json").is_file()
    assert _snapshot(ROOT / "results") == before


def _root_conftest():
    """The repository's own conftest.py, loaded by its path: under a whole-suite session the module name
    ``conftest`` may belong to another folder's conftest (tests/browser has one)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvqbench_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(args, markexpr="not full", kvq_out=None, tmp=None, worker=False):
    from kvqbench.plugin.state import SETTINGS_KEY, Settings

    stash = pytest.Stash()
    stash[SETTINGS_KEY] = Settings(out_dir=kvq_out)
    opts = {"--kvq-out": kvq_out, "markexpr": markexpr}
    cfg = SimpleNamespace(args=args, invocation_params=SimpleNamespace(dir=ROOT), stash=stash,
                          option=SimpleNamespace(kvq_out=kvq_out), getoption=lambda name, default=None: opts[name],
                          _tmp_path_factory=SimpleNamespace(getbasetemp=lambda: tmp))
    if worker:
        cfg.workerinput = {}
    return cfg


@pytest.mark.parametrize("args,markexpr,moved", [
    (["tests"], "not full", True),  # python -m pytest (testpaths)
    (["tests/unit/test_cli.py", "tests/bench"], "not full", True),
    (["tests/bench"], "full", False),  # kvqbench run
    (["tests/bench"], "smoke", False),  # kvqbench run --smoke
    (["tests"], "smoke", False),  # pytest -m smoke (README): cells only
    (["tests/bench"], "not full", False),  # pytest tests/bench
    (["tests/bench/test_exp1_reconstruction.py::test_reconstruction"], "not full", False),
])
def test_which_sessions_write_into_the_temporary_folder(tmp_path, monkeypatch, args, markexpr, moved):
    conftest = _root_conftest()
    from kvqbench.plugin.state import SETTINGS_KEY

    monkeypatch.delenv(conftest.SUITE_OUT_ENV, raising=False)
    cfg = _config(args, markexpr, tmp=tmp_path)
    conftest._suite_results_in_tmp(cfg)
    want = str(tmp_path / "kvqbench-results") if moved else None
    assert cfg.option.kvq_out == want and cfg.stash[SETTINGS_KEY].out_dir == want


def test_kvq_out_and_the_environment_variable_win(tmp_path, monkeypatch):
    conftest = _root_conftest()
    from kvqbench.plugin.state import SETTINGS_KEY

    monkeypatch.delenv(conftest.SUITE_OUT_ENV, raising=False)
    cfg = _config(["tests"], kvq_out="mine", tmp=tmp_path)
    conftest._suite_results_in_tmp(cfg)
    assert cfg.option.kvq_out == "mine" and cfg.stash[SETTINGS_KEY].out_dir == "mine"
    monkeypatch.setenv(conftest.SUITE_OUT_ENV, str(tmp_path / "ci"))
    cfg = _config(["tests"], tmp=tmp_path)
    conftest._suite_results_in_tmp(cfg)
    assert cfg.option.kvq_out == str(tmp_path / "ci")
    worker = _config(["tests"], tmp=tmp_path, worker=True)  # an xdist worker: the controller decides
    conftest._suite_results_in_tmp(worker)
    assert worker.option.kvq_out is None
