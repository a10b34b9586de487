"""The root conftest skips tests/ outside tests/bench under ``-m smoke``/``-m full`` (collection speed).
That is only sound while no test there can carry a benchmark-cell mark: checked here from the source,
and the skip rule's reading of ``-m`` expressions checked against pytest's own evaluation."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("kvq_root_conftest", ROOT / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cell_marks_used(path: Path, cell_marks: frozenset[str]) -> list[str]:
    """``pytest.mark.<m>`` / ``mark.<m>`` attribute uses (code, not strings) and ``getattr(…mark, …)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Attribute) and node.attr in cell_marks
                and isinstance(node.value, (ast.Attribute, ast.Name))
                and getattr(node.value, "attr", getattr(node.value, "id", None)) == "mark"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} mark.{node.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and node.args and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "mark"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} getattr(mark, …)")
    return found


def test_no_test_outside_bench_carries_a_cell_mark():
    conftest = _root_conftest()
    outside = [p for p in (ROOT / "tests").rglob("*.py") if conftest._BENCH not in p.parents]
    assert len(outside) > 10  # the unit, property and plugin tests were found
    used = [hit for p in outside for hit in _cell_marks_used(p, conftest._CELL_MARKS)]
    assert not used, f"a test outside tests/bench uses a benchmark-cell mark (the -m smoke skip would lose it): {used}"


def test_the_bench_folder_uses_the_cell_marks():  # the AST check above does see a kvq mark where there is one
    conftest = _root_conftest()
    used = [hit for p in (ROOT / "tests" / "bench").glob("test_*.py") for hit in _cell_marks_used(p, conftest._CELL_MARKS)]
    assert any("mark.kvq" in hit for hit in used)


@pytest.mark.parametrize("expr, expected", [
    ("smoke", True), ("full", True), (" smoke ", True), ("smoke and not real", True), ("full and real", True),
    ("smoke or full", True), ("kvq", True), ("(smoke or full) and not slow", True),
    ("not full", False), ("slow or smoke", False), ("not smoke", False), ("real", False), ("", False),
    ("smoke or not real", False), ("not (smoke or full)", False),
])
def test_only_cells_reads_mark_expressions(expr, expected):
    """``_only_cells`` is True exactly when a test with none of smoke/full/kvq can never match — checked
    here against the truth table of each expression, evaluated independently with Python's own ``eval``."""
    conftest = _root_conftest()
    assert conftest._only_cells(expr) is expected
    if expr.strip():
        names = sorted(set(conftest._IDENT.findall(expr)) - {"and", "or", "not"})
        others = [n for n in names if n not in conftest._CELL_MARKS]
        rows = []
        for bits in range(2 ** len(others)):
            env = {n: False for n in names} | {n: bool(bits >> i & 1) for i, n in enumerate(others)}
            rows.append(eval(expr, {"__builtins__": {}}, env))
        assert (not any(rows)) is expected


def test_hypothesis_profile_is_loaded_when_tests_outside_bench_are_collected():
    """The root conftest loads the hypothesis profiles lazily (not for cells-only runs); this test module
    is outside tests/bench, so the profile named by HYPOTHESIS_PROFILE (default "ci") is in force."""
    import os

    from hypothesis import settings

    profile = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    expected = {"ci": (True, 40), "dev": (False, 100)}.get(profile)
    if expected is None:
        pytest.skip(f"HYPOTHESIS_PROFILE={profile} is not one of the root conftest's profiles")
    assert (settings.default.derandomize, settings.default.max_examples) == expected
