"""A result set made by someone else is data: a method name and a delta holding ``</script><script>``
and HTML tags show as text in the browser, and none of their scripts runs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_report_samples import PROVENANCE, catalog, records  # noqa: E402

from kvqbench.results.write import write_result_set  # noqa: E402

EVIL = 'kivi</script><script>window.__pwned = 1; document.title = "pwned"</script><b id="injected">bold</b>'
DELTA = 'G = 128 <img src="x" onerror="window.__pwned = 2"></script><script>window.__pwned = 3</script>'


def test_injected_markup_shows_as_text_and_never_runs(driver, sel, load, tmp_path):
    recs = records(sources=("synthetic", "real"))
    for r in recs:
        if r["method"] == "kivi":
            r["method"] = EVIL
            r["method_info"] = {**r["method_info"], "id": EVIL, "name": EVIL, "deltas": [DELTA]}
    prov = {**PROVENANCE, "command": "pytest </script><script>window.__pwned = 4</script>"}
    run = write_result_set(recs, prov, tmp_path / "run", catalog=catalog(), figures=False)
    driver.get("about:blank")
    driver.get_log("browser")
    load((run.out_dir / "index.html").as_uri())
    assert driver.execute_script("return window.__pwned") is None
    assert driver.title == "kvqbench leaderboard"
    assert driver.find_elements(sel.By.ID, "injected") == []
    assert driver.execute_script("return document.querySelectorAll('script').length") == 2  # the page's own two
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    cells = [c.text for c in driver.find_elements(sel.By.CSS_SELECTOR, "#methods-table tbody td")]
    assert any(EVIL.replace(" ", "") in c.replace(" ", "") for c in cells), cells
    shown = driver.execute_script("return Array.from(document.querySelectorAll('#metrics tbody tr'))"
                                  ".map(r => r.cells[2].textContent)")
    assert EVIL in shown
    details = driver.execute_script("return Array.from(document.querySelectorAll('details.method li'))"
                                    ".map(li => li.textContent)")
    assert DELTA in details
