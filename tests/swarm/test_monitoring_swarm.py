"""The swarm monitor on a real swarm: per-peer series from DHT records, removed when a peer leaves, on /metrics and
the live page (the collector alone: tests/unit/test_swarm_collector.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from monitoring.phases import CATEGORIES
from peer.testing import Swarm, until
from tests.browser import headless_chromium, peer_rows, wait_for
from tests.http import get, scrape, value
from tests.peers import free_port


@pytest.mark.timeout(180)
async def test_monitor_follows_peers_joining_and_leaving(tmp_path):
    """Through /metrics, and on the live page in a real headless Chromium."""
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "64", "--min-peers", "2",
                     fast=True) as swarm:
        bootstrap = await swarm.bootstrap()  # the monitor's way in, still there once every peer has left
        first, second = await swarm.start(2)
        port = free_port()
        swarm.run("monitor", "--initial-peers", bootstrap.address, "--metrics-port", str(port),
                  "--refresh-seconds", "1", name="monitor")

        await until(lambda: value(scrape(port), "swarm_peers") == 2, 90, "the monitor to see 2 peers")
        samples = scrape(port)
        peers = {dict(labels)["peer"] for name, labels in samples if name == "swarm_peer_info"}
        assert peers == {first.short_id, second.short_id}

        with headless_chromium() as chrome:
            chrome.get(f"http://127.0.0.1:{port}/")
            chrome.execute_script("window.loadedOnce = true")
            wait_for(chrome, lambda: shown_peers(chrome) == {first.short_id, second.short_id})
            epoch = int(chrome.find_element("id", "epoch").text)
            # the monitor was given no --target-batch-size: the run's own comes from its manifest
            wait_for(chrome, lambda: "of 64 samples" in chrome.find_element("id", "progress-text").text)
            wait_for(chrome, lambda: int(chrome.find_element("id", "epoch").text) >= epoch + 2, timeout=60)
            wait_for(chrome, lambda: chrome.find_elements("css selector", "#loss-chart polyline"), timeout=30)
            # each peer's own record (published every few seconds): its loss, time split and bottleneck
            wait_for(chrome, lambda: all(cells[4] != "–" and cells[7] in CATEGORIES for cells in peer_rows(chrome)),
                     timeout=60)
            screenshot = screenshot_path(tmp_path)
            assert chrome.save_screenshot(str(screenshot)) and screenshot.read_bytes()[:4] == b"\x89PNG"

            second.terminate()
            assert await second.exit_code(timeout=30) == 0
            await until(lambda: value(scrape(port), "swarm_peers") == 1, 60, "the departed peer to vanish")
            remaining = {dict(labels)["peer"] for name, labels in scrape(port) if name == "swarm_peer_info"}
            assert remaining == {first.short_id}
            assert get(port, "/healthz")[0] == 200
            wait_for(chrome, lambda: shown_peers(chrome) == {first.short_id})
            assert chrome.execute_script("return window.loadedOnce") is True  # all of it without a reload

        first.terminate()
        assert await first.exit_code(timeout=30) == 0
        await until(lambda: value(scrape(port), "swarm_peers") == 0, 60, "the last peer to vanish")
        assert value(scrape(port), "swarm_global_epoch") is None
        status, reason = get(port, "/healthz")
        assert status == 503 and "no live peer in the swarm" in reason, (status, reason)


def shown_peers(chrome) -> set:
    return {cells[0] for cells in peer_rows(chrome)}


def screenshot_path(tmp_path: Path) -> Path:
    """Where the page's screenshot goes: the test's directory, or SWARM_PAGE_SCREENSHOT (how
    docs/images/swarm-page.png is made)."""
    return Path(os.environ.get("SWARM_PAGE_SCREENSHOT") or tmp_path / "swarm-page.png")
