"""The ``kvqbench`` console command: subcommands and options, ``methods --changed`` (the method-PR
selector), ``publish`` and ``report`` exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report_samples import write_results

from kvqbench.cli import build_parser, changed_methods, k_expr, main


def test_parser_knows_every_subcommand():
    p = build_parser()
    for argv in (["run", "--smoke"], ["report", "x"], ["compare", "a", "b", "--fail-on", "rel_mse:5"],
                 ["publish", "results"], ["merge", "a", "b", "--out", "c"], ["methods", "--changed", "kvqbench/quantizers/kivi.py", "--k-expr"]):
        ns, _ = p.parse_known_args(argv)
        assert ns.cmd == argv[0]
    assert p.parse_args(["publish", "results"]).dest.name == "leaderboard"


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: kvqbench" in capsys.readouterr().out


def test_changed_methods_maps_files_to_ids():
    pytest.importorskip("torch", reason="method ids come from the registry (torch)")
    from kvqbench.quantizers import registry

    assert changed_methods(["kvqbench/quantizers/kivi.py"]) == ["kivi"]
    # rtn.py also holds GroupedRTNQuantizer (KIVI's base) and a helper polarquant and kitty import
    rtn_users = changed_methods(["kvqbench/quantizers/rtn.py"])
    assert {"rtn_tensor", "rtn_token", "rtn_channel", "kivi"} <= set(rtn_users)
    for mid in rtn_users:  # each really depends on rtn.py: a class in its MRO or a name it imports
        import sys

        mod = sys.modules[registry()[mid].__module__]
        assert mod.__name__ == "kvqbench.quantizers.rtn" or any(
            getattr(v, "__module__", None) == "kvqbench.quantizers.rtn" for v in vars(mod).values()), mid
    assert set(changed_methods(["kvqbench/numerics/hadamard.py"])) >= {"quarot", "kvarn"}
    assert "kivi" not in changed_methods(["kvqbench/numerics/hadamard.py"])
    # a fast version affects the methods that use its reference steps, and only those
    varn_users = changed_methods(["kvqbench/kernels/varn.py"])
    assert "kvarn" in varn_users and "kivi" not in varn_users
    assert changed_methods(["kvqbench/kernels/c/varn_sums.c"]) == varn_users
    assert {"kivi", "rtn_token"} <= set(changed_methods(["kvqbench/kernels/c/rtnpack.c"]))
    assert changed_methods(["kvqbench/kernels/build.py", "kvqbench/kernels/__init__.py"]) == []
    assert changed_methods(["kvqbench/quantizers/base.py"]) == list(registry())  # shared contract → all
    assert changed_methods(["kvqbench/quantizers/__init__.py", "README.md", "kvqbench/cli.py"]) == []


def test_methods_command_prints_ids_and_k_expression(capsys):
    pytest.importorskip("torch", reason="method ids come from the registry (torch)")
    assert main(["methods", "--changed", "kvqbench/quantizers/kivi.py", "--k-expr"]) == 0
    assert capsys.readouterr().out.strip() == "[kivi-"
    assert main(["methods", "--changed", "docs/PAPERS.md"]) == 0
    assert capsys.readouterr().out.strip() == ""
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    from kvqbench.quantizers import registry

    assert out == " ".join(registry()) + "\n" and "fp16" in out.split()  # one line, as the help says


def test_methods_help_says_what_it_prints(capsys):
    with pytest.raises(SystemExit):
        main(["methods", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "on one line, separated by spaces" in text and "one per line" not in text
    assert "with --k-expr, a pytest -k expression selecting their cells instead" in text
    assert k_expr(["a", "b"]) == "[a- or [b-"


def test_publish_command(tmp_path, capsys):
    res = write_results(tmp_path / "r")
    readme = tmp_path / "README.md"
    readme.write_text("# t\n")
    assert main(["publish", str(res), str(tmp_path / "lb"), "--readme", str(readme), "--no-figures"]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and (tmp_path / "lb" / "LEADERBOARD.md").exists()
    assert "kvqbench-digest:start" in readme.read_text()
    assert main(["publish", str(tmp_path / "nothing"), str(tmp_path / "lb2"), "--no-readme"]) == 2
    assert "not found" in capsys.readouterr().err


def test_unknown_arguments_are_rejected_outside_run():
    with pytest.raises(SystemExit):
        main(["report", "x", "--bogus"])


BAD_BOARDS = [
    ('{"provenance": {}, "sources": {"synth', "not valid JSON"),  # truncated
    ("", "not valid JSON"),
    ("[1, 2]", "top level is a JSON list"),
    ('{"sources": {"synthetic": {}}}', "no 'provenance'"),
    ('{"provenance": {}, "sources": {"synthetic": {}}}', "sources.synthetic has no 'stats'"),
    ('{"provenance": {}, "sources": {"synthetic": {"stats": {}, "rankings": {}, "cells": []}}}',
     "sources.synthetic.cells is a list"),
    ('{"provenance": {}, "sources": {"s": {"stats": {}, "rankings": {"rel_mse": 3}, "cells": {}}}}',
     "rankings.rel_mse has no 'by_setting'"),
    ("{}", "no 'provenance'"),
    ('{"provenance": [], "sources": {}}', "'provenance' is a list"),
]


@pytest.mark.parametrize("text,why", BAD_BOARDS)
def test_report_and_compare_reject_a_malformed_leaderboard(tmp_path, capsys, text, why):
    good = write_results(tmp_path / "good")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "leaderboard.json").write_text(text)
    assert main(["report", str(bad), "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvqbench report: {bad / 'leaderboard.json'} is not a kvqbench leaderboard (")
    assert why in err and "re-run the benchmark or point at a folder it wrote" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (bad / "LEADERBOARD.md").exists()
    for args in (["compare", str(good), str(bad)], ["compare", str(bad / "leaderboard.json"), str(good)]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvqbench compare: ") and "is not a kvqbench leaderboard (" in err and why in err
    assert main(["publish", str(bad), str(tmp_path / "lb"), "--no-readme", "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvqbench publish: ") and why in err and not (tmp_path / "lb").exists()


def test_report_accepts_a_well_formed_leaderboard(tmp_path, capsys):
    from kvqbench.report.io import read_json
    from kvqbench.report.reader import leaderboard_problem

    good = write_results(tmp_path / "good")
    assert leaderboard_problem(read_json(good / "leaderboard.json")) is None
    assert main(["report", str(good), "--no-figures"]) == 0
    assert "wrote" in capsys.readouterr().out


def _help_of_run(capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines; compare word streams


def test_run_help_lists_every_plugin_option_with_its_default(capsys, pytestconfig):
    """The options come from pytest's own parser, as this session loaded the plugin (a second reader of
    the same definitions): each flag is in ``kvqbench run --help`` followed by its default."""
    opts = pytestconfig._parser.getgroup("kvqbench").options  # the session's parser (not a new private one)
    assert len(opts) >= 9
    text = _help_of_run(capsys)
    text = text[text.index("kvqbench options"):]
    flags = [o.names()[0] for o in opts]
    starts = []
    for flag in flags:  # each entry starts where its flag is listed (in definition order)
        assert f" {flag} " in text[(starts[-1] if starts else 0):], flag
        starts.append(text.index(f" {flag} ", starts[-1] if starts else 0))
    for i, opt in enumerate(opts):
        flag = flags[i]
        entry = text[starts[i]:starts[i + 1] if i + 1 < len(starts) else len(text)]
        default = opt.attrs().get("default")
        assert "default" in entry, (flag, entry)
        if default is False:  # a store_true flag
            assert "(default off)" in entry, entry
        elif default is not None:
            assert str(default) in entry, (flag, default, entry)


@pytest.fixture
def pytest_calls(monkeypatch, tmp_path) -> list[list[str]]:
    """The argument lists ``kvqbench run`` passes to pytest (stubbed), from an empty checkout."""
    import kvqbench.runner as runner

    calls: list[list[str]] = []
    monkeypatch.setattr(runner, "_pytest_main", lambda args: calls.append(list(args)) or 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests" / "bench").mkdir(parents=True)
    return calls


def test_run_smoke_is_synthetic_unless_kvq_real(pytest_calls):
    calls = pytest_calls
    assert main(["run", "--smoke"]) == 0
    assert main(["run", "--smoke", "--kvq-real"]) == 0
    assert main(["run"]) == 0
    smoke, smoke_real, full = calls
    assert "--kvq-real" not in smoke and smoke[:3] == ["tests/bench", "-m", "smoke"]
    assert smoke_real.count("--kvq-real") == 1
    assert "--kvq-real" in full and "full" in full


def test_run_echoes_a_pytest_command_the_shell_reads_back(pytest_calls, capsys):
    """The echoed command, pasted into a shell, gives pytest the same arguments (shell-quoted)."""
    import shlex

    assert main(["run", "--no-real", "-k", "kivi or kvarn", "--kvq-out", "my results"]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("kvqbench run: ")]
    assert shlex.split(line.removeprefix("kvqbench run: ")) == ["pytest", *pytest_calls[0]]


def test_run_smoke_hides_the_benchmark_table_but_keeps_its_json(pytest_calls):
    """``--smoke`` passes pytest-benchmark's ``--benchmark-quiet`` (no timing table; the JSON is still
    saved: quiet only skips the display); the main job and an explicit ``--benchmark-verbose`` do not."""
    calls = pytest_calls
    assert main(["run", "--smoke"]) == 0
    assert main(["run", "--smoke", "--benchmark-verbose"]) == 0
    assert main(["run"]) == 0
    smoke, verbose, full = calls
    assert smoke.count("--benchmark-quiet") == 1
    assert "--benchmark-quiet" not in verbose and "--benchmark-quiet" not in full


def test_run_ray_passes_smoke_settings_to_every_shard_and_the_merge(pytest_calls, monkeypatch):
    """``--ray --smoke`` shards get ``--benchmark-quiet`` like a one-session smoke run, and the merge
    draws figures only as one session would (``--kvq-figures``; auto: not for smoke cells)."""
    import kvqbench.dist as dist

    seen: list[tuple[list[str], bool]] = []
    monkeypatch.setattr(dist, "run_on_ray", lambda args, **kw: seen.append((list(args), kw["figures"])) or 0)
    assert main(["run", "--ray", "--smoke"]) == 0
    assert main(["run", "--ray", "--smoke", "--kvq-figures", "on"]) == 0
    assert main(["run", "--ray"]) == 0
    assert main(["run", "--ray", "--kvq-figures=off"]) == 0
    (smoke, smoke_fig, full, full_off) = seen
    assert smoke[0].count("--benchmark-quiet") == 1 and "--benchmark-quiet" not in full[0]
    assert [smoke[1], smoke_fig[1], full[1], full_off[1]] == [False, True, True, False]
    assert not pytest_calls  # nothing ran in this process


@pytest.mark.parametrize("argv,message", [
    (["run", "--shard", "4/3"], "--shard expects I/N with 1 <= I <= N"),
    (["run", "--shard", "two"], "--shard expects I/N"),
    (["run", "--shard", "1/2", "--ray"], "--shard and --ray exclude each other"),
    (["run", "--shards", "3"], "--shards N needs --ray"),
    (["run", "--ray", "--shards", "0"], "--shards N needs --ray and N >= 1"),
])
def test_run_rejects_bad_shard_options_before_running(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv,message", [
    (["--kvq-bits", "2,,4"], "argument --kvq-bits: --kvq-bits expects a comma list of ints in 1..8 or 16"),
    (["--kvq-seeds", "0"], "argument --kvq-seeds: --kvq-seeds expects a count of at least 1"),
    (["--kvq-windows", "abc"], "argument --kvq-windows: --kvq-windows expects a count of at least 1"),
    (["--kvq-figures", "maybe"], "argument --kvq-figures: invalid choice: 'maybe'"),
    (["--kvq-progress=-5"], "argument --kvq-progress: --kvq-progress expects seconds >= 0"),
    (["--kvq-keep=-1"], "argument --kvq-keep: --kvq-keep expects a count >= 0 of kept result sets; got '-1'"),
    (["--kvq-keep", "all"], "argument --kvq-keep: --kvq-keep expects a count >= 0 of kept result sets; got 'all'"),
])
def test_run_rejects_a_bad_plugin_option_in_one_line_before_pytest(argv, message, capsys, pytest_calls):
    """A bad value of a kvqbench plugin option is caught with the plugin's own definition before pytest runs:
    one line naming the option and what it takes, exit status 2 (as --shard's errors)."""
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvqbench run: " + message) and len(err.strip().splitlines()) == 1, err
    assert not pytest_calls  # pytest never started


def test_run_usage_errors_of_pytest_name_kvqbench_run():
    """An option pytest does not know is reported by pytest's own parser, under the command the user typed
    (not ``pytest.main()``), with exit status 4 (pytest's usage error)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "kvqbench.cli", "run", "--kvq-nonsense"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 4, text
    assert "usage: kvqbench run [options]" in text and "kvqbench run: error: unrecognized arguments: --kvq-nonsense" in text
    assert "pytest.main()" not in text


def test_merge_of_no_shard_folder_exits_2(tmp_path, capsys):
    assert main(["merge", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no shard.json" in capsys.readouterr().err


def test_run_starts_its_workers_with_the_steady_allocator(monkeypatch, tmp_path):
    """``kvqbench run`` hands pytest (and so the xdist workers it spawns) an environment with glibc's
    steady-allocator tunables; a tunable the user already set is kept and wins."""
    import os

    import kvqbench.runner as runner
    from kvqbench.perf import STEADY_TUNABLES

    seen = []
    monkeypatch.setattr(runner, "_pytest_main", lambda args: seen.append(os.environ.get("GLIBC_TUNABLES")) or 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests" / "bench").mkdir(parents=True)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert main(["run"]) == 0
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=7")
    assert main(["run"]) == 0
    fresh = dict(t.split("=") for t in seen[0].split(":"))
    assert fresh == STEADY_TUNABLES
    user = dict(t.split("=") for t in seen[1].split(":"))
    assert user == {**STEADY_TUNABLES, "glibc.malloc.trim_threshold": "7"}
