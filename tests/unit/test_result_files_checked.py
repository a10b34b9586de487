"""Every file a command reads is checked (issue 35): ``compare``, ``merge`` and ``report`` stop with one
line naming a truncated, foreign, missing or short experiment file; a published folder rebuilds to its own
``LEADERBOARD.md``; and the report's messages (a long-only set's terminal table, suggestions for an
unknown metric, the digest's seeds)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_report_samples import PROVENANCE, catalog, records, write_results

from kvqbench.cli import main
from kvqbench.metrics import did_you_mean
from kvqbench.report.board import assemble
from kvqbench.report.render.terminal import render_terminal
from kvqbench.results.publish import publish, render_digest, seeds_text
from kvqbench.results.rerender import render_dir
from kvqbench.results.write import write_result_set


def _break(f: Path, case: str) -> str:
    """Spoil ``f`` the way ``case`` says; the message that must name it."""
    text = f.read_text()
    if case == "truncated":
        f.write_text(text[: len(text) // 2])
        return f"{f} is not valid JSON ("
    if case == "foreign":
        f.write_text('{"name": "some other tool", "cells": 3}\n')
        return f"{f} is not a kvqbench experiment file (no 'provenance' object)"
    if case == "missing":
        f.unlink()
        return f"{f} is missing: leaderboard.json has synthetic results of exp2"
    doc = json.loads(text)  # "short": a valid file holding fewer cells than leaderboard.json counts
    n = len(doc["cells"])
    doc["cells"] = doc["cells"][1:]
    f.write_text(json.dumps(doc))
    return f"exp2_synthetic.json: {n - 1}"


@pytest.mark.parametrize("case", ["truncated", "foreign", "missing", "short"])
@pytest.mark.parametrize("command", ["compare", "report"])
def test_compare_and_report_stop_on_a_bad_experiment_file(tmp_path, capsys, case, command):
    """``compare BASE NEW`` and ``report DIR`` read the per-experiment files beside ``leaderboard.json``:
    one spoiled file is one line naming it and exit 2 (``compare`` read only ``leaderboard.json`` before)."""
    good = write_results(tmp_path / "good", records())
    bad = write_results(tmp_path / "bad", records())
    want = _break(bad / "exp2_synthetic.json", case)
    args = ["compare", str(good), str(bad)] if command == "compare" else ["report", str(bad), "--no-figures"]
    assert main(args) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and len(cap.err.splitlines()) == 1, cap.err
    assert cap.err.startswith(f"kvqbench {command}: ") and want in cap.err, cap.err
    assert main(["compare", str(good), str(good)]) == 0  # the untouched folder passes the same checks


def test_merge_stops_on_a_truncated_experiment_file_of_a_shard(tmp_path, capsys):
    shard = write_results(tmp_path / "s1", records())
    (shard / "shard.json").write_text(json.dumps({"index": 1, "count": 1, "shard": "1/1", "matrix_sha256": "0",
                                                  "cells": [], "selected": [], "provenance": PROVENANCE}))
    want = _break(shard / "exp3_synthetic.json", "truncated")
    assert main(["merge", str(shard), "--out", str(tmp_path / "merged"), "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"kvqbench merge: {want}"), err
    assert not (tmp_path / "merged").exists()


def test_rebuild_of_a_published_folder_gives_its_leaderboard_md(tmp_path):
    """``report --rebuild`` of a published folder rebuilds it from the published experiment files alone:
    the model name, the ``Data:`` line, the methods' metadata and the worst layers come out as the
    published ``LEADERBOARD.md`` has them."""
    recs = records(sources=("synthetic", "real"))
    for r in recs:
        r["data"] = {"model": "smollm2", "seq_len": 64} if r["source"] == "real" else {"seq_len": 64}
        if "rel_mse" in r["metrics"]:  # a worse second layer: the worst layer is index 1
            r["per_layer"] = {"rel_mse": [r["metrics"]["rel_mse"] * 0.5, r["metrics"]["rel_mse"] * 1.5]}
    write_result_set(recs, copy.deepcopy(PROVENANCE), tmp_path / "run", expected=len(recs), catalog=catalog(),
                     figures=False, log=lambda m: None)
    dest = tmp_path / "lb"
    publish(tmp_path / "run", dest, readme=None, figures=False, identities={})
    published = (dest / "LEADERBOARD.md").read_text()
    assert "## real (smollm2)" in published and "Data: model=smollm2, seq_len=64" in published
    board = json.loads((dest / "leaderboard.json").read_text())
    assert board["sources"]["real"]["stats"]["exp1"]["kivi"]["k2v2"]["rel_mse"]["worst_layer_index"] == 1
    render_dir(dest, echo=False, figures=False, rebuild=True)
    assert (dest / "LEADERBOARD.md").read_text() == published


def _long_only() -> list[dict]:
    """exp6 records only (a ``kvqbench run --long`` set): two methods, seeds 0–3, KL doubling per method."""
    out = []
    for i, m in enumerate(("fp16", "kivi")):
        for s in range(4):
            out.append({"experiment": "exp6", "method": m, "k_bits": 2, "v_bits": 2, "seed": s, "source": "real",
                        "size": "long", "variant": {}, "status": "passed",
                        "nodeid": f"tests/bench/test_exp6.py::test_long[{m}-k2v2-seed{s}-real-long]",
                        "metrics": {"long_kl_nats": 0.25 * i * (1 + s), "long_bits_billed": 16.0 if i == 0 else 2.5}})
    return out


def test_terminal_table_of_a_long_only_set():
    """A set holding only the long decode (no headline metric, no relative MSE) still gets its table:
    ranked by the long-decode KL, with the bits billed at T."""
    board = assemble(_long_only(), catalog(), copy.deepcopy(PROVENANCE))
    lines = render_terminal(board).splitlines()
    assert lines[0].startswith("kvqbench [real] long_kl_nats (exp6) at k2v2")
    assert lines[1].split() == ["rank", "method", "long_kl_nats", "bits", "billed"]
    rows = [ln.split() for ln in lines[3:]]
    assert [r[1] for r in rows] == ["fp16", "kivi"]
    # kivi's mean KL over seeds 0–3: 0.25 · (1 + 2 + 3 + 4) / 4 = 0.625; its bits billed 2.5
    assert rows[1][2] == "0.625" and rows[1][-1] == "2.5"


def test_digest_names_the_seeds_of_each_experiment():
    """The digest's seeds are the list most experiments share, then each experiment with others — not the
    union of all runs' seeds."""
    recs = records(experiments=("exp1", "exp2")) + _long_only()
    board = assemble(recs, catalog(), {**PROVENANCE, "seeds": [0, 1, 2, 3]})
    seeds = sorted({r["seed"] for r in records(experiments=("exp1",))})
    assert seeds_text(board) == f"{seeds} (exp6: [0, 1, 2, 3])"
    assert f"seeds {seeds} (exp6: [0, 1, 2, 3]) ·" in render_digest(board)


@pytest.mark.parametrize("name, want", [
    ("mse", "; did you mean 'k_mse', 'v_mse' or 'rel_mse'?"),  # every name holding the word, shortest first
    ("rel_mes", "; did you mean 'rel_mse'?"),  # a typo: the one closest
    ("xyz", ""),  # nothing close: no guess
])
def test_suggestions_for_an_unknown_metric(name, want):
    known = ["rel_mse", "k_mse", "v_mse", "k_rel_mse", "passkey_match", "bits_effective"]
    assert did_you_mean(name, known) == want


def test_figures_read_the_files_of_a_source_with_a_dot(tmp_path):
    """A model label may hold ``.`` (:func:`kvqbench.cells.real_source`): its experiment files are read
    like any other, so the figures drawn from them (exp2's curves) exist."""
    pytest.importorskip("matplotlib", reason="figures need matplotlib")
    from kvqbench.cells import real_source
    from kvqbench.report.render.figures import write_figures

    src = real_source("Qwen2.5-0.5B")
    assert src == "real-qwen2.5-0.5b"
    out = write_results(tmp_path / "r", records(sources=(src,), experiments=("exp1", "exp2")))
    names = {p.name for p in write_figures(out, log=lambda m: None)}
    assert f"attn_error_vs_context_{src}.png" in names
