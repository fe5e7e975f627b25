"""Fast unit tests of monitoring/: metric contract, bottleneck classifier, exporter and health check.

No hivemind, no GPU, no sleeps: time is a fake clock, and every HTTP call has a timeout.
"""
from __future__ import annotations

import logging
import math
import socket
import types
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from monitoring import (
    CATEGORIES,
    CATEGORY_OF_PHASE,
    CONTRACT_METRIC_NAMES,
    CONTRACT_METRICS,
    CUDA_ONLY_METRICS,
    PHASES,
    ROUND_OUTCOMES,
    BottleneckChange,
    BottleneckClassifier,
    HealthCheck,
    MetricsBindError,
    MetricsExporter,
    PeerMetrics,
    PhaseTimer,
)
from monitoring.classifier import JOINING_ADVICE, describe

HTTP_TIMEOUT_SECONDS = 5.0


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def exposed_samples(registry: CollectorRegistry) -> dict:
    """{sample name: [labels, ...]} as Prometheus would read them from /metrics."""
    samples: dict = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    return samples


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_SECONDS) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


# --- metric contract -------------------------------------------------------------------------


def test_every_contract_metric_is_exposed_by_a_fresh_registry_with_all_label_values():
    registry = CollectorRegistry()
    metrics = PeerMetrics(registry, cuda=True)
    text = generate_latest(registry).decode()
    for name, kind in CONTRACT_METRICS.items():
        assert f"# TYPE {name} {kind}\n" in text, name

    samples = exposed_samples(registry)
    for name, kind in CONTRACT_METRICS.items():
        if name == "peer_info":
            continue  # has no series until set_info describes the peer
        sample_name = f"{name}_count" if kind == "histogram" else name
        assert sample_name in samples, name
    assert sorted(labels["phase"] for labels in samples["peer_phase_seconds_total"]) == sorted(PHASES)
    for name in ("peer_category_seconds_total", "peer_category_fraction", "peer_bottleneck"):
        assert sorted(labels["category"] for labels in samples[name]) == sorted(CATEGORIES), name
    assert sorted(labels["outcome"] for labels in samples["peer_averaging_rounds_total"]) == sorted(ROUND_OUTCOMES)

    metrics.set_info(version="0.1.0", device="cpu", strategy="gradient", compression="fp16")
    assert exposed_samples(registry)["peer_info"] == [
        {"version": "0.1.0", "device": "cpu", "strategy": "gradient", "compression": "fp16"}
    ]


def test_contract_names_follow_prometheus_naming():
    assert len(set(CONTRACT_METRIC_NAMES)) == len(CONTRACT_METRIC_NAMES)
    for name, kind in CONTRACT_METRICS.items():
        assert name.startswith(("peer_", "process_")), name
        assert name.endswith("_total") == (kind == "counter"), name


def test_metrics_never_touch_the_global_registry():
    from prometheus_client import REGISTRY

    before = set(REGISTRY._names_to_collectors)
    PeerMetrics(CollectorRegistry())
    PeerMetrics(CollectorRegistry())  # a second instance must not clash either
    assert set(REGISTRY._names_to_collectors) == before


def test_observe_phase_moves_the_phase_and_its_category_counters_only():
    registry = CollectorRegistry()
    metrics = PeerMetrics(registry)
    metrics.observe_phase("backward", 1.5)
    metrics.observe_phase("forward", 0.5)
    metrics.observe_phase("averaging", 2.0)

    def phase(name: str) -> float:
        return registry.get_sample_value("peer_phase_seconds_total", {"phase": name})

    def category(name: str) -> float:
        return registry.get_sample_value("peer_category_seconds_total", {"category": name})

    assert phase("backward") == 1.5
    assert phase("forward") == 0.5
    assert phase("averaging") == 2.0
    assert phase("data_wait") == 0.0
    assert category("compute") == 2.0
    assert category("communication") == 2.0
    assert category("preprocessing") == 0.0
    assert category("other") == 0.0
    with pytest.raises(ValueError, match="unknown phase 'lunch'"):
        metrics.observe_phase("lunch", 1.0)


def test_observe_phase_works_as_a_phase_timer_listener():
    clock = FakeClock()
    registry = CollectorRegistry()
    metrics = PeerMetrics(registry)
    timer = PhaseTimer(clock=clock)
    timer.add_listener(metrics.observe_phase)
    with timer.phase("optimizer"):
        clock.advance(1.0)
        with timer.phase("averaging"):  # nested phases are exclusive
            clock.advance(3.0)
        clock.advance(0.5)
    assert registry.get_sample_value("peer_phase_seconds_total", {"phase": "optimizer"}) == 1.5
    assert registry.get_sample_value("peer_phase_seconds_total", {"phase": "averaging"}) == 3.0
    assert registry.get_sample_value("peer_category_seconds_total", {"category": "compute"}) == 1.5
    assert registry.get_sample_value("peer_category_seconds_total", {"category": "communication"}) == 3.0


def test_training_loop_methods_set_the_documented_series():
    registry = CollectorRegistry()
    metrics = PeerMetrics(registry)
    value = registry.get_sample_value
    assert math.isnan(value("peer_train_loss"))  # unknown, not a perfect 0

    metrics.record_step(samples=32, loss=2.5)
    metrics.record_step(samples=16, loss=2.0)
    metrics.set_global_epoch(7)
    metrics.set_validation_loss(2.25)
    metrics.set_swarm(peers=3, samples_per_second=480.0, progress_ratio=0.75)
    assert value("peer_samples_total") == 48
    assert value("peer_local_steps_total") == 2
    assert value("peer_train_loss") == 2.0
    assert value("peer_global_epoch") == 7
    assert value("peer_validation_loss") == 2.25
    assert value("peer_swarm_peers") == 3
    assert value("peer_swarm_samples_per_second") == 480.0
    assert value("peer_target_progress_ratio") == 0.75

    metrics.record_round("ok", seconds=0.8, group_size=3, sent_bytes=1000, received_bytes=2000)
    metrics.record_round("timeout", seconds=60.0, group_size=2, sent_bytes=10, received_bytes=0)
    metrics.record_round("skipped", seconds=0.0, group_size=0, sent_bytes=0, received_bytes=0)
    assert value("peer_averaging_rounds_total", {"outcome": "ok"}) == 1
    assert value("peer_averaging_rounds_total", {"outcome": "timeout"}) == 1
    assert value("peer_averaging_rounds_total", {"outcome": "skipped"}) == 1
    assert value("peer_averaging_rounds_total", {"outcome": "failed"}) == 0
    assert value("peer_averaging_round_seconds_count") == 2  # skipped rounds are not timed
    assert value("peer_averaging_round_seconds_bucket", {"le": "1.0"}) == 1
    assert value("peer_averaging_round_seconds_sum") == 60.8
    assert value("peer_averaging_group_size") == 2
    assert value("peer_averaging_payload_sent_bytes_total") == 1010
    assert value("peer_averaging_payload_received_bytes_total") == 2000
    with pytest.raises(ValueError, match="unknown averaging outcome"):
        metrics.record_round("exploded", seconds=1.0, group_size=2, sent_bytes=0, received_bytes=0)

    metrics.set_info("0.1.0", "cpu", "gradient", "none")
    metrics.set_info("0.1.0", "cpu", "diloco", "fp16")  # replaces, never two peer_info series
    assert exposed_samples(registry)["peer_info"] == [
        {"version": "0.1.0", "device": "cpu", "strategy": "diloco", "compression": "fp16"}
    ]

    metrics.set_bottleneck({"compute": 0.7, "communication": 0.2, "other": 0.1}, dominant="compute")
    assert value("peer_category_fraction", {"category": "compute"}) == 0.7
    assert value("peer_category_fraction", {"category": "preprocessing"}) == 0.0
    assert [value("peer_bottleneck", {"category": c}) for c in CATEGORIES] == [0, 1, 0, 0]
    metrics.set_bottleneck({}, dominant=None)
    assert [value("peer_bottleneck", {"category": c}) for c in CATEGORIES] == [0, 0, 0, 0]


def test_process_resources_are_exported():
    registry = CollectorRegistry()
    PeerMetrics(registry)
    assert registry.get_sample_value("process_resident_memory_bytes") > 0
    assert registry.get_sample_value("process_cpu_seconds_total") >= 0


def test_a_cpu_peer_exports_no_gpu_gauges():
    registry = CollectorRegistry()
    metrics = PeerMetrics(registry)
    text = generate_latest(registry).decode()
    assert CUDA_ONLY_METRICS and not any(name in text for name in CUDA_ONLY_METRICS)
    assert metrics.update_gpu_memory() is False


def test_update_gpu_memory_does_nothing_without_cuda_and_reads_it_with_cuda(monkeypatch):
    registry = CollectorRegistry()
    metrics = PeerMetrics(registry, cuda=True)
    monkeypatch.delitem(__import__("sys").modules, "torch", raising=False)
    assert metrics.update_gpu_memory() is False
    assert registry.get_sample_value("peer_gpu_memory_allocated_bytes") == 0

    fake_cuda = types.SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        current_device=lambda: 0,
        memory_allocated=lambda device: 123,
        max_memory_allocated=lambda device: 456,
    )
    monkeypatch.setitem(__import__("sys").modules, "torch", types.SimpleNamespace(cuda=fake_cuda))
    assert metrics.update_gpu_memory() is True
    assert registry.get_sample_value("peer_gpu_memory_allocated_bytes") == 123
    assert registry.get_sample_value("peer_gpu_memory_peak_bytes") == 456


# --- bottleneck classifier ---------------------------------------------------------------------


def feed(classifier: BottleneckClassifier, clock: FakeClock, slices: list) -> None:
    """Run (phase, seconds) slices back to back: each one ends when the clock has advanced by its length."""
    for phase, seconds in slices:
        clock.advance(seconds)
        classifier.observe(phase, seconds)


def test_classifier_names_the_dominant_category_and_counts_gaps_as_other():
    clock = FakeClock()
    classifier = BottleneckClassifier(window_seconds=60.0, hysteresis=0.05, min_window_seconds=10.0, clock=clock)
    assert classifier.update() is None  # nothing seen yet
    assert classifier.fractions() == {c: 0.0 for c in CATEGORIES}

    feed(classifier, clock, [("data_wait", 0.1), ("forward", 0.3), ("backward", 0.5), ("averaging", 0.1)] * 5)
    assert classifier.update() is None  # 5 s of history < min_window_seconds
    feed(classifier, clock, [("data_wait", 0.1), ("forward", 0.3), ("backward", 0.5), ("averaging", 0.1)] * 15)
    fractions = classifier.fractions()
    assert fractions["compute"] == pytest.approx(0.8)
    assert fractions["preprocessing"] == pytest.approx(0.1)
    assert fractions["communication"] == pytest.approx(0.1)
    assert sum(fractions.values()) == pytest.approx(1.0)

    change = classifier.update()
    assert change == BottleneckChange(old=None, new="compute", fraction=pytest.approx(0.8))
    assert classifier.dominant == "compute"
    assert classifier.update() is None  # no change, no event

    clock.advance(20.0)  # 20 s of untimed time in a 40 s history
    fractions = classifier.fractions()
    assert fractions["other"] == pytest.approx(0.5)
    assert fractions["compute"] == pytest.approx(0.4)


def test_classifier_works_as_a_phase_timer_listener():
    clock = FakeClock()
    classifier = BottleneckClassifier(window_seconds=60.0, min_window_seconds=0.0, clock=clock)
    timer = PhaseTimer(clock=clock)
    timer.add_listener(classifier)
    with timer.phase("data_wait"):
        clock.advance(3.0)
    with timer.phase("forward"):
        clock.advance(1.0)
    assert classifier.fractions()["preprocessing"] == pytest.approx(0.75)
    assert classifier.update().new == "preprocessing"


def test_hysteresis_prevents_flapping_and_switches_when_the_gap_is_larger():
    clock = FakeClock()
    classifier = BottleneckClassifier(window_seconds=60.0, hysteresis=0.05, min_window_seconds=10.0, clock=clock)
    feed(classifier, clock, [("forward", 0.51), ("averaging", 0.49)] * 60)
    assert classifier.update().new == "compute"

    # Communication edges ahead, but by less than the margin: the label stays.
    feed(classifier, clock, [("forward", 0.49), ("averaging", 0.51)] * 60)
    assert classifier.fractions()["communication"] == pytest.approx(0.51)
    assert classifier.update() is None
    assert classifier.dominant == "compute"

    # Now communication leads by 0.2 > 0.05: the label switches, once.
    feed(classifier, clock, [("forward", 0.4), ("averaging", 0.6)] * 60)
    change = classifier.update()
    assert change == BottleneckChange(old="compute", new="communication", fraction=pytest.approx(0.6))
    assert classifier.update() is None

    # Compute back ahead by less than the margin: still communication.
    feed(classifier, clock, [("forward", 0.52), ("averaging", 0.48)] * 60)
    assert classifier.update() is None
    assert classifier.dominant == "communication"


def test_window_slides_and_old_slices_drop_out():
    clock = FakeClock()
    classifier = BottleneckClassifier(window_seconds=30.0, min_window_seconds=5.0, clock=clock)
    feed(classifier, clock, [("data_wait", 1.0)] * 30)
    assert classifier.update().new == "preprocessing"
    feed(classifier, clock, [("backward", 1.0)] * 15)
    assert classifier.fractions()["preprocessing"] == pytest.approx(0.5)
    feed(classifier, clock, [("backward", 1.0)] * 15)
    fractions = classifier.fractions()
    assert fractions["preprocessing"] == pytest.approx(0.0)
    assert fractions["compute"] == pytest.approx(1.0)
    assert classifier.update().new == "compute"
    assert len(classifier._buckets) <= 30 + 2  # memory is bounded by the window, not by the run length


def test_a_slice_longer_than_the_window_fills_it():
    clock = FakeClock()
    classifier = BottleneckClassifier(window_seconds=60.0, min_window_seconds=0.0, clock=clock)
    feed(classifier, clock, [("state_sync", 500.0)])
    assert classifier.fractions()["communication"] == pytest.approx(1.0)
    assert len(classifier._buckets) <= 60 + 2


def test_a_peer_that_has_just_joined_is_told_so_not_advised_about_rounds():
    clock = FakeClock()
    classifier = BottleneckClassifier(window_seconds=60.0, min_window_seconds=10.0, clock=clock)
    # 25 s starting, waiting for --min-peers and downloading the swarm's state, then training
    feed(classifier, clock, [("joining", 20.0), ("state_sync", 5.0)] + [("forward", 0.3), ("averaging", 0.2)] * 20)
    change = classifier.update()
    assert change.new == "communication" and change.joining
    assert describe(change, 60.0).endswith(JOINING_ADVICE)

    feed(classifier, clock, [("forward", 0.2), ("averaging", 0.8)] * 60)  # the join is out of the window
    classifier._dominant = None  # decide afresh
    change = classifier.update()
    assert change.new == "communication" and not change.joining
    assert "--target-batch-size" in describe(change, 60.0)


def test_a_change_is_logged_once_with_advice(caplog):
    clock = FakeClock()
    classifier = BottleneckClassifier(window_seconds=60.0, min_window_seconds=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="monitoring.classifier"):
        feed(classifier, clock, [("data_wait", 0.6), ("forward", 0.4)] * 20)
        for _ in range(5):
            classifier.update()
    records = [r for r in caplog.records if r.name == "monitoring.classifier"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert message.startswith("preprocessing now takes 60% of wall time")
    assert "--data-workers" in message

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="monitoring.classifier"):
        feed(classifier, clock, [("averaging", 1.0)] * 60)
        classifier.update()
        classifier.update()
    records = [r for r in caplog.records if r.name == "monitoring.classifier"]
    assert len(records) == 1
    assert "communication now takes 100%" in records[0].getMessage()
    assert "was preprocessing" in records[0].getMessage()
    assert "--target-batch-size" in records[0].getMessage()


def test_classifier_rejects_bad_settings():
    with pytest.raises(ValueError, match="hysteresis"):
        BottleneckClassifier(hysteresis=1.5)
    with pytest.raises(ValueError, match="min_window_seconds"):
        BottleneckClassifier(window_seconds=10.0, min_window_seconds=20.0)
    with pytest.raises(ValueError, match="unknown phase"):
        BottleneckClassifier().observe("nap", 1.0)


def test_every_phase_has_a_category_the_classifier_knows():
    assert set(CATEGORY_OF_PHASE) == set(PHASES)
    assert set(CATEGORY_OF_PHASE.values()) <= set(CATEGORIES)


# --- health check and exporter -----------------------------------------------------------------


def test_health_check_grace_then_window():
    clock = FakeClock()
    health = HealthCheck(window_seconds=60.0, clock=clock)
    assert health()[0] is True  # start-up grace
    clock.advance(61.0)
    ok, reason = health()
    assert not ok
    assert reason.startswith("training loop has not started")

    health.beat()
    assert health()[0] is True
    clock.advance(93.0)
    assert health() == (False, "no training progress for 93s (window 60s)")
    health.beat()
    assert health()[0] is True


@pytest.fixture
def exporter_setup():
    clock = FakeClock()
    registry = CollectorRegistry()
    metrics = PeerMetrics(registry)
    health = HealthCheck(window_seconds=60.0, clock=clock)
    exporter = MetricsExporter(registry, port=0, host="127.0.0.1", health=health)
    port = exporter.start()
    try:
        yield types.SimpleNamespace(
            clock=clock, metrics=metrics, health=health, exporter=exporter, url=f"http://127.0.0.1:{port}", port=port
        )
    finally:
        exporter.stop()


def test_exporter_serves_metrics_and_healthz(exporter_setup):
    s = exporter_setup
    assert s.port > 0
    s.metrics.record_step(samples=32, loss=1.0)
    status, body = http_get(s.url + "/metrics")
    assert status == 200
    assert "peer_samples_total 32.0" in body
    assert "process_resident_memory_bytes" in body

    s.health.beat()
    assert http_get(s.url + "/healthz") == (200, "ok\n")
    s.clock.advance(93.0)
    assert http_get(s.url + "/healthz") == (503, "no training progress for 93s (window 60s)\n")
    assert http_get(s.url + "/nope")[0] == 404


def test_exporter_reports_a_failing_health_callable_as_unhealthy():
    def broken() -> tuple:
        raise RuntimeError("boom")

    exporter = MetricsExporter(CollectorRegistry(), port=0, host="127.0.0.1", health=broken)
    port = exporter.start()
    try:
        status, body = http_get(f"http://127.0.0.1:{port}/healthz")
    finally:
        exporter.stop()
    assert status == 503
    assert "RuntimeError: boom" in body


def test_a_busy_port_raises_a_clear_error(exporter_setup):
    second = MetricsExporter(CollectorRegistry(), port=exporter_setup.port, host="127.0.0.1")
    with pytest.raises(MetricsBindError) as info:
        second.start()
    assert isinstance(info.value, OSError)
    assert f"metrics port {exporter_setup.port}" in str(info.value)
    assert "--metrics-port 0" in str(info.value)


def test_stop_joins_the_thread_and_frees_the_port():
    exporter = MetricsExporter(CollectorRegistry(), port=0, host="127.0.0.1")
    port = exporter.start()
    thread = exporter._thread
    exporter.stop()
    assert not thread.is_alive()
    exporter.stop()  # idempotent
    with socket.socket() as probe:
        probe.settimeout(HTTP_TIMEOUT_SECONDS)
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more
    # The same port can be served again at once.
    again = MetricsExporter(CollectorRegistry(), port=port, host="127.0.0.1")
    assert again.start() == port
    again.stop()


def test_exporter_rejects_a_bad_port():
    with pytest.raises(ValueError, match="metrics port"):
        MetricsExporter(CollectorRegistry(), port=70000)
