"""The published leaderboard's web page in headless Chromium: it loads without a script error and
without any request leaving ``file://``, shows every row of the data, sorts, filters (the filter in the
URL, restored from it), shows a chart point's value on hover, and works by keyboard and on a narrow
screen."""

from __future__ import annotations

from collections import Counter

import pytest


def visible_rows(driver) -> list:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#metrics tbody tr')).filter(r => !r.hidden)"
        ".map(r => Array.from(r.cells).map(c => [c.textContent, c.dataset.v === undefined ? null : c.dataset.v]))")


def stat_rows(board: dict) -> list[tuple]:
    """Every (source, experiment, method, setting, metric, mean) of the board, from its JSON."""
    return [(s, e, m, st, k, v.get("mean")) for s, src in board["sources"].items() for e, bm in src["stats"].items()
            for m, bs in bm.items() for st, ks in bs.items() for k, v in ks.items()]


@pytest.fixture()
def page(driver, published_page, load):
    path, board = published_page
    driver.set_window_size(1280, 1000)
    driver.get("about:blank")
    driver.get_log("browser")
    load(path.as_uri())
    return path, board


def test_loads_without_errors_or_network(driver, page, tmp_path, screenshot):
    path, _ = page
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
    urls = driver.execute_script(
        "return performance.getEntriesByType('navigation').concat(performance.getEntriesByType('resource'))"
        ".map(e => e.name)")
    assert urls and all(u.startswith(("file:", "data:")) for u in urls), urls
    srcs = driver.execute_script("return Array.from(document.querySelectorAll('[src],[href]'))"
                                 ".map(e => e.getAttribute('src') || e.getAttribute('href'))")
    # nothing loads from another host: images are data: URIs, links are in-page anchors or plain arXiv links
    assert all(s.startswith(("data:", "#", "https://arxiv.org/abs/")) for s in srcs), srcs
    assert driver.execute_script("return document.querySelectorAll('img').length") > 0
    shot = screenshot(tmp_path / "leaderboard.png")
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000


def test_row_counts_equal_the_json(driver, page, sel):
    _, board = page
    assert len(visible_rows(driver)) == len(stat_rows(board))
    assert driver.find_element(sel.By.ID, "count").text == f"{len(stat_rows(board))} of {len(stat_rows(board))} rows"
    for name, src in board["sources"].items():
        rows = driver.find_elements(sel.By.CSS_SELECTOR, f'table.headline[data-source="{name}"] tbody tr')
        assert len(rows) == len(src["headline"])
    assert len(driver.find_elements(sel.By.CSS_SELECTOR, "#methods-table tbody tr")) == len(board["methods"])


def test_clicking_a_header_sorts(driver, page, sel):
    _, board = page
    for key, value in (("source", "synthetic"), ("metric", "rel_mse"), ("bits", "k2v2")):
        sel.Select(driver.find_element(sel.By.ID, f"f-{key}")).select_by_value(value)
    want = sorted(r[5] for r in stat_rows(board) if r[0] == "synthetic" and r[4] == "rel_mse" and r[3] == "k2v2")
    header = driver.find_element(sel.By.XPATH, "//table[@id='metrics']//th[button='value (mean ± 95% CI)']")
    header.find_element(sel.By.TAG_NAME, "button").click()
    got = [float(r[6][1]) for r in visible_rows(driver)]
    assert got == pytest.approx(want, rel=1e-5)
    assert header.get_attribute("aria-sort") == "ascending"
    header.find_element(sel.By.TAG_NAME, "button").click()
    got = [float(r[6][1]) for r in visible_rows(driver)]
    assert got == pytest.approx(want[::-1], rel=1e-5)
    assert "sort=value" in driver.current_url and "dir=desc" in driver.current_url
    # a text column sorts by its text
    driver.find_element(sel.By.XPATH, "//table[@id='metrics']//th/button[.='method']").click()
    methods = [r[2][0] for r in visible_rows(driver)]
    assert methods == sorted(methods)


def test_a_filter_narrows_lives_in_the_url_and_is_restored(driver, page, sel, load):
    path, board = page
    sel.Select(driver.find_element(sel.By.ID, "f-method")).select_by_value("kivi")
    sel.Select(driver.find_element(sel.By.ID, "f-experiment")).select_by_value("exp1")
    want = Counter((r[0], r[3], r[4]) for r in stat_rows(board) if r[2] == "kivi" and r[1] == "exp1")
    rows = visible_rows(driver)
    assert Counter((r[0][0], r[4][0], r[5][0]) for r in rows) == want
    assert {r[2][0] for r in rows} == {"kivi"}
    url = driver.current_url
    assert "method=kivi" in url and "experiment=exp1" in url
    load(url)
    assert sel.Select(driver.find_element(sel.By.ID, "f-method")).first_selected_option.get_attribute("value") == "kivi"
    assert len(visible_rows(driver)) == sum(want.values())
    # the fidelity filter narrows to the methods the board tags so
    sel.Select(driver.find_element(sel.By.ID, "f-method")).select_by_value("")
    sel.Select(driver.find_element(sel.By.ID, "f-fidelity")).select_by_value("approximate")
    approx = {m for m, i in board["methods"].items() if i.get("fidelity") == "approximate"}
    assert {r[2][0] for r in visible_rows(driver)} == approx


def test_a_chart_point_shows_its_value_on_hover(driver, page, sel):
    _, board = page
    pt = driver.find_element(sel.By.CSS_SELECTOR, "figure.interactive svg .pt")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", pt)
    sel.ActionChains(driver).move_to_element(pt).perform()
    tip = driver.find_element(sel.By.ID, "tip")
    assert tip.is_displayed()
    text = tip.text
    # the first chart is the first source's Pareto front: the tooltip names one of its points and its value
    first = next(iter(board["sources"].values()))["pareto"]["points"]
    match = [p for p in first if text.startswith(f"{p['method']} {p['setting']}:")]
    assert match, text
    assert f"{match[0]['rel_mse']:.4g}" in text and f"{match[0]['bits_effective']:.4g}" in text


def test_keyboard_tab_to_a_header_and_enter_sorts(driver, page, sel):
    driver.find_element(sel.By.ID, "f-metric").click()
    driver.find_element(sel.By.ID, "f-metric").send_keys(sel.Keys.ESCAPE)
    target = driver.find_element(sel.By.XPATH, "//table[@id='metrics']//th[1]/button")
    active = None
    for _ in range(10):
        sel.ActionChains(driver).send_keys(sel.Keys.TAB).perform()
        active = driver.switch_to.active_element
        if active == target:
            break
    assert active == target, "Tab from the last filter does not reach the table's first heading"
    active.send_keys(sel.Keys.ENTER)
    th = driver.find_element(sel.By.XPATH, "//table[@id='metrics']//th[1]")
    assert th.get_attribute("aria-sort") == "ascending"
    sources = [r[0][0] for r in visible_rows(driver)]
    assert sources == sorted(sources)
    # a chart point takes the keyboard focus and shows its value
    pt = driver.find_element(sel.By.CSS_SELECTOR, "figure.interactive svg .pt")
    driver.execute_script("arguments[0].focus()", pt)
    assert driver.find_element(sel.By.ID, "tip").text == pt.get_attribute("data-tip")


def test_readable_on_a_narrow_screen(driver, page, tmp_path, screenshot):
    driver.set_window_size(390, 844)
    driver.refresh()
    # the page itself never scrolls sideways: wide tables scroll inside their own box
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1")
    screenshot(tmp_path / "narrow.png")
