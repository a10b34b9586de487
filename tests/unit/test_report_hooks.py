"""The plugin's user hooks (``pytest_kvqbench_update_leaderboard``, ``pytest_kvqbench_write_extra``),
the figures written at session end and the progress/ETA lines — tested with pytester in a subprocess,
serial and under pytest-xdist."""

from __future__ import annotations

import json
import re

import pytest

# torch (and numpy) imported before any in-process pytester run: pytester drops the modules first
# imported inside a run, and neither can be imported twice in one process
import torch  # noqa: F401

pytest_plugins = ["pytester"]

CELL_TEST = '''
import pytest
from kvqbench.experiments.reconstruction import run_reconstruction

pytestmark = pytest.mark.kvq(experiment="exp1")

def test_reconstruction(cell, kvq_method, kvq_data, kvq_record):
    kvq_record(run_reconstruction(kvq_method, kvq_data))
'''

HOOK_CONFTEST = '''
import json

def pytest_kvqbench_update_leaderboard(config, board):
    board["custom"] = {"note": "added by conftest"}
    board["methods"]["kivi"]["name"] = "KIVI (customised)"

def pytest_kvqbench_write_extra(config, board, out_dir):
    p = out_dir / "extra.json"
    p.write_text(json.dumps({"methods": sorted(board["methods"]), "custom": board.get("custom")}))
    return [p]
'''

ARGS = ["-p", "no:cacheprovider", "-m", "smoke", "--kvq-methods", "fp16,kivi", "--kvq-bits", "2,16",
        "--kvq-seeds", "2"]


@pytest.fixture
def args():
    from importlib.metadata import entry_points

    if any(ep.name == "kvqbench" for ep in entry_points(group="pytest11")):
        return list(ARGS)
    return [*ARGS, "-p", "kvqbench.plugin"]


SLOW = "import time, pytest\n@pytest.fixture(autouse=True)\ndef slow():\n    time.sleep(0.05)\n"
PROGRESS = re.compile(r"^kvqbench: (\d+)/8 tests, elapsed (?:\d+h)?(?:\d+m)?\d+s, ETA ((?:\d+h)?(?:\d+m)?\d+s|"
                      r"\? \(no recorded duration for these tests yet: an estimate follows the first to finish\))$")


def _progress(res) -> list[int]:
    """Progress lines are printed on a timer (also while a test runs): done counts never decrease,
    some come while tests are still running, and one closing line says all 8 finished."""
    lines = [ln for ln in res.outlines if " tests, elapsed " in ln]
    done = []
    for ln in lines:
        if ln.startswith("kvqbench: finished "):
            continue
        m = PROGRESS.match(ln)
        assert m, f"malformed progress line {ln!r}"
        done.append(int(m.group(1)))
    assert done == sorted(done) and all(0 <= d <= 8 for d in done) and any(d < 8 for d in done), done
    assert [ln for ln in lines if ln.startswith("kvqbench: finished ")] == \
        [next(ln for ln in lines if ln.startswith("kvqbench: finished 8/8 tests, elapsed "))]
    return done


def test_hooks_change_the_written_leaderboard_and_progress_serial(pytester, args):
    pytester.makepyfile(test_cells=CELL_TEST)
    pytester.makeconftest(HOOK_CONFTEST + SLOW)
    out = pytester.path / "out"
    res = pytester.runpytest_subprocess(*args, "-q", "--kvq-progress", "0.01", "--kvq-out", str(out))
    res.assert_outcomes(passed=2 * 2 * 2)
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["custom"] == {"note": "added by conftest"}
    assert board["methods"]["kivi"]["name"] == "KIVI (customised)"
    assert "KIVI (customised)" in (out / "LEADERBOARD.md").read_text()  # Markdown derives from the hooked board
    extra = json.loads((out / "extra.json").read_text())
    assert extra == {"methods": ["fp16", "kivi"], "custom": {"note": "added by conftest"}}
    res.stdout.fnmatch_lines(["*kvqbench: wrote * files to *out*"])
    assert _progress(res), res.stdout.str()


def test_xdist_progress_no_hooks_and_figures(pytester, args):
    pytest.importorskip("xdist", reason="needs pytest-xdist")
    pytester.makepyfile(test_cells=CELL_TEST)
    pytester.makeconftest(SLOW)
    out = pytester.path / "out"
    res = pytester.runpytest_subprocess(*args, "-n", "2", "--kvq-progress", "0.01", "--kvq-figures", "on",
                                       "--kvq-out", str(out))  # smoke cells: figures only when asked
    res.assert_outcomes(passed=8)
    assert _progress(res), res.stdout.str()
    assert "custom" not in json.loads((out / "leaderboard.json").read_text())
    assert not (out / "extra.json").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("figures need matplotlib (the rest of this test passed)")
    for name in ("pareto_synthetic.png", "mse_vs_bits_synthetic.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name


def test_bad_progress_value_is_a_usage_error(pytester, args):
    pytester.makepyfile(test_cells=CELL_TEST)
    res = pytester.runpytest_subprocess(*args, "--kvq-progress", "soon")
    assert res.ret != 0
    res.stderr.fnmatch_lines(["*--kvq-progress expects seconds*"])


LONG_TEST = '''
import time

def test_long():
    print("captured output of the test")
    time.sleep(2.6)

def test_short():
    pass
'''


def test_serial_progress_lines_appear_during_a_long_test_despite_output_capture(pytester, args):
    """In a serial run pytest redirects stdout into its capture file during each test phase; the progress
    line must still reach the terminal while a long test runs (at --kvq-progress 0.5: a line at least
    every 0.75 s + 0.125 s, so >= 2 lines during a 2.6 s test), and the test's own output stays captured."""
    pytester.makepyfile(test_long=LONG_TEST)
    res = pytester.runpytest_subprocess(*args[:2], "--kvq-progress", "0.5", "-q")
    res.assert_outcomes(passed=2)
    during = [ln for ln in res.outlines if re.match(r"^kvqbench: 0/2 tests, elapsed \d+s, ETA ", ln)]
    assert len(during) >= 2, res.stdout.str()
    assert "captured output of the test" not in res.stdout.str()
    assert any(ln.startswith("kvqbench: finished 2/2 tests") for ln in res.outlines)



SHORT_THEN_LONG = '''
import time

def test_a_short():
    time.sleep(0.8)

def test_b_long():
    time.sleep(2.6)
'''

#: a pause outside every test phase, after each setup, where the printer thread speaks through pytest's
#: reporter (no capture is active then)
PAUSE_AFTER_SETUP = '''
import time, pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "setup":
        time.sleep(0.5)
    yield
'''


def test_serial_progress_lines_reach_the_terminal_in_order_each_on_its_own_line(pytester, args, monkeypatch):
    """Lines the printer writes through pytest's reporter between test phases (its stdout is
    block-buffered when it is a pipe, as in CI) and lines it writes past the capture during the next
    long test (straight to the terminal's descriptor) must reach the terminal in the order written, each
    starting a line. A first version left the reporter's lines in its buffer, so the later ones arrived
    first, one glued to pytest's dots ('.kvqbench: 6/8 …', seen in CI)."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    pytester.makepyfile(test_order=SHORT_THEN_LONG)
    pytester.makeconftest(PAUSE_AFTER_SETUP)
    res = pytester.runpytest_subprocess(*args[:2], "--kvq-progress", "0.2", "-q")
    res.assert_outcomes(passed=2)
    lines = [ln for ln in res.outlines if "tests, elapsed" in ln and "finished" not in ln]
    assert all(ln.startswith("kvqbench: ") for ln in lines), res.stdout.str()
    parsed = [re.match(r"^kvqbench: (\d+)/2 tests, elapsed (\d+)s", ln) for ln in lines]
    order = [(int(m.group(1)), int(m.group(2))) for m in parsed]
    assert len(order) >= 4 and {d for d, _ in order} == {0, 1}, res.stdout.str()
    assert order == sorted(order), res.stdout.str()  # done counts and elapsed seconds never go back
    assert "" not in res.outlines[:res.outlines.index(lines[-1])], res.stdout.str()  # no blank lines between


def test_every_hook_implementation_of_the_plugin_is_registered(pytestconfig):
    """pytest registers a plugin's function as a hook only when its name starts with ``pytest_`` — also
    one marked with ``specname=`` — so a misnamed wrapper is silently dropped (the progress lock's report
    wrappers once were: lines then raced pytest's dots). Every function the plugin marks as a hook must be
    among the registered implementations of the hook it names."""
    from kvqbench.plugin import MODULES

    marked = {(mod, name): fn.pytest_impl for mod in MODULES for name, fn in vars(mod).items()
              if callable(fn) and hasattr(fn, "pytest_impl")}
    assert len(marked) >= 8  # the phase and report wrappers, configure, sessionfinish, …
    pm = pytestconfig.pluginmanager
    for (mod, name), opts in marked.items():
        hook = getattr(pm.hook, opts.get("specname") or name)
        assert any(impl.function is getattr(mod, name) for impl in hook.get_hookimpls()), (mod.__name__, name)


def test_every_module_of_the_plugin_is_registered(pytestconfig):
    """The package registers each of its modules (kvqbench.plugin.MODULES) as a plugin of its own."""
    from kvqbench.plugin import MODULES

    pm = pytestconfig.pluginmanager
    assert [pm.get_plugin(mod.__name__) for mod in MODULES] == list(MODULES)


FOLDER_TAKEN = '''
def pytest_configure(config):
    config._kvq_out = config.getoption("--kvq-out")

def pytest_runtest_setup(item):
    # after the up-front check passed, a file comes to stand where the results folder would go
    with open(item.config._kvq_out, "w") as f:
        f.write("in the way")
'''


def test_an_unwritable_results_folder_at_the_end_keeps_results_and_timings_and_fails(pytester, monkeypatch):
    """A serial run with exp4 (pytest-benchmark writes its JSON beside the results) whose folder cannot
    be written when the run ends: the results and the benchmark JSON go to a printed temporary folder —
    no traceback, nothing lost — and the exit status says the results are not where they were asked."""
    from pathlib import Path

    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(var, raising=False)  # a serial session of its own, also under an outer -n
    pytester.makepyfile(folder_taken=FOLDER_TAKEN)
    out = pytester.path / "out"
    bench = Path(__file__).resolve().parents[1] / "bench" / "test_exp4_cost.py"
    res = pytester.runpytest_subprocess(str(bench), "-p", "folder_taken", "-m", "smoke", "--kvq-methods", "fp16",
                                       "--kvq-bits", "2", "--kvq-seeds", "1", "--kvq-out", str(out),
                                       "-p", "no:cacheprovider", "--kvq-progress", "0")
    text = res.stdout.str() + res.stderr.str()
    assert res.ret == 1, text
    assert "Traceback" not in text and "INTERNALERROR" not in text, text
    saved = re.search(r"saved them to (\S+) instead", text)
    assert saved, text
    assert (Path(saved.group(1)) / "leaderboard.json").is_file()
    # the timings, not lost: pytest-benchmark's JSON went with the results
    assert json.loads((Path(saved.group(1)) / "benchmark_exp4.json").read_text())["benchmarks"]
    assert out.read_text() == "in the way"
