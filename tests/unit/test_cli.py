"""The ``kvqbench`` console command: subcommands and options, ``methods --changed`` (the method-PR
selector), ``publish`` and ``report`` exit codes."""

from __future__ import annotations

import pytest
from test_report_samples import write_results

from kvqbench.cli import build_parser, changed_methods, k_expr, main


def test_parser_knows_every_subcommand():
    p = build_parser()
    for argv in (["run", "--smoke"], ["report", "x"], ["compare", "a", "b", "--fail-on", "rel_mse:5"],
                 ["publish", "results"], ["methods", "--changed", "kvqbench/quantizers/kivi.py", "--k-expr"]):
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
    assert changed_methods(["kvqbench/quantizers/rtn.py"]) == ["rtn_tensor", "rtn_token", "rtn_channel"]
    assert changed_methods(["kvqbench/quantizers/base.py"]) == list(registry())  # shared contract → all
    assert changed_methods(["kvqbench/quantizers/__init__.py", "README.md", "kvqbench/cli.py"]) == []


def test_methods_command_prints_ids_and_k_expression(capsys):
    pytest.importorskip("torch", reason="method ids come from the registry (torch)")
    assert main(["methods", "--changed", "kvqbench/quantizers/kivi.py", "--k-expr"]) == 0
    assert capsys.readouterr().out.strip() == "[kivi-"
    assert main(["methods", "--changed", "docs/PAPERS.md"]) == 0
    assert capsys.readouterr().out.strip() == ""
    assert main(["methods"]) == 0
    assert "fp16" in capsys.readouterr().out.split()
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
