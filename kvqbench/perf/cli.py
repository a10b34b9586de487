"""``kvqbench perf``'s options and entry (:func:`add_arguments`, :func:`main`; parsed by :mod:`kvqbench.cli`).

Importing this module does not import torch, so that ``kvqbench --help`` stays light.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from kvqbench.perf.machine import is_glibc_linux
from kvqbench.perf.processes import DEFAULT_PROCESSES, PROCESS_MARK, in_processes, rerun_command
from kvqbench.perf.report import emit
from kvqbench.perf.timing import DEFAULT_REPEATS, DEFAULT_TOKENS, check_config, run_perf

__all__ = ["add_arguments", "main"]


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
                        f"process's medians and ratios (default {DEFAULT_PROCESSES}): where a process's memory lands "
                        f"moves the eager RTN's time for the whole process, more than the methods'; CUDA: always 1")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--no-peers", action="store_true", help="leave out optional peer baselines (hqq_rtn)")
    p.add_argument("--allocator", choices=("steady", "default"), default="steady",
                   help="steady (default; Linux/glibc): re-run once with GLIBC_TUNABLES so that every buffer comes "
                        "from glibc's heap and freed memory is kept, as a serving engine reuses its buffers; "
                        "otherwise each buffer of 32 MiB or more is freshly mapped and page-faulted on every call. "
                        "default: the allocator as is. Recorded in the JSON's environment")
    p.add_argument("--cache", choices=("cold", "warm"), default="cold",
                   help="cold (default): every timed call reads its own copy of the input, round-robin over copies "
                        "totalling more than the last-level cache (sysfs; CUDA: L2), so every candidate starts from "
                        "memory at every T (costs about twice the LLC in memory per T: K and V copies; at most "
                        "2 GiB each); warm: one input tensor, reused (whatever the previous call left in cache)")


def _check_json_path(path: Path | None) -> str | None:
    """Why ``--json`` ``path`` cannot be written (checked before anything is measured, nothing created), or
    ``None`` (:func:`kvqbench.results.write.check_writable` on its folder)."""
    from kvqbench.results.write import check_writable

    if path is None:
        return None
    if path.is_dir():
        return f"--json {path}: is a folder"
    why = check_writable(path.parent)
    return None if why is None else f"--json {path}: {why}"


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
        return in_processes(args, argv)
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
    emit(result, args.json)
    return 0
