"""The swarm monitor: per-peer series from DHT records, removed when a peer leaves."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from monitoring.phases import CATEGORIES
from monitoring.swarm_metrics import SWARM_METRICS, SwarmCollector
from peer.testing import Swarm, until
from tests.browser import headless_chromium, wait_for
from tests.peers import free_port
from tests.swarm.test_monitoring_peers import get, scrape, value


def snapshot(*short_ids: str) -> dict:
    peers = [
        {"short_id": short_id, "device": "cpu", "version": "0.1.0", "client_mode": False, "samples_per_second": 10.0,
         "epoch": 3, "bottleneck": "compute", "fractions": {"compute": 0.8, "other": 0.2}, "last_seen_seconds": 1.0}
        for short_id in short_ids
    ]
    swarm = {"peers": len(peers), "global_epoch": 3, "samples_per_second": 10.0 * len(peers), "progress": 0.25,
             "eta_next_epoch_seconds": None}
    return {"swarm": swarm, "peers": peers}


def test_collector_renders_the_latest_snapshot_only():
    registry = CollectorRegistry()
    collector = SwarmCollector(clock=lambda: 100.0)
    registry.register(collector)
    assert generate_latest(registry) == b""  # nothing before the first read of the swarm

    collector.update(snapshot("aaaaaaaa", "bbbbbbbb"))
    assert registry.get_sample_value("swarm_peers") == 2
    assert registry.get_sample_value("swarm_peer_bottleneck", {"peer": "aaaaaaaa", "category": "compute"}) == 1
    assert registry.get_sample_value("swarm_peer_category_fraction",
                                     {"peer": "bbbbbbbb", "category": "preprocessing"}) == 0
    exposed = generate_latest(registry).decode()
    assert all(name in exposed for name in SWARM_METRICS)

    collector.update(snapshot("aaaaaaaa"))
    assert registry.get_sample_value("swarm_peers") == 1
    assert registry.get_sample_value("swarm_peer_global_epoch", {"peer": "bbbbbbbb"}) is None
    assert registry.get_sample_value("swarm_peer_global_epoch", {"peer": "aaaaaaaa"}) == 3
    assert registry.get_sample_value("swarm_global_epoch") == 3

    collector.update(snapshot())  # the last peer left: a swarm with no peer has no epoch (not epoch 0)
    assert registry.get_sample_value("swarm_peers") == 0
    assert registry.get_sample_value("swarm_global_epoch") is None


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
            wait_for(chrome, lambda: all(cells[4] != "–" and cells[6] in CATEGORIES for cells in peer_rows(chrome)),
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


def peer_rows(chrome) -> list:
    """Each peer row's cells as text: peer, device, epoch, samples/s, val loss, time split, bottleneck, last seen.
    Read in one script: the page rebuilds its rows on every refresh, so element handles go stale."""
    return chrome.execute_script(
        "return [...document.querySelectorAll('#peers tbody tr')].map("
        "row => [row.dataset.peer, ...[...row.cells].slice(1).map(cell => cell.textContent)])")


def screenshot_path(tmp_path: Path) -> Path:
    """Where the page's screenshot goes: the test's directory, or SWARM_PAGE_SCREENSHOT (how the README's is made)."""
    return Path(os.environ.get("SWARM_PAGE_SCREENSHOT") or tmp_path / "swarm-page.png")
