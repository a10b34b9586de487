"""The one loader of the fast versions' C sources (``kvqbench/kernels/c/``): compiled on first use (``cc``/``gcc``/``clang`` found on ``PATH``, or ``$CC``) and loaded
with :mod:`ctypes` — no build step at install time, no torch headers.

A kernel is only ever an optional fast path: :func:`load` returns ``None`` (and the step's fast version
declines, so its reference runs) when no compiler is found, the compilation or loading fails, or kernels are
off (:func:`kvqbench.steps.enabled`).

The shared object is cached in a folder only this user can write (:mod:`kvqbench.privdir`):
``$KVQBENCH_CBUILD_DIR``, else the user's cache folder (``~/.cache/kvqbench/cbuild``), else a folder this
process creates privately (``tempfile.mkdtemp``). A folder or library another user could write is refused
with one warning and kernels stay off (nothing is loaded from it). The library is named by a hash of the source, the local headers it includes (``#include "x.h"``, next to
it), the compiler, its flags and the CPU (the code is built
for the host CPU, ``-march=native``, or with :data:`PORTABLE_FLAGS` where the compiler rejects that); it is written to a temporary name and renamed, so concurrent
processes (pytest-xdist workers) never load a partial file. A compilation takes well under a second.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from kvqbench import privdir, steps

__all__ = ["load"]

FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-math-errno",
         "-shared", "-fPIC")
#: tried when the compiler rejects :data:`FLAGS` (e.g. no ``-march=native`` on the platform)
PORTABLE_FLAGS = ("-O2", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
_HERE = Path(__file__).resolve().parent / "c"


def _compiler() -> str | None:
    for name in (os.environ.get("CC") or "", "cc", "gcc", "clang"):
        path = name and shutil.which(name)
        if path:
            return path
    return None


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(keep)


def _cache_dir() -> Path:
    """The build folder (see the module docstring). Raises :class:`~kvqbench.privdir.UnsafePathError` for a
    folder another user could write."""
    env = os.environ.get("KVQBENCH_CBUILD_DIR")
    if env:
        return privdir.private_dir(env)
    try:
        return privdir.user_cache_dir("cbuild")
    except privdir.UnsafePathError:
        raise
    except OSError:
        return privdir.fallback_dir("cbuild")


@functools.lru_cache(maxsize=None)
def _load_cached(source: str) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        return None
    src = _HERE / source
    try:
        text = src.read_bytes()
        headers = [(_HERE / h.decode()).read_bytes() for h in re.findall(rb'^#include "([^"]+)"', text, re.M)]
        key = hashlib.sha256(b"\0".join([text, *headers, cc.encode(), " ".join(FLAGS).encode(),
                                         _cpu_id().encode()])).hexdigest()[:16]
        folder = _cache_dir()
        lib = folder / f"{src.stem}-{key}.so"
        if not lib.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            try:
                try:
                    subprocess.run([cc, *FLAGS, str(src), "-o", tmp, "-lm"], check=True, capture_output=True,
                                   timeout=120)
                except subprocess.CalledProcessError:
                    subprocess.run([cc, *PORTABLE_FLAGS, str(src), "-o", tmp, "-lm"], check=True,
                                   capture_output=True, timeout=120)
                os.chmod(tmp, 0o700)  # whatever the umask: only this user may write it
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return ctypes.CDLL(str(privdir.check_private_file(lib)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        warnings.warn(f"kvqbench: C kernel {source} unavailable ({type(e).__name__}: {e} "
                      f"{detail.decode(errors='replace')[:200]}); every step runs its reference", RuntimeWarning, stacklevel=3)
        return None


def load(source: str) -> ctypes.CDLL | None:
    """The compiled shared object of ``source`` (a C file in ``kvqbench/kernels/c/``), or ``None`` (see module
    docstring). Compiled at most once per process and once per cache folder."""
    if not steps.enabled():
        return None
    return _load_cached(source)
