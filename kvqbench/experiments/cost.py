"""Experiment 4 — cost: latency, throughput, bits and memory of quantize / dequantize (docs/DESIGN.md §4).

For K and V of the cell's data (a data-dependent method is fitted first; fitting is calibration and is
not timed — its one-off time goes to ``extra``):

* **latency** — the K + V round trip (quantize + dequantize) with pytest-benchmark's ``benchmark``
  fixture when the cell gets it (calibrated rounds and warm-up; min/median/IQR kept in
  ``extra["benchmark"]``; pytest-benchmark disables itself under xdist, then the round trip is timed like
  the rest, without a warm-up of its own: its calls were just warmed up). Quantize and dequantize
  separately: ``warmup`` untimed calls, then ``repeats`` timed calls; the median is reported. On CUDA
  every call is timed with ``torch.cuda.Event`` pairs after a synchronize; on the CPU with
  ``time.perf_counter`` — recorded, but flagged ``extra["unreliable_timing"] = True`` (shared cores,
  frequency scaling, Python overhead). ``quant_latency_ms`` / ``dequant_latency_ms`` are K + V.
* **ratios to clone** — every latency also as a multiple of ``x.clone()`` of K and V timed in the same
  cell (the memory-bound floor), so that CPU and GPU runs and machines compare;
* **throughput** — fp16 bytes of the input (2 bytes per element of K and V) per second of latency, GB/s
  (10⁹ bytes).
* **bits** — nominal (benchmark budget) and effective (as stored) bits per element, mean of K and V;
  **compression** = 16 / effective bits.
* **peak memory** (MiB, 2²⁰ bytes) of one quantize + dequantize of K then V, *including the input*: on
  CUDA ``torch.cuda.max_memory_allocated`` above the level before the calls, plus the input's bytes; on
  the CPU torch's allocator keeps no statistics (and ``tracemalloc`` does not see tensor storage), so the
  figure is the deterministic lower bound of what must coexist at the peak — input + the
  representation's tensors as held + the dequantized output (``extra["peak_mem_source"]`` says which).

Run-to-run variation: the latency and throughput metrics (and peak memory on CUDA) change from run to run
and between serial and ``-n`` runs. They are recorded in ``metrics`` so the leaderboard ranks them, and
again under ``extra["timings"]``; their names are listed in ``extra["nondeterministic_metrics"]`` and in
:data:`kvqbench.metrics.NONDETERMINISTIC_METRICS` so determinism checks can leave them out.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvqbench.data.memory import release_after
from kvqbench.data.types import KVData
from kvqbench.experiments.common import fit_method, tally_nonfinite
from kvqbench.experiments.reconstruction import CellResult
from kvqbench.metrics import NONDETERMINISTIC_METRICS
from kvqbench.quantizers.base import QuantizedTensor, Quantizer

__all__ = ["CostConfig", "CONFIG_BY_SIZE", "TIMING_METRICS", "time_call", "held_bytes", "run_cost"]

EXPERIMENT = "exp4"
#: metrics whose values vary run to run (wall-clock time), in a fixed order
TIMING_METRICS: tuple[str, ...] = tuple(sorted(NONDETERMINISTIC_METRICS))
MIB = float(1 << 20)


@dataclass(frozen=True)
class CostConfig:
    """Timing knobs: ``warmup`` untimed calls then ``repeats`` timed calls (median reported).

    ``benchmark_rounds``: how pytest-benchmark times the round trip — ``None``: its own calibration
    (rounds until ``--benchmark-max-time``, 1 s by default, after calibrating the timer); an int: exactly
    that many rounds after ``warmup`` warm-up rounds (``benchmark.pedantic``), for cells where a
    calibrated second per cell would cost more than everything else (smoke).
    """

    warmup: int = 1
    repeats: int = 5
    benchmark_rounds: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {self.warmup!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {self.repeats!r}")
        r = self.benchmark_rounds
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
            raise ValueError(f"benchmark_rounds must be None or an int >= 1, got {r!r}")


#: the configuration of the benchmark cells per cell size (see :data:`kvqbench.cells.SIZES`): smoke cells
#: give pytest-benchmark fixed rounds (its calibration takes about a second per cell, the rest of a smoke
#: cell milliseconds); full cells are calibrated.
#:
#: Full cells take the median of 3 timed calls after 1 warm-up: a median of 3 is robust to one disturbed
#: call (a preemption by a neighbour process, the usual outlier on shared cores, moves it by at most the
#: spread of the two other calls), a full cell's call is far above ``perf_counter``'s resolution, and the
#: warm-up call takes the first-touch and allocator costs out. The timing loops are most of an exp4
#: cell's time (8 round trips of K and V at 3 repeats). CPU timings are flagged unreliable either way, and
#: a serial run's round trip is timed by pytest-benchmark's calibrated rounds.
CONFIG_BY_SIZE: dict[str, CostConfig] = {"smoke": CostConfig(warmup=1, repeats=3, benchmark_rounds=5),
                                         "full": CostConfig(warmup=1, repeats=3)}


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def time_call(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> tuple[list[float], Any]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed.

    Returns:
        (the timed durations in milliseconds, the last result). CUDA: ``torch.cuda.Event`` timing after
        a synchronize; CPU: ``time.perf_counter``.
    """
    out = None
    for _ in range(warmup):
        out = fn()
    times: list[float] = []
    cuda = _is_cuda(device)
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times, out


def held_bytes(qt: QuantizedTensor) -> int:
    """Bytes the representation's tensors occupy in memory as held (not as billed)."""
    return sum(int(f.tensor.numel() * f.tensor.element_size()) for f in qt.fields.values())


def _peak_mem(method: Quantizer, xs: list[tuple[str, torch.Tensor]],
              held: list[QuantizedTensor] | None = None) -> tuple[float, str]:
    """Peak memory (MiB) of a quantize + dequantize of each of ``xs`` and how it was measured. CPU: from
    ``held``, the representations of ``xs`` already made (quantized again when not given)."""
    dev = xs[0][1].device
    in_bytes = sum(int(x.numel() * x.element_size()) for _, x in xs)
    if _is_cuda(dev):
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        for kind, x in xs:
            y = method.dequantize(method.quantize(x, kind))  # type: ignore[arg-type]
            del y
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base + in_bytes
        return peak / MIB, "cuda.max_memory_allocated above the baseline + input"
    total = in_bytes
    for i, (kind, x) in enumerate(xs):
        qt = held[i] if held is not None else method.quantize(x, kind)  # type: ignore[arg-type]
        total += held_bytes(qt) + int(x.numel() * x.element_size())
    return total / MIB, "estimate (cpu): input + representation as held + dequantized output"


def _benchmark_stats(benchmark: Any) -> dict[str, float] | None:
    """min/median/IQR/mean (ms) and rounds of a pytest-benchmark fixture that has run, else None."""
    meta = getattr(benchmark, "stats", None)
    st = getattr(meta, "stats", None)
    if st is None or not getattr(st, "rounds", 0):
        return None
    return {"min_ms": st.min * 1e3, "median_ms": st.median * 1e3, "iqr_ms": st.iqr * 1e3,
            "mean_ms": st.mean * 1e3, "rounds": int(st.rounds)}


@release_after  # the cell's temporaries: kvqbench.data.memory
@torch.no_grad()
def run_cost(method: Quantizer, data: KVData, config: CostConfig | None = None,
             benchmark: Callable[[Callable[[], Any]], Any] | None = None) -> CellResult:
    """Run experiment 4 for one method on one data source.

    Args:
        method: a configured quantizer.
        data: K/V ``(batch|layers, kv_heads, seq_len, head_dim)``; timed on their device.
        config: warm-up and repeats (default :class:`CostConfig`).
        benchmark: optional pytest-benchmark ``benchmark`` fixture (any callable ``benchmark(fn)`` with
            ``benchmark.pedantic`` and the fixture's ``stats`` afterwards): it times the K + V round trip
            with calibrated rounds and warm-up (or ``config.benchmark_rounds`` fixed rounds) (``roundtrip_latency_ms`` = its median; min/median/IQR in ``extra["benchmark"]``).
            Without it, or when pytest-benchmark is disabled (it disables itself under xdist), the round
            trip is timed like the other latencies.
    Returns:
        :class:`~kvqbench.experiments.reconstruction.CellResult` with the ``exp4`` metrics of
        :mod:`kvqbench.metrics`; ``extra`` holds ``timings`` (per K/V, every repeat),
        ``unreliable_timing``, ``nondeterministic_metrics``, ``peak_mem_source``, ``fit_ms``,
        ``roundtrip_timer`` and ``benchmark`` (pytest-benchmark's statistics or None).
    """
    cfg = config or CostConfig()
    t0 = time.perf_counter()
    fit_method(method, data, reuse=False)  # a fit of its own: its time is recorded
    fit_ms = (time.perf_counter() - t0) * 1e3
    xs = [("k", data.k_for(method.k_pre_rope)), ("v", data.v)]
    dev = xs[0][1].device
    timings: dict[str, Any] = {}
    res_extra: dict[str, Any] = {}
    q_ms = d_ms = 0.0
    eff, nom = [], []
    qts: list[QuantizedTensor] = []  # the representations made while timing (their held bytes: peak memory)
    fp16_bytes = 0
    for kind, x in xs:
        qt_times, qt = time_call(functools.partial(method.quantize, x, kind), dev,  # type: ignore[arg-type]
                                 warmup=cfg.warmup, repeats=cfg.repeats)
        dq_times, x_hat = time_call(functools.partial(method.dequantize, qt), dev, warmup=cfg.warmup,
                                    repeats=cfg.repeats)
        tally_nonfinite(res_extra, **{kind: x_hat})
        qm, dm = statistics.median(qt_times), statistics.median(dq_times)
        timings[f"{kind}_quant_ms"] = qm
        timings[f"{kind}_dequant_ms"] = dm
        timings[f"{kind}_quant_ms_all"] = qt_times
        timings[f"{kind}_dequant_ms_all"] = dq_times
        q_ms += qm
        d_ms += dm
        eff.append(qt.effective_bits())
        qts.append(qt)
        nom.append(method.nominal_bits(kind, tuple(int(s) for s in x.shape)))  # type: ignore[arg-type]
        fp16_bytes += 2 * int(x.numel())
    # the floor: x.clone() of K and V, and the round trip of both, timed in this cell
    clone_times, _ = time_call(lambda: [x.clone() for _, x in xs], dev, warmup=cfg.warmup, repeats=cfg.repeats)
    clone_ms = statistics.median(clone_times)

    def roundtrip() -> list[torch.Tensor]:
        return [method.dequantize(method.quantize(x, kind)) for kind, x in xs]  # type: ignore[arg-type]

    bench_stats = None
    if benchmark is not None:
        if cfg.benchmark_rounds is None:
            benchmark(roundtrip)
        else:
            benchmark.pedantic(roundtrip, rounds=cfg.benchmark_rounds, warmup_rounds=cfg.warmup, iterations=1)
        bench_stats = _benchmark_stats(benchmark)
    if bench_stats is not None:
        rt_ms, rt_timer = bench_stats["median_ms"], "pytest-benchmark"
    else:
        # no warm-up of its own: every call of the round trip (quantize and dequantize of K and V) was just
        # warmed up and timed above, so a warm-up round trip would only repeat them
        rt_times, _ = time_call(roundtrip, dev, warmup=0, repeats=cfg.repeats)
        rt_ms, rt_timer = statistics.median(rt_times), "median of repeats"
        timings["roundtrip_ms_all"] = rt_times
    timings["clone_ms"] = clone_ms
    timings["clone_ms_all"] = clone_times
    peak, source = _peak_mem(method, xs, qts)  # type: ignore[arg-type]
    res = CellResult()
    res.extra.update(res_extra)
    bits_eff = sum(eff) / 2
    res.metrics.update({
        "quant_latency_ms": q_ms,
        "dequant_latency_ms": d_ms,
        "quant_throughput_gbps": fp16_bytes / (max(q_ms, 1e-9) * 1e-3) / 1e9,
        "dequant_throughput_gbps": fp16_bytes / (max(d_ms, 1e-9) * 1e-3) / 1e9,
        "cost_bits_nominal": sum(nom) / 2,
        "cost_bits_effective": bits_eff,
        "compression_ratio": 16.0 / bits_eff,
        "peak_mem_mib": peak,
        "roundtrip_latency_ms": rt_ms,
        "quant_latency_x_clone": q_ms / max(clone_ms, 1e-9),
        "dequant_latency_x_clone": d_ms / max(clone_ms, 1e-9),
        "roundtrip_latency_x_clone": rt_ms / max(clone_ms, 1e-9),
    })
    timings.update({k: res.metrics[k] for k in TIMING_METRICS})
    nondet = list(TIMING_METRICS) + (["peak_mem_mib"] if _is_cuda(dev) else [])
    res.extra.update({
        "timings": timings,
        "unreliable_timing": not _is_cuda(dev),
        "nondeterministic_metrics": nondet,
        "peak_mem_source": source,
        "fit_ms": fit_ms,
        "roundtrip_timer": rt_timer,
        "benchmark": bench_stats,
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "device": str(dev),
        "torch_threads": torch.get_num_threads(),
    })
    return res
