"""Results of two models are kept apart: ``kvqbench merge`` of two models' shards gives one leaderboard
with one section per model, ``kvqbench compare`` compares cells within one model only. Torch-free inputs
built by hand (the sample records of test_report_samples)."""

from __future__ import annotations

import copy
import io
import json

import pytest
from test_report_samples import PROVENANCE, records

from kvqbench.cells import real_source
from kvqbench.results.compare import main as compare_main
from kvqbench.results.merge import MergeError, merge_shards
from kvqbench.results.read import load_result_set
from kvqbench.results.write import write_result_set

GEMMA = "gemma3-270m"


def _shard(folder, model: str, *, commit: str = "0123456789ab"):
    """A one-shard run of ``model``: the synthetic sample cells and the same cells on the model's real
    source, written as a ``--kvq-shard 1/1`` session writes them."""
    recs = records(sources=("synthetic", real_source(model)), experiments=("exp1",))
    prov = {**copy.deepcopy(PROVENANCE), "model": model, "git_commit": commit}
    ids = [r["nodeid"] for r in recs]
    write_result_set(recs, prov, folder, expected=ids, figures=False, log=lambda m: None)
    doc = {"index": 1, "count": 1, "shard": "1/1", "matrix_sha256": model, "cells": ids, "selected": ids,
           "provenance": prov}
    (folder / "shard.json").write_text(json.dumps(doc))
    return folder, recs


def test_two_models_shards_merge_into_one_leaderboard_with_a_section_per_model(tmp_path):
    a, recs_a = _shard(tmp_path / "smol", "smollm2")
    b, recs_b = _shard(tmp_path / "gemma", GEMMA)
    res = merge_shards([b, a], tmp_path / "m", figures=False, log=lambda m: None)
    assert res.complete and not res.missing
    board = json.loads((tmp_path / "m" / "leaderboard.json").read_text())
    assert set(board["sources"]) == {"synthetic", "real", "real-gemma3-270m"}
    assert board["provenance"]["model"] == "smollm2 + gemma3-270m"
    merged, _, _ = load_result_set(tmp_path / "m")[:3]
    # every cell once: the synthetic ones (the same node ids in both runs) from the first model's run
    ids = [r["nodeid"] for r in merged]
    assert len(ids) == len(set(ids)) == len(recs_a) + len(recs_b) - sum(r["source"] == "synthetic" for r in recs_b)
    assert {p.name for p in (tmp_path / "m").glob("exp*.json")} == {
        "exp1_synthetic.json", "exp1_real.json", "exp1_real-gemma3-270m.json"}
    md = (tmp_path / "m" / "LEADERBOARD.md").read_text()
    sections = [ln for ln in md.splitlines() if ln.startswith("## real")]
    assert "## real" in sections and "## real-gemma3-270m" in sections
    # the rows of a model's section are that model's cells alone
    for src in ("real", "real-gemma3-270m"):
        n = board["sources"][src]["stats"]["exp1"]["kivi"]["k2v2"]["rel_mse"]["n"]
        assert n == sum(1 for r in merged if r["source"] == src and r["method"] == "kivi" and r["k_bits"] == 2)


def test_two_models_runs_must_agree_on_all_but_the_model(tmp_path):
    a, _ = _shard(tmp_path / "smol", "smollm2")
    b, _ = _shard(tmp_path / "gemma", GEMMA, commit="fedcba987654")
    with pytest.raises(MergeError, match="differ in git commit"):
        merge_shards([a, b], tmp_path / "m", figures=False, log=lambda m: None)


def test_compare_matches_cells_within_one_model_only(tmp_path):
    """BASE ran SmolLM2, NEW Gemma with the very same values: no real cell is compared, the real source
    of each side is listed as missing on the other, and a gate fails on the missing model."""
    smol = tmp_path / "smol"
    gemma = tmp_path / "gemma"
    _shard(smol, "smollm2")
    _shard(gemma, GEMMA)
    buf = io.StringIO()
    rc = compare_main(smol, gemma, ["rel_mse:5"], out=buf)
    text = buf.getvalue()
    assert rc == 1
    assert "only in BASE" in text and "only in NEW" in text and "source real-gemma3-270m" in text
    from kvqbench.results.compare import compare_boards, load_board

    cmp = compare_boards(load_board(smol), load_board(gemma))
    assert cmp.changes and all(c.source == "synthetic" for c in cmp.changes)
    assert "source real" in cmp.only_base and "source real-gemma3-270m" in cmp.only_new


@pytest.mark.parametrize("model", ["smollm2", GEMMA])
def test_collection_names_the_real_cells_by_their_model(model):
    """The real cells of a run on ``model`` carry its source (``real`` for SmolLM2, ``real-gemma3-270m``
    for Gemma); synthetic cells are the same for either model; an experiment restricted to real data
    (``sources=("real",)``) keeps the model's real cells."""
    from kvqbench.plugin.collection import _cells_for
    from kvqbench.plugin.state import Settings

    s = Settings(real=True, model=model, methods=["fp16"], bits=[2], seeds=[0])
    cells = _cells_for(pytest.Mark("kvq", (), {"experiment": "exp1"}), s)  # the mark a bench test carries
    assert {c.source for c in cells} == {"synthetic", real_source(model)}
    assert {c.id for c in cells if c.source == "synthetic"} == {"fp16-k2v2-seed0-synthetic-smoke",
                                                                "fp16-k2v2-seed0-synthetic-full"}
    only_real = _cells_for(pytest.Mark("kvq", (), {"experiment": "exp5", "sources": ("real",)}), s)
    assert {c.source for c in only_real} == {real_source(model)}


def test_a_folder_holding_two_models_runs_rebuilds_with_both_provenances(tmp_path):
    """Two whole runs (not shards), one per model, their files put in one folder: ``load_result_set``
    names both models and keeps each run's command and start time under ``runs``; the completeness counts
    the cells the folder holds; and publishing that rebuilt set keeps every model's files."""
    import shutil

    from kvqbench.results.publish import publish
    from kvqbench.results.rerender import render_dir

    a, recs_a = _shard(tmp_path / "smol", "smollm2")
    b, recs_b = _shard(tmp_path / "gemma", GEMMA)
    prov_b = json.loads((b / "exp1_real-gemma3-270m.json").read_text())["provenance"]
    prov_b["start_time"], prov_b["command"] = "2000-01-01T00:00:00+00:00", "pytest --kvq-model gemma3-270m"
    for f in b.glob("exp*.json"):
        doc = json.loads(f.read_text())
        doc["provenance"] = prov_b
        f.write_text(json.dumps(doc))
    both = tmp_path / "both"
    shutil.copytree(a, both)
    shutil.copy(b / "exp1_real-gemma3-270m.json", both)
    recs, prov, comp, _ = load_result_set(both)
    assert prov["model"] == "smollm2 + gemma3-270m" and prov["start_time"] == "2000-01-01T00:00:00+00:00"
    assert [r["model"] for r in prov["runs"]] == ["smollm2", GEMMA]
    assert prov["runs"][1]["command"] == "pytest --kvq-model gemma3-270m"
    n = len(recs_a) + sum(r["source"] != "synthetic" for r in recs_b)
    assert len(recs) == n and comp["finished"] == comp["passed"] == n and comp["complete"]
    render_dir(both, echo=False, figures=False, rebuild=True)
    publish(both, tmp_path / "pub", readme=None, figures=False)
    assert {p.name for p in (tmp_path / "pub").glob("exp*.json")} == {
        "exp1_synthetic.json", "exp1_real.json", "exp1_real-gemma3-270m.json"}
