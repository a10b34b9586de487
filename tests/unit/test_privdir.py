"""Nothing is loaded from where another user could write: kvqbench.privdir refuses folders and files that
are group/world-writable or another user's, and the kernel loader then keeps kernels off."""

from __future__ import annotations

import os
import stat

import pytest

from kvqbench import privdir, steps
from kvqbench.kernels import build


def _other_user(path) -> None:
    """Give ``path`` to another uid (only root can); skip where that is impossible."""
    if not hasattr(os, "getuid") or os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, 65534, -1)


def test_a_missing_folder_is_created_private(tmp_path) -> None:
    p = privdir.private_dir(tmp_path / "a" / "b")
    assert p.is_dir() and stat.S_IMODE(os.stat(p).st_mode) & 0o077 == 0


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_writable_folder_is_refused_in_one_line(tmp_path, mode) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(privdir.UnsafePathError, match="writable by group or others") as e:
        privdir.private_dir(d)
    assert "\n" not in str(e.value) and str(d) in str(e.value)


def test_another_users_folder_and_file_are_refused(tmp_path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    f = tmp_path / "lib.so"
    f.write_bytes(b"x")
    _other_user(d)
    _other_user(f)
    with pytest.raises(privdir.UnsafePathError, match="another user"):
        privdir.private_dir(d)
    with pytest.raises(privdir.UnsafePathError, match="another user"):
        privdir.check_private_file(f)


def test_the_fallback_is_a_fresh_private_folder(tmp_path) -> None:
    p = privdir.fallback_dir("test-only")
    assert p.is_dir() and stat.S_IMODE(os.stat(p).st_mode) == 0o700
    assert privdir.fallback_dir("test-only") == p and "kvqbench-test-only-" in p.name


def test_the_kernel_loader_refuses_a_shared_build_folder(tmp_path, monkeypatch) -> None:
    if build._compiler() is None:
        pytest.skip("no C compiler on PATH")
    d = tmp_path / "kvqbench-cbuild-0"
    d.mkdir()
    os.chmod(d, 0o777)
    monkeypatch.setenv("KVQBENCH_CBUILD_DIR", str(d))
    monkeypatch.delenv(steps.ENV, raising=False)
    build._load_cached.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="writable by group or others"):
            assert build.load("packbits.c") is None
        assert not list(d.glob("*.so"))  # nothing built into it either
    finally:
        build._load_cached.cache_clear()


def test_the_kernel_loader_refuses_a_library_others_can_write(tmp_path, monkeypatch) -> None:
    if build._compiler() is None:
        pytest.skip("no C compiler on PATH")
    d = privdir.private_dir(tmp_path / "cb")
    monkeypatch.setenv("KVQBENCH_CBUILD_DIR", str(d))
    monkeypatch.delenv(steps.ENV, raising=False)
    build._load_cached.cache_clear()
    try:
        assert build.load("packbits.c") is not None  # builds a private library
        (lib,) = d.glob("packbits-*.so")
        assert stat.S_IMODE(os.stat(lib).st_mode) & 0o022 == 0
        os.chmod(lib, 0o666)  # as if another process of another user had planted it
        build._load_cached.cache_clear()
        with pytest.warns(RuntimeWarning, match="writable by group or others"):
            assert build.load("packbits.c") is None
    finally:
        build._load_cached.cache_clear()
