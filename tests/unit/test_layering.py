"""The import graph of ``kvqbench``: no circles anywhere, the step registry on the lowest floor, numerics
below the fast versions and the methods, ``report/`` and ``results/`` free of torch, ``report/`` free of
``results/`` and its statistics free of its renderers (docs/INTERNALS.md). Every import counts, at module
level or inside a function: both run, and both tie one module to another."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kvqbench

ROOT = Path(kvqbench.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name → file (a package is its ``__init__.py``)."""
    out = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()

#: the packages ``kvqbench report``, ``compare``, ``merge`` and ``publish`` run on, without torch
TORCH_FREE = ("kvqbench.report", "kvqbench.results")


def _imports(name: str, file: Path) -> set[str]:
    """The modules ``name`` imports, wherever the import statement stands: ``from a import b`` is ``a.b``
    when that is a module, else ``a``; relative imports resolved against ``name``'s package."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return found


def graph(prefix: str = "kvqbench") -> dict[str, set[str]]:
    """Edges between the modules under ``prefix`` (imports of a module by itself left out)."""
    return {m: {i for i in _imports(m, f) if i in MODULES and i != m and i.startswith(prefix)}
            for m, f in MODULES.items() if m.startswith(prefix)}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``g`` with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_sees_a_circle_and_a_chain():
    """The finder itself, on graphs whose answer is known: a three-module circle, and a chain without one."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_in_report():
    found = cycles(graph("kvqbench.report"))
    assert not found, "import circles: " + "; ".join(" ↔ ".join(c) for c in found)


def test_no_import_circle_in_kvqbench():
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" ↔ ".join(c) for c in found)


def _kvq_imports_of(prefix: str) -> dict[str, set[str]]:
    g = graph()
    return {m: deps for m, deps in g.items() if m == prefix or m.startswith(prefix + ".")}


def test_the_step_registry_is_the_lowest_floor():
    assert graph()["kvqbench.steps"] == set()


def test_numerics_imports_only_numerics_and_the_registry():
    bad = {m: sorted(d for d in deps if not (d == "kvqbench.steps" or d.startswith("kvqbench.numerics")))
           for m, deps in _kvq_imports_of("kvqbench.numerics").items()}
    assert not {m: d for m, d in bad.items() if d}


def test_fast_versions_sit_between_numerics_and_the_methods():
    allowed = ("kvqbench.steps", "kvqbench.privdir", "kvqbench.numerics", "kvqbench.kernels")
    bad = {m: sorted(d for d in deps if not d.startswith(allowed))
           for m, deps in _kvq_imports_of("kvqbench.kernels").items()}
    assert not {m: d for m, d in bad.items() if d}


def test_report_imports_no_torch_by_its_source():
    bad = {m: sorted(i for i in _imports(m, f) if i == "torch" or i.startswith("torch."))
           for m, f in MODULES.items() if m.startswith(TORCH_FREE)}
    assert not {m: v for m, v in bad.items() if v}


def test_report_stats_import_no_renderer():
    """The statistics layer imports no renderer, tabulate or matplotlib, and nothing above it (the board,
    the commands)."""
    stats = [m for m in MODULES if m.startswith("kvqbench.report.stats")]
    assert stats
    bad = {}
    for m in stats:
        wrong = sorted(i for i in _imports(m, MODULES[m])
                       if i.split(".")[0] in ("tabulate", "matplotlib", "torch")
                       or (i.startswith("kvqbench.report") and not i.startswith(("kvqbench.report.stats",
                                                                                  "kvqbench.report.io"))))
        if wrong:
            bad[m] = wrong
    assert not bad


def test_renderers_never_import_commands():
    """The renderers read the assembled board: they import statistics constants below them, never the
    board's assembly or the result-folder commands above them."""
    above = ("kvqbench.report.board", "kvqbench.results")
    bad = {m: sorted(i for i in _imports(m, f) if i.startswith(above))
           for m, f in MODULES.items() if m.startswith("kvqbench.report.render")}
    assert not {m: v for m, v in bad.items() if v}


def test_report_imports_nothing_of_results():
    """``kvqbench.results`` (result folders: write, read back, merge, compare, publish) sits above
    ``kvqbench.report``; no module of ``report/`` imports it."""
    assert any(m.startswith("kvqbench.results.") for m in MODULES)
    bad = {m: sorted(d for d in deps if d == "kvqbench.results" or d.startswith("kvqbench.results."))
           for m, deps in _kvq_imports_of("kvqbench.report").items()}
    assert not {m: d for m, d in bad.items() if d}


BLOCK_TORCH = """
import importlib, importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch blocked: {name}")
        return None

sys.meta_path.insert(0, NoTorch())
for name in sys.argv[1:]:
    importlib.import_module(name)
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch was imported"
print("ok", len(sys.argv) - 1)
"""


def test_report_imports_without_torch():
    """Every module of ``report/`` and ``results/`` imports in a fresh interpreter where importing torch raises."""
    names = sorted(m for m in MODULES if m.startswith(TORCH_FREE))
    res = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *names], capture_output=True, text=True,
                         cwd=ROOT.parent, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == f"ok {len(names)}"


@pytest.mark.parametrize("name", ["torch", "torch.nn"])
def test_torch_blocker_blocks(name):
    """The blocker of :func:`test_report_imports_without_torch` does stop a torch import."""
    res = subprocess.run([sys.executable, "-c", BLOCK_TORCH, name], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "torch blocked" in res.stderr
