"""``kvqbench perf`` — round-trip speed of every registered method, as ratios to two floors measured in the
same run.

A KV quantizer's round trip (quantize, then dequantize) is memory-bound: it reads the tensor, writes its
codes and writes the reconstruction. Two baselines are timed beside the methods, on the same tensor and
in the same process:

* ``clone`` — ``x.clone()``, one read and one write of the tensor (the floor; on CUDA a device-to-device
  copy, i.e. the memory bandwidth);
* ``eager_rtn`` — a straightforward eager-torch asymmetric RTN, per token in groups of 64 channels
  (min/max, scale, round, clamp, dequantize; no bit packing) — what a method costs when it is written
  plainly;
* ``hqq_rtn`` (when the ``hqq`` package is installed, extra ``peers``) — HQQ's quantizer without its
  optimizer (plain min/max RTN, group 64, bit-packed), quantize + dequantize.

Every candidate (baselines, then each method's K and V round trip) is timed once per round at every token
count, back to back, and the rounds are repeated ``repeats`` times with both orders rotated each round
(interleaved, so a slow spell of a shared machine hits every candidate and every token count alike), and
the median per candidate is reported with its ratios to the
medians of ``clone``, ``eager_rtn`` and ``hqq_rtn``. This is done at every token count and at every thread
count asked (default: 1 thread and torch's default). On CUDA every call is timed with CUDA events after a
synchronize and the peak of ``torch.cuda.max_memory_allocated`` per round trip is recorded.

Data: a synthetic K/V of shape ``(1, kv_heads, T, head_dim)`` fp32 from :func:`kvqbench.data.make_synthetic`
(fixed seed). Data-dependent methods are fitted first on an independent batch (untimed), as in the
benchmark cells.

Timing protocol (what makes the 4× token steps comparable; ``kvqbench perf`` defaults):

* **several processes** (``--processes``, default 3 on the CPU): the whole measurement runs in that many fresh
  processes one after another, and every reported time, ratio and scaling is the median over the processes of
  each process's own (its ratios taken within its own rounds, as in one run). Where a process's memory lands
  moves the eager RTN's time for the whole process: its seven full-size passes ran 17.4 ms in one process and
  22.2 ms in the next (1 thread, 4k tokens, each process's calls within 3 % of each other), and 6.5–11.5 ms at 1k
  across six processes of one host's afternoon, while the methods' times moved by about 5 %, so one process's
  ratios to it could move by a quarter. ``per_process`` in the JSON keeps each process's median time and ratios
  to the eager RTN (wall and CPU). On CUDA one process.

* **steady allocator** (``--allocator steady``; Linux/glibc): a serving engine allocates its buffers once
  and reuses them. glibc instead hands out every buffer of 32 MiB or more (its dynamic mmap threshold's
  ceiling) as a fresh mapping and returns it on free, so each 16k call (64 MiB tensors) paid first-touch
  page faults that a 4k call (16 MiB, reused from the heap) did not: a plain clone grew ~8.5× per 4×
  tokens. ``kvqbench perf`` therefore re-runs itself once with ``GLIBC_TUNABLES`` raising glibc's mmap and
  trim thresholds (:data:`STEADY_TUNABLES`), so buffers come from the heap and freed memory is kept (only
  a tunable set at process start does this: ``mallopt`` refuses a threshold above 32 MiB). The state is
  probed (a 64 MiB ``malloc`` served from the heap or mapped) and recorded in ``environment.allocator``.
  ``--allocator default`` keeps the process's allocator as is.
* **cold inputs** (``--cache cold``): every timed call reads its own copy of the input, taken round-robin
  from enough copies that the bytes between two uses of one copy exceed the last-level cache (size from
  sysfs; on CUDA the L2), so every candidate starts from memory at every token count instead of some
  finding the input in cache. Copies cost memory (about one LLC's worth per tensor) but no time per call,
  unlike flushing the cache before each call (writing a buffer the size of the LLC). ``--cache warm``
  reuses one input tensor.

This is a benchmark command, not a test: timings are never asserted. Torch is imported lazily so that
``kvqbench --help`` stays light.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["add_arguments", "check_config", "run_perf", "merge_processes", "format_report", "main",
           "eager_rtn_roundtrip", "BASELINES",
           "STEADY_TUNABLES", "steady_env", "allocator_state", "last_level_cache_bytes", "cold_copies"]

#: the baselines, in table order (``hqq_rtn`` only when hqq is installed)
BASELINES: tuple[str, ...] = ("clone", "eager_rtn", "hqq_rtn")
DEFAULT_TOKENS = (1024, 4096, 16384)
#: interleaved rounds per process, and processes (CPU), by default
DEFAULT_REPEATS = 5
DEFAULT_PROCESSES = 3
#: set in the environment of the processes a multi-process ``kvqbench perf`` starts
PROCESS_MARK = "KVQBENCH_PERF_PROCESS"
EAGER_GROUP = 64
#: glibc tunables of the steady allocator: every buffer up to 1 GiB from the heap (not a fresh mapping per
#: buffer of 32 MiB or more), freed memory kept up to 4 GiB
STEADY_TUNABLES: dict[str, str] = {"glibc.malloc.mmap_threshold": str(1 << 30),
                                   "glibc.malloc.trim_threshold": str(1 << 32)}
#: set in the environment of the re-run (``kvqbench perf`` re-runs itself at most once)
CHILD_MARK = "KVQBENCH_PERF_STEADY"
#: the last-level cache assumed when sysfs does not say
FALLBACK_LLC_BYTES = 64 << 20
#: cold inputs: at most this many bytes of copies per input tensor (fewer copies, recorded, beyond it)
MAX_COPY_BYTES = 2 << 30


def _positive_ints(text: str, *, one: bool = False) -> list[int]:
    """A comma list of positive ints (``one``: exactly one), for argparse."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
        if not vals or any(v < 1 for v in vals) or (one and len(vals) != 1):
            raise ValueError
        return vals
    except ValueError:
        want = "a positive int" if one else "a comma list of positive ints"
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None


def _positive_int(text: str) -> int:
    return _positive_ints(text, one=True)[0]


def _threads(text: str) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    for v in vals:
        if v != "default" and not (v.isdigit() and int(v) >= 1):
            raise argparse.ArgumentTypeError(f"--threads expects a comma list of ints >= 1 or 'default', got {text!r}")
    if not vals:
        raise argparse.ArgumentTypeError("--threads got nothing")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``kvqbench perf`` options (used by :mod:`kvqbench.cli`)."""
    p.add_argument("--methods", default="all", help="comma list of method ids (default: every registered method)")
    p.add_argument("--tokens", type=_positive_ints, default=list(DEFAULT_TOKENS), metavar="T1,T2,…",
                   help="sequence lengths (default 1024,4096,16384)")
    p.add_argument("--threads", type=_threads, default=["1", "default"], metavar="N,…",
                   help="torch CPU thread counts, ints or 'default' (default: 1,default)")
    p.add_argument("--bits", type=int, default=2, help="k_bits = v_bits of every method (default 2)")
    p.add_argument("--kv-heads", type=int, default=8,
                   help="KV heads of the timed tensor (1, H, T, head_dim) (default 8, as Llama-3-8B)")
    p.add_argument("--head-dim", type=int, default=128,
                   help="head_dim of the timed tensor, the last dim every method groups or rotates (default 128)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"interleaved rounds per process; medians are reported (default {DEFAULT_REPEATS})")
    p.add_argument("--processes", type=_positive_int, default=DEFAULT_PROCESSES, metavar="N",
                   help=f"CPU: time in N processes one after another and report the median over them of each "
                        f"process's medians and ratios (default {DEFAULT_PROCESSES}): a process's memory placement "
                        f"moves the eager RTN's time by up to ~25 %% for the whole process, more than the methods'; "
                        f"CUDA: always 1")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--no-peers", action="store_true", help="leave out optional peer baselines (hqq_rtn)")
    p.add_argument("--allocator", choices=("steady", "default"), default="steady",
                   help="steady (default; Linux/glibc): re-run once with GLIBC_TUNABLES so that every buffer comes "
                        "from glibc's heap and freed memory is kept, as a serving engine reuses its buffers; "
                        "otherwise each buffer of 32 MiB or more is freshly mapped and page-faulted on every call "
                        "and 16k timings measure that (a plain clone grew ~8.5x per 4x tokens). default: the "
                        "allocator as is. Recorded in the JSON's environment")
    p.add_argument("--cache", choices=("cold", "warm"), default="cold",
                   help="cold (default): every timed call reads its own copy of the input, round-robin over copies "
                        "totalling more than the last-level cache (sysfs; CUDA: L2), so every candidate starts from "
                        "memory at every T (costs about twice the LLC in memory per T: K and V copies; at most "
                        "2 GiB each); warm: one input tensor, reused (whatever the previous call left in cache)")
    p.add_argument("--fused", action="store_true",
                   help="use the compiled (torch.compile) RTN kernels where a compiler exists, as KVQBENCH_FUSED=1 "
                        "(bit-identical; the first call per shape compiles)")


# --------------------------------------------------------------------------------------------------
# baselines


def eager_rtn_roundtrip(x, bits: int = 2, group: int = EAGER_GROUP):
    """A plain eager asymmetric RTN round trip of ``x`` ``(…, head_dim)`` per token in groups of ``group``
    channels: ``lo, hi`` per group, ``scale = (hi − lo)/(2^b − 1)``, codes ``clamp(round((x − lo)/scale))``
    as uint8, ``x̂ = q·scale + lo``. The reference the methods are compared with (no packing, no guards)."""
    import torch

    d = x.shape[-1]
    g = group if d % group == 0 else d
    xg = x.reshape(-1, g)
    lo = xg.amin(-1, keepdim=True)
    hi = xg.amax(-1, keepdim=True)
    scale = (hi - lo) / (2**bits - 1)
    q = torch.clamp(torch.round((xg - lo) / scale), 0, 2**bits - 1).to(torch.uint8)
    return (q * scale + lo).reshape(x.shape)


def _hqq_roundtrip(bits: int) -> Callable | None:
    """HQQ's plain RTN (optimizer off, group 64, bit-packed) round trip, or None when hqq is absent."""
    try:
        from hqq.core.quantize import Quantizer as HQQ  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - absent or broken optional peer
        return None

    def rt(x):
        wq, meta = HQQ.quantize(x.reshape(-1, x.shape[-1]), nbits=bits, group_size=EAGER_GROUP, optimize=False,
                                axis=1, bitpack=True, device=str(x.device))
        return HQQ.dequantize(wq, meta).reshape(x.shape)

    return rt


# --------------------------------------------------------------------------------------------------
# timing protocol: steady allocator, cold inputs


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


def cold_copies(tensor_bytes: int, cache_bytes: int, max_bytes: int = MAX_COPY_BYTES) -> int:
    """How many copies of an input of ``tensor_bytes`` a round-robin needs so that more than ``cache_bytes``
    of inputs are read between two uses of one copy: ``ceil(cache / tensor) + 1`` (at least 2), but no more
    than ``max_bytes`` of copies (at least 1)."""
    if tensor_bytes < 1 or cache_bytes < 0:
        raise ValueError("tensor_bytes must be >= 1 and cache_bytes >= 0")
    want = max(2, math.ceil(cache_bytes / tensor_bytes) + 1)
    return max(1, min(want, max_bytes // tensor_bytes))


class _Rotation:
    """Round-robin over copies of one input tensor: every call of :meth:`next` returns the next copy."""

    def __init__(self, x, n: int) -> None:
        self.copies = [x] + [x.clone() for _ in range(n - 1)]
        self.i = 0

    def next(self):
        x = self.copies[self.i]
        self.i = (self.i + 1) % len(self.copies)
        return x


# --------------------------------------------------------------------------------------------------
# timing


def _timer(device) -> Callable[[Callable[[], Any]], tuple[float, int, float | None]]:
    """``fn → (milliseconds, peak bytes above the level before the call or 0, CPU milliseconds or None)``.
    On the CPU the CPU time of the process (all its threads) is measured beside the wall clock: on a
    shared, oversubscribed machine a call that waits for a core is not charged for the wait, and a long
    call is not penalized against a short one that fits between two preemptions."""
    import torch

    if device.type == "cuda":
        def cuda_time(fn: Callable[[], Any]) -> tuple[float, int]:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize(device)
            del out
            return float(start.elapsed_time(end)), int(torch.cuda.max_memory_allocated(device) - base), None

        return cuda_time

    def cpu_time(fn: Callable[[], Any]) -> tuple[float, int, float | None]:
        c0 = time.process_time()
        t0 = time.perf_counter()
        out = fn()
        dt = (time.perf_counter() - t0) * 1e3
        dc = (time.process_time() - c0) * 1e3
        del out
        return dt, 0, dc

    return cpu_time


def _candidates(method_ids: list[str], bits: int, data, peers: bool,
                n_copies: int = 1) -> dict[str, Callable[[], Any]]:
    """The timed callables; with ``n_copies`` > 1 every call reads the next of ``n_copies`` copies of K
    (V for the V round trips), round-robin (cold inputs)."""
    import torch

    from kvqbench.experiments.common import fit_method
    from kvqbench.quantizers import create

    rk, rv = _Rotation(data.k, n_copies), _Rotation(data.v, n_copies)
    cands: dict[str, Callable[[], Any]] = {
        "clone": lambda: rk.next().clone(),
        "eager_rtn": lambda: eager_rtn_roundtrip(rk.next(), bits),
    }
    hqq = _hqq_roundtrip(bits) if peers else None
    if hqq is not None:
        cands["hqq_rtn"] = lambda: hqq(rk.next())
    for mid in method_ids:
        m = create(mid, bits, bits, seed=0)
        fit_method(m, data)  # data-dependent state from the independent calibration batch, untimed
        cands[f"{mid}/k"] = (lambda m=m: m.roundtrip(rk.next(), "k"))
        cands[f"{mid}/v"] = (lambda m=m: m.roundtrip(rv.next(), "v"))
    with torch.no_grad():
        for fn in cands.values():  # warm-up: caches (Hadamard, codebooks), allocator, lazy kernels
            fn()
    return cands


def _measure(groups: dict[int, dict[str, Callable[[], Any]]], timer,
             repeats: int) -> dict[int, dict[str, dict[str, Any]]]:
    """Time every candidate of every group (token count) ``repeats`` times. Each round visits the
    candidates in an order rotated every round, and each candidate at every token count back to back (that
    order rotated too), so a slow spell of a shared machine hits the token counts alike: the scaling ratios
    compare calls made seconds apart, not sections made minutes apart."""
    import torch

    keys = list(groups)
    names = list(groups[keys[0]])
    times = {g: {n: [] for n in names} for g in keys}
    cpu: dict[int, dict[str, list[float]]] = {g: {n: [] for n in names} for g in keys}
    peak = {g: {n: 0 for n in names} for g in keys}
    with torch.no_grad():
        for r in range(repeats):
            shift, gshift = r % len(names), r % len(keys)
            for n in names[shift:] + names[:shift]:
                for g in keys[gshift:] + keys[:gshift]:
                    ms, mem, cms = timer(groups[g][n])
                    times[g][n].append(ms)
                    if cms is not None:
                        cpu[g][n].append(cms)
                    peak[g][n] = max(peak[g][n], mem)
    return {g: {n: {"median_ms": statistics.median(times[g][n]), "min_ms": min(times[g][n]),
                    "all_ms": times[g][n], "peak_bytes": peak[g][n],
                    "median_cpu_ms": statistics.median(cpu[g][n]) if cpu[g][n] else None,
                    "all_cpu_ms": cpu[g][n] or None} for n in names} for g in keys}


def check_config(methods: list[str] | None, repeats: int, bits: int, kv_heads: int, head_dim: int, cache: str,
                 device: str) -> tuple[list[str], Any]:
    """The method ids and the ``torch.device`` of a :func:`run_perf` configuration, checked before anything is
    measured.

    Raises:
        ValueError: unknown method ids, bad sizes, a width the methods do not take (1..8 or ≥ 16 bits), an
            unknown ``cache``, a device torch does not know, or ``device`` cuda without CUDA.
    """
    import torch

    from kvqbench.cells import parse_methods
    from kvqbench.quantizers import available

    ids = parse_methods(None if methods is None else ",".join(methods), available(), option="--methods")
    if repeats < 1 or bits < 1 or kv_heads < 1 or head_dim < 2:
        raise ValueError("repeats, bits and kv_heads must be >= 1 and head_dim >= 2")
    if 8 < bits < 16:
        raise ValueError(f"bits={bits}: the methods pack codes of 1..8 bits, and 16 or more is the fp16 pass-through")
    if cache not in ("cold", "warm"):
        raise ValueError(f"cache must be 'cold' or 'warm', got {cache!r}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: kvqbench perf times on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked but CUDA is not available (torch {torch.__version__})")
    return ids, dev


def run_perf(
    methods: list[str] | None = None,
    tokens: list[int] | tuple[int, ...] = DEFAULT_TOKENS,
    threads: list[str] | tuple[str, ...] = ("1", "default"),
    bits: int = 2,
    kv_heads: int = 8,
    head_dim: int = 128,
    repeats: int = DEFAULT_REPEATS,
    device: str = "cpu",
    peers: bool = True,
    log: Callable[[str], None] | None = None,
    cache: str = "cold",
) -> dict[str, Any]:
    """Time every method's K and V round trip against the baselines (see module doc).

    Returns:
        a JSON-able dict: ``config``, ``environment`` and ``rows`` — one per (threads, tokens, candidate)
        with ``median_ms``, ``min_ms``, ``all_ms``, ``peak_bytes`` (CUDA), on the CPU ``median_cpu_ms`` and
        ``all_cpu_ms`` (process CPU time, all threads), and the ratios ``x_clone``, ``x_eager_rtn`` and
        ``x_hqq_rtn`` (None without hqq) of the median wall times, ``x_<baseline>_cpu`` of the median CPU
        times; and ``scaling`` — per threads and candidate the ratio between consecutive token counts of the
        median times (``time_ratio``), of the fastest calls (``min_time_ratio``) and of the median CPU
        times (``cpu_time_ratio``).
    ``cache``: ``"cold"`` (every call reads the next of enough input copies to exceed the last-level cache;
    ``config.input_copies`` per T) or ``"warm"`` (one input). The allocator is the process's own (``kvqbench
    perf`` sets it up before: see :func:`main`); ``environment.allocator`` records what it does.

    Raises:
        ValueError: unknown method ids, bad sizes, an unknown ``cache``, or ``device`` cuda without CUDA.
    """
    import torch

    from kvqbench.data.synthetic import make_synthetic

    ids, dev = check_config(methods, repeats, bits, kv_heads, head_dim, cache, device)
    if dev.type == "cuda":
        cache_bytes: int | None = int(torch.cuda.get_device_properties(dev).L2_cache_size)
    else:
        cache_bytes = last_level_cache_bytes()
    copies: dict[int, int] = {}
    default_threads = torch.get_num_threads()
    timer = _timer(dev)
    say = log or (lambda s: None)
    rows: list[dict[str, Any]] = []
    thread_counts = [default_threads if t == "default" else int(t) for t in threads]
    for nt in dict.fromkeys(thread_counts):
        torch.set_num_threads(nt)
        groups: dict[int, dict[str, Callable[[], Any]]] = {}
        nbytes: dict[int, int] = {}
        t0 = time.perf_counter()
        for t in dict.fromkeys(int(t) for t in tokens):
            spec = dict(batch=1, kv_heads=kv_heads, q_heads=kv_heads, seq_len=t, head_dim=head_dim)
            data = make_synthetic(seed=0, **spec).to(dev)
            data.calibration = make_synthetic(seed=1_000_033, **spec).to(dev)
            nbytes[t] = data.k.numel() * data.k.element_size()
            n_copies = 1 if cache == "warm" else cold_copies(
                nbytes[t], cache_bytes if cache_bytes is not None else FALLBACK_LLC_BYTES)
            copies[t] = n_copies
            groups[t] = _candidates(ids, bits, data, peers, n_copies)
            del data
        measured = _measure(groups, timer, repeats)
        del groups
        for t, res in measured.items():
            base = {b: res[b]["median_ms"] for b in BASELINES if b in res}
            # clone reads and writes the tensor once: its bytes moved per second is the memory bandwidth
            res["clone"]["bandwidth_gbps"] = 2 * nbytes[t] / (max(base["clone"], 1e-9) * 1e-3) / 1e9
            for name, r in res.items():
                mid, _, kind = name.partition("/")
                row = {"threads": nt, "tokens": t, "candidate": mid, "kind": kind or None, **r}
                for b in BASELINES:
                    row[f"x_{b}"] = r["median_ms"] / base[b] if b in base and base[b] > 0 else None
                    bc = res[b]["median_cpu_ms"] if b in res else None
                    row[f"x_{b}_cpu"] = r["median_cpu_ms"] / bc if bc and r["median_cpu_ms"] is not None else None
                rows.append(row)
        say(f"kvqbench perf: threads={nt} T={','.join(map(str, measured))}: {len(measured[t])} candidates × "
            f"{repeats} rounds, interleaved, in {time.perf_counter() - t0:.1f} s")
    torch.set_num_threads(default_threads)
    scaling = []
    for nt in dict.fromkeys(thread_counts):
        sel = {(r["candidate"], r["kind"], r["tokens"]): r["median_ms"] for r in rows if r["threads"] == nt}
        mins = {(r["candidate"], r["kind"], r["tokens"]): r["min_ms"] for r in rows if r["threads"] == nt}
        cpus = {(r["candidate"], r["kind"], r["tokens"]): r["median_cpu_ms"] for r in rows if r["threads"] == nt}
        ts = sorted(set(tokens))
        for (cand, kind) in dict.fromkeys((c, k) for c, k, _ in sel):
            for a, b in zip(ts, ts[1:]):
                if sel.get((cand, kind, a)) and (cand, kind, b) in sel:
                    lo = mins[(cand, kind, a)]
                    scaling.append({"threads": nt, "candidate": cand, "kind": kind, "from_tokens": a,
                                    "to_tokens": b, "time_ratio": sel[(cand, kind, b)] / sel[(cand, kind, a)],
                                    "min_time_ratio": mins[(cand, kind, b)] / lo if lo > 0 else None,
                                    "cpu_time_ratio": cpus[(cand, kind, b)] / cpus[(cand, kind, a)]
                                    if cpus[(cand, kind, a)] and cpus[(cand, kind, b)] is not None else None,
                                    "token_ratio": b / a})
    env = {
        "torch": torch.__version__, "device": str(dev), "platform": platform.platform(),
        "machine": platform.machine(), "cpu_count": _cpu_count(), "default_threads": default_threads,
        "cuda_device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "hqq": _hqq_version() if peers else None,
        "timer": "cuda events" if dev.type == "cuda" else "time.perf_counter (wall) and time.process_time (CPU)",
        "allocator": allocator_state() if dev.type == "cpu" else "torch CUDA caching allocator",
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "cache_bytes": cache_bytes,
        "cache_bytes_source": ("CUDA L2" if dev.type == "cuda" else "sysfs last-level cache")
        if cache_bytes is not None else f"assumed {FALLBACK_LLC_BYTES >> 20} MiB",
    }
    cfg = {"fused": False, "methods": ids, "tokens": [int(t) for t in tokens], "threads": thread_counts, "bits": bits,
           "shape": [1, kv_heads, "T", head_dim], "dtype": "float32", "repeats": repeats,
           "eager_rtn_group": EAGER_GROUP, "cache": cache, "input_copies": copies, "processes": 1}
    return {"config": cfg, "environment": env, "rows": rows, "scaling": scaling}


def _median_of(vals: list[Any]) -> float | None:
    got = [v for v in vals if v is not None]
    return statistics.median(got) if got else None


def merge_processes(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the :func:`run_perf` results of several processes (same configuration): per candidate,
    token count and thread count, the median over the processes of each process's median time, CPU time,
    ratios to the baselines (each taken within its own process, as in one run) and clone bandwidth; the
    fastest call of all; every call's time (``all_ms``, ``all_cpu_ms``, process after process); the largest
    peak; and ``per_process`` with each process's median time and ratio to the eager RTN (wall and CPU). The
    token scaling: the median of the processes' ratios. ``config["processes"]`` = their number.

    Raises:
        ValueError: no results, or results of different configurations or rows.
    """
    if not results:
        raise ValueError("no results to merge")
    skip = ("input_copies", "processes")
    cfg0 = {k: v for k, v in results[0]["config"].items() if k not in skip}
    if any({k: v for k, v in r["config"].items() if k not in skip} != cfg0 for r in results[1:]):
        raise ValueError("the processes' results differ in configuration")

    def key(r: dict[str, Any]) -> tuple:
        return r["threads"], r["tokens"], r["candidate"], r["kind"]

    keys = [key(r) for r in results[0]["rows"]]
    by = [{key(r): r for r in res["rows"]} for res in results]
    if any(set(b) != set(keys) for b in by):
        raise ValueError("the processes' results differ in their rows")
    rows = []
    for k in keys:
        rs = [b[k] for b in by]
        row = dict(rs[0])
        row["median_ms"] = statistics.median(r["median_ms"] for r in rs)
        row["min_ms"] = min(r["min_ms"] for r in rs)
        row["all_ms"] = [v for r in rs for v in r["all_ms"]]
        row["median_cpu_ms"] = _median_of([r.get("median_cpu_ms") for r in rs])
        row["all_cpu_ms"] = [v for r in rs for v in (r.get("all_cpu_ms") or [])] or None
        row["peak_bytes"] = max(r.get("peak_bytes", 0) for r in rs)
        for f in [f for f in rs[0] if f.startswith("x_")] + (["bandwidth_gbps"] if "bandwidth_gbps" in rs[0] else []):
            row[f] = _median_of([r.get(f) for r in rs])
        row["per_process"] = {"median_ms": [r["median_ms"] for r in rs],
                              "x_eager_rtn": [r.get("x_eager_rtn") for r in rs],
                              "x_eager_rtn_cpu": [r.get("x_eager_rtn_cpu") for r in rs]}
        rows.append(row)

    def skey(s: dict[str, Any]) -> tuple:
        return s["threads"], s["candidate"], s["kind"], s["from_tokens"], s["to_tokens"]

    sby = [{skey(s): s for s in res.get("scaling") or []} for res in results]
    scaling = []
    for k in [skey(s) for s in results[0].get("scaling") or []]:
        ss = [b[k] for b in sby if k in b]
        sc = dict(ss[0])
        for f in ("time_ratio", "min_time_ratio", "cpu_time_ratio"):
            sc[f] = _median_of([x.get(f) for x in ss])
        scaling.append(sc)
    cfg = dict(results[0]["config"], processes=len(results))
    return {"config": cfg, "environment": results[0]["environment"], "rows": rows, "scaling": scaling}


def _cpu_count() -> int | None:
    return os.cpu_count()


def _hqq_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("hqq")
    except Exception:  # noqa: BLE001
        return None


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def format_report(result: dict[str, Any]) -> str:
    """The tables ``kvqbench perf`` prints: per (threads, tokens) one row per method with the K and V
    median times and ratios, then the 4× token scaling of every candidate."""
    from tabulate import tabulate

    rows = result["rows"]
    has_hqq = any(r.get("x_hqq_rtn") is not None for r in rows)
    out: list[str] = []
    cuda = str(result["environment"]["device"]).startswith("cuda")
    nproc_all = result["config"].get("processes", 1)
    out.append("K ms / V ms: median wall time of a method's K and V round trip (quantize + dequantize); ×clone, "
               "×eager_rtn" + (", ×hqq_rtn" if has_hqq else "") + ": that time as a multiple of the baseline's median "
               "in the same rounds" + ("" if cuda else "; ×eager_rtn cpu: the same ratio of CPU times "
                                       "(time.process_time)") + ". The baselines (clone, eager_rtn"
               + (", hqq_rtn" if has_hqq else "") + ") time one tensor (K), so their V columns are empty."
               + (f" Timed in {nproc_all} processes: every median time and ratio is the median over the processes of "
                  "that process's own (a ratio is taken within its process's rounds, so it need not equal the ratio "
                  "of the printed medians)." if nproc_all > 1 else "") + "\n")
    for nt in result["config"]["threads"]:
        for t in result["config"]["tokens"]:
            sel = [r for r in rows if r["threads"] == nt and r["tokens"] == t]
            if not sel:
                continue
            by = {(r["candidate"], r["kind"]): r for r in sel}
            table = []
            for cand in dict.fromkeys(r["candidate"] for r in sel):
                if (cand, None) in by:
                    r = by[(cand, None)]
                    line = [cand, f"{r['median_ms']:.3f}", "", _fmt(r["x_clone"]), "", _fmt(r["x_eager_rtn"]), ""]
                    if has_hqq:
                        line += [_fmt(r["x_hqq_rtn"]), ""]
                    if cuda:
                        line += [f"{r['peak_bytes'] / 2**20:.1f}"]
                    else:
                        line += [_fmt(r.get("x_eager_rtn_cpu")), ""]
                    table.append(line)
                    continue
                rk, rv = by.get((cand, "k")), by.get((cand, "v"))
                line = [cand, f"{rk['median_ms']:.3f}", f"{rv['median_ms']:.3f}", _fmt(rk["x_clone"]),
                        _fmt(rv["x_clone"]), _fmt(rk["x_eager_rtn"]), _fmt(rv["x_eager_rtn"])]
                if has_hqq:
                    line += [_fmt(rk["x_hqq_rtn"]), _fmt(rv["x_hqq_rtn"])]
                if cuda:
                    line += [f"{max(rk['peak_bytes'], rv['peak_bytes']) / 2**20:.1f}"]
                else:
                    line += [_fmt(rk.get("x_eager_rtn_cpu")), _fmt(rv.get("x_eager_rtn_cpu"))]
                table.append(line)
            headers = ["candidate", "K ms", "V ms", "K ×clone", "V ×clone", "K ×eager_rtn", "V ×eager_rtn"]
            if has_hqq:
                headers += ["K ×hqq_rtn", "V ×hqq_rtn"]
            headers += ["peak MiB"] if cuda else ["K ×eager_rtn cpu", "V ×eager_rtn cpu"]
            shape = result["config"]["shape"]
            rounds = (f"median over {nproc_all} processes of medians of {result['config']['repeats']} interleaved "
                      "rounds" if nproc_all > 1 else f"median of {result['config']['repeats']} interleaved rounds")
            out.append(f"threads={nt}  T={t}  x=({shape[0]}, {shape[1]}, {t}, {shape[3]}) fp32  "
                       f"{result['config']['bits']} bits  {rounds}")
            out.append(tabulate(table, headers=headers, disable_numparse=True))
            bw = by.get(("clone", None), {}).get("bandwidth_gbps")
            if bw:
                out.append(f"clone moves {bw:.1f} GB/s (read + write)")
            out.append("")
    sc = result.get("scaling") or []
    if sc:
        steps = sorted({(s["from_tokens"], s["to_tokens"]) for s in sc})
        table = []
        keys = list(dict.fromkeys((s["threads"], s["candidate"], s["kind"]) for s in sc))
        for nt, cand, kind in keys:
            vals = {(s["from_tokens"], s["to_tokens"]): s for s in sc
                    if (s["threads"], s["candidate"], s["kind"]) == (nt, cand, kind)}
            table.append([nt, cand + (f"/{kind}" if kind else "")]
                         + [_fmt(vals[st]["time_ratio"]) if st in vals else "—" for st in steps]
                         + ([_fmt(vals[st].get("cpu_time_ratio")) if st in vals else "—" for st in steps]
                            if not cuda else []))
        out.append("time ratio between token counts: of the median wall times" + ("" if cuda else " and of the "
                   "median CPU times") + " (a memory-bound round trip scales like the token ratio; the JSON also "
                   "has the ratio of the fastest calls)")
        out.append(tabulate(table, headers=["threads", "candidate"] + [f"{a}→{b} (×{b / a:g})" for a, b in steps]
                            + ([] if cuda else [f"cpu {a}→{b}" for a, b in steps]), disable_numparse=True))
    env = result["environment"]
    out.append(f"\ntorch {env['torch']} · {env['device']}{' ' + env['cuda_device'] if env.get('cuda_device') else ''}"
               f" · {env['cpu_count']} CPUs (default threads {env['default_threads']}) · timer {env['timer']} · "
               f"hqq {env['hqq'] or 'not installed (pip install -e .[peers])'}")
    cfg = result["config"]
    if "cache" in cfg:
        n = ", ".join(f"T={t}: {c}" for t, c in cfg.get("input_copies", {}).items())
        llc = env.get("cache_bytes")
        out.append(f"allocator {env.get('allocator', '?')} · inputs {cfg['cache']}"
                   + (f" ({n} copies round-robin; cache {llc / 2**20:.0f} MiB, {env.get('cache_bytes_source')})"
                      if cfg["cache"] == "cold" and llc else ""))
    return "\n".join(out)


#: what the re-run executes: ``kvqbench.cli.main`` on the same arguments
_RERUN = "import sys; from kvqbench.cli import main; sys.exit(main(sys.argv[1:]))"


def rerun_command(args: argparse.Namespace, argv: list[str] | None,
                  environ: dict[str, str] | os._Environ[str] | None = None) -> tuple[list[str], dict[str, str]] | None:
    """``(command, environment)`` to re-run ``kvqbench perf`` with the steady allocator, or ``None`` to run
    in this process: ``--allocator default``, a CUDA device, not Linux/glibc, no ``argv`` to repeat, or
    the tunables already set (:func:`steady_env`)."""
    if args.allocator != "steady" or args.device.startswith("cuda") or argv is None or not is_glibc_linux():
        return None
    env = steady_env(os.environ if environ is None else environ)
    if env is None:
        return None
    return [sys.executable, "-c", _RERUN, *argv], env


def _in_processes(args: argparse.Namespace, argv: list[str]) -> int:
    """Run ``kvqbench perf`` (``argv``, from ``perf`` on) in ``args.processes`` processes one after another,
    each with ``--processes 1`` and the steady allocator's environment where asked (:func:`steady_env`), and
    print (and write) :func:`merge_processes` of their results. A failing process (its error printed) stops it
    with its status; an interrupt (Ctrl-C) reports the processes that finished, then exits 130."""
    import tempfile

    n = args.processes
    env = dict(os.environ)
    if args.allocator == "steady" and is_glibc_linux():
        env = steady_env(env) or env
    env[PROCESS_MARK] = "1"
    results: list[dict[str, Any]] = []
    status = 0
    with tempfile.TemporaryDirectory(prefix="kvqbench-perf-") as tmp:
        for i in range(n):
            print(f"kvqbench perf: process {i + 1}/{n}", file=sys.stderr, flush=True)
            path = Path(tmp) / f"process{i}.json"
            cmd = [sys.executable, "-c", _RERUN, *argv, "--processes", "1", "--json", str(path)]
            try:
                rc = subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL)
            except KeyboardInterrupt:
                rc = 130
            if rc != 0:  # a failure's own error line is the last one printed
                status = rc
                break
            results.append(json.loads(path.read_text()))
    if status == 130 and results:
        print(f"kvqbench perf: interrupted; the {len(results)} finished process(es) of {n}:", file=sys.stderr)
    elif status:
        return status
    if results:
        _emit(merge_processes(results), args.json)
    return status


def _check_json_path(path: Path | None) -> str | None:
    """Why ``--json`` ``path`` cannot be written (checked before anything is measured, nothing created), or
    ``None`` (:func:`kvqbench.report.results.check_writable` on its folder)."""
    from kvqbench.report.results import check_writable

    if path is None:
        return None
    if path.is_dir():
        return f"--json {path}: is a folder"
    why = check_writable(path.parent)
    return None if why is None else f"--json {path}: {why}"


def _emit(result: dict[str, Any], path: Path | None) -> None:
    """Write the JSON (first, so that nothing measured is lost; a write that fails anyway is reported in one
    line after the table) and print the tables."""
    err = None
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1) + "\n")
        except OSError as e:
            err = f"kvqbench perf: could not write {path}: {e.strerror or e}"
    print(format_report(result))
    if path is not None and err is None:
        print(f"wrote {path}")
    if err:
        print(err, file=sys.stderr)


def _methods_arg(args: argparse.Namespace) -> list[str] | None:
    """``--methods`` as a list of ids, or ``None`` for every registered method."""
    return None if args.methods.strip() in ("", "all") else [m.strip() for m in args.methods.split(",")]


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Entry of ``kvqbench perf`` (parsed by :mod:`kvqbench.cli`; ``argv``: the command line, from
    ``perf`` on, to re-run it in several processes (``--processes``, CPU) and with the steady allocator —
    see :func:`rerun_command`). The configuration and the ``--json`` path are checked first (one line, exit 2)."""
    bad = _check_json_path(args.json)
    if bad:
        print(f"kvqbench perf: {bad}", file=sys.stderr)
        return 2
    if (args.processes > 1 and not args.device.startswith("cuda") and argv is not None
            and not os.environ.get(PROCESS_MARK)):
        try:
            check_config(_methods_arg(args), args.repeats, args.bits, args.kv_heads, args.head_dim, args.cache, args.device)
        except ValueError as e:
            print(f"kvqbench perf: {e}", file=sys.stderr)
            return 2
        return _in_processes(args, argv)
    rerun = rerun_command(args, argv)
    if rerun is not None:
        cmd, env = rerun
        try:
            return subprocess.call(cmd, env=env)
        except KeyboardInterrupt:
            return 130
    if args.allocator == "steady" and not args.device.startswith("cuda") and not is_glibc_linux():
        print("kvqbench perf: --allocator steady needs Linux with glibc; timing with the allocator as is",
              file=sys.stderr)
    methods = _methods_arg(args)
    if args.fused:
        from kvqbench.numerics import fused

        if not fused.compiler_available("cuda" if args.device.startswith("cuda") else "cpu"):
            print("kvqbench perf: --fused needs a C++ compiler (CPU) or Triton (CUDA); none found", file=sys.stderr)
            return 2
        fused.set_enabled(True)
    try:
        result = run_perf(methods, args.tokens, args.threads, args.bits, args.kv_heads, args.head_dim,
                          args.repeats, args.device, peers=not args.no_peers,
                          log=lambda s: print(s, file=sys.stderr, flush=True), cache=args.cache)
    except (ValueError, RuntimeError) as e:
        print(f"kvqbench perf: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvqbench perf: interrupted", file=sys.stderr)
        return 130
    _emit(result, args.json)
    return 0
