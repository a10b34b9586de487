"""The ``kvqbench`` console command, for people who do not think in pytest.

    kvqbench run [--smoke|--full|--long] [--no-real] [pytest args…]   run the benchmark cells (calls pytest)
    kvqbench report DIR [--no-figures]                         re-render tables and figures from saved JSON
    kvqbench merge SHARD_DIR… --out DIR                        join the folders of a sharded run into one result set
    kvqbench compare BASE NEW [--fail-on metric:percent]       per-metric deltas between two result sets (a CI gate)
    kvqbench publish RESULTS [DEST]                            write the committed leaderboard/ + README digest
    kvqbench methods [--changed FILE…] [--k-expr]             method ids (or those a set of changed files touch)
    kvqbench perf [--tokens …] [--threads …] [--json PATH]      round-trip speed of every method vs clone/eager RTN

``report``, ``merge``, ``compare`` and ``publish`` never import torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from kvqbench.runner import UntilReaderGone, plugin_options_help, run

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose epilog may be computed when the help is printed (``epilog_fn``)."""

    epilog_fn: Callable[[], str] | None = None

    def format_help(self) -> str:
        if self.epilog_fn is not None and self.epilog is None:
            self.epilog = self.epilog_fn()
        return super().format_help()


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
    sub = p.add_subparsers(dest="cmd", metavar="{run,report,merge,compare,publish,methods,perf}",
                           parser_class=_Parser)
    r = sub.add_parser("run", help="run the benchmark cells through pytest (extra args go to pytest)",
                       description="Run benchmark cells: `pytest tests/bench -m full --kvq-real -n auto` "
                                   "(the progress line's ETA says how long it takes on this machine). "
                                   "Unknown arguments are passed to "
                                   "pytest (e.g. -k kvarn, -n 2, --kvq-seeds 5, --device cuda, --kvq-out DIR).",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.epilog_fn = plugin_options_help  # built only when the help is shown (imports pytest)
    size = r.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true",
                      help="tiny synthetic cells only (no figures unless --kvq-figures on; no pytest-benchmark timing table at the end, its JSON is "
                           "still saved, --benchmark-verbose shows the table); add --kvq-real for the "
                           "real-model smoke cells too")
    size.add_argument("--full", action="store_true", help="full-size cells (default)")
    size.add_argument("--long", action="store_true",
                      help="the long tier: long-decode and passkey cells on the real model (exp6; 4 seeds unless "
                           "--kvq-seeds is given) into results/long (or --kvq-out); stops with one line when "
                           "the model's context is shorter than they need")
    r.add_argument("--no-real", action="store_true", help="skip the real-model cells (synthetic only; not with --long, "
                                                          "which is real-data only; "
                                                          "--smoke implies it unless --kvq-real is given)")
    r.add_argument("--tests", default="tests/bench", help="folder of the benchmark cells (default tests/bench)")
    r.add_argument("--shard", metavar="I/N", default=None,
                   help="run only shard I of N (duration-balanced, the same on every machine) into "
                        "results/shards/shard-I-of-N (results/smoke/shards/… for smoke cells; or --kvq-out); join the N folders with kvqbench merge")
    r.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the shards as Ray tasks and merge them (needs the dist extra): no ADDRESS = a local "
                        "Ray instance on this machine; 'auto', HOST:6379 or ray://HOST:10001 joins a cluster (by address, "
                        "a cluster with Ray's token authentication needs RAY_AUTH_MODE=token; docs/CLUSTER.md). "
                        "One GPU per shard with --device cuda, one CPU otherwise")
    r.add_argument("--shards", type=int, metavar="N", default=None,
                   help="with --ray: number of shards (default: the cluster's GPUs with --device cuda, else its CPUs)")
    rep = sub.add_parser("report", help="re-render LEADERBOARD.md, index.html, the figures and the terminal table from "
                                        "saved JSON (no torch)",
                         description="Re-render a results folder from its saved JSON: LEADERBOARD.md, the PNG figures, "
                                     "the web page index.html (one self-contained file, figures embedded) and the "
                                     "terminal table (no torch, no cell runs again); --rebuild also rebuilds "
                                     "leaderboard.json from the per-experiment files. Every JSON file it reads is "
                                     "checked first: one that is truncated or not kvqbench's stops it with one line "
                                     "naming the file (exit 2, nothing written).")
    rep.add_argument("dir", type=Path, help="a results folder holding leaderboard.json")
    rep.add_argument("--no-figures", action="store_true", help="only the Markdown, the web page and the terminal table")
    rep.add_argument("--out", type=Path, default=None, help="write into this folder instead of DIR")
    rep.add_argument("--rebuild", action="store_true",
                     help="rebuild leaderboard.json and summary.json from DIR/exp*_*.json too (done anyway when "
                          "leaderboard.json is missing or unreadable, e.g. after a run killed while writing)")
    mer = sub.add_parser(
        "merge", help="join the shard folders of a sharded run (kvqbench run --shard I/N) into one result set (no torch)",
        description="Join the folders written by the N shards of one run (kvqbench run --shard I/N, --ray, "
                    "scripts/slurm_array.sh) into the files a single session writes. Refuses folders from "
                    "different commits, configurations or data with one line naming the difference; lists "
                    "cells no folder holds and stamps the merged set incomplete. Exit 0: complete; 1: "
                    "written but incomplete (missing or failed cells); 2: refused.")
    mer.add_argument("dirs", type=Path, nargs="+", metavar="SHARD_DIR", help="shard folders (each holds shard.json)")
    mer.add_argument("--out", type=Path, required=True, help="folder of the merged result set")
    mer.add_argument("--no-figures", action="store_true", help="skip the figures")
    cmp_ = sub.add_parser(
        "compare", help="compare two result sets; exit 1 when a metric regresses past a threshold",
        description="Per-metric changes from BASE to NEW by each metric's better-direction. A gate (--fail-on) "
                    "fails when a metric worsens by more than its PERCENT. Damage measured through the model "
                    "(end-to-end and long-decode KL: float noise moves them between runs of the same seeds) "
                    "fails only when, paired window by window (or text by text), the 95% CI of NEW/BASE also "
                    "lies wholly above 1; timing metrics only when the change is also larger than BASE's plus "
                    "NEW's 95% CI half-widths (sides with >= 2 seeds); other metrics are deterministic given "
                    "their seeds, and the threshold alone decides. A gate also fails when NEW lacks a source, "
                    "method, setting, metric, seed or finite value BASE has, unless --methods or --only-common "
                    "narrows the comparison on purpose, and when NEW is incomplete. What only NEW has is listed, "
                    "never a failure. Exit 0: passed; 1: failed; 2: bad input.")
    cmp_.add_argument("base", type=Path, help="baseline results folder or leaderboard.json")
    cmp_.add_argument("new", type=Path, help="new results folder or leaderboard.json")
    cmp_.add_argument("--fail-on", action="append", default=[], metavar="METRIC:PERCENT",
                      help="fail when METRIC gets worse by more than PERCENT %% (end-to-end or long-decode damage: and "
                           "its paired 95%% CI of NEW/BASE lies above 1; a timing metric: and by more than the CI "
                           "half-widths of BASE and NEW added) (repeatable; METRIC may be "
                           "'any', which skips timing metrics)")
    cmp_.add_argument("--methods", type=_method_list, default=None, metavar="ID,…",
                      help="compare only these methods (comma-separated), on both sides")
    cmp_.add_argument("--only-common", action="store_true",
                      help="compare only what both sets hold: what NEW lacks is listed, not a failure")
    cmp_.add_argument("--show", type=float, default=1.0, metavar="PERCENT",
                      help="list changes of at least PERCENT %% (default 1)")
    cmp_.add_argument("--max-rows", type=int, default=40, help="rows per table (default 40)")
    pub = sub.add_parser("publish", help="publish a run as the committed, provenance-clean leaderboard/ "
                                         "and regenerate the README digest",
                         description="Copy a run's result set into the committed reference folder (default "
                                     "leaderboard/) with machine-specific provenance removed, redraw its figures and its "
                                     "web page (index.html) "
                                     "and regenerate the results digest between the markers in the README.")
    pub.add_argument("results", type=Path, help="a results folder written by a run")
    pub.add_argument("dest", type=Path, nargs="?", default=Path("leaderboard"), help="destination (default leaderboard/)")
    pub.add_argument("--readme", type=Path, default=Path("README.md"),
                     help="README whose digest block is regenerated (default README.md)")
    pub.add_argument("--no-readme", action="store_true", help="leave the README alone")
    pub.add_argument("--no-figures", action="store_true", help="skip the figures")
    me = sub.add_parser("methods", help="list registered method ids, or those that changed files define",
                        description="Print the registered method ids (entry points included) on one line, "
                                    "separated by spaces; with --k-expr, a pytest -k expression selecting their "
                                    "cells instead; with --changed FILE…, only the methods those files affect (for "
                                    "CI on a method PR; an empty line when none).")
    me.add_argument("--changed", nargs="*", default=None, metavar="FILE",
                    help="changed paths (e.g. from git diff --name-only); prints the method ids they affect "
                         "(every method when the shared base/registry changes)")
    me.add_argument("--k-expr", action="store_true",
                    help="print, instead of the ids, a pytest -k expression selecting exactly those methods' cells "
                         "('[kivi- or …')")
    from kvqbench.perf import add_arguments as _perf_arguments  # torch-free at import

    _perf_arguments(sub.add_parser(
        "perf", help="time every method's K/V round trip as ratios to clone and to a plain eager RTN",
        description="Benchmark (not a test): median round-trip time of every registered method's K and V, "
                    "interleaved with x.clone() and a straightforward eager RTN (and HQQ's plain RTN when hqq "
                    "is installed), at 1 thread and the default thread count, T = 1k/4k/16k, in 3 processes (the "
                    "median over them; protocol and figures: docs/PERFORMANCE.md)."))
    return p


def _report(args: argparse.Namespace) -> int:
    from kvqbench.results.rerender import render_dir

    try:
        written = render_dir(args.dir, figures=not args.no_figures, out_dir=args.out, rebuild=args.rebuild)
    except (OSError, ValueError) as e:  # ValueError: an input file is truncated or not kvqbench's (names it)
        print(f"kvqbench report: {e}", file=sys.stderr)
        return 2
    for w in written:
        print(f"wrote {w}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from kvqbench.results.merge import MergeError, merge_shards

    try:
        res = merge_shards(args.dirs, args.out, figures=not args.no_figures,
                           log=lambda m: print(m, file=sys.stderr))
    except MergeError as e:
        print(f"kvqbench merge: {e}", file=sys.stderr)
        return 2
    comp = res.result.completeness
    where = res.result.out_dir
    print(f"kvqbench merge: {comp.get('summary', 'no cells')} from {len(args.dirs)} folder(s) -> {where}")
    return 0 if res.complete else 1


def _method_list(text: str) -> list[str]:
    """``"kivi,kvarn"`` → ``["kivi", "kvarn"]`` (``--methods``)."""
    ids = [x for x in (t.strip() for t in text.split(",")) if x]
    if not ids:
        raise argparse.ArgumentTypeError(f"expected comma-separated method ids, e.g. kivi,kvarn; got {text!r}")
    return ids


def _compare(args: argparse.Namespace) -> int:
    from kvqbench.results.compare import main as compare_main

    out = UntilReaderGone(sys.stdout)
    rc = compare_main(args.base, args.new, args.fail_on, show_percent=args.show, max_rows=args.max_rows,
                      only_common=args.only_common, methods=args.methods, out=out)
    out.flush()
    return rc


def _publish(args: argparse.Namespace) -> int:
    from kvqbench.results.publish import publish

    try:
        written = publish(args.results, args.dest, readme=None if args.no_readme else args.readme,
                          figures=not args.no_figures)
    except (FileNotFoundError, ValueError) as e:
        print(f"kvqbench publish: {e}", file=sys.stderr)
        return 2
    for w in written:
        print(f"wrote {w}")
    return 0


def _module_deps(modname: str, seen: set[str] | None = None) -> set[str]:
    """kvqbench modules ``modname`` depends on, transitively: the modules of the classes and functions
    in its namespace (``from x import y`` bindings and base classes alike)."""
    import sys

    seen = set() if seen is None else seen
    if modname in seen or modname not in sys.modules:
        return seen
    seen.add(modname)
    for obj in vars(sys.modules[modname]).values():
        dep = getattr(obj, "__module__", None) if not isinstance(obj, type(sys)) else obj.__name__
        if isinstance(obj, type(sys)) and dep.startswith(modname + "."):
            continue  # a package's loaded submodule is an attribute of it, not something it depends on
        if isinstance(dep, str) and dep.startswith("kvqbench.") and dep != modname:
            _module_deps(dep, seen)
    return seen


def _kernel_step_modules(path: Path) -> set[str]:
    """The modules declaring the reference steps that a file of ``kvqbench/kernels/`` speeds up: a kernel
    module serves the steps it registers; a C source serves the kernel modules that load it by name."""
    from kvqbench import kernels, steps

    here = Path(kernels.__file__).parent
    files = [path] if path.suffix == ".py" else [py for py in here.glob("*.py")
                                                 if path.name in py.read_text(encoding="utf-8")]
    mods = {f"kvqbench.kernels.{py.stem}" for py in files}
    refs = steps.references()
    return {refs[k.step].__module__ for k in steps.registered().values() if k.fn.__module__ in mods and k.step in refs}


def changed_methods(paths: list[str]) -> list[str]:
    """Method ids affected by changed files. A changed module under ``kvqbench/quantizers/`` or
    ``kvqbench/numerics/`` affects every method whose module depends on it, directly or through
    another module (a method's own file, a shared base such as ``GroupedRTNQuantizer`` in ``rtn.py``, a
    numerics helper); a fast version under ``kvqbench/kernels/`` (module or C source) affects the methods
    that depend on a module declaring one of its reference steps; ``quantizers/base.py`` affects every
    method; ``__init__.py`` files alone (the import lists) and the kernel loader affect none — a new method's
    own file names it. Other paths affect none. Imports the registry (torch)."""
    from kvqbench.quantizers import registry

    reg = registry()
    deps = {mid: _module_deps(cls.__module__) for mid, cls in reg.items()}
    out: list[str] = []
    for p in paths:
        parts = Path(p).parts
        if len(parts) >= 3 and parts[:2] == ("kvqbench", "kernels") and Path(p).suffix in (".py", ".c", ".h") \
                and Path(p).stem not in ("__init__", "build"):
            mods = _kernel_step_modules(Path(p))
            out += [mid for mid in reg if mods & deps[mid] and mid not in out]
            continue
        if len(parts) < 3 or parts[0] != "kvqbench" or parts[1] not in ("quantizers", "numerics") \
                or not p.endswith(".py") or Path(p).stem == "__init__":
            continue
        mod = ".".join(Path(p).with_suffix("").parts)
        ids = [mid for mid in reg if mod in deps[mid]]
        if mod == "kvqbench.quantizers.base":
            ids = list(reg)
        out += [i for i in ids if i not in out]
    return [m for m in reg if m in out]


def k_expr(ids: list[str]) -> str:
    """A pytest ``-k`` expression matching exactly the cells of ``ids``: node ids read
    ``test_x[<method>-k2v2-…]``, so ``[kivi-`` cannot match another method whose id merely contains
    ``kivi``."""
    return " or ".join(f"[{i}-" for i in ids)


def _methods(args: argparse.Namespace) -> int:
    if args.changed is not None:
        ids = changed_methods(args.changed)
    else:
        from kvqbench.quantizers import available

        ids = list(available())
    print(k_expr(ids) if args.k_expr else " ".join(ids))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd != "run" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "run":
        return run(args, extra)
    if args.cmd == "report":
        return _report(args)
    if args.cmd == "publish":
        return _publish(args)
    if args.cmd == "methods":
        return _methods(args)
    if args.cmd == "merge":
        return _merge(args)
    if args.cmd == "perf":
        from kvqbench.perf import main as perf_main

        return perf_main(args, list(sys.argv[1:] if argv is None else argv))
    return _compare(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
