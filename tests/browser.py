"""A real headless Chromium for the monitor's page, driven by Selenium with Debian's chromedriver.

Selenium is pointed at the system's browser and driver, so it never tries to download one.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from tests.system_tools import system_tool

PAGE_LOAD_TIMEOUT_SECONDS = 30


@contextmanager
def headless_chromium() -> Iterator["selenium.webdriver.Chrome"]:  # noqa: F821 (imported below)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = system_tool("chromium", "chromium"), system_tool("chromedriver", "chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1280,1000", "--no-proxy-server"):  # --no-sandbox: CI runs as root
        options.add_argument(argument)
    chrome = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    try:
        chrome.set_page_load_timeout(PAGE_LOAD_TIMEOUT_SECONDS)
        yield chrome
    finally:
        chrome.quit()


def wait_for(chrome, condition: Callable[[], bool], timeout: float = 20.0) -> None:
    """Until condition() holds in the page, polling it; raises TimeoutException after `timeout` seconds."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(chrome, timeout, poll_frequency=0.2).until(lambda _: condition())


def peer_rows(chrome) -> list:
    """Each peer row's cells as text: peer, device, epoch, samples/s, val loss, time split, bottleneck, last seen,
    state.
    Read in one script: the page rebuilds its rows on every refresh, so element handles go stale."""
    return chrome.execute_script(
        "return [...document.querySelectorAll('#peers tbody tr')].map("
        "row => [row.dataset.peer, ...[...row.cells].slice(1).map(cell => cell.textContent)])")


def contributor_rows(chrome) -> list:
    """Each row of the contributors table as text: peer, claimed, observed, observers, compute, sent."""
    return chrome.execute_script(
        "return [...document.querySelectorAll('#contributors tbody tr')].map(row => [...row.cells].map("
        "cell => cell.textContent))")
