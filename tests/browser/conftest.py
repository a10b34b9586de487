"""Headless Chromium for the web-page tests, driven by selenium with the system chromedriver (Debian's
``chromium`` and ``chromium-driver``; ``.ci/run`` installs them). Where selenium, a Chromium binary or
chromedriver is missing, every test here skips with one reason.

One browser serves the whole session (starting it takes seconds). Screenshots go to the session's
temporary folder; their paths are listed at the end of the run."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "leaderboard"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
#: Chromium flags for a headless run as root in a container, with nothing fetched in the background
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1000")
SCREENSHOTS: list[str] = []


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.browser)


def _why_no_browser() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install 'kvqbench[dev]')"
    if not any(shutil.which(b) for b in BROWSERS) or not shutil.which("chromedriver"):
        return "no Chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)"
    return None


@pytest.fixture(scope="session")
def driver(tmp_path_factory):
    why = _why_no_browser()
    if why:
        pytest.skip(f"browser tests need a local Chromium: {why}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    for f in FLAGS:
        opts.add_argument(f)
    opts.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='kvq-chromium-', dir=tmp_path_factory.getbasetemp())}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    d.set_page_load_timeout(60)
    yield d
    d.quit()


@pytest.fixture(scope="session")
def published_page(tmp_path_factory) -> tuple[Path, dict]:
    """The page of the published result set (its leaderboard.json and PNGs copied, the page written by
    this checkout's code) and the board it shows."""
    from kvqbench.report.render.html import write_html

    d = tmp_path_factory.mktemp("published")
    shutil.copy(PUBLISHED / "leaderboard.json", d)
    for png in PUBLISHED.glob("*.png"):
        shutil.copy(png, d)
    board = json.loads((d / "leaderboard.json").read_text(encoding="utf-8"))
    page = write_html(board, d)
    assert page is not None
    return page, board


@pytest.fixture(scope="session")
def sel(driver):
    """selenium's helpers (``By``, ``Keys``, ``Select``, ``ActionChains``), imported only where a browser
    runs, so that the test modules import without selenium and skip with the driver's one reason."""
    from types import SimpleNamespace

    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    return SimpleNamespace(By=By, Keys=Keys, Select=Select, ActionChains=ActionChains)


@pytest.fixture()
def load(driver):
    """``load(url)``: open ``url`` from a blank page and return once its script has run. Chromium under
    load can return from ``get`` before the new document is committed, so this waits (up to 30 s) for the
    new address, a complete document and the row count the page's script writes last."""
    from selenium.webdriver.support.ui import WebDriverWait

    def go(url: str) -> None:
        driver.get("about:blank")
        driver.get(url)
        WebDriverWait(driver, 30).until(lambda d: d.execute_script(
            "return location.href === arguments[0] && document.readyState === 'complete' && "
            "!!document.getElementById('count') && document.getElementById('count').textContent !== ''", url))

    return go


@pytest.fixture()
def screenshot(driver):
    """``screenshot(path)``: save the window as a PNG at ``path``, listed at the end of the run."""
    def save(path: Path) -> Path:
        driver.save_screenshot(str(path))
        SCREENSHOTS.append(str(path))
        return path

    return save


def pytest_terminal_summary(terminalreporter):
    if SCREENSHOTS:
        terminalreporter.write_line("web page screenshots: " + ", ".join(SCREENSHOTS))
