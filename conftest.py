"""Root conftest: makes the kvqbench plugin available when running from a source tree where the
package's ``pytest11`` entry point is not installed, sets up hypothesis profiles, and keeps
``pytest -m smoke`` (or ``-m full``) from importing the test modules that hold no benchmark cell."""

from __future__ import annotations

import os
import re
from importlib.metadata import entry_points
from pathlib import Path

import pytest

if not any(ep.name == "kvqbench" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["kvqbench.plugin"]


def _hypothesis_profiles() -> None:
    """"ci": derandomized so CI is reproducible; "dev": more examples, random (``HYPOTHESIS_PROFILE``)."""
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", derandomize=True, max_examples=40, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("dev", max_examples=100, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)  # before hypothesis' own plugin reads --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    # The benchmark cells use no hypothesis: a cells-only run (-m smoke / -m full, see pytest_ignore_collect)
    # skips importing it (a third of a second, and its per-test hooks stay idle).
    asked = any(config.getoption(o, None) for o in ("--hypothesis-profile", "--hypothesis-seed", "--hypothesis-verbosity",
                                                    "--hypothesis-show-statistics", "--hypothesis-explain"))
    if asked or not _only_cells(config.getoption("markexpr", "") or ""):
        _hypothesis_profiles()
        return
    # hypothesis' pytest plugin imports hypothesis in its terminal summary, whatever ran; with no
    # hypothesis test collected, its remaining hooks have nothing to do
    plugin = config.pluginmanager.get_plugin("hypothesispytest")
    if plugin is not None:
        config.pluginmanager.unregister(plugin)

@pytest.hookimpl(tryfirst=True)  # configured (--kvq-out read, pytest's temporary folder made); before xdist
def pytest_sessionstart(session: pytest.Session) -> None:  # starts its workers with the options
    _suite_results_in_tmp(session.config)


#: where the test suite's smoke cells write their results instead of pytest's temporary folder (CI keeps
#: them as an artifact)
SUITE_OUT_ENV = "KVQBENCH_SUITE_OUT"


def _suite_results_in_tmp(config: pytest.Config) -> None:
    """The test suite (a session that may select tests beyond the benchmark cells, from outside
    tests/bench — ``python -m pytest -n auto``) runs the smoke cells too: their results go to
    ``<pytest's temporary folder>/kvqbench-results`` (or ``$KVQBENCH_SUITE_OUT``), never into the
    repository's ``results/smoke`` where a user's own smoke run lives. ``--kvq-out`` wins; a cells-only
    session (``kvqbench run``, ``pytest -m smoke``, ``pytest tests/bench``) keeps the plugin's default."""
    if hasattr(config, "workerinput") or config.getoption("--kvq-out", None) is not None:
        return
    if _only_cells(config.getoption("markexpr", "") or ""):
        return
    here = Path(config.invocation_params.dir)
    from kvqbench.cells import parse_nodeid

    paths = [(here / parse_nodeid(str(a)).path).resolve() for a in config.args] or [_TESTS]
    if all(p == _BENCH or _BENCH in p.parents for p in paths):
        return
    env = os.environ.get(SUITE_OUT_ENV)
    if env:
        out = Path(env)
    else:
        factory = getattr(config, "_tmp_path_factory", None)  # pytest's tmp_path_factory (kept 3 sessions)
        if factory is None:  # -p no:tmpdir
            import tempfile

            out = Path(tempfile.mkdtemp(prefix="kvqbench-suite-")) / "kvqbench-results"
        else:
            out = factory.getbasetemp() / "kvqbench-results"
    config.option.kvq_out = str(out)  # xdist hands the workers this option namespace
    from kvqbench.plugin.state import SETTINGS_KEY

    settings = config.stash.get(SETTINGS_KEY, None)
    if settings is not None:  # already read by the plugin's pytest_configure
        settings.out_dir = str(out)


#: the benchmark cells (the only tests the plugin marks ``smoke``/``full``/``kvq``) live here; the other
#: folders under tests/ hold none (tests/unit/test_cells_only_in_bench.py checks it)
_TESTS = Path(__file__).parent / "tests"
_BENCH = _TESTS / "bench"
#: marks that only benchmark cells carry
_CELL_MARKS = frozenset({"smoke", "full", "long", "kvq"})
#: an identifier of pytest's -m grammar
_IDENT = re.compile(r"(?:\w|:|\+|-|\.|\[|\]|\\|/)+")


def _only_cells(markexpr: str) -> bool:
    """Whether the ``-m`` expression can select no test that lacks all of ``_CELL_MARKS`` — i.e. it is
    false, whatever other marks a test carries, when smoke, full and kvq are all absent (``smoke``,
    ``full``, ``smoke and not real``: yes; ``not full``, ``slow or smoke``: no). Any doubt → False."""
    if not markexpr.strip():
        return False
    try:
        from _pytest.mark.expression import Expression  # pytest's own -m parser

        expr = Expression.compile(markexpr)
        others = sorted({t for t in _IDENT.findall(markexpr) if t not in ("and", "or", "not")} - _CELL_MARKS)
        if len(others) > 10:
            return False
        for bits in range(2 ** len(others)):
            marks = {name for i, name in enumerate(others) if bits >> i & 1}
            if expr.evaluate(lambda name, /, marks=marks, **kwargs: name in marks):
                return False
        return True
    except Exception:  # a pytest whose private parser differs: collect everything, as without this hook
        return False


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """Under ``-m smoke``/``-m full`` skip the folders and modules of tests/ outside tests/bench: they
    hold no benchmark cell, so every test in them would be deselected after an import that costs seconds
    (torch-free modules pulling in scipy.stats, transformers, hypothesis, matplotlib)."""
    path = Path(collection_path)
    if path == _TESTS or _BENCH == path or _BENCH in path.parents or _TESTS not in path.parents:
        return None
    if _only_cells(config.getoption("markexpr", "") or ""):
        return True
    return None
