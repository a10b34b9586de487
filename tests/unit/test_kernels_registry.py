"""kvqbench.kernels: one dispatch contract — a reference step runs its fast version when one is registered,
enabled and not declining; otherwise the reference itself."""

from __future__ import annotations

import pytest

from kvqbench import kernels


@pytest.fixture
def step(monkeypatch):
    """A throwaway step name whose registrations are removed afterwards."""
    name = "zz_test_only.double"
    monkeypatch.setitem(kernels._LOADED, "zz_test_only", True)  # no module to import for this prefix
    yield name
    kernels._REFS.pop(name, None)
    kernels._FAST.pop(name, None)


def test_reference_runs_without_a_fast_version(step) -> None:
    @kernels.reference(step)
    def double(x):
        return 2 * x

    assert double(3) == 6 and double.reference(3) == 6 and double.step == step


def test_fast_version_runs_declines_and_is_switched_off(step, monkeypatch) -> None:
    monkeypatch.delenv(kernels.ENV, raising=False)  # the suite may run with kernels off
    calls = []

    @kernels.reference(step)
    def double(x):
        calls.append("ref")
        return 2 * x

    @kernels.fast(step, when="x is even")
    def double_fast(x):
        if x % 2:
            return kernels.DECLINED
        calls.append("fast")
        return x + x

    assert double(4) == 8 and calls == ["fast"]
    assert double(3) == 6 and calls == ["fast", "ref"]  # declined: the reference ran
    with kernels.disabled():
        assert double(4) == 8 and calls[-1] == "ref"
    monkeypatch.setenv(kernels.ENV, "off")
    assert not kernels.enabled()
    assert double(4) == 8 and calls[-1] == "ref"
    assert kernels.lookup(step).when == "x is even"


def test_duplicates_and_silent_conditions_are_refused(step) -> None:
    kernels.reference(step)(lambda x: x)
    with pytest.raises(ValueError, match="already has a reference"):
        kernels.reference(step)(lambda x: x)
    with pytest.raises(ValueError, match="say when"):
        kernels.fast(step, when=" ")
    kernels.fast(step, when="always")(lambda x: x)
    with pytest.raises(ValueError, match="already has a fast version"):
        kernels.fast(step, when="always")(lambda x: x)
