"""``kvqbench run --long``: the long tier's pytest arguments and its context check before pytest starts."""

from __future__ import annotations

import pytest

from kvqbench.cli import main
from kvqbench.experiments import longtext as LT
from kvqbench.runner import LONG_SEEDS


@pytest.fixture
def pytest_calls(monkeypatch, tmp_path) -> list[list[str]]:
    """The argument lists ``kvqbench run`` passes to pytest (stubbed), from an empty checkout; the model's
    context reads as 8192 tokens (SmolLM2's) without a model."""
    import kvqbench.runner as runner

    calls: list[list[str]] = []
    monkeypatch.setattr(runner, "_pytest_main", lambda args: calls.append(list(args)) or 0)
    monkeypatch.setattr(LT, "model_context", lambda model: 8192)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests" / "bench").mkdir(parents=True)
    return calls


def test_run_long_selects_the_long_cells_with_their_folder_and_seeds(pytest_calls):
    assert main(["run", "--long"]) == 0
    assert main(["run", "--long", "--kvq-out", "elsewhere", "--kvq-seeds=4"]) == 0
    plain, given = pytest_calls
    assert plain[:3] == ["tests/bench", "-m", "long"] and "--kvq-real" in plain
    assert plain[plain.index("--kvq-out") + 1] == "results/long"
    assert plain[plain.index("--kvq-seeds") + 1] == LONG_SEEDS
    assert given.count("--kvq-out") == 1 and given[given.index("--kvq-out") + 1] == "elsewhere"
    assert "--kvq-seeds" not in given and "--kvq-seeds=4" in given


def test_run_long_with_no_real_says_the_long_tier_is_real_data_only(pytest_calls, capsys):
    """Every long-tier cell runs on the real model, so ``--long --no-real`` would select none: one line
    naming why, exit 2, pytest never started."""
    assert main(["run", "--long", "--no-real"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvqbench run --long: the long tier runs on the real model only")
    assert "drop --no-real" in err and len(err.splitlines()) == 1
    assert not pytest_calls


def test_run_long_ray_merges_into_the_long_folder(pytest_calls, monkeypatch):
    import kvqbench.dist as dist

    seen: list[dict] = []
    monkeypatch.setattr(dist, "run_on_ray", lambda args, **kw: seen.append({"args": list(args), **kw}) or 0)
    assert main(["run", "--long", "--ray"]) == 0
    (call,) = seen
    assert call["out_dir"].parts[-2:] == ("results", "long") and "-m" in call["args"]
    assert call["args"][call["args"].index("-m") + 1] == "long"


def test_run_long_stops_in_one_line_when_the_context_is_too_short(pytest_calls, monkeypatch, capsys):
    monkeypatch.setattr(LT, "model_context", lambda model: 1024)
    assert main(["run", "--long", "--kvq-model", "tiny"]) == 2
    err = capsys.readouterr().err
    need = LT.CONFIG_BY_SIZE["long"].context
    assert err.startswith("kvqbench run --long: --kvq-model tiny: model tiny has a context of 1024 tokens")
    assert f"shorter than the {need} tokens" in err and len(err.strip().splitlines()) == 1
    assert not pytest_calls  # pytest never started


def test_the_plugin_stops_a_long_session_whose_model_context_is_too_short(monkeypatch):
    """``pytest -m long`` without ``kvqbench run``: the plugin checks the collected long cells' model before
    any cell runs (one line); sessions without long cells never look."""
    from kvqbench.plugin.collection import long_context_problem
    from kvqbench.plugin.state import Settings

    monkeypatch.setattr(LT, "model_context", lambda model: 1024)
    s = Settings(real=True, model="tiny")
    long_cell = "tests/bench/test_exp6_longdecode.py::test_longdecode[kivi-k2v2-seed0-real-long]"
    smoke_cell = "tests/bench/test_exp6_longdecode.py::test_longdecode_smoke[kivi-k2v2-seed0-real-smoke]"
    line = long_context_problem(s, [smoke_cell, long_cell])
    assert line == (f"kvqbench: --kvq-model tiny: model tiny has a context of 1024 tokens, shorter than the "
                    f"{LT.CONFIG_BY_SIZE['long'].context} tokens the long-decode cells need")
    assert long_context_problem(s, [smoke_cell]) is None
    monkeypatch.setattr(LT, "model_context", lambda model: 8192)
    assert long_context_problem(s, [long_cell]) is None
