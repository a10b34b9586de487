"""``kvqbench publish``: provenance-clean published files, the README digest, and the repository's
own README digest agreeing with the committed ``leaderboard/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report_samples import PROVENANCE, records, write_results

from kvqbench.report.io import read_json
from kvqbench.results.publish import (
    DIGEST_END,
    DIGEST_START,
    find_leaks,
    publish,
    readme_digest,
    render_digest,
    scrub,
    update_readme,
)

ROOT = Path(__file__).resolve().parents[2]
ALICE = {"alice": "<user>", "alices-laptop": "<host>"}


def test_scrub_paths_users_hosts_but_not_urls_or_units():
    doc = {"command": "pytest --kvq-out /home/alice/runs/r1 -k kivi", "model": "C:\\Users\\alice\\m\\llama",
           "note": "alice ran it on alices-laptop from ~/kvq", "paper": "https://arxiv.org/abs/2402.02750",
           "unit": "GB/s", "desc": "(‖x̂‖−‖x‖)/‖x‖ over K/V", "nodeid": "tests/bench/t.py::t[kivi-k2v2]",
           "/home/alice/key": 1, "n": 3}
    out = scrub(doc, identities=ALICE)
    assert out["command"] == "pytest --kvq-out <local>/r1 -k kivi"
    assert out["model"] == "<local>/llama"
    assert out["note"] == "<user> ran it on <host> from <local>/kvq"
    for k in ("paper", "unit", "desc", "nodeid", "n"):
        assert out[k] == doc[k]
    assert "<local>/key" in out
    assert find_leaks(out, identities=ALICE) == []
    assert find_leaks(doc, identities=ALICE)  # the raw document does leak


def test_publish_writes_clean_files_and_readme_digest(tmp_path):
    res = write_results(tmp_path / "results", records(sources=("synthetic", "real")))
    readme = tmp_path / "README.md"
    readme.write_text(f"# project\n\n## Results digest\n\n{DIGEST_START}\nold\n{DIGEST_END}\n\n## After\n")
    dest = tmp_path / "leaderboard"
    written = publish(res, dest, readme=readme, figures=False, identities=ALICE)
    names = {Path(w).name for w in written}
    assert {"leaderboard.json", "LEADERBOARD.md", "README.md", "exp1_synthetic.json", "exp1_real.json"} <= names
    board = read_json(dest / "leaderboard.json")
    assert find_leaks(board, identities=ALICE) == []
    prov = board["provenance"]
    for key in ("kvqbench_version", "git_commit", "torch_version", "device", "device_name", "seeds", "shapes"):
        assert prov[key] == PROVENANCE[key], key
    assert prov["command"] == "pytest tests/bench -m smoke --kvq-out <local>/results"
    assert set(board["sources"]) == {"real", "synthetic"}
    md = (dest / "LEADERBOARD.md").read_text()
    assert "## real" in md and "## synthetic" in md
    text = readme.read_text()
    assert text.startswith("# project\n") and text.rstrip().endswith("## After") and "\nold\n" not in text
    assert readme_digest(text) == render_digest(board)
    assert "**synthetic** — best method" in text and "**real** — best method" in text
    # publishing the same run again changes nothing in the README
    assert update_readme(readme, render_digest(board)) is False


def test_publish_removes_files_of_a_previous_run(tmp_path):
    pytest.importorskip("matplotlib", reason="figures need matplotlib")
    dest = tmp_path / "leaderboard"
    publish(write_results(tmp_path / "a", records(sources=("synthetic", "real"))), dest, readme=None, identities={})
    assert (dest / "pareto_real.png").exists() and (dest / "exp2_real.json").exists()
    publish(write_results(tmp_path / "b", records(sources=("synthetic",))), dest, readme=None, identities={})
    assert not (dest / "pareto_real.png").exists() and not (dest / "exp2_real.json").exists()
    assert (dest / "pareto_synthetic.png").exists()


def _stale(res: Path, name: str, **prov: str) -> None:
    """Rewrite ``res/name`` as if an older run had left it (different provenance fields)."""
    doc = read_json(res / name)
    doc["provenance"] = {**doc["provenance"], **prov}
    doc["cells"] = doc["cells"][:1]
    (res / name).write_text(json.dumps(doc))


def test_publish_skips_experiment_files_of_another_run(tmp_path, capsys):
    res = write_results(tmp_path / "results", records(sources=("synthetic", "real")))
    _stale(res, "exp1_real.json", start_time="2025-06-01T00:00:00+00:00")  # older run, same folder
    _stale(res, "exp2_real.json", command="pytest tests/bench -m full")  # same time, other command
    dest = tmp_path / "leaderboard"
    written = {Path(w).name for w in publish(res, dest, readme=None, figures=False, identities=ALICE)}
    assert "exp1_real.json" not in written and not (dest / "exp1_real.json").exists()
    assert "exp2_real.json" not in written and not (dest / "exp2_real.json").exists()
    assert {"exp1_synthetic.json", "exp2_synthetic.json", "exp3_real.json"} <= written
    err = capsys.readouterr().err.splitlines()
    warned = [line for line in err if "skipping" in line]
    assert len(warned) == 2, err
    assert "exp1_real.json" in warned[0] and "start_time" in warned[0] and "another run" in warned[0]
    assert "exp2_real.json" in warned[1] and "command" in warned[1]


def test_publish_skips_sources_the_leaderboard_lacks_and_never_copies_old_figures(tmp_path, capsys):
    old = write_results(tmp_path / "old", records(sources=("synthetic", "real")))
    res = write_results(tmp_path / "results", records(sources=("synthetic",)))
    for p in old.glob("exp*_real.json"):  # a real run's files left in the folder of a synthetic-only run
        (res / p.name).write_bytes(p.read_bytes())
    (res / "pareto_real.png").write_bytes(b"stale figure")
    (res / "pareto_synthetic.png").write_bytes(b"stale figure")
    dest = tmp_path / "leaderboard"
    dest.mkdir()
    (dest / "mse_vs_bits_real.png").write_bytes(b"previous publish")
    written = {Path(w).name for w in publish(res, dest, readme=None, identities=ALICE)}
    assert not any("real" in n for n in written), written
    assert not list(dest.glob("*_real.*"))
    err = capsys.readouterr().err
    assert err.count("skipping exp") == 4 and "source 'real' is not in leaderboard.json" in err
    for png in dest.glob("*.png"):  # re-rendered from the published JSON, never the results folder's files
        assert png.read_bytes() != b"stale figure"


def test_publish_refuses_a_leak_it_cannot_scrub(tmp_path, monkeypatch):
    res = write_results(tmp_path / "r")
    b = read_json(res / "leaderboard.json")
    b["provenance"]["operator"] = "bobsmith"
    (res / "leaderboard.json").write_text(json.dumps(b))
    import kvqbench.results.publish as pub

    monkeypatch.setattr(pub, "scrub", lambda obj, identities=None: obj)  # a scrubber that misses it
    with pytest.raises(ValueError, match="survived scrubbing"):
        pub.publish(res, tmp_path / "lb", readme=None, figures=False, identities={"bobsmith": "<user>"})
    assert not (tmp_path / "lb").exists()


def test_update_readme_appends_markers_when_missing(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    assert update_readme(readme, "digest body\n") is True
    assert readme.read_text() == f"# x\n\n## Results digest\n\n{DIGEST_START}\ndigest body\n{DIGEST_END}\n"
    assert readme_digest(readme.read_text()) == "digest body\n"


def test_readme_digest_matches_published_leaderboard():
    """The README's results digest is generated from ``leaderboard/``; they must not disagree."""
    lb = ROOT / "leaderboard" / "leaderboard.json"
    if not lb.exists():
        pytest.skip("leaderboard/ is empty: nothing published yet (kvqbench publish RESULTS leaderboard/)")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    got = readme_digest(readme)
    assert got is not None, f"README.md lacks the {DIGEST_START} … {DIGEST_END} block"
    want = render_digest(read_json(lb))
    assert got == want, "README digest is stale: run `kvqbench publish RESULTS_DIR leaderboard/` (or fix README.md)"
    md = ROOT / "leaderboard" / "LEADERBOARD.md"
    from kvqbench.report.render.markdown import render_markdown

    assert md.read_text(encoding="utf-8") == render_markdown(read_json(lb)), "leaderboard/LEADERBOARD.md is stale"
    assert find_leaks(read_json(lb)) == [], "leaderboard/leaderboard.json holds local paths or names"


def test_digest_names_at_most_three_ties_and_counts_the_rest():
    """The README digest keeps a best cell short; LEADERBOARD.md names every tie."""
    from kvqbench.results.publish import _short_ties

    names = ["`kivi` (rank 1, P(best) 1.00)"] + [f"`m{i}`" for i in range(6)]
    assert _short_ties(" = ".join(names)) == " = ".join(names[:4]) + " = +3 more"
    assert _short_ties(" = ".join(names[:5])) == " = ".join(names[:5])  # one more name is no longer than "+1 more"
    assert _short_ties("`kivi`") == "`kivi`" and _short_ties(None) is None
