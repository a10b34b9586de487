"""The README's metric table is generated from the metric catalog; keep them in sync."""

from pathlib import Path

from kvqbench.metrics import CATALOG, markdown_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_metric_table_matches_catalog():
    text = README.read_text(encoding="utf-8")
    start, end = "<!-- kvqbench-metrics:start -->\n", "\n<!-- kvqbench-metrics:end -->"
    assert start in text and end in text, "README lost its metric-table markers"
    block = text[text.index(start) + len(start): text.index(end)]
    assert block == markdown_table(), "README metric table is stale: regenerate it from kvqbench.metrics.markdown_table()"
    for name in CATALOG:
        assert f"`{name}`" in block
