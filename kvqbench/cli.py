"""The ``kvqbench`` console command, for people who do not think in pytest.

    kvqbench run [--smoke|--full] [--no-real] [pytest args…]   run the benchmark cells (calls pytest)
    kvqbench report DIR                                        re-render tables from saved JSON (no torch)
    kvqbench compare BASE NEW [--fail-on metric:percent]       per-metric deltas between two result sets

``report`` and ``compare`` never import torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvqbench",
        description="kvqbench — a reproducible, method-neutral benchmark of KV-cache quantization methods.",
        epilog="Examples:\n  kvqbench run                      # main job: full cells, synthetic + real SmolLM2, 3 seeds\n"
               "  kvqbench run --smoke -k kivi      # KIVI's smoke cells only\n"
               "  kvqbench report results/          # rebuild LEADERBOARD.md from results/leaderboard.json\n"
               "  kvqbench compare leaderboard/ results/ --fail-on rel_mse:5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", metavar="{run,report,compare}")
    r = sub.add_parser("run", help="run the benchmark cells through pytest (extra args go to pytest)",
                       description="Run benchmark cells. Unknown arguments are passed to pytest "
                                   "(e.g. -k kvarn, -n auto, --kvq-seeds 5, --device cuda, --kvq-out DIR).")
    size = r.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="tiny cells (seconds)")
    size.add_argument("--full", action="store_true", help="full-size cells (default)")
    r.add_argument("--no-real", action="store_true", help="skip the real-model cells (synthetic only)")
    r.add_argument("--tests", default="tests/bench", help="folder of the benchmark cells (default tests/bench)")
    rep = sub.add_parser("report", help="re-render LEADERBOARD.md and the terminal table from saved JSON (no torch)")
    rep.add_argument("dir", type=Path, help="a results folder holding leaderboard.json")
    cmp_ = sub.add_parser("compare", help="compare two result sets; exit 1 when a metric regresses past a threshold")
    cmp_.add_argument("base", type=Path, help="baseline results folder or leaderboard.json")
    cmp_.add_argument("new", type=Path, help="new results folder or leaderboard.json")
    cmp_.add_argument("--fail-on", action="append", default=[], metavar="METRIC:PERCENT",
                      help="fail when METRIC gets worse by more than PERCENT %% (repeatable; METRIC may be 'any')")
    return p


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    import pytest

    tests = Path(args.tests)
    if not tests.exists():
        print(f"kvqbench run: {tests}/ not found — run from the kvqbench repository root, or pass --tests DIR",
              file=sys.stderr)
        return 2
    cmd = [str(tests), "-m", "smoke" if args.smoke else "full"]
    if not args.no_real and "--kvq-real" not in extra:
        cmd.append("--kvq-real")
    if not any(a == "-n" or a.startswith("-n") or a.startswith("--numprocesses") for a in extra):
        cmd += ["-n", "auto"]  # one torch thread per worker (see --kvq-threads); xdist uses the cores
    cmd += extra
    print("kvqbench run: pytest " + " ".join(cmd), flush=True)
    return int(pytest.main(cmd))


def _report(args: argparse.Namespace) -> int:
    from kvqbench.report.render import render_dir

    try:
        written = render_dir(args.dir)
    except FileNotFoundError as e:
        print(f"kvqbench report: {e}", file=sys.stderr)
        return 2
    for w in written:
        print(f"wrote {w}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from kvqbench.report.compare import main as compare_main

    return compare_main(args.base, args.new, args.fail_on)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd != "run" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "run":
        return _run(args, extra)
    if args.cmd == "report":
        return _report(args)
    return _compare(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
