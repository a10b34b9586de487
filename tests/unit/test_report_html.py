"""The web page (``index.html``) shows what LEADERBOARD.md shows, is a pure function of the saved result
set (``kvqbench report`` and ``report --rebuild`` write the same bytes) and keeps every result string
as data. No browser here: the page is parsed with the standard library's HTML parser (the browser tests
are in ``tests/browser``)."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_report_samples import PROVENANCE, catalog, records

from kvqbench.report.render.html import embed_json, render_html
from kvqbench.results.rerender import render_dir
from kvqbench.results.write import write_result_set

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "leaderboard"


class Tables(HTMLParser):
    """Every ``<table>`` of a page: its attributes and rows of cell texts; and the embedded JSON."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[dict, list[list[str]]]] = []
        self.data_json = ""
        self._cell: list[str] | None = None
        self._in_json = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.tables.append((a, []))
        elif tag == "tr" and self.tables:
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "script" and a.get("id") == "kvq-data":
            self._in_json = True

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][1][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "script":
            self._in_json = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._in_json:
            self.data_json += data

    def table(self, **want: str) -> list[list[str]]:
        for attrs, rows in self.tables:
            if all(attrs.get(k) == v or (k == "class" and v in (attrs.get("class") or "").split())
                   for k, v in want.items()):
                return rows
        raise AssertionError(f"no table {want}")


def parse_page(text: str) -> Tables:
    p = Tables()
    p.feed(text)
    return p


def md_tables(text: str) -> dict[str, list[list[list[str]]]]:
    """Markdown tables by the heading path above them (``"## real > ### Relative MSE …"``), backticks removed."""
    out: dict[str, list] = {}
    path: list[str] = []
    rows: list[list[str]] | None = None
    for line in text.splitlines() + [""]:
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            path = path[:level - 1] + [line.strip()]
        if line.startswith("|"):
            if rows is None:
                rows = []
                out.setdefault(" > ".join(path), []).append(rows)
            if not re.fullmatch(r"\|[-|: ]+\|", line.strip()):
                rows.append([c.strip().replace("`", "") for c in line.strip()[1:-1].split("|")])
        else:
            rows = None
    return out


def section(tables: dict, *parts: str) -> list[list[str]]:
    hits = [t for k, ts in tables.items() if all(p in k for p in parts) for t in ts]
    assert hits, f"no Markdown table under {parts}"
    return hits[0]


@pytest.fixture(scope="module")
def published() -> tuple[dict, Tables, dict]:
    board = json.loads((PUBLISHED / "leaderboard.json").read_text(encoding="utf-8"))
    return board, parse_page(render_html(board)), md_tables((PUBLISHED / "LEADERBOARD.md").read_text(encoding="utf-8"))


def test_first_screen_equals_the_markdown(published):
    board, page, md = published
    for name, src in board["sources"].items():
        table = page.table(**{"class": "headline", "data-source": name})
        want = section(md, f"## {name}", "best method at a matched budget")
        assert table == want, name
        assert len(table) == 1 + len(src["headline"])


def test_metric_values_equal_the_markdown_matrices(published):
    board, page, md = published
    data = json.loads(page.data_json)
    text = {(data["sources"][r[0]], data["experiments"][r[1]], data["methods"][r[2]], data["settings"][r[3]],
             data["metrics"][r[4]]): r[6] for r in data["rows"]}
    checked = 0
    for name in board["sources"]:
        for title, metric in (("### Relative MSE", "rel_mse"), ("### Effective bits", "bits_effective")):
            head, *rows = section(md, f"## {name}", title)
            for row in rows:
                for setting, cell in zip(head[2:], row[2:]):
                    got = text.get((name, "exp1", row[0], setting, metric))
                    if got is None:
                        assert cell in ("not run", "failed", "skipped", "—"), (name, row[0], setting, cell)
                    else:
                        assert got == cell, (name, row[0], setting)
                        checked += 1
        if "exp5" in board["sources"][name]["stats"]:
            head, *rows = section(md, f"## {name}", "### End-to-end damage")
            for row in rows:
                for col, cell in zip(head[1:], row[1:]):
                    regime, setting = col.split()
                    got = text.get((name, "exp5", row[0], setting, f"e2e_{regime}_kl_nats"))
                    if got is not None:  # the decode cells add "@ bits b"
                        assert cell == got or cell.startswith(got + " @ "), (name, row[0], col)
                        checked += 1
    assert checked > 200


def test_methods_table_equals_the_markdown(published):
    board, page, md = published
    rows = page.table(id="methods-table")
    assert rows == section(md, "## Methods")
    assert len(rows) == 1 + len(board["methods"])


def test_metric_table_holds_every_statistic_once(published):
    board, page, _ = published
    data = json.loads(page.data_json)
    want = sorted((s, e, m, st, k) for s, src in board["sources"].items() for e, bm in src["stats"].items()
                  for m, bs in bm.items() for st, ks in bs.items() for k in ks)
    got = sorted((data["sources"][r[0]], data["experiments"][r[1]], data["methods"][r[2]], data["settings"][r[3]],
                  data["metrics"][r[4]]) for r in data["rows"])
    assert got == want


def test_committed_page_matches_the_committed_board(published):
    """leaderboard/index.html is regenerated with the reference run: its data is the board's."""
    _, page, _ = published
    committed = parse_page((PUBLISHED / "index.html").read_text(encoding="utf-8"))
    assert json.loads(committed.data_json) == json.loads(page.data_json)


@pytest.mark.parametrize("text", ["</script><script>alert(1)</script>", "a\u2028b\u2029c", "<!--", "&amp; <b>"])
def test_embedded_json_cannot_end_its_script_and_reads_back(text):
    out = embed_json({"k": text, text: [text]})
    assert "<" not in out and ">" not in out and "&" not in out and "\u2028" not in out and "\u2029" not in out
    assert json.loads(out) == {"k": text, text: [text]}


def test_report_and_rebuild_write_the_same_page(tmp_path):
    run = write_result_set(records(sources=("synthetic", "real")), dict(PROVENANCE), tmp_path / "run",
                           catalog=catalog(), figures=False)
    page = (run.out_dir / "index.html").read_bytes()
    assert str(run.out_dir / "index.html") in run.paths
    again = tmp_path / "again"
    shutil.copytree(run.out_dir, again)
    (again / "index.html").unlink()
    render_dir(again, echo=False, figures=False)
    assert (again / "index.html").read_bytes() == page
    (again / "index.html").unlink()
    render_dir(again, echo=False, figures=False, rebuild=True)
    assert (again / "index.html").read_bytes() == page


def test_result_strings_are_text_not_markup(tmp_path):
    evil = 'x</script><script>document.title="pwned"</script><b>b</b>'
    recs = records()
    for r in recs:
        if r["method"] == "kivi":
            r["method"] = evil
            r["method_info"] = {**r["method_info"], "id": evil, "deltas": [f"delta {evil}"], "name": evil}
    run = write_result_set(recs, dict(PROVENANCE), tmp_path / "run", catalog=catalog(), figures=False)
    text = (run.out_dir / "index.html").read_text(encoding="utf-8")
    assert "<script>document.title" not in text and "<b>b</b>" not in text
    page = parse_page(text)
    assert any(evil in cell for row in page.table(id="methods-table") for cell in row)
    assert evil in json.loads(page.data_json)["methods"]


def test_paired_first_screen_fields_show_when_present():
    """docs of issue 32's shape: rank interval, P(best) and each comparison's ratio to the best with its CI."""
    from test_report_samples import board

    b = without_paired_fields(board())
    row = next(r for r in b["sources"]["synthetic"]["headline"] if r.get("method"))
    row.update({"unit": "seed", "n_units": 16, "rank_interval": [1, 2], "p_best": 0.83, "comparisons": [
        {"method": "kvarn", "setting": "k2v2", "bits": 2.5625, "value": 0.80, "ci95": 0.39, "ratio": 1.66,
         "ratio_ci95": [1.39, 1.98], "p": 0.0012, "p_holm": 0.0048, "tied": False, "n_units": 16,
         "rank_interval": [2, 3], "p_best": 0.04},
        {"method": "kivi", "setting": "k2v2", "bits": 2.1875, "value": 0.9, "ci95": 0.2, "ratio": 1.1,
         "ratio_ci95": [0.9, 1.3], "p": 0.3, "p_holm": 0.6, "tied": True, "n_units": 16, "rank_interval": [1, 3]}]})
    text = render_html(b)
    assert "best rank 1–2, P(best) 0.83 · paired on 16 seeds" in text
    rows = [r for _, rs in parse_page(text).tables for r in rs if r and r[0] in ("kvarn k2v2", "kivi k2v2")]
    assert rows == [["kvarn k2v2", "2.562", "0.8 ± 0.39", "1.66× [1.39, 1.98]", "0.0048", "2–3", ""],
                    ["kivi k2v2", "2.188", "0.9 ± 0.2", "1.1× [0.9, 1.3]", "0.6", "1–3", "= (tied)"]]
    assert "· paired on" not in render_html(without_paired_fields(board()))  # a board without them: no paired block


PAIRED_FIELDS = ("unit", "n_units", "rank_interval", "p_best", "comparisons", "no_verdict")


def without_paired_fields(b: dict) -> dict:
    """The board as a result set written before the paired statistics existed has it."""
    for src in b["sources"].values():
        for r in src.get("headline") or []:
            for k in PAIRED_FIELDS:
                r.pop(k, None)
    b.pop("paired_test", None)
    return b
