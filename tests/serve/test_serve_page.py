"""The live view at / in real headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium): the page loads, streams a completion, shows accepted draft tokens and target-chosen
tokens differently with α, τ and tokens/s, and a screenshot is saved in the test's tmp folder.

`make test` installs Chromium when it is missing and it runs as root; elsewhere install it with
`apt-get install chromium chromium-driver` (the test is skipped, saying so, when it is absent).
"""
from __future__ import annotations

import shutil

import pytest

from ..serve_helpers import Server
from .test_serve import K

CHROMEDRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(CHROMEDRIVER is None or shutil.which("chromium") is None,
                    reason="Chromium is not installed: run `apt-get install chromium chromium-driver` "
                           "(as root; `make test` does it) to run the browser test")
def test_the_live_view_streams_and_shows_both_token_kinds(tiny_checkpoint, draft_checkpoint, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = Server("--model", str(tiny_checkpoint), "--draft", "draft-model", "--draft-model", str(draft_checkpoint),
                    "-k", str(K), log=tmp_path / "serve.log")
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=DriverService(CHROMEDRIVER))
    try:
        browser.get(server.url + "/")
        assert "specdec" in browser.title
        WebDriverWait(browser, 30).until(lambda b: "draft-model" in b.find_element(By.ID, "model").text)
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("def f(x):")
        browser.find_element(By.ID, "max_tokens").clear()
        browser.find_element(By.ID, "max_tokens").send_keys("80")
        browser.find_element(By.ID, "go").click()
        WebDriverWait(browser, 60).until(lambda b: "finished" in b.find_element(By.ID, "status").text)
        drafted = browser.find_elements(By.CSS_SELECTOR, "#out .draft")
        chosen = browser.find_elements(By.CSS_SELECTOR, "#out .target")
        assert drafted and chosen
        colours = {e.value_of_css_property("background-color") for e in (drafted[0], chosen[0])}
        assert len(colours) == 2  # shown differently
        assert browser.find_element(By.ID, "count").text == "80"
        alpha, tau = float(browser.find_element(By.ID, "alpha").text), float(browser.find_element(By.ID, "tau").text)
        assert 0 < alpha <= 1 and 1 < tau <= K + 1
        assert float(browser.find_element(By.ID, "rate").text) > 0
        shot = tmp_path / "live-view.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
        print(f"\nscreenshot: {shot}")
    finally:
        browser.quit()
        assert server.stop(), server.log.read_text()


def test_the_page_wraps_long_lines_and_refuses_a_top_p_of_zero():
    """Static checks, no browser: the output wraps anywhere (a long line without spaces must not
    overflow sideways) and the top-p input's minimum is above 0, which the server refuses."""
    import re

    from specdec.serve.app import PAGE

    html = PAGE.read_text()
    assert re.search(r"#out \{[^}]*overflow-wrap: anywhere", html)
    minimum = float(re.search(r'id="top_p"[^>]*min="([0-9.]+)"', html).group(1))
    assert 0 < minimum <= 0.05
