"""docs/METRICS.md's metric table is generated from the metric catalog; keep them in sync."""

from pathlib import Path

from kvqbench.metrics import CATALOG, markdown_table

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "METRICS.md"


def test_metrics_doc_table_matches_catalog():
    text = METRICS_DOC.read_text(encoding="utf-8")
    start, end = "<!-- kvqbench-metrics:start -->\n", "\n<!-- kvqbench-metrics:end -->"
    assert start in text and end in text, "docs/METRICS.md lost its metric-table markers"
    block = text[text.index(start) + len(start): text.index(end)]
    assert block == markdown_table(), (
        "docs/METRICS.md metric table is stale: regenerate it from kvqbench.metrics.markdown_table()")
    for name in CATALOG:
        assert f"`{name}`" in block
