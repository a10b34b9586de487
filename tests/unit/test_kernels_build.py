"""kvqbench.kernels.build: compiled kernels are optional — switched off by the environment, and a failing
compiler gives one warning and ``None`` (the fast versions then decline and the references run)."""

from __future__ import annotations

import stat

import pytest

from kvqbench import steps
from kvqbench.kernels import build as cbuild


def test_switched_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(steps.ENV, "0")
    assert not steps.enabled()
    assert cbuild.load("varn_sums.c") is None


def test_a_failing_compiler_falls_back_with_a_warning(monkeypatch, tmp_path) -> None:
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("KVQBENCH_CBUILD_DIR", str(tmp_path / "build"))
    monkeypatch.delenv(steps.ENV, raising=False)
    cbuild._load_cached.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="unavailable"):
            assert cbuild.load("varn_sums.c") is None
        assert not list((tmp_path / "build").glob("*.so"))  # nothing half-written left behind
    finally:
        cbuild._load_cached.cache_clear()


def test_builds_once_into_the_cache_folder(monkeypatch, tmp_path) -> None:
    if cbuild._compiler() is None:
        pytest.skip("no C compiler on PATH")
    monkeypatch.setenv("KVQBENCH_CBUILD_DIR", str(tmp_path))
    monkeypatch.delenv(steps.ENV, raising=False)
    cbuild._load_cached.cache_clear()
    try:
        assert cbuild.load("varn_sums.c") is not None
        built = list(tmp_path.glob("varn_sums-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        cbuild._load_cached.cache_clear()
        assert cbuild.load("varn_sums.c") is not None
        assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    finally:
        cbuild._load_cached.cache_clear()


def test_a_change_to_an_included_header_rebuilds(monkeypatch, tmp_path) -> None:
    """The cache key covers the local headers a source includes: editing the header gives a new shared object
    (the kernels share kvq_minmax.h)."""
    if cbuild._compiler() is None:
        pytest.skip("no C compiler on PATH")
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.h").write_text("static inline int kvq_value(void) { return 1; }\n")
    (src / "k.c").write_text('#include "k.h"\nint value(void) { return kvq_value(); }\n')
    monkeypatch.setattr(cbuild, "_HERE", src)
    monkeypatch.setenv("KVQBENCH_CBUILD_DIR", str(tmp_path / "build"))
    monkeypatch.delenv(steps.ENV, raising=False)
    cbuild._load_cached.cache_clear()
    try:
        assert cbuild.load("k.c").value() == 1
        (src / "k.h").write_text("static inline int kvq_value(void) { return 2; }\n")
        cbuild._load_cached.cache_clear()
        assert cbuild.load("k.c").value() == 2
        assert len(list((tmp_path / "build").glob("k-*.so"))) == 2
    finally:
        cbuild._load_cached.cache_clear()
