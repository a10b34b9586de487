"""The CI workflows and tox.ini: valid YAML/INI, and every command they run refers to files that exist
and to ``kvqbench`` subcommands/options that parse."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest

from kvqbench.cli import build_parser

yaml = pytest.importorskip("yaml", reason="needs pyyaml (in the dev extra)")

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
KNOWN_COMMANDS = {"python", "python3", "pip", "bash", "kvqbench", "pytest", "ruff", "git", "echo", "if", "fi",
                  "then", ".", "export", "cd", "test", "[", "tox"}
#: paths a workflow creates before using them
PRODUCED = (".venv", "results")


def _steps(wf: dict) -> list[tuple[str, dict]]:
    return [(job, step) for job, spec in wf["jobs"].items() for step in spec.get("steps", [])]


def _commands(script: str) -> list[list[str]]:
    """Split a ``run:`` script into simple commands (on newlines, ``&&``, ``;``; ``$(...)`` unwrapped)."""
    out = []
    for line in script.splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"\$\{\{[^}]*\}\}", "X", line)
        inner = re.findall(r"\$\(([^)]*)\)", line)
        line = re.sub(r"\$\([^)]*\)", "X", line)
        for part in [*re.split(r"&&|;|\|\||(?<![|])\|(?![|])", line), *inner]:
            part = part.strip()
            if part.startswith(("if ", "then ", "else ")):
                part = part.split(" ", 1)[1]
            toks = shlex.split(part) if part else []
            if toks and toks[0] not in ("then", "fi", "else"):
                out.append(toks)
    return out


def _check_command(toks: list[str]) -> None:
    cmd = toks[0]
    if "=" in cmd and not cmd.startswith("-"):  # VAR=value assignment
        return
    assert cmd in KNOWN_COMMANDS, f"unknown command {cmd!r} in {' '.join(toks)}"
    if cmd == "bash" or cmd == ".":
        _check_path(toks[1])
    if cmd == "kvqbench":
        args = [("x" if "$" in t else t) for t in toks[1:]]
        parser = build_parser()
        if args[0] == "run":
            ns, _extra = parser.parse_known_args(args)
        else:
            ns = parser.parse_args(args)
        assert ns.cmd == args[0]
        for t in args[1:]:
            if not t.startswith("-") and "/" in t:
                _check_path(t)
    if cmd in ("python", "python3") and len(toks) > 2 and toks[1] == "-m" and toks[2] == "kvqbench.cli":
        _check_command(["kvqbench", *toks[3:]])
    if cmd == "ruff":
        for t in toks[2:]:
            if not t.startswith("-"):
                _check_path(t)
    if cmd == "pytest":
        for t in toks[1:]:
            if t.startswith("tests"):
                _check_path(t)


def _check_path(p: str) -> None:
    if "$" in p or "{" in p:
        return
    rel = p.lstrip("./") if p.startswith("./") else p
    if rel.startswith(PRODUCED):
        return
    assert (ROOT / rel).exists(), f"workflow refers to {p}, which is not in the repository"


def test_there_are_workflows():
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "method-pr.yml"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_commands_refer_to_existing_things(path):
    wf = yaml.safe_load(path.read_text())
    assert wf.get("on", wf.get(True)), "no trigger"  # PyYAML reads the key `on` as True
    steps = _steps(wf)
    assert steps, "no steps"
    n = 0
    for job, step in steps:
        if "run" in step:
            for toks in _commands(step["run"]):
                _check_command(toks)
                n += 1
        else:
            assert "uses" in step, f"{job}: a step without run or uses"
    assert n > 0


def test_ci_runs_what_dot_ci_run_runs():
    ci = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())
    trig = ci.get("on", ci.get(True))
    assert "push" in trig
    runs = [s["run"] for _, s in _steps(ci) if "run" in s]
    assert any(r.strip() == "bash .ci/run" for r in runs)
    assert (ROOT / ".ci" / "run").exists()


def test_method_pr_runs_changed_methods_full_and_compares():
    wf = yaml.safe_load((ROOT / ".github/workflows/method-pr.yml").read_text())
    trig = wf.get("on", wf.get(True))
    assert trig["pull_request"]["paths"] == ["kvqbench/quantizers/**", "kvqbench/numerics/**"]
    script = "\n".join(s["run"] for _, s in _steps(wf) if "run" in s)
    assert "kvqbench methods --changed" in script and "--k-expr" in script
    assert re.search(r"kvqbench run --full -k \"\$KEXPR\"", script)
    assert "kvqbench compare leaderboard/ results/ --fail-on rel_mse:5" in script
    # the cells run as a matrix of shards, merged in a final job before the comparison
    shards = wf["jobs"]["shard"]["strategy"]["matrix"]["shard"]
    n = len(shards)
    assert shards == list(range(1, n + 1)) and n > 1
    assert re.search(rf'kvqbench run --full -k "\$KEXPR" --shard "\$SHARD/{n}"', script)
    merge = wf["jobs"]["merge"]
    assert "shard" in merge["needs"] and "always()" in merge["if"]
    merge_script = "\n".join(s["run"] for s in merge["steps"] if "run" in s)
    assert f"kvqbench merge results/shards/shard-*-of-{n} --out results" in merge_script
    assert merge_script.index("kvqbench merge") < merge_script.index("kvqbench compare")


def test_k_expression_selects_only_the_method_cells():
    from _pytest.mark.expression import Expression

    from kvqbench.cli import k_expr

    expr = Expression.compile(k_expr(["kivi", "rtn_token"]))

    def selects(nodeid_name: str) -> bool:
        return expr.evaluate(lambda sub: sub in nodeid_name)

    assert selects("test_reconstruction[kivi-k2v2-seed0-synthetic-full]")
    assert selects("test_reconstruction[rtn_token-k4v4-seed1-real-full]")
    assert not selects("test_reconstruction[rtn_tensor-k2v2-seed0-synthetic-full]")
    assert not selects("test_reconstruction[kvarn-k2v2-seed0-synthetic-full]")
    assert not selects("test_kivi_helper")  # a non-cell test named after the method


def test_tox_envs_and_commands():
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "tox.ini")
    envs = {s.split(":", 1)[1] for s in cfg.sections() if s.startswith("testenv:")}
    assert {"smoke", "full", "lint", "report"} <= envs
    for env in envs:
        for key in ("commands_pre", "commands"):
            for line in cfg.get(f"testenv:{env}", key, fallback="").strip().splitlines():
                line = line.replace("{posargs}", "").replace("{toxinidir}/", "").replace("{envtmpdir}", "$TMP")
                _check_command(shlex.split(line))
    assert "skip_install = true" in (ROOT / "tox.ini").read_text().split("[testenv:report]")[1].split("[")[0]


def test_the_checker_itself_rejects_bad_commands():
    with pytest.raises(AssertionError, match="not in the repository"):
        _check_command(["bash", ".ci/does-not-exist"])
    with pytest.raises(AssertionError, match="unknown command"):
        _check_command(["make", "all"])
    with pytest.raises(SystemExit):
        _check_command(["kvqbench", "comapre", "a", "b"])
    with pytest.raises(SystemExit):
        _check_command(["kvqbench", "compare", "leaderboard/", "results/", "--fial-on", "x:1"])
