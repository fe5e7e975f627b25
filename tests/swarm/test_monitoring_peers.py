"""Monitoring on real peers: the metric contract on /metrics, /healthz, and the bottleneck classifier."""
from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from typing import Optional

import pytest

from monitoring import CONTRACT_METRICS, CUDA_ONLY_METRICS
from peer.telemetry.events import BottleneckChanged
from peer.testing import Peer, Swarm, until
from tests.http import get, scrape, value


def bottleneck(port: int) -> Optional[str]:
    samples = scrape(port)
    for category in ("preprocessing", "compute", "communication", "other"):
        if value(samples, "peer_bottleneck", category=category) == 1:
            return category
    return None


def metrics_port(peer: Peer) -> int:
    return urllib.parse.urlsplit(peer.metrics_url).port


@pytest.mark.timeout(150)
async def test_every_contract_metric_is_exported_and_counters_move(tmp_path):
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "32", fast=True) as swarm:
        peer = await swarm.add()
        port = metrics_port(peer)
        await peer.reach(2, timeout=90)
        first = scrape(port)
        exposed = {name for name, _ in first}
        for name, kind in CONTRACT_METRICS.items():
            expected = f"{name}_count" if kind == "histogram" else name
            assert (expected in exposed) == (name not in CUDA_ONLY_METRICS), f"{name} on a CPU peer's /metrics"
        info = [labels for name, labels in first if name == "peer_info"]
        assert len(info) == 1 and dict(info[0])["device"] == "cpu"

        samples_before = value(first, "peer_samples_total")
        await until(lambda: (value(scrape(port), "peer_samples_total") or 0) > samples_before + 64, 60, "more steps")
        second = scrape(port)
    for counter in ("peer_samples_total", "peer_local_steps_total"):
        assert value(second, counter) > value(first, counter) > 0
    assert (value(second, "peer_phase_seconds_total", phase="forward")
            > value(first, "peer_phase_seconds_total", phase="forward"))
    assert value(second, "peer_category_seconds_total", category="compute") > 0
    assert value(second, "peer_global_epoch") >= 4
    assert value(second, "peer_averaging_rounds_total", outcome="skipped") >= 4  # alone: every round is skipped
    assert 0 < value(second, "peer_validation_loss") < 6
    assert value(second, "process_resident_memory_bytes") > 0


@pytest.mark.timeout(120)
async def test_healthz_turns_503_when_the_training_loop_stalls(tmp_path):
    async with Swarm(tmp_path, "--task", "tests.tasks_for_tests:make_stalling_task", "--target-batch-size", "16",
                     "--health-window-seconds", "4", fast=True, env={"STALL_AFTER_ITEMS": "400"}) as swarm:
        peer = await swarm.add()
        port = metrics_port(peer)
        seen = []

        def stalled() -> bool:
            seen.append(get(port, "/healthz"))
            return seen[-1][0] == 503 and seen[-1][1].startswith("no training progress for")

        await until(stalled, 100, "/healthz to report the stall", interval=0.2)
        assert (200, "ok\n") in seen  # it was healthy while training
        assert peer.epoch >= 1
        assert seen[-1][1].count("\n") <= 1


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "task, extra, expected",
    [
        ("tests.tasks_for_tests:make_slow_data_task", ["--data-workers", "1", "--target-batch-size", "64"],
         "preprocessing"),
        ("tests.tasks_for_tests:make_heavy_model_task", ["--data-workers", "1", "--target-batch-size", "100000"],
         "compute"),
    ],
)
async def test_single_peer_bottleneck_is_classified(tmp_path, task, extra, expected):
    async with Swarm(tmp_path, "--task", task, *extra, fast=True) as swarm:
        peer = await swarm.add()
        await until(lambda: bottleneck(metrics_port(peer)) == expected, 120, f"a {expected}-bound classification",
                    interval=1.0)
        changes = [event for event in peer.events if isinstance(event, BottleneckChanged)]
        assert changes and changes[-1].category == expected  # its events say what its metrics say


@pytest.mark.timeout(180)
async def test_swarm_with_tiny_model_and_long_averaging_is_communication_bound(tmp_path):
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "32", "--min-peers", "2", fast=True,
                     ) as swarm:
        peers = await swarm.start(2, "--matchmaking-seconds", "3")
        ports = [metrics_port(peer) for peer in peers]
        await until(lambda: all(bottleneck(port) == "communication" for port in ports), 150,
                    "both peers classified communication-bound", interval=1.0)
