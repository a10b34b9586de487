"""Folders kvqbench loads from or writes to that no other user can write.

Compiled kernels are loaded with ``ctypes`` and captures/memos are trusted as computed results, so their
folders must be the user's own: :func:`private_dir` accepts an existing folder only when it is owned by
the current user and neither group- nor world-writable, creates a missing one with mode 0700, and says in
one line why it refuses any other. :func:`user_cache_dir` is the user's cache folder for kvqbench
(``$KVQBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvqbench``, else ``~/.cache/kvqbench``); when that cannot
be used, :func:`fallback_dir` gives a fresh folder of this process (``tempfile.mkdtemp``, mode 0700),
never a predictable shared name. Torch-free.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["UnsafePathError", "private_dir", "check_private_file", "user_cache_dir", "fallback_dir"]


class UnsafePathError(OSError):
    """A folder or file another user could write (its message is one line naming it and why)."""


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _why_unsafe(st: os.stat_result, what: str, path: Path) -> str | None:
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"{what} {path} belongs to another user (uid {st.st_uid}, you are {uid})"
    if uid is not None and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder only this user can write: created (with missing parents) mode 0700 if absent;
    an existing one must be this user's and not group/world-writable. A symlink is followed and its
    target checked.

    Raises:
        UnsafePathError: the folder exists but another user could write it, or it is not a folder.
        OSError: it cannot be created.
    """
    p = Path(path).expanduser()
    try:
        p.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.stat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{p} is not a folder")
    why = _why_unsafe(st, "folder", p)
    if why:
        raise UnsafePathError(why)
    return p


def check_private_file(path: str | os.PathLike[str]) -> Path:
    """``path`` if it is a regular file of this user that group and others cannot write.

    Raises:
        UnsafePathError: it is another user's, group/world-writable, or not a regular file.
        FileNotFoundError: it does not exist.
    """
    p = Path(path)
    st = os.stat(p)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{p} is not a regular file")
    why = _why_unsafe(st, "file", p)
    if why:
        raise UnsafePathError(why)
    return p


def user_cache_dir(sub: str) -> Path:
    """The user's own cache folder for kvqbench's ``sub`` (created 0700 where missing).

    Raises:
        UnsafePathError: the folder (or ``$KVQBENCH_CACHE_DIR``) exists and another user could write it.
        OSError: it cannot be created (e.g. a read-only home).
    """
    env = os.environ.get("KVQBENCH_CACHE_DIR")
    if env:
        base = Path(env)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "kvqbench"
    private_dir(base)
    return private_dir(base / sub)


_FALLBACK: dict[str, Path] = {}


def fallback_dir(sub: str) -> Path:
    """A folder of this process for ``sub`` when the user's cache folder cannot be used: made once per
    process by :func:`tempfile.mkdtemp` (mode 0700, an unpredictable name), reused for later calls."""
    if sub not in _FALLBACK:
        _FALLBACK[sub] = Path(tempfile.mkdtemp(prefix=f"kvqbench-{sub}-"))
    return _FALLBACK[sub]
