"""The package's floors, read from the source with :mod:`ast` (every import statement, those inside function
bodies too): no import circle among the modules outside ``report/`` (its own layers are checked with it), the
step registry on the lowest floor, numerics below the fast versions and the methods."""

from __future__ import annotations

import ast
from pathlib import Path

import kvqbench

ROOT = Path(kvqbench.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(name: str) -> set[str]:
    """The kvqbench modules ``name`` imports (``from pkg import mod`` counts as the module ``pkg.mod``)."""
    path = MODULES[name]
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            deps |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "kvqbench"}
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parts = pkg.split(".")
                mod = ".".join(parts[: len(parts) - node.level + 1] + ([mod] if mod else []))
            if mod.split(".")[0] == "kvqbench":
                deps |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else _resolve(mod) for a in node.names}
    return deps - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a list of modules, the first repeated at the end), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_outside_report() -> None:
    outside = {m for m in MODULES if not m.startswith("kvqbench.report")}
    graph = {m: _imports(m) & outside for m in outside}
    assert _cycle(graph) is None, f"import circle: {' → '.join(_cycle(graph))}"


def _kvq_imports_of(prefix: str) -> dict[str, set[str]]:
    return {m: _imports(m) for m in MODULES if m == prefix or m.startswith(prefix + ".")}


def test_the_step_registry_is_the_lowest_floor() -> None:
    assert _imports("kvqbench.steps") == set()


def test_numerics_imports_only_numerics_and_the_registry() -> None:
    bad = {m: sorted(d for d in deps if not (d == "kvqbench.steps" or d.startswith("kvqbench.numerics")))
           for m, deps in _kvq_imports_of("kvqbench.numerics").items()}
    assert not {m: d for m, d in bad.items() if d}


def test_fast_versions_sit_between_numerics_and_the_methods() -> None:
    allowed = ("kvqbench.steps", "kvqbench.privdir", "kvqbench.numerics", "kvqbench.kernels")
    bad = {m: sorted(d for d in deps if not d.startswith(allowed)) for m, deps in _kvq_imports_of("kvqbench.kernels").items()}
    assert not {m: d for m, d in bad.items() if d}
