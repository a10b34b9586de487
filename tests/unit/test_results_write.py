"""The result-set writer (``kvqbench.results.write``): completeness, never replacing a complete set with
a partial one, the fallback folder, and ``kvqbench report DIR`` rebuilding from the per-experiment files.
Torch-free, hand-built records (``test_report_samples``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_report_samples import PROVENANCE, catalog, records

from kvqbench.results.read import load_result_set
from kvqbench.results.write import (
    INCOMPLETE_DIR,
    check_writable,
    completeness,
    holds_complete_set,
    write_result_set,
)


def _write(out: Path, recs, **kw):
    return write_result_set(recs, dict(PROVENANCE), out, catalog=catalog(), figures=False, log=lambda m: None, **kw)


def test_completeness_counts_and_one_line_summary():
    recs = records(experiments=("exp1",))  # 4 methods × 3 bits × 2 seeds = 24 passed
    assert len(recs) == 24
    c = completeness(recs, expected=24)
    assert c["complete"] and c["summary"] == "complete: 24 cells" and c["not_run"] == 0
    c = completeness(recs[:20], expected=[r["nodeid"] for r in recs], reason="interrupted")
    assert not c["complete"]
    assert c["summary"] == "incomplete: 20 of 24 cells finished, 4 not run, interrupted"
    assert c["not_run_ids"] == [r["nodeid"] for r in recs[20:]]
    recs[0]["status"] = "failed"
    c = completeness(recs, expected=24)
    assert not c["complete"] and c["summary"] == "incomplete: 24 of 24 cells finished, 1 failed"
    skipped = records(experiments=("exp1",))
    skipped[0]["status"] = "skipped"
    assert completeness(skipped, expected=24)["complete"]  # a deliberate skip is not a missing cell


def test_partial_run_never_replaces_a_complete_set(tmp_path):
    recs = records(experiments=("exp1", "exp2"))
    out = tmp_path / "results"
    full = _write(out, recs, expected=len(recs))
    assert full.completeness["complete"] and full.out_dir == out and holds_complete_set(out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    part = _write(out, recs[:10], expected=len(recs), reason="interrupted")
    assert part.out_dir == out / INCOMPLETE_DIR and "are kept" in part.note
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # untouched
    inc = out / INCOMPLETE_DIR
    summary = "incomplete: 10 of %d cells finished, %d not run, interrupted" % (len(recs), len(recs) - 10)
    for name in ("leaderboard.json", "summary.json"):
        text = (inc / name).read_text()
        assert text.splitlines()[1].strip() == '"completeness": {', name  # the first key of the document
        assert json.loads(text)["completeness"]["summary"] == summary
    md = (inc / "LEADERBOARD.md").read_text().splitlines()
    assert summary in md[2]  # right under the title
    assert not holds_complete_set(inc)
    # a later partial run replaces the earlier partial one, not the complete set
    _write(out, recs[:5], expected=len(recs), reason="interrupted")
    assert json.loads((inc / "summary.json").read_text())["completeness"]["finished"] == 5
    assert holds_complete_set(out)
    # a complete run replaces the complete set and removes the superseded partial one; no staging left
    _write(out, recs, expected=len(recs))
    assert not [p for p in out.iterdir() if p.name.startswith(".kvqbench-staging")] and not inc.exists()


def test_partial_run_writes_in_place_when_there_is_no_complete_set(tmp_path):
    recs = records(experiments=("exp1",))
    res = _write(tmp_path / "r", recs[:3], expected=len(recs), reason="interrupted")
    assert res.out_dir == tmp_path / "r" and res.note is None
    assert json.loads((tmp_path / "r" / "leaderboard.json").read_text())["completeness"]["complete"] is False


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_destination_goes_to_a_printed_fallback(tmp_path, monkeypatch):
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    logged: list[str] = []
    try:
        assert check_writable(ro) == f"{ro} is not writable"
        res = write_result_set(records(experiments=("exp1",)), dict(PROVENANCE), ro / "out", catalog=catalog(),
                               figures=False, log=logged.append)
    finally:
        ro.chmod(0o755)
    assert res.out_dir != ro / "out" and (res.out_dir / "leaderboard.json").exists()
    assert logged == [res.note] and str(res.out_dir) in res.note and str(ro / "out") in res.note


def test_a_file_in_the_way_sends_results_to_a_printed_fallback(tmp_path, monkeypatch):
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "f").write_text("x")
    logged: list[str] = []
    res = write_result_set(records(experiments=("exp1",)), dict(PROVENANCE), tmp_path / "f" / "out",
                           catalog=catalog(), figures=False, log=logged.append)
    assert (res.out_dir / "leaderboard.json").exists() and res.out_dir.parent == tmp_path / "tmp"
    assert logged == [res.note] and str(res.out_dir) in res.note and "could not write results to" in res.note


def test_check_writable_names_files_in_the_way(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    assert check_writable(f) == f"{f} is a file, not a folder"
    assert check_writable(f / "sub") == f"{f / 'sub'} cannot be created: {f} is a file, not a folder"
    assert check_writable(tmp_path / "new" / "deeper") is None
    if Path("/proc").is_dir() and os.access("/proc", os.W_OK):  # root: the bits allow it, the file system not
        why = check_writable("/proc/kvqbench-nope")
        assert why.startswith("/proc/kvqbench-nope cannot be created: /proc accepts no new file (creating a test "
                              "file there failed: "), why


def test_hooks_are_plain_callbacks(tmp_path):
    seen = {}

    def update(board):
        board["custom"] = 1

    def extra(board, folder):
        seen["custom"] = board["custom"]
        p = folder / "extra.txt"
        p.write_text("x")
        return [p]

    res = _write(tmp_path / "r", records(experiments=("exp1",)), update_board=update, write_extra=extra)
    assert seen == {"custom": 1} and json.loads((tmp_path / "r" / "leaderboard.json").read_text())["custom"] == 1
    assert str(tmp_path / "r" / "extra.txt") in res.paths and (tmp_path / "r" / "extra.txt").exists()


def test_report_rebuilds_a_killed_write_byte_for_byte(tmp_path, capsys):
    from kvqbench.cli import main

    recs = records()  # every experiment, so every catalog entry is in some experiment file
    out = tmp_path / "r"
    _write(out, recs, expected=len(recs))
    want = {n: (out / n).read_bytes() for n in ("leaderboard.json", "summary.json", "LEADERBOARD.md")}
    for n in want:  # a kill during the write phase: experiment files but no leaderboard
        (out / n).unlink()
    assert main(["report", str(out), "--no-figures"]) == 0
    assert {n: (out / n).read_bytes() for n in want} == want
    (out / "leaderboard.json").write_text("{trunc")  # unreadable leaderboard: rebuilt too
    assert main(["report", str(out), "--no-figures"]) == 0
    assert (out / "leaderboard.json").read_bytes() == want["leaderboard.json"]
    recs2, prov, comp, _ = load_result_set(out)
    assert len(recs2) == len(recs) and prov == PROVENANCE and comp["complete"]
    capsys.readouterr()


def test_a_failed_seed_is_marked_not_ranked_and_off_the_front():
    from test_report_samples import board

    from kvqbench.report.render.markdown import render_markdown

    recs = records(experiments=("exp1",))
    for r in recs:
        if r["method"] == "kvarn" and r["k_bits"] == 2 and r["seed"] == 1:
            r["status"], r["error"] = "failed", "boom"
        if r["method"] == "kivi" and r["k_bits"] == 4:
            r["status"] = "skipped"
    recs = [r for r in recs if not (r["method"] == "rtn_token" and r["k_bits"] == 16)]  # never ran
    b = board(recs)
    src = b["sources"]["synthetic"]
    e = src["stats"]["exp1"]["kvarn"]["k2v2"]["rel_mse"]
    assert (e["n"], e["n_asked"]) == (1, 2)
    rows = src["rankings"]["rel_mse"]["by_setting"]["k2v2"]
    assert rows[-1]["method"] == "kvarn" and rows[-1]["rank"] is None and rows[-1]["short"]
    assert all(r["rank"] is not None for r in rows[:-1])
    # kvarn's one good seed at k2v2 (0.23 at 2.25 bits) would dominate kivi's 0.56 at 2.19: it must not count
    assert ("kvarn", "k2v2") not in {(p["method"], p["setting"]) for p in src["pareto"]["points"]}
    assert all(m["method"] != "kvarn" or m["setting"] != "k2v2" for m in src["matched_budget"])
    md = render_markdown(b)
    kvarn_row = next(ln for ln in md.splitlines() if ln.startswith("| `kvarn`"))
    assert "(n=1/2)" in kvarn_row
    assert "| skipped " in next(ln for ln in md.splitlines() if ln.startswith("| `kivi`"))
    assert "| not run " in next(ln for ln in md.splitlines() if ln.startswith("| `rtn_token`"))
    assert "not ranked: n=1 of 2 seeds" in md
    recs[0]["status"] = "failed"  # fp16 k2v2 seed 0 fails, seed 1 passes: short, not "failed"
    recs[1]["status"] = "failed"  # … and now both: "failed"
    md = render_markdown(board(recs))
    assert "| failed " in next(ln for ln in md.splitlines() if ln.startswith("| `fp16`"))


def test_publish_refuses_and_compare_warns_on_an_incomplete_set(tmp_path):
    import io

    from kvqbench.results.compare import main as compare_main
    from kvqbench.results.publish import publish

    recs = records(experiments=("exp1",))
    _write(tmp_path / "part", recs[:10], expected=len(recs), reason="interrupted")
    with pytest.raises(ValueError, match="incomplete result set .*10 of 24 cells finished"):
        publish(tmp_path / "part", tmp_path / "pub", readme=None, figures=False)
    assert not (tmp_path / "pub").exists()
    buf = io.StringIO()
    compare_main(tmp_path / "part", tmp_path / "part", [], out=buf)
    assert "warning: NEW is incomplete: 10 of 24 cells finished, 14 not run, interrupted" in buf.getvalue()


def test_a_write_without_figures_keeps_the_figures_already_drawn(tmp_path):
    recs = records(experiments=("exp1",))
    out = tmp_path / "results"
    _write(out, recs, expected=len(recs))
    fig = out / "pareto_synthetic.png"
    fig.write_bytes(b"\x89PNG drawn by an earlier render")
    stale_json = out / "exp9_synthetic.json"  # a result file of another run is still replaced
    stale_json.write_text("{}")
    _write(out, recs, expected=len(recs), in_place=True)  # figures=False, as `kvqbench report --no-figures`
    assert fig.read_bytes() == b"\x89PNG drawn by an earlier render"
    assert not stale_json.exists()


def _set_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _kept_name(files: dict[str, bytes], start: str) -> str:
    """The folder name a displaced set gets: its run's UTC start, then the first 8 hex digits of the
    SHA-256 of its leaderboard.json (computed here from the bytes, independently of the writer)."""
    import datetime as dt
    import hashlib

    stamp = dt.datetime.fromisoformat(start).astimezone(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{hashlib.sha256(files['leaderboard.json']).hexdigest()[:8]}"


def test_no_sequence_of_runs_loses_a_complete_set(tmp_path):
    """Complete, narrower, narrower again, broader, interrupted, failed and repeated runs into one folder:
    after each, every complete set written so far is either the folder's own or kept, unchanged, in
    ``previous/<start>-<digest>/`` (up to the retention, here 3), and the log says where each went and
    which one the retention removed."""
    out = tmp_path / "results"
    prev = out / "previous"
    every = records(experiments=("exp1", "exp3"))  # 48 cells
    kivi = [r for r in every if r["method"] in ("fp16", "kivi")]  # 24
    kivi2 = [r for r in kivi if r["k_bits"] == 2]  # 8
    runs = [  # (records, expected, reason)
        (every, len(every), None),  # A: the main job
        (kivi, len(kivi), None),  # B: -k kivi            -> A kept
        (kivi2, len(kivi2), None),  # C: -k "kivi and k2"  -> B kept (A still there)
        (every, len(every), None),  # D: broader again     -> C kept
        (every[:10], len(every), "interrupted"),  # E: Ctrl-C -> incomplete/, nothing moves
        (every, len(every), None),  # F: one failed cell (below) -> incomplete/, nothing moves
        (every, len(every), None),  # G: a rerun           -> D kept, A removed (retention 3)
        (kivi, len(kivi), None),  # H: narrower          -> G kept, B removed
    ]
    runs[5] = ([{**r, "status": "failed"} if i == 0 else r for i, r in enumerate(every)], len(every), None)
    complete_sets: list[tuple[str, dict[str, bytes]]] = []  # (start, files) of every complete set written
    for i, (recs, expected, reason) in enumerate(runs):
        start = f"2026-12-03T10:{i:02d}:00+00:00"
        before = _set_files(out) if out.is_dir() else {}
        logged: list[str] = []
        res = write_result_set(recs, {**PROVENANCE, "start_time": start}, out, expected=expected, reason=reason,
                               catalog=catalog(), figures=False, log=logged.append, keep=3)
        if not res.completeness["complete"]:
            assert res.out_dir == out / INCOMPLETE_DIR and _set_files(out) == before
            assert logged == [f"kvqbench: {res.completeness['summary']} — the complete results in {out} are kept; "
                              f"this run's results are in {out / INCOMPLETE_DIR}"]
            continue
        moved = []
        if complete_sets:  # the folder's set is displaced: one line says where it went
            old_start, old_files = complete_sets[-1]
            n_old = json.loads(old_files["leaderboard.json"])["completeness"]["expected"]
            target = prev / _kept_name(old_files, old_start)
            moved = [f"kvqbench: the complete set of {n_old} cells (run 2026-12-03 10:{int(old_start[14:16]):02d} "
                     f"UTC) that was in {out} is kept in {target}"]
        complete_sets.append((start, _set_files(out)))
        kept = complete_sets[-4:-1]  # before the folder's own: the newest 3
        removed = complete_sets[-5:-4]  # the one the retention drops now
        gone = [f"kvqbench: removed {prev / _kept_name(f, st)}, the complete set of "
                f"{json.loads(f['leaderboard.json'])['completeness']['expected']} cells (run 2026-12-03 "
                f"10:{int(st[14:16]):02d} UTC): {prev} keeps the newest 3 (--kvq-keep N or KVQBENCH_KEEP=N to "
                "keep more)" for st, f in removed]
        assert logged == moved + gone, i
        assert res.note == "\n".join(moved + gone) or (not moved and res.note is None)
        # every complete set: the folder's own, or kept unchanged (newest first)
        listed = sorted((p.name for p in prev.iterdir()), reverse=True) if prev.is_dir() else []
        assert listed == [_kept_name(f, st) for st, f in reversed(kept)]
        for st, f in kept:
            assert _set_files(prev / _kept_name(f, st)) == f
        assert not (out / INCOMPLETE_DIR).exists()  # superseded by this complete set
    assert len(complete_sets) == 6  # A B C D G H; E (interrupted) and F (failed) never displaced anything


def test_retention_comes_from_keep_then_the_environment_then_five(tmp_path, monkeypatch):
    from kvqbench.results.previous import DEFAULT_KEEP, keep_count, kept_sets

    assert DEFAULT_KEEP == 5 and keep_count() == 5
    monkeypatch.setenv("KVQBENCH_KEEP", "1")
    assert keep_count() == 1 and keep_count(0) == 0
    out = tmp_path / "r"
    recs = records(experiments=("exp1",))
    for minute in range(3):
        write_result_set(recs, {**PROVENANCE, "start_time": f"2026-12-03T10:0{minute}:00+00:00"}, out,
                         expected=len(recs), catalog=catalog(), figures=False, log=lambda m: None)
    assert [p.name[:16] for p in kept_sets(out)] == ["20261203T100100Z"]  # KVQBENCH_KEEP=1: the newest
    monkeypatch.setenv("KVQBENCH_KEEP", "many")
    with pytest.raises(ValueError, match="KVQBENCH_KEEP expects a count >= 0 of kept result sets; got 'many'"):
        keep_count()
    logged: list[str] = []
    write_result_set(recs, {**PROVENANCE, "start_time": "2026-12-03T10:03:00+00:00"}, out, expected=len(recs),
                     catalog=catalog(), figures=False, log=logged.append)
    assert logged[0] == ("kvqbench: KVQBENCH_KEEP expects a count >= 0 of kept result sets; got 'many'; "
                         "keeping the newest 5")
    assert len(kept_sets(out)) == 2  # nothing removed: 5 applied
    logged.clear()
    write_result_set(recs, {**PROVENANCE, "start_time": "2026-12-03T10:04:00+00:00"}, out, expected=len(recs),
                     catalog=catalog(), figures=False, log=logged.append, keep=0)  # 0 keeps none
    assert kept_sets(out) == [] and len(logged) == 1 + 3  # moved, then it and the 2 kept before removed
    assert f"is kept in {out / 'previous' / '20261203T100300Z-'}" in logged[0]
    assert all(ln.startswith(f"kvqbench: removed {out / 'previous'}/") for ln in logged[1:])


def test_a_set_kept_flat_in_previous_moves_into_a_folder_of_its_own(tmp_path):
    """``previous/`` holding one set's files directly (one displaced set, kept flat): the next displacement
    moves those into a ``<start>-<digest>`` folder first (one line), then the folder's set next to it."""
    out = tmp_path / "r"
    recs = records(experiments=("exp1",))
    flat = write_result_set(recs, {**PROVENANCE, "start_time": "2026-12-03T09:00:00+00:00"}, out / "previous",
                            expected=len(recs), catalog=catalog(), figures=False, log=lambda m: None)
    flat_files = _set_files(flat.out_dir)
    _write(out, recs, expected=len(recs))
    own = _set_files(out)
    logged: list[str] = []
    write_result_set(recs[:8], dict(PROVENANCE), out, expected=8, catalog=catalog(), figures=False,
                     log=logged.append)
    a, b = _kept_name(flat_files, "2026-12-03T09:00:00+00:00"), _kept_name(own, PROVENANCE["start_time"])
    assert logged == [
        f"kvqbench: the complete set of 24 cells (run 2026-12-03 09:00 UTC) kept in {out / 'previous'} moved to "
        f"{out / 'previous' / a}",
        f"kvqbench: the complete set of 24 cells (run 2026-01-01 00:00 UTC) that was in {out} is kept in "
        f"{out / 'previous' / b}"]
    assert _set_files(out / "previous" / a) == flat_files and _set_files(out / "previous" / b) == own
    assert not _set_files(out / "previous")  # nothing left flat


def test_only_kept_set_folders_count_and_go(tmp_path):
    """The retention counts and removes only folders named like a kept set; anything else the user put in
    ``previous/`` stays."""
    out = tmp_path / "r"
    recs = records(experiments=("exp1",))
    (out / "previous" / "my-notes").mkdir(parents=True)
    (out / "previous" / "README.txt").write_text("mine")
    for minute in range(3):
        write_result_set(recs, {**PROVENANCE, "start_time": f"2026-12-03T10:0{minute}:00+00:00"}, out,
                         expected=len(recs), catalog=catalog(), figures=False, log=lambda m: None, keep=1)
    names = sorted(p.name for p in (out / "previous").iterdir())
    assert len(names) == 3 and names[0].startswith("20261203T100100Z-") and names[1:] == ["README.txt", "my-notes"]
    assert (out / "previous" / "README.txt").read_text() == "mine"


def test_a_second_shard_into_the_same_folder_keeps_the_first_shards_set(tmp_path):
    """Shards 1/2 and 2/2 run into one folder (or a long tier's shards into its default folder): the first
    shard's finished set is kept, unchanged, in ``previous/`` with one line, not deleted; an interrupted run
    over a finished shard keeps it too."""
    from kvqbench.results.previous import kept_sets

    out = tmp_path / "r"
    every = records(experiments=("exp1",))
    ids = [r["nodeid"] for r in every]
    half = len(every) // 2
    first = write_result_set(every[:half], {**PROVENANCE, "start_time": "2026-12-03T10:00:00+00:00"}, out,
                             expected=ids, shard="1/2", catalog=catalog(), figures=False, log=lambda m: None)
    assert first.completeness["shard_done"] == "1/2" and not first.completeness["complete"]
    files = _set_files(out)
    logged: list[str] = []
    write_result_set(every[half:], {**PROVENANCE, "start_time": "2026-12-03T10:01:00+00:00"}, out,
                     expected=ids, shard="2/2", catalog=catalog(), figures=False, log=logged.append)
    (kept,) = kept_sets(out)
    assert _set_files(kept) == files
    assert logged == [f"kvqbench: the set of shard 1/2 ({half} cells) (run 2026-12-03 10:00 UTC) that was in {out} "
                      f"is kept in {kept}"]
    write_result_set(every[:3], {**PROVENANCE, "start_time": "2026-12-03T10:02:00+00:00"}, out, expected=ids,
                     reason="interrupted", catalog=catalog(), figures=False, log=lambda m: None)
    assert len(kept_sets(out)) == 2  # shard 2/2's set kept as well


def test_a_shards_summary_says_it_ran_its_share():
    """A shard that ran its cells without failure is one step of a sharded run, not an alarming incomplete
    set (it still is not complete); an interrupted or failing shard keeps the incomplete summary."""
    from kvqbench.results.write import completeness

    recs = [{"nodeid": f"a{i}", "status": "passed"} for i in range(3)]
    ids = [f"a{i}" for i in range(6)]
    comp = completeness(recs, ids, shard="1/2")
    assert comp["complete"] is False and comp["reason"] == "shard 1/2 (join the shards with kvqbench merge)"
    assert comp["summary"] == "shard 1/2: 3 of 6 cells, this shard's share of the run (join the shards with kvqbench merge)"
    assert completeness(recs, ids, "interrupted", shard="1/2")["summary"] == (
        "incomplete: 3 of 6 cells finished, 3 not run, shard 1/2 (join the shards with kvqbench merge), interrupted")
    failed = [*recs[:2], {"nodeid": "a2", "status": "failed"}]
    assert completeness(failed, ids, shard="1/2")["summary"].startswith("incomplete: 3 of 6 cells finished, 1 failed")
