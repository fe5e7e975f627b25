"""Monitoring on real peers: the metric contract on /metrics, /healthz, and the bottleneck classifier."""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Dict, Optional, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from monitoring import CONTRACT_METRICS
from tests.peers import FAST_SWARM_ARGS, free_port, wait_until

pytestmark = pytest.mark.integration


def get(port: int, path: str) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def scrape(port: int) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from a peer's /metrics."""
    status, text = get(port, "/metrics")
    if status != 200:
        return {}
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> Optional[float]:
    return samples.get((name, tuple(sorted(labels.items()))))


def bottleneck(port: int) -> Optional[str]:
    samples = scrape(port)
    for category in ("preprocessing", "compute", "communication", "other"):
        if value(samples, "peer_bottleneck", category=category) == 1:
            return category
    return None


@pytest.mark.timeout(150)
def test_every_contract_metric_is_exported_and_counters_move(spawn):
    port = free_port()
    peer = spawn("peer", "start", *FAST_SWARM_ARGS, "--target-batch-size", "32", "--metrics-port", str(port))
    wait_until(lambda: peer.epoch() >= 2, 90, message="two epochs")
    first = scrape(port)
    exposed = {name for name, _ in first}
    for name, kind in CONTRACT_METRICS.items():
        expected = f"{name}_count" if kind == "histogram" else name
        assert expected in exposed, f"{name} missing from /metrics"
    info = [labels for name, labels in first if name == "peer_info"]
    assert len(info) == 1 and dict(info[0])["device"] == "cpu"

    samples_before = value(first, "peer_samples_total")
    wait_until(lambda: (value(scrape(port), "peer_samples_total") or 0) > samples_before + 64, 60, message="more steps")
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
def test_healthz_turns_503_when_the_training_loop_stalls(spawn):
    port = free_port()
    peer = spawn(
        "peer", "start", *FAST_SWARM_ARGS, "--task", "tests.tasks_for_tests:make_stalling_task",
        "--target-batch-size", "16", "--metrics-port", str(port), "--health-window-seconds", "4",
        env={"STALL_AFTER_ITEMS": "400"},
    )
    seen = []

    def stalled() -> bool:
        seen.append(get(port, "/healthz"))
        return seen[-1][0] == 503 and seen[-1][1].startswith("no training progress for")

    wait_until(stalled, 100, message="/healthz to report the stall")
    assert (200, "ok\n") in seen  # it was healthy while training
    assert peer.epoch() >= 1
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
def test_single_peer_bottleneck_is_classified(spawn, task, extra, expected):
    port = free_port()
    args = [*FAST_SWARM_ARGS, "--task", task, *extra, "--metrics-port", str(port)]
    spawn("peer", "start", *args)
    wait_until(lambda: bottleneck(port) == expected, 120, interval=1.0, message=f"a {expected}-bound classification")


@pytest.mark.timeout(180)
def test_swarm_with_tiny_model_and_long_averaging_is_communication_bound(spawn):
    ports = [free_port(), free_port()]
    common = [*FAST_SWARM_ARGS, "--target-batch-size", "32", "--matchmaking-seconds", "3", "--min-peers", "2"]
    # each its own --checkpoint-dir (relative to the shared working directory): one directory takes one peer
    first = spawn("a", "start", *common, "--metrics-port", str(ports[0]), "--checkpoint-dir", "ckpt-a")
    spawn("b", "start", *common, "--metrics-port", str(ports[1]), "--checkpoint-dir", "ckpt-b",
          "--initial-peers", first.join_address())
    wait_until(lambda: bottleneck(ports[0]) == "communication" and bottleneck(ports[1]) == "communication",
               150, interval=1.0, message="both peers classified communication-bound")
