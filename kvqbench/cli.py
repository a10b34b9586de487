"""The ``kvqbench`` console command, for people who do not think in pytest.

    kvqbench run [--smoke|--full] [--no-real] [pytest args…]   run the benchmark cells (calls pytest)
    kvqbench report DIR [--no-figures]                         re-render tables and figures from saved JSON
    kvqbench compare BASE NEW [--fail-on metric:percent]       per-metric deltas between two result sets
    kvqbench publish RESULTS [DEST]                            write the committed leaderboard/ + README digest
    kvqbench methods [--changed FILE…] [--k-expr]             method ids (or those a set of changed files touch)

``report``, ``compare`` and ``publish`` never import torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

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
    sub = p.add_subparsers(dest="cmd", metavar="{run,report,compare,publish,methods}", parser_class=_Parser)
    r = sub.add_parser("run", help="run the benchmark cells through pytest (extra args go to pytest)",
                       description="Run benchmark cells: `pytest tests/bench -m full --kvq-real -n auto` "
                                   "(measured: about 7 min on a 2-core CPU). Unknown arguments are passed to "
                                   "pytest (e.g. -k kvarn, -n 2, --kvq-seeds 5, --device cuda, --kvq-out DIR).",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.epilog_fn = plugin_options_help  # built only when the help is shown (imports pytest)
    size = r.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true",
                      help="tiny synthetic cells only (about 40 s on a 2-core CPU); add --kvq-real for the "
                           "real-model smoke cells too (about 2 min)")
    size.add_argument("--full", action="store_true", help="full-size cells (default)")
    r.add_argument("--no-real", action="store_true", help="skip the real-model cells (synthetic only; "
                                                          "--smoke implies it unless --kvq-real is given)")
    r.add_argument("--tests", default="tests/bench", help="folder of the benchmark cells (default tests/bench)")
    rep = sub.add_parser("report", help="re-render LEADERBOARD.md and the terminal table from saved JSON (no torch)")
    rep.add_argument("dir", type=Path, help="a results folder holding leaderboard.json")
    rep.add_argument("--no-figures", action="store_true", help="only the Markdown and the terminal table")
    rep.add_argument("--out", type=Path, default=None, help="write into this folder instead of DIR")
    cmp_ = sub.add_parser("compare", help="compare two result sets; exit 1 when a metric regresses past a threshold")
    cmp_.add_argument("base", type=Path, help="baseline results folder or leaderboard.json")
    cmp_.add_argument("new", type=Path, help="new results folder or leaderboard.json")
    cmp_.add_argument("--fail-on", action="append", default=[], metavar="METRIC:PERCENT",
                      help="fail when METRIC gets worse by more than PERCENT %% (repeatable; METRIC may be 'any', "
                           "which skips timing metrics)")
    cmp_.add_argument("--show", type=float, default=1.0, metavar="PERCENT",
                      help="list changes of at least PERCENT %% (default 1)")
    cmp_.add_argument("--max-rows", type=int, default=40, help="rows per table (default 40)")
    pub = sub.add_parser("publish", help="publish a run as the committed, provenance-clean leaderboard/ "
                                         "and regenerate the README digest")
    pub.add_argument("results", type=Path, help="a results folder written by a run")
    pub.add_argument("dest", type=Path, nargs="?", default=Path("leaderboard"), help="destination (default leaderboard/)")
    pub.add_argument("--readme", type=Path, default=Path("README.md"),
                     help="README whose digest block is regenerated (default README.md)")
    pub.add_argument("--no-readme", action="store_true", help="leave the README alone")
    pub.add_argument("--no-figures", action="store_true", help="skip the figures")
    me = sub.add_parser("methods", help="list registered method ids, or those that changed files define")
    me.add_argument("--changed", nargs="*", default=None, metavar="FILE",
                    help="changed paths (e.g. from git diff --name-only); prints the method ids they affect "
                         "(every method when the shared base/registry changes)")
    me.add_argument("--k-expr", action="store_true",
                    help="print a pytest -k expression selecting exactly those methods' cells ('[kivi- or …')")
    return p


class _OptionRecorder:
    """Stands in for pytest's ``Parser``/``OptionGroup``: records every ``addoption`` call so the
    plugin's own option definitions can be shown in ``kvqbench run --help`` (one source, no drift)."""

    def __init__(self) -> None:
        self.options: list[tuple[tuple[str, ...], dict]] = []

    def getgroup(self, *args: object, **kwargs: object) -> _OptionRecorder:
        return self

    def addoption(self, *names: str, **kwargs: object) -> None:
        self.options.append((names, dict(kwargs)))

    def addini(self, *args: object, **kwargs: object) -> None:  # ini values are not command-line options
        return None


def plugin_options() -> list[tuple[tuple[str, ...], dict]]:
    """Every command-line option the kvqbench pytest plugin defines, as ``(flags, addoption kwargs)``,
    read by running the plugin's ``pytest_addoption`` against a recorder (imports pytest, not torch)."""
    from kvqbench.plugin import pytest_addoption

    rec = _OptionRecorder()
    pytest_addoption(rec)  # type: ignore[arg-type]
    return rec.options


def plugin_options_help() -> str:
    """The ``kvqbench (pytest plugin) options`` section of ``kvqbench run --help``: each option with
    its help text and its default, formatted by argparse from the plugin's definitions."""
    helper = argparse.ArgumentParser(prog="kvqbench run", add_help=False,
                                     formatter_class=argparse.HelpFormatter)
    group = helper.add_argument_group("kvqbench options (passed to pytest; defaults shown)")
    for names, kw in plugin_options():
        kw = {k: v for k, v in kw.items() if k in ("action", "default", "metavar", "help", "choices", "nargs")}
        default = kw.get("default")
        shown = "off" if kw.get("action") == "store_true" else ("none" if default is None else str(default))
        text = str(kw.get("help") or "").replace("%", "%%")
        if "(default" not in text:
            text += f" (default {shown})"
        kw["help"] = text
        group.add_argument(*names, **kw)
    body = helper.format_help().split("\n\n", 1)[-1]  # drop the usage line
    return (body + "\nAny other pytest option works too (pytest --help). Selecting: -k kivi (a method id), "
            "-k reconstruction (an experiment's test name); a selection that matches no cell lists both.")


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    import pytest

    tests = Path(args.tests)
    if not tests.exists():
        print(f"kvqbench run: {tests}/ not found — run from the kvqbench repository root, or pass --tests DIR",
              file=sys.stderr)
        return 2
    cmd = [str(tests), "-m", "smoke" if args.smoke else "full"]
    if not args.no_real and not args.smoke and "--kvq-real" not in extra:  # --smoke: synthetic unless asked
        cmd.append("--kvq-real")
    if not any(a == "-n" or a.startswith("-n") or a.startswith("--numprocesses") for a in extra):
        cmd += ["-n", "auto"]  # one torch thread per worker (see --kvq-threads); xdist uses the cores
    cmd += extra
    print("kvqbench run: pytest " + " ".join(cmd), flush=True)
    return int(pytest.main(cmd))


def _report(args: argparse.Namespace) -> int:
    from kvqbench.report.render import render_dir

    try:
        written = render_dir(args.dir, figures=not args.no_figures, out_dir=args.out)
    except (FileNotFoundError, ValueError) as e:  # ValueError: not a kvqbench leaderboard (names the file)
        print(f"kvqbench report: {e}", file=sys.stderr)
        return 2
    for w in written:
        print(f"wrote {w}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from kvqbench.report.compare import main as compare_main

    return compare_main(args.base, args.new, args.fail_on, show_percent=args.show, max_rows=args.max_rows)


def _publish(args: argparse.Namespace) -> int:
    from kvqbench.report.publish import publish

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
        if isinstance(dep, str) and dep.startswith("kvqbench.") and dep != modname:
            _module_deps(dep, seen)
    return seen


def changed_methods(paths: list[str]) -> list[str]:
    """Method ids affected by changed files. A changed module under ``kvqbench/quantizers/`` or
    ``kvqbench/numerics/`` affects every method whose module depends on it, directly or through
    another module (a method's own file, a shared base such as ``GroupedRTNQuantizer`` in ``rtn.py``, a
    numerics helper); ``quantizers/base.py`` affects every method; ``__init__.py`` files alone (the import
    lists) affect none — a new method's own file names it. Other paths affect none. Imports the
    registry (torch)."""
    from kvqbench.quantizers import registry

    reg = registry()
    deps = {mid: _module_deps(cls.__module__) for mid, cls in reg.items()}
    out: list[str] = []
    for p in paths:
        parts = Path(p).parts
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
        return _run(args, extra)
    if args.cmd == "report":
        return _report(args)
    if args.cmd == "publish":
        return _publish(args)
    if args.cmd == "methods":
        return _methods(args)
    return _compare(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
