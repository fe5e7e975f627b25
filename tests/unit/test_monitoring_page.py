"""The monitor's live swarm page: its data, how the endpoint serves it, and what a real browser shows.

The page against a real 2-peer swarm is tested in tests/swarm/test_monitoring_swarm.py; here it draws
snapshots made by hand, so that each rule is checked alone.
"""
from __future__ import annotations

import json
import math

from prometheus_client import CollectorRegistry

from monitoring import MetricsExporter
from monitoring.swarm_page import SwarmPage
from tests.browser import contributor_rows, headless_chromium, peer_rows, wait_for
from tests.http import get
from tests.unit.test_swarm_collector import snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def swarm_snapshot(*losses, epoch: int = 3) -> dict:
    """Peers aaaaaaaa, bbbbbbbb, ... with these validation losses (None: not validated yet)."""
    made = snapshot(*[chr(ord("a") + index) * 8 for index in range(len(losses))])
    for peer, loss in zip(made["peers"], losses):
        peer["val_loss"] = loss
    made["swarm"].update(global_epoch=epoch, run_id="page-test", samples_accumulated=16, target_batch_size=64)
    return made


def serve(page: SwarmPage) -> MetricsExporter:
    exporter = MetricsExporter(CollectorRegistry(), 0, "127.0.0.1", routes=page.routes())
    exporter.start()
    return exporter


def test_history_charts_the_mean_validation_loss_and_stays_bounded():
    clock = Clock()
    page = SwarmPage(lambda: (True, "ok"), refresh_seconds=5.0, clock=clock, history_points=3)
    for losses in [(None, None), (2.0, None), (2.0, 1.0), (1.0, 0.5)]:
        page.update(swarm_snapshot(*losses))
        clock.now += 5
    history = page.state()["history"]
    assert [point["time"] for point in history] == [1005.0, 1010.0, 1015.0]  # the oldest point dropped
    assert [point["val_loss"] for point in history] == [2.0, 1.5, 0.75]  # peers not validated yet are left out

    page.update(swarm_snapshot())  # the last peer left: the swarm has no epoch (0 would read as a restart)
    state = page.state()
    assert state["history"][-1]["epoch"] is None and state["history"][-1]["val_loss"] is None
    assert state["peers"] == [] and state["read"] is True


def test_state_is_strict_json_even_when_a_peer_reports_an_infinite_rate():
    page = SwarmPage(lambda: (False, "no live peer in the swarm"), refresh_seconds=2.0)
    assert page.state()["read"] is False  # before the first read of the swarm
    made = swarm_snapshot(1.0)
    made["peers"][0]["samples_per_second"] = math.inf  # a record's rate is only bounded below
    made["swarm"]["samples_per_second"] = math.inf
    page.update(made)
    exporter = serve(page)
    try:
        status, body = get(exporter.bound_port, "/swarm.json")
    finally:
        exporter.stop()
    assert status == 200
    state = json.loads(body)  # 200: json.dumps(allow_nan=False) did not raise
    assert state["peers"][0]["samples_per_second"] is None and state["history"][0]["samples_per_second"] is None
    assert state["healthy"] is False and state["health"] == "no live peer in the swarm"


def test_endpoint_serves_the_page_and_survives_a_broken_route():
    page = SwarmPage(lambda: (True, "ok"), refresh_seconds=5.0)

    def broken():
        raise RuntimeError("boom")

    exporter = MetricsExporter(CollectorRegistry(), 0, "127.0.0.1", routes={**page.routes(), "/broken": broken})
    port = exporter.start()
    try:
        status, html = get(port, "/")
        assert status == 200 and "swarm.json" in html and "<script>" in html
        assert "http" not in html.replace("http://www.w3.org/2000/svg", "")  # nothing fetched from elsewhere
        assert get(port, "/broken") == (500, "rendering /broken failed: RuntimeError\n")
        status, missing = get(port, "/nothing")
        assert status == 404 and "/swarm.json" in missing
        assert get(port, "/metrics")[0] == 200  # a broken page takes nothing else down
    finally:
        exporter.stop()


def test_browser_draws_peers_as_text_and_follows_updates_without_reload():
    clock = Clock()
    page = SwarmPage(lambda: (True, "ok"), refresh_seconds=1.0, clock=clock)
    hostile = swarm_snapshot(2.5, 2.4)
    hostile["peers"][0]["device"] = '<img id="injected" src="x">'  # records are written by other machines
    hostile["peers"][1]["paused"] = ["busy"]
    hostile["peers"][0].update(round_factor=2, round_factor_requested=4, upload_budget_mbit=2.5)  # DiLoCo's
    hostile["contributors"] = [
        {"peer_id": "b" * 8, "claimed_samples": 960, "observed_samples": 944, "observers": 1, "device_seconds": 75.0,
         "sent_bytes": 3 * 2**20},
        {"peer_id": '<b id="bold">' + "a" * 8, "claimed_samples": 10**6, "observed_samples": None, "observers": 0,
         "device_seconds": 1.5, "sent_bytes": 0}]
    page.update(hostile)
    exporter = serve(page)
    try:
        with headless_chromium() as chrome:
            chrome.get(f"http://127.0.0.1:{exporter.bound_port}/")
            chrome.execute_script("window.loadedOnce = true")
            wait_for(chrome, lambda: len(peer_rows(chrome)) == 2)
            assert chrome.find_elements("id", "injected") == []
            assert peer_rows(chrome)[0][1] == '<img id="injected" src="x">'
            assert chrome.find_element("id", "epoch").text == "3"
            assert peer_rows(chrome)[1][-1] == "paused: busy"
            assert [cells[5] for cells in peer_rows(chrome)] == ["x2, asks x4, 2.5 Mbit/s", "–"]
            assert contributor_rows(chrome) == [["bbbbbbbb", "960", "944", "1", "1 min 15 s", "3.0 MiB"],
                                                ["aaaaaaaa", "1000000", "–", "0", "1.5 s", "0.0 MiB"]]
            assert chrome.find_elements("id", "bold") == []

            clock.now += 5
            page.update(swarm_snapshot(2.0, epoch=4))
            wait_for(chrome, lambda: chrome.find_element("id", "epoch").text == "4")
            assert [cells[0] for cells in peer_rows(chrome)] == ["aaaaaaaa"]
            assert chrome.execute_script("return window.loadedOnce") is True  # redrawn in place, not reloaded
            assert chrome.find_elements("css selector", "#loss-chart polyline")  # two points: a line
    finally:
        exporter.stop()
