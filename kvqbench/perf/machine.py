"""The machine a timing runs on: CPU model, last-level cache, glibc's allocator, and the environment record.

**Steady allocator** (Linux/glibc): a serving engine allocates its buffers once and reuses them. glibc by
default hands out every buffer of 32 MiB or more (its dynamic mmap threshold's ceiling) as a fresh mapping
and returns it on free, so each call on a large tensor pays first-touch page faults that a call on a small
one (served from the heap) does not. ``kvqbench perf`` therefore runs in a process started with
``GLIBC_TUNABLES`` raising glibc's mmap and trim thresholds (:data:`STEADY_TUNABLES`, :func:`steady_env`),
so buffers come from the heap and freed memory is kept (only a tunable set at process start does this:
``mallopt`` refuses a threshold above 32 MiB). The state is probed once, when this module is imported (a
large ``malloc`` served from the heap or mapped), and recorded as ``environment.allocator``.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["STEADY_TUNABLES", "CHILD_MARK", "FALLBACK_LLC_BYTES", "is_glibc_linux", "steady_env",
           "allocator_state", "last_level_cache_bytes", "cpu_model", "environment"]

#: glibc tunables of the steady allocator: every buffer up to 1 GiB from the heap (not a fresh mapping per
#: buffer of 32 MiB or more), freed memory kept up to 4 GiB
STEADY_TUNABLES: dict[str, str] = {"glibc.malloc.mmap_threshold": str(1 << 30),
                                   "glibc.malloc.trim_threshold": str(1 << 32)}
#: set in the environment of the re-run (``kvqbench perf`` re-runs itself at most once)
CHILD_MARK = "KVQBENCH_PERF_STEADY"
#: the last-level cache assumed when sysfs does not say
FALLBACK_LLC_BYTES = 64 << 20


def _parse_tunables(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in text.split(":"):
        key, sep, val = item.partition("=")
        if key.strip() and sep:
            out[key.strip()] = val
    return out


def is_glibc_linux() -> bool:
    """Whether this process runs on Linux with glibc (where ``GLIBC_TUNABLES`` is read at start)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def steady_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str] | None:
    """The environment to re-run ``kvqbench perf`` in with the steady allocator: ``environ`` plus
    :data:`STEADY_TUNABLES` appended to ``GLIBC_TUNABLES`` (tunables already set there, the user's, are kept
    and win) and :data:`CHILD_MARK`. ``None`` when no re-run is needed: this process is that re-run, or both
    thresholds are already set."""
    if environ.get(CHILD_MARK):
        return None
    have = _parse_tunables(environ.get("GLIBC_TUNABLES", ""))
    missing = {k: v for k, v in STEADY_TUNABLES.items() if k not in have}
    if not missing:
        return None
    env = dict(environ)
    extra = ":".join(f"{k}={v}" for k, v in missing.items())
    env["GLIBC_TUNABLES"] = f"{environ['GLIBC_TUNABLES']}:{extra}" if environ.get("GLIBC_TUNABLES") else extra
    env[CHILD_MARK] = "1"
    return env


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _large_malloc_is_mapped(nbytes: int = 64 << 20) -> bool | None:
    """Whether glibc serves a ``malloc`` of ``nbytes`` — raised above the heap's free bytes, so that no
    free chunk can serve it, up to 768 MiB — with a fresh mapping (``mallinfo2().hblks`` grows while it
    lives) rather than by growing its heap; ``None`` where that cannot be asked (not glibc, glibc < 2.33).
    The block is never touched (no page is faulted in)."""
    if not is_glibc_linux():
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        info, malloc, free = libc.mallinfo2, libc.malloc, libc.free
    except (OSError, AttributeError):
        return None
    info.restype, malloc.restype, malloc.argtypes = _MallInfo2, ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    before = info()
    ptr = malloc(min(max(nbytes, before.fordblks + nbytes), 768 << 20))
    if not ptr:
        return None
    try:
        return info().hblks > before.hblks
    finally:
        free(ptr)


def _probe_allocator() -> str:
    mapped = _large_malloc_is_mapped()
    return "unknown" if mapped is None else ("default" if mapped else "steady")


#: the allocator as found when this module was first imported: its thresholds are fixed at process start,
#: and a probe made later could be served from free heap chunks that a long-running process left behind
_ALLOCATOR_AT_IMPORT = _probe_allocator()


def allocator_state() -> str:
    """``"steady"`` (a new buffer of 64 MiB or more comes from glibc's heap: freed buffers are reused),
    ``"default"`` (it is freshly mapped, as glibc does by default) or ``"unknown"`` (not glibc, or glibc
    too old to ask), probed once when this module is imported."""
    return _ALLOCATOR_AT_IMPORT


def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """Size in bytes of the highest-level data/unified CPU cache that sysfs lists (``None`` without sysfs)."""
    best: tuple[int, int] | None = None
    for d in sorted(sysfs.glob("index*")) if sysfs.is_dir() else []:
        try:
            level = int((d / "level").read_text())
            kind = (d / "type").read_text().strip()
            size = (d / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        if kind == "INSTRUCTION" or not size:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        try:
            nbytes = int(size.rstrip("KMG")) * mult
        except ValueError:
            continue
        if best is None or (level, nbytes) > best:
            best = (level, nbytes)
    return None if best is None else best[1]


def _field(text: str, name: str) -> str | None:
    """The value of the first ``name: value`` line of ``text`` (``name`` compared without case), or ``None``."""
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if sep and key.strip().lower() == name.lower() and val.strip():
            return val.strip()
    return None


def _lscpu() -> str:
    """``lscpu``'s output in the C locale, or ``""`` where it cannot run."""
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                              env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model(lscpu_text: str | None = None, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's model name: the "Model name" of ``lscpu`` (``lscpu_text``: its output; ``None``: run it), else
    the first "model name" of ``cpuinfo``, else :func:`platform.processor`; ``None`` when none of them says."""
    got = _field(_lscpu() if lscpu_text is None else lscpu_text, "Model name")
    if got is None:
        try:
            got = _field(cpuinfo.read_text(errors="replace"), "model name")
        except OSError:
            got = None
    return got or platform.processor() or None


def environment(dev: Any, *, default_threads: int, cache_bytes: int | None, hqq: str | None) -> dict[str, Any]:
    """What a timing ran on, as recorded in ``kvqbench perf``'s JSON (``environment``): torch, the device
    (``dev``, a ``torch.device``) and, on CUDA, its name, the CPU model, platform, CPU count, torch's default
    thread count, the timer, the allocator state and ``GLIBC_TUNABLES``, the cache size the cold inputs were
    sized for (``cache_bytes``, ``None``: :data:`FALLBACK_LLC_BYTES` assumed) and the ``hqq`` version."""
    import torch

    cuda = dev.type == "cuda"
    return {
        "torch": torch.__version__, "device": str(dev), "cpu_model": cpu_model(), "platform": platform.platform(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "default_threads": default_threads,
        "cuda_device": torch.cuda.get_device_name(dev) if cuda else None,
        "hqq": hqq,
        "timer": "cuda events" if cuda else "time.perf_counter (wall) and time.process_time (CPU)",
        "allocator": "torch CUDA caching allocator" if cuda else allocator_state(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "cache_bytes": cache_bytes,
        "cache_bytes_source": ("CUDA L2" if cuda else "sysfs last-level cache")
        if cache_bytes is not None else f"assumed {FALLBACK_LLC_BYTES >> 20} MiB",
    }
