"""``kvqbench report DIR`` re-renders a run's LEADERBOARD.md byte for byte from the saved JSON in a
process where importing torch fails, and writes the figures there too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_report_samples import write_results

from kvqbench.results.rerender import render_dir

ROOT = Path(__file__).resolve().parents[2]
#: torch as if not installed: any import of it raises ImportError. (``sys.modules['torch'] = None`` would
#: leave a ``torch`` entry that scipy.stats' array-API layer reads as a module and fails on.)
NO_TORCH = """import importlib.abc, sys


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"import of torch halted: {name}")
        return None


sys.meta_path.insert(0, _NoTorch())
"""


def _env_without_torch(tmp_path: Path) -> dict[str, str]:
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(NO_TORCH)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    """A real (tiny) benchmark run: two methods, two seeds, 2 and 16 bits."""
    out = tmp_path_factory.mktemp("run") / "results"
    cmd = [sys.executable, "-m", "pytest", "tests/bench", "-m", "smoke", "-q", "-p", "no:cacheprovider",
           "-p", "no:randomly", "--kvq-methods", "fp16,kivi", "--kvq-seeds", "2", "--kvq-bits", "2,16",
           "--kvq-progress", "0", "--kvq-figures", "on", "--kvq-out", str(out), "-k", "reconstruction"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (out / "LEADERBOARD.md").exists()
    return out


def test_shim_really_blocks_torch(tmp_path):
    res = subprocess.run([sys.executable, "-c", "import torch"], env=_env_without_torch(tmp_path),
                         capture_output=True, text=True)
    assert res.returncode != 0 and "import of torch halted" in res.stderr


def test_report_without_torch_is_byte_identical(smoke_run, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(smoke_run, d)
    original = (d / "LEADERBOARD.md").read_bytes()
    (d / "LEADERBOARD.md").unlink()
    for png in d.glob("*.png"):
        png.unlink()
    res = subprocess.run([sys.executable, "-m", "kvqbench.cli", "report", str(d)], cwd=tmp_path,
                         env=_env_without_torch(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (d / "LEADERBOARD.md").read_bytes() == original
    assert "kvqbench [synthetic] headline rel_mse (exp1) at k2v2" in res.stdout
    assert "(relative MSE: this result set has no end-to-end run" in res.stdout  # why not the main job's metric
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("figures need matplotlib (Markdown part passed)")
    assert (d / "pareto_synthetic.png").read_bytes()[:4] == b"\x89PNG"
    assert {p.name for p in d.glob("*.png")} == {p.name for p in smoke_run.glob("*.png")}


def test_compare_and_publish_run_without_torch(smoke_run, tmp_path):
    env = _env_without_torch(tmp_path)
    res = subprocess.run([sys.executable, "-m", "kvqbench.cli", "compare", str(smoke_run), str(smoke_run),
                          "--fail-on", "any:0"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    res = subprocess.run([sys.executable, "-m", "kvqbench.cli", "publish", str(smoke_run), str(tmp_path / "lb"),
                          "--readme", str(readme), "--no-figures"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "lb" / "leaderboard.json").exists() and "kvqbench-digest:start" in readme.read_text()


def test_render_dir_in_process_and_missing_folder(tmp_path, capsys):
    out = write_results(tmp_path / "r")
    before = (out / "LEADERBOARD.md").read_bytes()
    written = render_dir(out, figures=False)
    assert written == [str(out / "LEADERBOARD.md"), str(out / "index.html")]
    assert (out / "LEADERBOARD.md").read_bytes() == before
    assert "headline rel_mse" in capsys.readouterr().out
    from kvqbench.cli import main

    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "leaderboard.json not found" in capsys.readouterr().err
    # a results tree whose only set is in a subfolder (a smoke run writes results/smoke): named in the error
    assert main(["report", str(tmp_path)]) == 2
    assert f"result sets below it: {out}" in capsys.readouterr().err


def test_terminal_says_why_a_set_without_end_to_end_ranks_on_relative_mse():
    """docs/DESIGN.md §4: the headline metric is the one predictivity picks, which needs the end-to-end run; a set
    without it (a smoke run) ranks on relative MSE, and the terminal table says why; one with it does not."""
    import copy

    from test_report_samples import board

    from kvqbench.report.render.terminal import render_terminal

    b = board()
    assert not b["headline"]["from_predictivity"]
    assert "this result set has no end-to-end run" in render_terminal(b)
    picked = copy.deepcopy(b)
    picked["headline"] = {**b["headline"], "metric": "rel_mse", "from_predictivity": True, "rho": 0.9,
                          "source": "synthetic", "target": "e2e_prefill_kl_nats"}
    text = render_terminal(picked)
    assert "no end-to-end run" not in text and "Spearman rho 0.90" in text


def _e2e_records(methods):
    """exp5 records for ``methods`` on the sample's bit widths and seeds: KL exactly 0 for fp16 and at 16
    bits (the exact points), the method's sample error / 10 elsewhere."""
    from test_report_samples import BASE_ERR, BITS, SEEDS, _rec

    out = []
    for m in methods:
        for b in BITS:
            for s in SEEDS:
                kl = 0.0 if m == "fp16" or b >= 16 else BASE_ERR.get(m, 0.4) / 10 * 4.0 ** (2 - b) * (1 + 0.02 * s)
                out.append(_rec("exp5", m, b, s, "synthetic", {"e2e_prefill_kl_nats": kl, "e2e_decode_kl_nats": kl}))
    return out


def test_terminal_says_why_an_end_to_end_run_of_one_method_picks_no_metric():
    """``kvqbench run -k kvarn``: exp5 ran (its KL is in the table), yet predictivity needs Spearman ρ over
    at least 4 methods with a non-zero KL; the line above the table names that, not a missing end-to-end
    run. With every sample method (fp16 is exact: 3 damaged) the same reason names the three."""
    from test_report_samples import board, records

    from kvqbench.report.render.markdown import render_markdown
    from kvqbench.report.render.terminal import render_terminal
    from kvqbench.report.stats.predictivity import PREDICTIVITY_MIN_METHODS

    assert PREDICTIVITY_MIN_METHODS == 4
    kvarn = [r for r in records() if r["method"] == "kvarn"] + _e2e_records(["kvarn"])
    b = board(kvarn)
    assert not b["headline"]["from_predictivity"]
    text = render_terminal(b)
    lines = text.splitlines()
    why = next(i for i, ln in enumerate(lines) if ln.startswith("  (relative MSE:"))
    assert lines[why] == ("  (relative MSE: the end-to-end run in this result set has 1 method with a non-zero KL (kvarn), and ranking "
                          "tensor metrics against it takes at least 4, so it cannot pick the tensor metric that "
                          "predicts model damage; the main job, `kvqbench run`, ranks on that metric)")
    assert "e2e KL (nats)" in lines[why + 1]  # the table right below shows the end-to-end KL
    assert "no end-to-end run" not in text
    assert ("Headline tensor metric `rel_mse`: the end-to-end run in this result set has 1 method with a non-zero KL (kvarn), and ranking tensor "
            "metrics against it takes at least 4, so which tensor metric") in render_markdown(b)
    every = board(records() + _e2e_records(["fp16", "rtn_token", "kivi", "kvarn"]))
    assert "the end-to-end run in this result set has 3 methods with a non-zero KL (kivi, kvarn, rtn_token)" in render_terminal(every)
    # without exp5 the reason is the missing end-to-end run
    assert "(relative MSE: this result set has no end-to-end run, so it cannot pick" in render_terminal(board())
    # enough damaged methods, but no tensor metric beside them (an end-to-end-only selection)
    from kvqbench.report.render.headline import no_predictivity_reason

    e2e_only = board(_e2e_records(["rtn_token", "kivi", "kvarn", "other"]))
    assert not e2e_only["headline"]["from_predictivity"]
    assert no_predictivity_reason(e2e_only) == ("the end-to-end run in this result set has no tensor metric of experiments 1–3 beside "
                                                "it for the same methods and settings")


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", ["truncated", "foreign", "wrong_name", "bad_cell"])
@pytest.mark.parametrize("rebuild", [False, True], ids=["report", "rebuild"])
def test_report_checks_every_experiment_file_before_writing(tmp_path, capsys, case, rebuild):
    """A truncated or foreign ``exp2_*.json`` stops ``kvqbench report DIR`` (and ``--rebuild``) with one line
    naming the file, exit 2, and leaves every file as it was (the figures read those files)."""
    from kvqbench.cli import main

    out = write_results(tmp_path / "r")
    f = out / "exp2_synthetic.json"
    text = f.read_text()
    if case == "truncated":
        f.write_text(text[: len(text) // 2])
        want = f"{f} is not valid JSON ("
    elif case == "foreign":
        f.write_text('{"name": "some other tool", "cells": 3}\n')
        want = f"{f} is not a kvqbench experiment file (no 'provenance' object)"
    elif case == "wrong_name":
        f.rename(out / "exp2_synthetic_copy.json")  # a copy of exp2 under another source's name
        f = out / "exp2_synthetic_copy.json"
        want = f"{f} is not a kvqbench experiment file ('source' is 'synthetic', not 'synthetic_copy' as its name says)"
    else:
        doc = json.loads(text)
        del doc["cells"][3]["method"]
        f.write_text(json.dumps(doc))
        want = f"{f} is not a kvqbench experiment file (cell 3 has no 'method')"
    before = _snapshot(out)
    assert main(["report", str(out), "--no-figures", *(["--rebuild"] if rebuild else [])]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.splitlines()) == 1 and cap.err.startswith(f"kvqbench report: {want}"), cap.err
    assert _snapshot(out) == before  # nothing rewritten


def test_report_refuses_a_foreign_leaderboard_and_rebuilds_a_truncated_one(tmp_path, capsys):
    from kvqbench.cli import main

    out = write_results(tmp_path / "r")
    lb = out / "leaderboard.json"
    lb.write_text('{"sources": []}\n')  # valid JSON, someone else's: not overwritten
    before = _snapshot(out)
    assert main(["report", str(out), "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvqbench report: {lb} is not a kvqbench leaderboard (no 'provenance'); re-run the benchmark or " \
                  "point at a folder it wrote\n"
    assert _snapshot(out) == before
    lb.write_text('{"provenance": {')  # truncated: rebuilt from the valid per-experiment files, one line says so
    assert main(["report", str(out), "--no-figures"]) == 0
    assert capsys.readouterr().err == (f"kvqbench report: {lb} is not valid JSON; rebuilding it from "
                                       f"{out}/exp*_*.json\n")
    assert json.loads(lb.read_text())["sources"]["synthetic"]["stats"]


def test_report_out_never_mixes_or_deletes_another_set(tmp_path, capsys):
    """``report DIR --out OTHER`` where OTHER holds another complete set: a re-render (Markdown and figures
    only) refuses in one line and writes nothing; ``--rebuild`` writes the set there and keeps OTHER's in
    ``OTHER/previous/`` (like any new complete set)."""
    from test_report_samples import records

    from kvqbench.cli import main
    from kvqbench.results.previous import kept_sets

    src = write_results(tmp_path / "a")
    other = write_results(tmp_path / "b", [r for r in records() if r["method"] != "kvarn"])
    before = _snapshot(other)
    assert main(["report", str(src), "--out", str(other), "--no-figures"]) == 2
    assert capsys.readouterr().err == (f"kvqbench report: {other} holds another result set (its leaderboard.json), "
                                       "whose LEADERBOARD.md and figures this would replace; give --out an empty "
                                       f"folder, or render into {src}\n")
    assert _snapshot(other) == before
    assert main(["report", str(src), "--out", str(other), "--no-figures", "--rebuild"]) == 0
    (kept,) = kept_sets(other)
    assert {n: b for n, (b, _) in _snapshot(kept).items()} == {n: b for n, (b, _) in before.items()}
    assert f"is kept in {kept}" in capsys.readouterr().err
