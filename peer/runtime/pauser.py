"""Pausing the training loop between two steps, and resuming it, without leaving the swarm.

While any reason of the gate holds (peer/runtime/pausing.py), the loop stands aside after a whole step:
1. the optimizer drops what it accumulated toward this epoch and lets the rounds scheduled ahead go on
   at zero weight, and its progress record says it accumulates nothing (no peer waits on it or counts on
   its rate), and the session says it is paused (peers leaving at their last epoch do not stay for it);
2. on a GPU, the model and optimizer state move to host memory (peer/runtime/parking.py);
3. it waits, keeping its DHT node, its averagers (it still serves its state) and its identity, and says
   again every few seconds that it is paused.
When no reason holds any longer it moves back to the device, catches up (downloads the swarm's state, checked
like any download, if the swarm moved on) and trains. A stop or --max-seconds ends a pause too.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from averaging.api import LoopOptimizer
from dht.records import PUBLISH_PERIOD_SECONDS
from peer.runtime.parking import Parked, park
from peer.runtime.pausing import PAUSED, TRAINING, PauseGate, PauseWatch, describe, write_state
from peer.runtime.session import SwarmSession
from peer.telemetry.reports import TrainingObserver
from peer.telemetry.summary import PeerSummary

logger = logging.getLogger(__name__)


class Pauser:
    def __init__(self, gate: PauseGate, watch: Optional[PauseWatch], directory: Path, model: torch.nn.Module,
                 optimizer: LoopOptimizer, session: SwarmSession, observer: TrainingObserver, summary: PeerSummary):
        self.gate, self.watch, self.directory = gate, watch, directory
        self.model, self.optimizer, self.session = model, optimizer, session
        self.observer, self.summary = observer, summary
        self._reported: Optional[tuple] = None
        self.report(TRAINING, {})

    @property
    def wanted(self) -> bool:
        return self.gate.paused

    def sit_out(self, keep_going: Callable[[], bool]) -> None:
        """Pause now, wait while a reason holds and `keep_going()`, then resume."""
        started, epoch, reasons = time.monotonic(), self.optimizer.local_epoch, self.gate.reasons()
        self.optimizer.pause()
        self.session.announce_paused()
        parked = park(self.model, self.optimizer.task_optimizer)
        self.summary.pauses += 1
        freed = f"; {parked.bytes / 2**20:.0f} MiB of GPU memory given back" if parked.bytes else ""
        logger.info(f"paused at epoch {epoch} ({describe(reasons)}): no samples counted and no rounds joined until "
                    f"it resumes{freed}")
        self.report(PAUSED, reasons)
        self.observer.on_paused(epoch, reasons, parked.bytes)
        self._wait(reasons, keep_going, parked)
        self._resume(started, catch_up=keep_going(), parked=parked)

    def _wait(self, reasons: Dict[str, str], keep_going: Callable[[], bool], parked: Parked) -> None:
        next_announcement = time.monotonic() + PUBLISH_PERIOD_SECONDS
        while self.gate.paused and keep_going():
            if self.gate.wait_for_change(1.0) and self.gate.paused and self.gate.reasons() != reasons:
                reasons = self.gate.reasons()
                logger.info(f"still paused: {describe(reasons)}")
                self.observer.on_paused(self.optimizer.local_epoch, reasons, parked.bytes)
            self.report(PAUSED, reasons)  # also when only a request was seen: `peer resume` waits for it
            if time.monotonic() >= next_announcement:
                next_announcement = time.monotonic() + PUBLISH_PERIOD_SECONDS
                self.session.announce_paused()

    def _resume(self, started: float, catch_up: bool, parked: Parked) -> None:
        paused_seconds, resuming = time.monotonic() - started, time.monotonic()
        parked.unpark()
        self.session.announce_resumed()
        self.optimizer.resume()
        downloads = self.summary.state_downloads
        if catch_up:
            self.optimizer.swarm_view(refresh_timeout_seconds=2.0)  # the swarm may have moved on meanwhile
            self.session.catch_up()
        downloaded = self.summary.state_downloads > downloads
        seconds = time.monotonic() - resuming
        self.summary.paused_seconds += paused_seconds
        logger.info(f"resumed at epoch {self.optimizer.local_epoch} after {paused_seconds:.0f}s paused"
                    f"{' (downloaded the swarm state)' if downloaded else ''}; resuming took {seconds:.1f}s")
        self.observer.on_resumed(self.optimizer.local_epoch, paused_seconds, seconds, downloaded)
        self.report(TRAINING, {})

    def report(self, state: str, reasons: Dict[str, str]) -> None:
        """Write what this peer does for `peer pause`/`peer resume`, when that changed."""
        seen = self.watch.request_seen if self.watch else None
        if self._reported != (state, reasons, seen):
            self._reported = (state, reasons, seen)
            write_state(self.directory, state, reasons, seen)
