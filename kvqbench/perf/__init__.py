"""``kvqbench perf`` — round-trip speed of every registered method, as ratios to baselines measured in the
same run.

A KV quantizer's round trip (quantize, then dequantize) is memory-bound: it reads the tensor, writes its
codes and writes the reconstruction. Baselines (:mod:`~kvqbench.perf.baselines`: ``clone``, a plain eager
RTN, HQQ's RTN when installed) are timed beside the methods on the same tensor, in the same process and the
same interleaved rounds (:mod:`~kvqbench.perf.timing`), at every token count and thread count asked, in
several processes merged by medians (:mod:`~kvqbench.perf.processes`), with the allocator and the machine
recorded (:mod:`~kvqbench.perf.machine`: CPU model, cache, glibc's allocator). :mod:`~kvqbench.perf.report`
prints the tables and writes the JSON; :mod:`~kvqbench.perf.cli` holds the options and the entry.

This is a benchmark command, not a test: timings are never asserted. Torch is imported lazily so that
``kvqbench --help`` stays light. Protocol and measured figures: docs/PERFORMANCE.md.
"""

from kvqbench.perf.baselines import BASELINES, EAGER_GROUP, eager_rtn_roundtrip
from kvqbench.perf.cli import add_arguments, main
from kvqbench.perf.machine import (
    CHILD_MARK,
    STEADY_TUNABLES,
    allocator_state,
    cpu_model,
    is_glibc_linux,
    last_level_cache_bytes,
    steady_env,
)
from kvqbench.perf.processes import PROCESS_MARK, merge_processes, rerun_command
from kvqbench.perf.report import format_report
from kvqbench.perf.timing import check_config, cold_copies, run_perf

__all__ = ["add_arguments", "check_config", "run_perf", "merge_processes", "format_report", "main",
           "eager_rtn_roundtrip", "BASELINES", "EAGER_GROUP", "STEADY_TUNABLES", "CHILD_MARK", "PROCESS_MARK",
           "steady_env", "rerun_command", "is_glibc_linux", "allocator_state", "last_level_cache_bytes",
           "cold_copies", "cpu_model"]
