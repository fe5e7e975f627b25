"""The training loop of one peer: local steps toward the swarm's target batch.

One step: data_wait -> h2d -> forward -> backward -> optimizer (which may average with
the swarm or download state). Every phase is timed on this thread. The forward and loss run
in the peer's precision (peer/runtime/precision.py); with fp16, a batch whose gradients overflowed
is skipped before the optimizer counts it. At each new global
epoch the peer validates, reports, and every K epochs writes a checkpoint; a checkpoint
that cannot be written (a full, read-only or deleted disk) is reported and retried at the
next one, never a reason to stop. The loop stops at --max-epochs, --max-seconds, or a stop
request, always after a whole step.

The Trainer receives everything built (peer/runtime/builder.py assembles it): it knows the
LoopOptimizer Protocol and the swarm session, never a hivemind object.
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from averaging.api import LoopOptimizer
from monitoring import PhaseTimer
from peer.checkpoint.store import CheckpointError, CheckpointStore
from peer.config import PeerConfig
from peer.process.signals import StopRequest
from peer.runtime.pauser import Pauser
from peer.runtime.precision import MixedPrecision
from peer.runtime.resume import training_state
from peer.runtime.session import SwarmSession
from peer.runtime.tally import RoundTally
from peer.tasks import Task
from peer.tasks.data import evaluate, move_to
from peer.tasks.order import DataPosition
from peer.telemetry.console import ProgressDisplay
from peer.telemetry.reports import EpochReport
from peer.testing.faults import FaultInjector

logger = logging.getLogger(__name__)

NONFINITE_LOSS_LIMIT = 20
"""Batches in a row with a non-finite loss (or fp16 gradients that overflowed) before the peer acts: one is
noise, twenty is divergence (twenty overflows have lowered the loss scale a million times)."""


class TrainingDiverged(RuntimeError):
    """The loss stays non-finite and the swarm cannot give this peer finite weights: stop, do not spin."""


@dataclass
class EpochStats:
    """Local steps since the last global epoch, for the per-epoch report line."""

    started_at: float
    samples: int = 0
    loss_sum: float = 0.0
    steps: int = 0

    @property
    def mean_loss(self) -> Optional[float]:
        return self.loss_sum / self.steps if self.steps else None


def seed_from_run_id(run_id: str) -> int:
    """Every peer of a run initializes its model identically, from the run id."""
    return int.from_bytes(hashlib.sha256(run_id.encode()).digest()[:4], "big")


class Trainer:
    def __init__(
        self,
        config: PeerConfig,
        task: Task,
        model: torch.nn.Module,
        optimizer: LoopOptimizer,
        train_loader,
        val_loader,
        *,
        device: torch.device,
        session: SwarmSession,
        rounds: RoundTally,
        store: CheckpointStore,
        stop: StopRequest,
        timer: PhaseTimer,
        data_position: DataPosition,
        display: Optional[ProgressDisplay] = None,
        on_progress: Callable[[], None] = lambda: None,
        precision: Optional[MixedPrecision] = None,
        faults: Optional[FaultInjector] = None,
        pauser: Optional[Pauser] = None,
    ):
        self.config, self.task, self.model, self.optimizer = config, task, model, optimizer
        self.train_loader, self.val_loader, self.device = train_loader, val_loader, device
        self.data_position = data_position  # where the train loader's order stands: its checkpoints record it
        self.session, self.rounds, self.store = session, rounds, store
        self.summary, self.observer = rounds.summary, rounds.observer
        self.stop, self.timer = stop, timer
        self.display = display or ProgressDisplay(config.averaging.target_batch_size, interactive=False)
        self.on_progress = on_progress  # heartbeat for /healthz
        self.batch_size = config.training.batch_size or task.batch_size
        self.precision = precision or MixedPrecision("fp32", device, model.parameters())
        self.faults = faults or FaultInjector()  # tests only (peer/testing/faults.py)
        self.pauser = pauser  # None: nothing can pause this loop
        # GPU kernels run asynchronously: without a synchronize where the category of the work changes, their
        # time would land in whichever phase waits next (the optimizer's kernels in the next step's h2d, counted
        # as preprocessing, before the synchronize after `optimizer`). Only there: between forward and backward,
        # both compute, a synchronize would only stall the GPU's queue. Only on CUDA, and only when the metrics
        # are exported.
        measure_gpu = device.type == "cuda" and config.monitoring.metrics_port != "off"
        self._category_boundary: Callable[[], None] = torch.cuda.synchronize if measure_gpu else (lambda: None)
        self._nonfinite_streak = 0
        self._reset_from_swarm = False  # whether this streak of non-finite losses already took the swarm's state
        self._epoch_finished = 0  # the last epoch the loop validated and reported
        self.last_checkpoint: Optional[str] = self.summary.resumed_from  # the newest this peer wrote or read
        self._checkpoint_failures_in_a_row = 0
        self._checkpoints_failing_since: Optional[int] = None  # the epoch of the first failure of the streak

    def close(self) -> None:
        """Let the persistent DataLoader workers exit (they live as long as their loader)."""
        self.train_loader = self.val_loader = None

    def save_checkpoint(self) -> Path:
        """Write a checkpoint now and report the outcome to the observer.

        :raises CheckpointError: it could not be written; earlier checkpoints are untouched
        """
        epoch = self.optimizer.local_epoch
        try:
            with self.timer.phase("checkpoint"):
                self.optimizer.wait_for_background_updates()
                state = training_state(self.config, self.task, self.model, self.optimizer, self.summary,
                                       self.precision, self.data_position)
                path = self.store.save(state, global_epoch=epoch)
        except CheckpointError as e:
            self._checkpoint_failed(epoch, e)
            raise
        logger.info(f"checkpoint written: {path}")
        if self._checkpoint_failures_in_a_row:
            logger.info(f"checkpoints work again: wrote {path} after {self._checkpoint_failures_in_a_row} "
                        f"that failed")
        self._checkpoint_failures_in_a_row, self._checkpoints_failing_since = 0, None
        self.last_checkpoint = self.summary.last_checkpoint = str(path)
        self.observer.on_checkpoint(epoch, str(path))
        return path

    def _checkpoint_failed(self, epoch: int, error: CheckpointError) -> None:
        self.summary.checkpoint_failures += 1
        self._checkpoint_failures_in_a_row += 1
        if self._checkpoints_failing_since is None:
            self._checkpoints_failing_since = epoch
        self.observer.on_checkpoint(epoch, None, (
            f"checkpoints failing since epoch {self._checkpoints_failing_since} "
            f"({self._checkpoint_failures_in_a_row} in a row), training goes on: {error}"
        ))

    def _periodic_checkpoint(self) -> None:
        """The every-K-epochs checkpoint. A failed write must not take a volunteer out of the swarm.

        A full, read-only or deleted disk costs this peer its newest checkpoint, nothing else: the store
        leaves the earlier ones untouched, the swarm holds the current state, and the next checkpoint retries
        (recreating a deleted directory). So the loop goes on training and averaging, and says so once per
        streak of failures, not at every checkpoint; only a final checkpoint that fails makes the exit code
        non-zero (peer/cli/start.py).
        """
        try:
            self.save_checkpoint()
        except CheckpointError as e:
            if self._checkpoint_failures_in_a_row == 1:
                every = self.config.checkpoint.checkpoint_every_epochs
                logger.warning(
                    f"checkpoint failed: {e}; training goes on and retries at the next checkpoint (every {every} "
                    f"epoch{'s' if every != 1 else ''}, no more warnings until one works); earlier checkpoints are "
                    f"untouched; free space on, or fix, --checkpoint-dir {self.config.checkpoint.checkpoint_dir}"
                )

    def validate(self) -> float:
        return evaluate(self.model, self.val_loader, self.task.loss_fn, self.device, self.config.training.val_batches,
                        autocast=self.precision.autocast)

    def run(self) -> str:
        """Train until a stop condition; return the exit reason."""
        try:
            return self._train()
        finally:
            self.session.begin_leaving()

    def _train(self) -> str:
        training = self.config.training
        started = time.monotonic()

        def out_of_time() -> bool:
            return training.max_seconds is not None and time.monotonic() - started >= training.max_seconds

        self.model.train()
        batches = iter(self.train_loader)  # endless: its order never ends
        val_loss = self.validate()
        self.rounds.judge_update(self.optimizer.local_epoch, val_loss, self.optimizer)  # the first baseline
        self.summary.val_loss_first = self.summary.val_loss_last = val_loss
        self.summary.global_epoch = self._epoch_finished = self.optimizer.local_epoch
        self.observer.on_joined(self.optimizer.local_epoch, self.optimizer.swarm_view().peers, val_loss)
        self._report_swarm()  # the bar shows the epoch it joined at (after a download), not 0
        stats = EpochStats(started_at=time.monotonic())

        while True:
            max_epochs = self.faults.max_epochs(training.max_epochs)
            if max_epochs is not None and self.optimizer.local_epoch >= max_epochs:
                self.observer.on_leaving("max_epochs")
                # a round still in flight (local-sgd's last parameter round) reports its outcome once it has landed
                self.optimizer.wait_for_background_updates()
                self.session.leave_at_last_epoch(self.rounds.last_outcome)
                # the summary's last validation is of the state the final checkpoint holds, which may not be the one
                # validated at the last epoch: the swarm's, downloaded as it left; a round that landed after the epoch
                # began (overlapped DiLoCo validated its own inner model there: 5.21 where its partner's was 3.46, and
                # 3.41 once the round landed); a delayed update applied as the round was waited for
                self.summary.val_loss_last = self.validate()
                return "max_epochs"
            if out_of_time():
                return self._leaving("max_seconds")
            if self.stop:
                return self._leaving(f"signal:{self.stop.signal_name}")
            if self.pauser is not None and self.pauser.wanted:
                self.pauser.sit_out(keep_going=lambda: not self.stop and not out_of_time())
                stats = EpochStats(started_at=time.monotonic())  # what it had of this epoch counts no more
                continue

            epoch_before = self.optimizer.local_epoch
            step_started = time.monotonic()
            loss = self._step(batches)
            self.summary.longest_step_seconds = max(self.summary.longest_step_seconds, time.monotonic() - step_started)
            if loss is not None:
                stats.samples += self.batch_size
                stats.steps += 1
                stats.loss_sum += loss
            self.on_progress()
            self._report_swarm()

            if self.optimizer.local_epoch != epoch_before:
                self._finish_epoch(stats)
                stats = EpochStats(started_at=time.monotonic())

    def _leaving(self, reason: str) -> str:
        self.observer.on_leaving(reason)
        return reason

    def _step(self, batches) -> Optional[float]:
        """One local step; its loss, or None if the batch was skipped (a non-finite loss, an fp16 overflow)."""
        timer = self.timer
        with timer.phase("data_wait"):
            batch = next(batches)
        self.data_position.samples_read += self.batch_size
        with timer.phase("h2d"):
            batch = move_to(batch, self.device)
            self._category_boundary()
        with timer.phase("forward"):  # on a GPU: queueing its kernels; they run on into backward's time
            with self.precision.autocast():
                loss = self.faults.loss(self.task.loss_fn(self.model, batch))
        with timer.phase("backward"):
            self.precision.backward(loss)
            loss_value = float(loss.detach())  # waits for the GPU's forward and backward
        if not math.isfinite(loss_value):
            # never feed a non-finite gradient to the swarm: drop this batch and go on
            self.optimizer.zero_grad()
            self.summary.nonfinite_batches += 1
            self._on_skipped_batch(f"non-finite loss ({loss_value})", warn=True)
            return None
        with timer.phase("optimizer"):
            stepped = self.precision.step(lambda: self.optimizer.step(batch_size=self.batch_size))
            self.optimizer.zero_grad()
            self._category_boundary()
        if not stepped:  # the scaler has lowered its scale for the next batch; this one was never counted
            self.summary.overflow_batches += 1
            self._on_skipped_batch(f"fp16 gradients overflowed (loss scale now {self.precision.scale:g})", warn=False)
            return None
        self._nonfinite_streak, self._reset_from_swarm = 0, False
        self.summary.local_steps += 1
        self.summary.samples += self.batch_size
        self.summary.train_loss = loss_value
        self.observer.on_step(self.batch_size, loss_value)
        return loss_value

    def _on_skipped_batch(self, why: str, warn: bool) -> None:
        """After NONFINITE_LOSS_LIMIT skipped batches in a row, take the swarm's weights once, then stop.

        An fp16 overflow now and then is the loss scaler at work (it finds its scale by overflowing), so only a
        non-finite loss is warned about, once per streak: a diverged peer would otherwise flood its log."""
        self._nonfinite_streak += 1
        if self._nonfinite_streak == 1 and warn:
            logger.warning(f"{why}; skipping this batch")
        if self._nonfinite_streak < NONFINITE_LOSS_LIMIT:
            return
        self._nonfinite_streak = 0
        if not self._reset_from_swarm and self.optimizer.swarm_view().peers > 1:
            logger.warning(f"the loss or its gradients were non-finite for {NONFINITE_LOSS_LIMIT} batches in a row "
                           f"(last: {why}): replacing this peer's weights with the swarm's state")
            self._reset_from_swarm = True
            if self.optimizer.load_state_from_peers():
                return
            after = " and no peer sent its state to start over from"
        else:
            after = " even with the swarm's weights" if self._reset_from_swarm else ""
        raise TrainingDiverged(
            f"the loss or its gradients were non-finite for {NONFINITE_LOSS_LIMIT} batches in a row (last: {why})"
            f"{after}: training diverged or "
            f"the task's data or loss function produce NaN/Inf; lower the learning rate or fix the task, "
            f"then restart (from the last checkpoint, or with a fresh --checkpoint-dir)"
        )

    def _report_swarm(self) -> None:
        view = self.optimizer.swarm_view()
        self.display.update(view.samples_accumulated, self.optimizer.local_epoch, view.swarm_samples_per_second,
                            view.target_batch_size)
        self.observer.on_swarm(view.peers, view.swarm_samples_per_second, view.progress_ratio)

    def _finish_epoch(self, stats: EpochStats) -> None:
        epoch = self.optimizer.local_epoch
        self.rounds.epoch_ended(stats.samples)
        val_loss = self.validate()
        self.rounds.judge_update(epoch, val_loss, self.optimizer)
        self.summary.global_epoch = epoch
        self.summary.val_loss_last = val_loss
        view = self.optimizer.swarm_view()
        report = EpochReport(epoch=epoch, train_loss=stats.mean_loss, val_loss=val_loss, samples=stats.samples,
                             seconds=time.monotonic() - stats.started_at,
                             swarm_samples_per_second=view.swarm_samples_per_second, peers=max(1, view.peers))
        self.observer.on_epoch(report)
        self.display.epoch_line(epoch=epoch, train_loss=report.train_loss, val_loss=val_loss,
                                samples_per_second=report.samples_per_second,
                                swarm_samples_per_second=report.swarm_samples_per_second, peers=report.peers,
                                seconds=report.seconds)
        self.faults.after_epoch(epoch, self.model.parameters())
        # every K epochs, also when a state download jumps over a multiple of K
        every, previous = self.config.checkpoint.checkpoint_every_epochs, self._epoch_finished
        self._epoch_finished = epoch
        if epoch // every > previous // every:
            self._periodic_checkpoint()
