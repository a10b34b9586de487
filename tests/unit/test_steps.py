"""kvqbench.steps: one dispatch contract — a reference step runs its fast version when one is registered,
enabled and not declining; otherwise the reference itself."""

from __future__ import annotations

import pytest

from kvqbench import steps


@pytest.fixture
def step(monkeypatch):
    """A throwaway step name whose registrations are removed afterwards."""
    name = "zz_test_only.double"
    yield name
    steps._REFS.pop(name, None)
    steps._FAST.pop(name, None)


def test_reference_runs_without_a_fast_version(step) -> None:
    @steps.reference(step)
    def double(x):
        return 2 * x

    assert double(3) == 6 and double.reference(3) == 6 and double.step == step


def test_fast_version_runs_declines_and_is_switched_off(step, monkeypatch) -> None:
    monkeypatch.delenv(steps.ENV, raising=False)  # the suite may run with kernels off
    calls = []

    @steps.reference(step)
    def double(x):
        calls.append("ref")
        return 2 * x

    @steps.fast(step, when="x is even", tol=steps.EXACT)
    def double_fast(x):
        if x % 2:
            return steps.DECLINED
        calls.append("fast")
        return x + x

    assert double(4) == 8 and calls == ["fast"]
    assert double(3) == 6 and calls == ["fast", "ref"]  # declined: the reference ran
    with steps.disabled():
        assert double(4) == 8 and calls[-1] == "ref"
    monkeypatch.setenv(steps.ENV, "off")
    assert not steps.enabled()
    assert double(4) == 8 and calls[-1] == "ref"
    assert steps.lookup(step).when == "x is even" and dict(steps.lookup(step).tol) == {}


def test_duplicates_and_silent_conditions_are_refused(step) -> None:
    steps.reference(step)(lambda x: x)
    with pytest.raises(ValueError, match="already has a reference"):
        steps.reference(step)(lambda x: x)
    with pytest.raises(ValueError, match="say when"):
        steps.fast(step, when=" ", tol=steps.EXACT)
    with pytest.raises(TypeError):
        steps.fast(step, when="always")  # a fast version declares its tolerance
    for bad in (-1e-6, float("nan"), "1e-6", True):
        with pytest.raises(ValueError, match="number >= 0"):
            steps.fast(step, when="always", tol={"rtol": bad})
    steps.fast(step, when="always", tol={"rtol": 1e-6})(lambda x: x)
    assert dict(steps.lookup(step).tol) == {"rtol": 1e-6}
    with pytest.raises(TypeError):
        steps.lookup(step).tol["rtol"] = 1.0  # read-only: the declaration is the one source
    with pytest.raises(ValueError, match="already has a fast version"):
        steps.fast(step, when="always", tol=steps.EXACT)(lambda x: x)


def test_the_registry_imports_nothing_of_kvqbench() -> None:
    """The registry is the lowest floor: it imports no kvqbench module and loads none by name."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(steps))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in ("kvqbench", "importlib")], names
