"""The kvqbench pytest plugin, tested with pytester: it records metrics from cells, survives
pytest-xdist with identical values, writes valid JSON and keeps failed cells."""

import json
import math

import pytest

from kvqbench.quantizers import available  # imported here: pytester restores sys.modules after each test

pytest_plugins = ["pytester"]

CELL_TEST = '''
import pytest
from kvqbench.experiments.reconstruction import run_reconstruction

pytestmark = pytest.mark.kvq(experiment="exp1")

def test_reconstruction(cell, kvq_method, kvq_data, kvq_record):
    res = run_reconstruction(kvq_method, kvq_data)
    kvq_record(res)
    assert res.metrics["k_mse"] >= 0
'''

ARGS = ["-p", "no:cacheprovider", "-m", "smoke", "--kvq-methods", "fp16,rtn_token,kivi", "--kvq-bits", "2,4,16",
        "--kvq-seeds", "2"]


def _load(path):
    with open(path) as fh:
        return json.load(fh)


@pytest.fixture
def plugin_loaded_once():
    """Arguments for a pytester subprocess: the installed ``pytest11`` entry point loads the plugin;
    from an uninstalled source tree it is loaded explicitly (never both: that double-registers)."""
    from importlib.metadata import entry_points

    if any(ep.name == "kvqbench" for ep in entry_points(group="pytest11")):
        return list(ARGS)
    return [*ARGS, "-p", "kvqbench.plugin"]


def test_records_and_writes_valid_json(pytester, plugin_loaded_once):
    pytester.makepyfile(test_cells=CELL_TEST)
    res = pytester.runpytest_subprocess(*plugin_loaded_once, "--kvq-out", str(pytester.path / "out"))
    res.assert_outcomes(passed=3 * 3 * 2)
    out = pytester.path / "out"
    for name in ("exp1_synthetic.json", "leaderboard.json", "summary.json", "LEADERBOARD.md"):
        assert (out / name).exists(), name
    exp1 = _load(out / "exp1_synthetic.json")
    assert len(exp1["cells"]) == 18
    assert {c["method"] for c in exp1["cells"]} == {"fp16", "rtn_token", "kivi"}
    assert all(c["status"] == "passed" and c["metrics"]["k_mse"] >= 0 for c in exp1["cells"])
    assert exp1["provenance"]["kvqbench_version"] and exp1["provenance"]["seeds"] == [0, 1]
    board = _load(out / "leaderboard.json")
    syn = board["sources"]["synthetic"]
    # multi-seed stats: mean of the two seeds' values, Student-t CI with n=2
    st = syn["stats"]["exp1"]["kivi"]["k2v2"]["rel_mse"]
    assert st["n"] == 2 and st["mean"] == pytest.approx(sum(st["values"]) / 2)
    t975_df1 = 12.706204736174703
    sd = math.sqrt(sum((v - st["mean"]) ** 2 for v in st["values"]))
    assert st["ci95"] == pytest.approx(t975_df1 * sd / math.sqrt(2))
    # rankings hold every method; fp16 (lossless) ranks first on rel_mse
    ranked = syn["rankings"]["rel_mse"]["by_setting"]["k2v2"]
    assert [r["method"] for r in ranked][0] == "fp16" and len(ranked) == 3
    flags = {d["name"]: d["ok"] for d in syn["data_quality"]}
    assert flags["fp16_roundtrip_exact"] is True and flags["exact_at_16_bits"] is True
    assert "kivi" in (out / "LEADERBOARD.md").read_text()
    res.stdout.fnmatch_lines(["*kvqbench summary*", "*headline rel_mse (exp1) at k2v2*"])
    # a smoke run draws no figures by default (they cost more than its cells) and says how to get them
    assert not list(out.glob("*.png"))
    res.stdout.fnmatch_lines(["*figures skipped for a smoke run (`kvqbench report *` draws them*"])


def test_figures_option():
    from kvqbench.plugin.results import _figures
    from kvqbench.plugin.state import Settings

    smoke, full = [{"size": "smoke"}], [{"size": "smoke"}, {"size": "full"}]
    assert (_figures(Settings(), smoke), _figures(Settings(), full)) == (False, True)  # auto
    assert _figures(Settings(figures="on"), smoke) and not _figures(Settings(figures="off"), full)


def test_xdist_gives_identical_metrics(pytester, plugin_loaded_once):
    pytester.makepyfile(test_cells=CELL_TEST)
    r1 = pytester.runpytest_subprocess(*plugin_loaded_once, "--kvq-out", str(pytester.path / "serial"))
    r2 = pytester.runpytest_subprocess(*plugin_loaded_once, "-n", "2", "--kvq-out", str(pytester.path / "xdist"))
    r1.assert_outcomes(passed=18)
    r2.assert_outcomes(passed=18)
    a = _load(pytester.path / "serial" / "exp1_synthetic.json")["cells"]
    b = _load(pytester.path / "xdist" / "exp1_synthetic.json")["cells"]
    assert [c["nodeid"] for c in a] == [c["nodeid"] for c in b]
    assert [c["metrics"] for c in a] == [c["metrics"] for c in b]
    la = _load(pytester.path / "serial" / "leaderboard.json")["sources"]["synthetic"]["rankings"]
    lb = _load(pytester.path / "xdist" / "leaderboard.json")["sources"]["synthetic"]["rankings"]
    assert la == lb


def test_failed_cell_is_recorded_and_others_survive(pytester, plugin_loaded_once):
    pytester.makepyfile(test_cells=CELL_TEST.replace(
        "    kvq_record(res)\n",
        "    kvq_record(res)\n    if cell.method == 'kivi' and cell.k_bits == 2:\n        raise RuntimeError('boom in kivi')\n"))
    res = pytester.runpytest_subprocess(*plugin_loaded_once, "--kvq-out", str(pytester.path / "out"))
    res.assert_outcomes(passed=16, failed=2)
    board = _load(pytester.path / "out" / "leaderboard.json")
    syn = board["sources"]["synthetic"]
    assert syn["cells"]["failed"] == 2 and syn["cells"]["passed"] == 16
    assert all("boom in kivi" in f["error"] for f in syn["failures"])
    assert "k2v2" not in syn["stats"]["exp1"]["kivi"] and "k4v4" in syn["stats"]["exp1"]["kivi"]


def test_bad_options_give_clear_errors(pytester, plugin_loaded_once):
    pytester.makepyfile(test_cells=CELL_TEST)
    r = pytester.runpytest_subprocess(*plugin_loaded_once, "--kvq-methods", "kivi,nosuch")
    assert r.ret != 0
    r.stderr.fnmatch_lines(["*unknown method id(s) nosuch*registered:*kivi*"])
    r = pytester.runpytest_subprocess(*plugin_loaded_once, "--kvq-seeds", "zero")
    assert r.ret != 0
    r.stderr.fnmatch_lines(["*--kvq-seeds*"])


def test_node_ids_name_method_bits_seed_source(pytester, plugin_loaded_once):
    pytester.makepyfile(test_cells=CELL_TEST)
    r = pytester.runpytest_subprocess(*plugin_loaded_once, "--collect-only", "-q", "-k", "kivi")
    r.stdout.fnmatch_lines(["*test_reconstruction?kivi-k2v2-seed0-synthetic-smoke?*"])
    assert "rtn_token" not in r.stdout.str()


def test_records_survive_execnet_serialization():
    # regression: a real capture's meta held torch's TorchVersion (a str subclass) and xdist's
    # execnet refused it, crashing the worker; numpy scalars and NaN are other traps
    import execnet.gateway_base as gb
    import numpy as np
    import torch

    from kvqbench.plugin.recording import plain_record

    rec = {"data": {"torch_version": torch.__version__, "x": np.float64(1.5), "n": np.int64(3)},
           "metrics": {"a": float("nan"), "b": 2.0}, "variant": (("group_size", 64),)}
    with pytest.raises(gb.DumpError):
        gb.dumps(rec)
    clean = plain_record(rec)
    assert gb.loads(gb.dumps(clean)) == clean
    assert clean["data"] == {"torch_version": str(torch.__version__), "x": 1.5, "n": 3}
    assert clean["metrics"]["a"] == "nan" and clean["variant"] == [["group_size", 64]]


def test_option_errors_show_our_messages(pytester, plugin_loaded_once):
    pytester.makepyfile(test_cells=CELL_TEST)
    for opt, val, text in (("--kvq-seeds", "0", "*--kvq-seeds expects a count*"),
                           ("--kvq-bits", "12", "*--kvq-bits expects a comma list of ints in 1..8 or 16*"),
                           ("--kvq-bits", "2,,4", "*--kvq-bits expects a comma list of ints*'2,,4'*"),
                           ("--device", "tpu", "*--device expects auto, cpu, cuda or cuda:N*"),
                           ("--kvq-threads", "0", "*--kvq-threads expects a positive int*"),
                           ("--kvq-methods", ",", "*--kvq-methods got no method id*")):
        r = pytester.runpytest_subprocess(*plugin_loaded_once, opt, val)
        assert r.ret != 0, opt
        r.stderr.fnmatch_lines([text])


def test_explicit_bits_apply_to_every_experiment(pytester, plugin_loaded_once):
    pytester.makepyfile(test_cells=CELL_TEST.replace('kvq(experiment="exp1")', 'kvq(experiment="exp2", bits=(2, 4))'))
    i = plugin_loaded_once.index("--kvq-bits")
    no_bits = plugin_loaded_once[:i] + plugin_loaded_once[i + 2:]
    r = pytester.runpytest_subprocess(*no_bits, "--collect-only", "-q")
    out = r.stdout.str()
    assert "k2v2" in out and "k4v4" in out and "k3v3" not in out and "k16v16" not in out  # marker's subset
    r = pytester.runpytest_subprocess(*no_bits, "--kvq-bits", "8", "--collect-only", "-q")
    out = r.stdout.str()
    assert "k8v8" in out and "k2v2" not in out and "k4v4" not in out


def test_budget_bits_add_a_width_only_for_methods_that_fit_the_largest_budget(pytester, plugin_loaded_once):
    """A marker's ``budget_bits=(8,)`` adds 8-bit cells for the methods whose 8-bit cache fits 8.25 bits per
    element (here ``rtn_tensor``: two parameters per tensor), not for ``rtn_token`` (fp16 parameters for
    every token) nor the fp16 control; ``--kvq-bits`` replaces the whole sweep."""
    pytester.makepyfile(test_cells=CELL_TEST.replace('kvq(experiment="exp1")', 'kvq(experiment="exp2", bits=(2, 4), budget_bits=(8,))'))
    i = plugin_loaded_once.index("--kvq-bits")
    args = plugin_loaded_once[:i] + plugin_loaded_once[i + 2:]
    j = args.index("--kvq-methods")
    args[j + 1] = "fp16,rtn_token,rtn_tensor"
    out = pytester.runpytest_subprocess(*args, "--collect-only", "-q").stdout.str()
    assert "rtn_tensor-k8v8" in out and "rtn_token-k8v8" not in out and "fp16-k8v8" not in out
    assert "rtn_token-k4v4" in out and "fp16-k2v2" in out
    out = pytester.runpytest_subprocess(*args, "--kvq-bits", "2", "--collect-only", "-q").stdout.str()
    assert "k8v8" not in out and "rtn_tensor-k2v2" in out


def test_provenance_command_is_the_pytest_invocation(pytester, plugin_loaded_once):
    pytester.makepyfile(test_cells=CELL_TEST)
    res = pytester.runpytest_subprocess(*plugin_loaded_once, "-k", "kivi", "--kvq-out", str(pytester.path / "o"))
    res.assert_outcomes(passed=6)
    cmd = _load(pytester.path / "o" / "exp1_synthetic.json")["provenance"]["command"]
    assert cmd.startswith("pytest ") and "-k kivi" in cmd and "--kvq-methods fp16,rtn_token,kivi" in cmd


def test_a_new_run_removes_the_previous_runs_outputs(pytester, plugin_loaded_once):
    out = pytester.path / "o"
    out.mkdir()
    (out / "exp3_real.json").write_text("{}")
    (out / "pareto_real.png").write_bytes(b"x")
    (out / "notes.txt").write_text("mine")
    pytester.makepyfile(test_cells=CELL_TEST)
    pytester.runpytest_subprocess(*plugin_loaded_once, "-k", "kivi", "--kvq-out", str(out)).assert_outcomes(passed=6)
    names = {p.name for p in out.iterdir()}
    assert "exp3_real.json" not in names and "pareto_real.png" not in names
    assert "notes.txt" in names and "exp1_synthetic.json" in names


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_selection_matching_no_cell_names_methods_and_experiments(pytester, plugin_loaded_once, workers):
    pytester.makepyfile(test_cells=CELL_TEST)
    r = pytester.runpytest_subprocess(*plugin_loaded_once, *workers, "-k", "nosuchmethod")
    assert r.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    out = r.stdout.str()
    line = next(ln for ln in out.splitlines() if "no benchmark cell matches" in ln)
    assert "-k 'nosuchmethod'" in line
    assert all(m in line for m in available())  # every registered id, from the registry itself
    assert "exp1: test_reconstruction" in line
    if not workers:  # a selection that matches: no such line
        r = pytester.runpytest_subprocess(*plugin_loaded_once, "-k", "kivi", "--collect-only")
        assert r.ret == 0 and "no benchmark cell matches" not in r.stdout.str()


def test_xdist_order_puts_one_real_capture_cell_first_then_synthetic_then_real():
    # the order is the collection order within each group: first real cell that needs the capture, then
    # everything without real data, then the other real cells (exp5's model cells need no kvq_data)
    from types import SimpleNamespace

    from kvqbench.cells import Cell
    from kvqbench.plugin.collection import real_capture_first

    def item(name, source=None, fixtures=("kvq_data",)):
        cs = None if source is None else SimpleNamespace(params={"cell": Cell("exp1", "fp16", 2, 2, 0, source, "full")})
        return SimpleNamespace(name=name, callspec=cs, fixturenames=fixtures)

    items = [item("unit"), item("s1", "synthetic"), item("e2e", "real", ("kvq_model",)), item("r1", "real"),
             item("s2", "synthetic"), item("r2", "real")]
    assert [it.name for it in real_capture_first(items)] == ["r1", "unit", "s1", "s2", "e2e", "r2"]
    no_real = items[:2] + items[4:5]
    assert real_capture_first(no_real) == no_real


def test_xdist_order_runs_real_cells_by_seed_without_a_capture_cell():
    # only model cells (e.g. -k endtoend): every seed-0 cell before any seed-1 cell, so the first cell of
    # a seed group (kvq_seed_rows) has computed the group before its other seeds come up
    from types import SimpleNamespace

    from kvqbench.cells import Cell
    from kvqbench.plugin.collection import real_capture_first

    def item(name, seed, source="real"):
        cell = Cell("exp5", name, 2, 2, seed, source, "full")
        return SimpleNamespace(name=f"{name}{seed}", callspec=SimpleNamespace(params={"cell": cell}),
                               fixturenames=("kvq_model",))

    items = [item(m, s) for m in ("a", "b") for s in (0, 1, 2)] + [item("s", 0, "synthetic")]
    assert [it.name for it in real_capture_first(items)] == ["s0", "a0", "b0", "a1", "b1", "a2", "b2"]


def test_xdist_order_spreads_seed_group_cells_and_puts_their_other_seeds_last():
    # the main job: exp5's group cells (kvq_seed_rows) at each group's first seed spread evenly over the other
    # real cells, the group's other seeds last, so that every xdist chunk holds its share of heavy cells and
    # no worker waits for a group the other still computes
    from types import SimpleNamespace

    from kvqbench.cells import Cell
    from kvqbench.plugin.collection import real_capture_first
    from kvqbench.plugin.state import Settings

    def item(exp, seed, fixtures):
        cell = Cell(exp, "fp16", 2, 2, seed, "real", "full")
        return SimpleNamespace(name=f"{exp}-{seed}", callspec=SimpleNamespace(params={"cell": cell}),
                               fixturenames=fixtures)

    cells = ("kvq_data", "kvq_run")
    groups = ("kvq_model", "kvq_seed_rows")
    items = [item("exp1", s, cells) for s in (0, 1, 2)] + [item("exp5", s, groups) for s in (0, 1, 2)]
    order = [it.name for it in real_capture_first(items, Settings(windows=[0, 1, 2]))]
    assert order == ["exp1-0", "exp5-0", "exp1-1", "exp1-2", "exp5-1", "exp5-2"]  # exp1-0: the capture cell
    # groups of three seeds (0-2, 3-4): seeds 0 and 3 compute, each before half the plain cells; 1, 2, 4 read
    items = ([item("exp5", s, groups) for s in range(5)] + [item("exp1", s, cells) for s in range(5)]
             + [item("exp3", s, cells) for s in range(5)])
    order = [it.name for it in real_capture_first(items, Settings(seeds=list(range(5)), windows=list(range(5))))]
    assert order == ["exp1-0", "exp5-0", "exp3-0", "exp1-1", "exp3-1", "exp1-2", "exp5-3", "exp3-2", "exp1-3",
                     "exp3-3", "exp1-4", "exp3-4", "exp5-1", "exp5-2", "exp5-4"]


def test_xdist_order_puts_a_large_models_cells_after_the_capture_cells():
    # a model whose float32 weights exceed SHARED_WEIGHTS_LIMIT (gemma3-270m, whatever --kvq-dtype; an
    # unregistered one): the first capture cell, the items without real data, the other cells reading the
    # capture, then the model cells, each part by seed, the groups' other seeds last; a small one (smollm2)
    # keeps the spread order
    from types import SimpleNamespace

    from kvqbench.cells import Cell
    from kvqbench.data.capture.registry import MODELS
    from kvqbench.plugin.collection import SHARED_WEIGHTS_LIMIT, model_cells_last, real_capture_first
    from kvqbench.plugin.state import Settings

    def item(exp, seed, fixtures, source="real"):
        cell = Cell(exp, "fp16", 2, 2, seed, source, "full")
        return SimpleNamespace(name=f"{exp}-{seed}{source[0]}", callspec=SimpleNamespace(params={"cell": cell}),
                               fixturenames=fixtures)

    assert MODELS["gemma3-270m"].params * 4 > SHARED_WEIGHTS_LIMIT >= MODELS["smollm2"].params * 4
    lean = Settings(model="gemma3-270m", seeds=list(range(5)), windows=list(range(5)))
    assert model_cells_last(lean) and model_cells_last(Settings(model="/x/other.gguf"))
    assert model_cells_last(Settings(model="gemma3-270m", dtype="bfloat16"))  # the model cells run float32
    assert not model_cells_last(Settings()) and not model_cells_last(Settings(dtype="float16"))
    cells = ("kvq_data", "kvq_run")
    groups = ("kvq_model", "kvq_seed_rows")
    items = ([item("exp5", s, groups) for s in range(5)] + [item("exp1", s, cells) for s in range(3)]
             + [item("exp1", s, cells, "synthetic") for s in range(2)] + [item("exp6", s, ("kvq_model",)) for s in range(2)]
             + [item("exp3", s, cells) for s in range(3)])
    got = real_capture_first(items, lean)
    assert [it.name for it in got] == ["exp1-0r", "exp1-0s", "exp1-1s", "exp3-0r", "exp1-1r", "exp3-1r",
                                       "exp1-2r", "exp3-2r", "exp5-0r", "exp6-0r", "exp6-1r", "exp5-3r",
                                       "exp5-1r", "exp5-2r", "exp5-4r"]
    first_model = next(i for i, it in enumerate(got) if "kvq_model" in it.fixturenames)
    assert not any("kvq_data" in it.fixturenames for it in got[first_model:])
    assert sorted(it.name for it in got) == sorted(it.name for it in items)
    no_model = [it for it in items if "kvq_model" not in it.fixturenames]  # e.g. -k "not endtoend"
    assert sorted(it.name for it in real_capture_first(no_model, lean)) == sorted(it.name for it in no_model)


def test_xdist_deals_a_few_cells_at_a_time_in_the_model_cells_last_order():
    # xdist's default deals consecutive cells by the hundred; in the model-cells-last order the controller
    # deals LEAN_CHUNK at a time unless the user chose --maxschedchunk; workers and the spread order keep
    # what they have
    from types import SimpleNamespace

    from kvqbench.plugin import collection
    from kvqbench.plugin.state import SETTINGS_KEY, Settings

    def configured(settings, chunk=None, **extra):
        config = SimpleNamespace(stash={SETTINGS_KEY: settings}, option=SimpleNamespace(maxschedchunk=chunk), **extra)
        collection.pytest_configure(config)
        return config.option.maxschedchunk

    gemma = Settings(model="gemma3-270m", real=True)
    assert configured(gemma) == collection.LEAN_CHUNK
    assert configured(gemma, 50) == 50
    assert configured(gemma, workerinput={}) is None
    assert configured(Settings(model="gemma3-270m")) is None  # no real cells
    assert configured(Settings(real=True)) is None  # smollm2: the spread order
