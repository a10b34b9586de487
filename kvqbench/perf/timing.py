"""Timing the candidates: cold inputs, the timer, interleaved rounds, and :func:`run_perf`.

Every candidate (the baselines of :mod:`kvqbench.perf.baselines`, then each method's K and V round trip) is
timed once per round at every token count, back to back, and the rounds are repeated ``repeats`` times with
both orders rotated each round (interleaved, so a slow spell of a shared machine hits every candidate and
every token count alike); the median per candidate is reported with its ratios to the baselines' medians
in the same rounds. On the CPU the process's CPU time (all threads) is measured beside the wall clock; on
CUDA every call is timed with CUDA events after a synchronize, and the peak of
``torch.cuda.max_memory_allocated`` per round trip is recorded.

**Cold inputs** (``cache="cold"``): every timed call reads its own copy of the input, taken round-robin from
enough copies that the bytes between two uses of one copy exceed the last-level cache (size from sysfs; on
CUDA the L2), so every candidate starts from memory at every token count instead of some finding the input
in cache. Copies cost memory (about one LLC's worth per tensor) but no time per call, unlike flushing the
cache before each call. ``cache="warm"`` reuses one input tensor.

Data: a synthetic K/V of shape ``(1, kv_heads, T, head_dim)`` fp32 from :func:`kvqbench.data.make_synthetic`
(fixed seed). Data-dependent methods are fitted first on an independent batch (untimed), as in the
benchmark cells. Torch is imported inside the functions, so that importing this module stays light.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

from kvqbench.perf.baselines import BASELINES, EAGER_GROUP, eager_rtn_roundtrip, hqq_roundtrip, hqq_version
from kvqbench.perf.machine import FALLBACK_LLC_BYTES, environment, last_level_cache_bytes

__all__ = ["DEFAULT_TOKENS", "DEFAULT_REPEATS", "MAX_COPY_BYTES", "cold_copies", "check_config", "run_perf"]

DEFAULT_TOKENS = (1024, 4096, 16384)
#: interleaved rounds per process, by default
DEFAULT_REPEATS = 5
#: cold inputs: at most this many bytes of copies per input tensor (fewer copies, recorded, beyond it)
MAX_COPY_BYTES = 2 << 30


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
    hqq = hqq_roundtrip(bits) if peers else None
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
    perf`` sets it up before: see :func:`kvqbench.perf.cli.main`). ``environment`` is
    :func:`kvqbench.perf.machine.environment` (CPU model, allocator, cache size …); ``config.kernels`` says
    whether the fast versions of :mod:`kvqbench.kernels` were on.

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
    env = environment(dev, default_threads=default_threads, cache_bytes=cache_bytes,
                      hqq=hqq_version() if peers else None)
    from kvqbench import steps

    cfg = {"kernels": steps.enabled(), "methods": ids, "tokens": [int(t) for t in tokens], "threads": thread_counts,
           "bits": bits,
           "shape": [1, kv_heads, "T", head_dim], "dtype": "float32", "repeats": repeats,
           "eager_rtn_group": EAGER_GROUP, "cache": cache, "input_copies": copies, "processes": 1}
    return {"config": cfg, "environment": env, "rows": rows, "scaling": scaling}
