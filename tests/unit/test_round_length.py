"""DiLoCo's round length (averaging/strategies/round_length.py) on a fake clock, and how a peer shows it: metrics,
events, peer status."""
from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import List

import pytest
from prometheus_client import CollectorRegistry

from averaging.api import AveragingHooks, RoundLength, RoundReport
from averaging.budget import UploadMeter
from averaging.config import AveragingConfig
from averaging.strategies.round_length import RoundLengthKeeper
from monitoring import BottleneckClassifier, HealthCheck, PeerMetrics
from peer.cli.status import describe_round, round_factor
from peer.telemetry import observers
from peer.telemetry.events import EventLog, RoundFactorChanged, UploadBudgetUnmet, read_events
from peer.telemetry.observers import EventsObserver, MetricsObserver

PAYLOAD = 50_000_000  # bytes of one contribution and its replies: a peer of a pair sends half, 25 MB, per round


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class NoSwarm:
    """The keeper's watch, for a peer alone: nothing read, nothing stored."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: True


def keeper(budget_mbit, max_factor: int = 64, seen: List[RoundLength] = None):
    clock = Clock()
    config = AveragingConfig(strategy="diloco", target_batch_size=100, max_round_factor=max_factor,
                             max_upload_mbit=budget_mbit)
    hooks = AveragingHooks(round_length=(seen if seen is not None else []).append)
    made = RoundLengthKeeper(config, SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")), "key", hooks,
                             PAYLOAD, excluded=frozenset, ttl_seconds=15.0, clock=clock)
    if made.watch is not None:
        made.watch = NoSwarm()
    tracker = SimpleNamespace(target_batch_size=100)
    made.enter(0, tracker, trained=False)
    return made, clock, tracker


def run_epochs(made, clock, tracker, epochs: int, start: int = 1, train_seconds: float = 10.0) -> None:
    """Epochs of `train_seconds` per target batch and 2 s rounds with one other peer."""
    for epoch in range(start, start + epochs):
        made.stepping()
        clock.now += train_seconds * made.factor
        made.round_begins()
        clock.now += 2.0
        made.round_measured(RoundReport("ok", 2.0, 2))
        made.enter(epoch, tracker, trained=True)


def test_a_lower_budget_makes_the_rounds_longer_and_a_higher_one_shorter():
    factors = {}
    for budget in (100.0, 5.0, 1.0):
        made, clock, tracker = keeper(budget)
        run_epochs(made, clock, tracker, 6)
        factors[budget] = made.factor
        assert tracker.target_batch_size == 100 * made.factor
    assert factors[100.0] == 1 < factors[5.0] < factors[1.0]


def test_a_request_takes_effect_two_epochs_after_it_is_made():
    seen: List[RoundLength] = []
    made, clock, tracker = keeper(1.0, seen=seen)
    run_epochs(made, clock, tracker, 5)
    # epoch 0 began before this peer trained (the start): epoch 1 is the first it times, and asks for as it enters 2
    assert seen[1].requested == 1
    asked = seen[2].requested
    assert asked > 1 and [length.factor for length in seen[:4]] == [1, 1, 1, 1] and seen[4].factor == asked


def test_an_epoch_with_a_pause_or_entered_by_a_download_is_not_timed():
    made, clock, tracker = keeper(1.0)
    run_epochs(made, clock, tracker, 1)
    made.enter(2, tracker, trained=False)  # a download
    run_epochs(made, clock, tracker, 1, start=3)
    made.stepping()
    made.paused()
    run_epochs(made, clock, tracker, 1, start=4)
    assert made.estimate.cost() is None and made.book.requested == 1
    run_epochs(made, clock, tracker, 1, start=5)
    assert made.estimate.cost() is not None and made.book.requested > 1


def test_a_peer_without_a_budget_asks_for_nothing_and_max_factor_1_publishes_nothing():
    made, clock, tracker = keeper(None)
    run_epochs(made, clock, tracker, 4)
    assert (made.factor, made.book.requested, tracker.target_batch_size) == (1, 1, 100)
    alone, _, _ = keeper(1.0, max_factor=1)
    assert alone.watch is None


def test_an_unmet_budget_is_said_once_and_again_only_after_it_was_met_in_between(caplog):
    caplog.set_level(logging.INFO, logger="averaging.strategies.round_length")
    seen: List[RoundLength] = []
    made, clock, tracker = keeper(2.0, max_factor=2, seen=seen)

    def unmet() -> List[str]:
        return [r.getMessage() for r in caplog.records if "even at the longest round" in r.getMessage()]

    run_epochs(made, clock, tracker, 3)
    assert len(unmet()) == 1 and not seen[-1].meets_budget and seen[-1].requested == 2
    line = unmet()[0]
    assert line.startswith("--max-upload-mbit 2: averaging sends") and "--max-round-factor 2" in line
    assert "raise --max-upload-mbit" in line and "--grad-compression int4" in line
    made.payload_bytes = PAYLOAD // 100  # a smaller codec: met again
    run_epochs(made, clock, tracker, 2, start=4)
    assert seen[-1].meets_budget and len(unmet()) == 1
    made.payload_bytes = PAYLOAD
    run_epochs(made, clock, tracker, 2, start=6)
    assert len(unmet()) == 2


def test_the_metrics_and_the_events_show_the_budget_and_each_change_of_the_swarms_factor(tmp_path, monkeypatch):
    registry = CollectorRegistry()
    metrics = PeerMetrics(registry)
    assert math.isnan(registry.get_sample_value("peer_upload_budget_bits_per_second"))
    assert registry.get_sample_value("peer_round_factor") == 1.0
    events = EventsObserver(EventLog(tmp_path / "events.jsonl"))
    observer = MetricsObserver(metrics, BottleneckClassifier(), HealthCheck(60.0))
    steps = [RoundLength(epoch=1, factor=1, requested=4, max_factor=4, budget_mbit=2.5),
             RoundLength(epoch=2, factor=1, requested=4, max_factor=4, budget_mbit=2.5, meets_budget=False,
                         needed_mbit=3.0),
             RoundLength(epoch=3, factor=4, requested=4, max_factor=4, budget_mbit=2.5, meets_budget=False,
                         needed_mbit=3.0),
             RoundLength(epoch=4, factor=4, requested=4, max_factor=4, budget_mbit=2.5, meets_budget=False,
                         needed_mbit=3.0)]
    for length in steps:
        events.on_round_length(length)
        observer.on_round_length(length)
    written, _ = read_events(tmp_path / "events.jsonl")
    assert [type(event) for event in written] == [UploadBudgetUnmet, RoundFactorChanged]
    assert (written[0].epoch, written[0].budget_mbit, written[0].needed_mbit) == (2, 2.5, 3.0)
    assert (written[1].epoch, written[1].factor, written[1].previous) == (3, 4, 1)
    assert registry.get_sample_value("peer_round_factor") == 4.0
    assert registry.get_sample_value("peer_round_factor_requested") == 4.0
    assert registry.get_sample_value("peer_upload_budget_bits_per_second") == 2.5e6
    observer.upload = UploadMeter(started=0.0)  # on a clock of our own: the round ends 10 s in
    monkeypatch.setattr(observers.time, "monotonic", lambda: 10.0)
    observer.on_round(RoundReport("ok", 1.0, 2), payload_bytes=2 * 7_500_000)  # 7.5 MB sent: 60 Mbit
    assert registry.get_sample_value("peer_upload_bits_per_second") == pytest.approx(6e6)  # over the 10 s so far


def test_peer_status_shows_each_peers_round_and_the_swarms_factor():
    peers = [dict(epoch=7, round_factor=2, round_factor_requested=4, upload_budget_mbit=10.0),
             dict(epoch=7, round_factor=2, round_factor_requested=1, upload_budget_mbit=None),
             dict(epoch=6, round_factor=8, round_factor_requested=8, upload_budget_mbit=0.5),  # behind: not the swarm's
             dict(epoch=7, round_factor=None, round_factor_requested=None, upload_budget_mbit=None)]  # an old peer
    assert [describe_round(peer) for peer in peers] == ["x2, asks x4, 10 Mbit/s", "x2", "x8, 0.5 Mbit/s", "-"]
    assert round_factor(peers) == 2 and round_factor(peers[3:]) == 1
