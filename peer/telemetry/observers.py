"""Where the training loop's reports go: the Prometheus metrics and the events file.

The Trainer reports to one TrainingObserver (peer/runtime/trainer.py); the builder gives it an
`Observers` that hands every report to each of these in turn.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

from averaging.api import RoundLength, RoundReport
from averaging.budget import UploadMeter
from averaging.codecs.compression import bytes_moved
from monitoring import BottleneckClassifier, HealthCheck, PeerMetrics
from monitoring.classifier import BottleneckChange
from peer.telemetry.events import (
    BottleneckChanged,
    CheckpointWritten,
    DownloadRejected,
    EpochEnded,
    EventLog,
    Joined,
    Leaving,
    Paused,
    PeerExcluded,
    ReducingChanged,
    Resumed,
    RoundEnded,
    RoundFactorChanged,
    StateChecked,
    StateDownloaded,
    SwarmRejoined,
    SwarmSplit,
    UpdatesRefused,
    UploadBudgetUnmet,
)
from peer.telemetry.reports import EpochReport, TrainingObserver

BottleneckListener = Callable[[BottleneckChange, Dict[str, float]], None]


class MetricsObserver(TrainingObserver):
    """Feeds the training loop's reports into the Prometheus metrics and the bottleneck classifier."""

    def __init__(self, metrics: PeerMetrics, classifier: BottleneckClassifier, health: HealthCheck,
                 on_bottleneck: BottleneckListener = lambda change, fractions: None):
        self.metrics, self.classifier, self.health = metrics, classifier, health
        self.on_bottleneck = on_bottleneck
        self._next_classification = 0.0
        self.upload = UploadMeter(started=time.monotonic())

    def on_joined(self, epoch: int, peers: int, val_loss: Optional[float]) -> None:
        self._set_epoch(epoch, val_loss)

    def on_step(self, samples: int, loss: float) -> None:
        self.metrics.record_step(samples, loss)
        self.health.beat()
        now = time.monotonic()
        if now >= self._next_classification:  # once a second is plenty for a 60 s window
            self._next_classification = now + 1.0
            change = self.classifier.update()
            fractions = self.classifier.fractions()
            self.metrics.set_bottleneck(fractions, self.classifier.dominant)
            self.metrics.update_gpu_memory()
            self.metrics.set_upload_rate(self.upload.mbit(now))
            if change is not None:
                self.on_bottleneck(change, fractions)

    def on_epoch(self, report: EpochReport) -> None:
        self._set_epoch(report.epoch, report.val_loss)

    def _set_epoch(self, epoch: int, val_loss: Optional[float]) -> None:
        self.metrics.set_global_epoch(epoch)
        if val_loss is not None:
            self.metrics.set_validation_loss(val_loss)

    def on_round(self, report: RoundReport, payload_bytes: int) -> None:
        moved = bytes_moved(payload_bytes, report.group_size, report.outcome)
        self.metrics.record_round(report.outcome, report.seconds, report.group_size, moved, moved,
                                  left_out=report.left_out > 0)
        now = time.monotonic()
        self.upload.record(now, moved)
        self.metrics.set_upload_rate(self.upload.mbit(now))

    def on_round_length(self, length: RoundLength) -> None:
        self.metrics.set_round_length(length.factor, length.requested, length.budget_mbit)

    def on_swarm(self, peers: int, samples_per_second: float, progress_ratio: float) -> None:
        self.metrics.set_swarm(peers, samples_per_second, progress_ratio)

    def on_checkpoint(self, epoch: int, path: Optional[str], problem: str = "") -> None:
        # failing checkpoints leave the peer training but unhealthy: /healthz says why until one works again
        if path is not None:
            self.health.recover()
        else:
            self.metrics.record_checkpoint_failure()
            self.health.degrade(problem)

    def on_dropped_contribution(self, reason: str) -> None:
        self.metrics.record_dropped_contribution(reason)

    def on_exclusion(self, peer_id: str) -> None:
        self.metrics.record_exclusion()

    def on_harmful_updates(self, found) -> None:
        self.metrics.record_harmful_updates(len(found.epochs), len(found.peers))

    def on_state_check(self, check) -> None:
        self.metrics.record_state_check(check.agrees)

    def on_download_rejected(self, donor: str, reason: str) -> None:
        self.metrics.record_rejected_download(reason)

    def on_reducing_changed(self, reduces: bool) -> None:
        self.metrics.set_reducing(reduces)

    def on_paused(self, epoch: int, reasons: Dict[str, str], parked_bytes: int) -> None:
        self.metrics.set_paused(reasons)
        self.health.pause("; ".join(reasons.values()))

    def on_resumed(self, epoch: int, paused_seconds: float, seconds: float, downloaded: bool) -> None:
        self.metrics.set_paused(())
        self.metrics.record_pause(paused_seconds)
        self.health.unpause()


class EventsObserver(TrainingObserver):
    """Writes the loop's reports to the events file (peer/telemetry/events.py); steps are too many to be events."""

    def __init__(self, events: EventLog):
        self.events = events
        self._round_length: Optional[RoundLength] = None

    def on_joined(self, epoch: int, peers: int, val_loss: Optional[float]) -> None:
        self.events.emit(Joined(epoch=epoch, peers=peers, val_loss=val_loss))

    def on_epoch(self, report: EpochReport) -> None:
        self.events.emit(EpochEnded(
            epoch=report.epoch, train_loss=report.train_loss, val_loss=report.val_loss, samples=report.samples,
            seconds=report.seconds, samples_per_second=report.samples_per_second,
            swarm_samples_per_second=report.swarm_samples_per_second, peers=report.peers,
        ))

    def on_round(self, report: RoundReport, payload_bytes: int) -> None:
        self.events.emit(RoundEnded(outcome=report.outcome, seconds=report.seconds, group_size=report.group_size,
                                    reason=report.reason, left_out=round(report.left_out, 4),
                                    group=list(report.peers)))

    def on_state_loaded(self, epoch: int) -> None:
        self.events.emit(StateDownloaded(epoch=epoch))

    def on_round_length(self, length: RoundLength) -> None:
        last, self._round_length = self._round_length, length
        previous = last.factor if last is not None else 1
        if length.factor != previous:
            self.events.emit(RoundFactorChanged(epoch=length.epoch, factor=length.factor, previous=previous,
                                                requested=length.requested))
        if not length.meets_budget and (last is None or last.meets_budget) and length.budget_mbit is not None:
            self.events.emit(UploadBudgetUnmet(epoch=length.epoch, budget_mbit=length.budget_mbit,
                                               needed_mbit=round(length.needed_mbit or 0.0, 6),
                                               max_round_factor=length.max_factor))

    def on_checkpoint(self, epoch: int, path: Optional[str], problem: str = "") -> None:
        self.events.emit(CheckpointWritten(epoch=epoch, ok=path is not None, path=path, problem=problem))

    def on_exclusion(self, peer_id: str) -> None:
        self.events.emit(PeerExcluded(peer_id=peer_id))

    def on_harmful_updates(self, found) -> None:
        self.events.emit(UpdatesRefused(peers=sorted(found.peers), epochs=[epoch for epoch, _, _ in found.epochs],
                                        losses=[[before, after] for _, before, after in found.epochs]))

    def on_state_check(self, check) -> None:
        self.events.emit(StateChecked(epoch=check.epoch, agrees=check.agrees, peers=check.peers,
                                      majority=check.reference))

    def on_download_rejected(self, donor: str, reason: str) -> None:
        self.events.emit(DownloadRejected(donor=donor, reason=reason))

    def on_reducing_changed(self, reduces: bool) -> None:
        self.events.emit(ReducingChanged(reduces=reduces))

    def on_paused(self, epoch: int, reasons: Dict[str, str], parked_bytes: int) -> None:
        self.events.emit(Paused(epoch=epoch, reasons=reasons, parked_bytes=parked_bytes))

    def on_resumed(self, epoch: int, paused_seconds: float, seconds: float, downloaded: bool) -> None:
        self.events.emit(Resumed(epoch=epoch, paused_seconds=round(paused_seconds, 3), seconds=round(seconds, 3),
                                 downloaded=downloaded))

    def on_leaving(self, reason: str) -> None:
        self.events.emit(Leaving(reason=reason))

    def on_bottleneck(self, change: BottleneckChange, fractions: Dict[str, float]) -> None:
        self.events.emit(BottleneckChanged(category=change.new, previous=change.old, fractions=fractions))

    def on_swarm_split(self, reachable: int, unreachable: List[str]) -> None:
        """From dht/reconnect.py: peers this one reached before stopped answering."""
        self.events.emit(SwarmSplit(reachable=reachable, unreachable=unreachable))

    def on_swarm_rejoined(self, peers: List[str]) -> None:
        self.events.emit(SwarmRejoined(peers=peers))


class Observers(TrainingObserver):
    """Hands every report to each observer, in order."""

    def __init__(self, *observers: TrainingObserver):
        self.observers = observers

    def on_joined(self, epoch: int, peers: int, val_loss: Optional[float]) -> None:
        for observer in self.observers:
            observer.on_joined(epoch, peers, val_loss)

    def on_step(self, samples: int, loss: float) -> None:
        for observer in self.observers:
            observer.on_step(samples, loss)

    def on_epoch(self, report: EpochReport) -> None:
        for observer in self.observers:
            observer.on_epoch(report)

    def on_round(self, report: RoundReport, payload_bytes: int) -> None:
        for observer in self.observers:
            observer.on_round(report, payload_bytes)

    def on_state_loaded(self, epoch: int) -> None:
        for observer in self.observers:
            observer.on_state_loaded(epoch)

    def on_round_length(self, length: RoundLength) -> None:
        for observer in self.observers:
            observer.on_round_length(length)

    def on_swarm(self, peers: int, samples_per_second: float, progress_ratio: float) -> None:
        for observer in self.observers:
            observer.on_swarm(peers, samples_per_second, progress_ratio)

    def on_checkpoint(self, epoch: int, path: Optional[str], problem: str = "") -> None:
        for observer in self.observers:
            observer.on_checkpoint(epoch, path, problem)

    def on_dropped_contribution(self, reason: str) -> None:
        for observer in self.observers:
            observer.on_dropped_contribution(reason)

    def on_exclusion(self, peer_id: str) -> None:
        for observer in self.observers:
            observer.on_exclusion(peer_id)

    def on_harmful_updates(self, found) -> None:
        for observer in self.observers:
            observer.on_harmful_updates(found)

    def on_state_check(self, check) -> None:
        for observer in self.observers:
            observer.on_state_check(check)

    def on_download_rejected(self, donor: str, reason: str) -> None:
        for observer in self.observers:
            observer.on_download_rejected(donor, reason)

    def on_reducing_changed(self, reduces: bool) -> None:
        for observer in self.observers:
            observer.on_reducing_changed(reduces)

    def on_paused(self, epoch: int, reasons: Dict[str, str], parked_bytes: int) -> None:
        for observer in self.observers:
            observer.on_paused(epoch, reasons, parked_bytes)

    def on_resumed(self, epoch: int, paused_seconds: float, seconds: float, downloaded: bool) -> None:
        for observer in self.observers:
            observer.on_resumed(epoch, paused_seconds, seconds, downloaded)

    def on_leaving(self, reason: str) -> None:
        for observer in self.observers:
            observer.on_leaving(reason)
