"""The training loop of one peer: local steps toward the swarm's target batch.

One step: data_wait -> h2d -> forward -> backward -> optimizer (which may average with
the swarm or download state). Every phase is timed on this thread. At each new global
epoch the peer validates, reports, and every K epochs writes a checkpoint. The loop
stops at --max-epochs, --max-seconds, or a stop request, always after a whole step.
"""
from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import hivemind
import torch
from hivemind.utils import get_dht_time

from averaging.compression import round_payload_bytes
from averaging.open_rounds import RoundAbandoner
from averaging.optimizer import AveragingHooks, Replica, RoundReport, build_swarm_optimizer
from dht.swarm_key import training_namespace
from monitoring import PhaseTimer
from peer.checkpoint import CheckpointStore
from peer.config import PeerConfig
from peer.data import endless, evaluate, make_loader, move_to
from peer.leaving import (
    DONE, DOWNLOADING, LEAVING_KEY_SUFFIX, Need, has_final_state_elsewhere, leave_record, needs_of_others,
)
from peer.progress import ProgressDisplay
from peer.signals import StopRequest
from peer.summary import PeerSummary
from peer.tasks import Task

logger = logging.getLogger(__name__)

NONFINITE_LOSS_LIMIT = 20
"""Batches in a row with a non-finite loss before the peer acts: one is noise, twenty is divergence."""


START_SETTLE_SECONDS = 2.0
"""Peers that wait for each other start this long after the first of them saw the quorum: enough for
the others, polling every 0.25 s, to see it too."""


class TrainingDiverged(RuntimeError):
    """The loss stays non-finite and the swarm cannot give this peer finite weights: stop, do not spin."""


class TrainingObserver:
    """What the loop reports as it goes; the default does nothing. peer.app connects it to metrics."""

    def on_step(self, samples: int, loss: float) -> None: ...

    def on_epoch(self, epoch: int, val_loss: Optional[float]) -> None: ...

    def on_round(self, report: RoundReport, payload_bytes: int) -> None: ...

    def on_swarm(self, peers: int, samples_per_second: float, progress_ratio: float) -> None: ...


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
        dht: hivemind.DHT,
        device: torch.device,
        stop: StopRequest,
        timer: PhaseTimer,
        observer: Optional[TrainingObserver] = None,
        display: Optional[ProgressDisplay] = None,
        on_progress: Callable[[], None] = lambda: None,
    ):
        self.config, self.task, self.dht, self.device = config, task, dht, device
        self.stop, self.timer = stop, timer
        self.observer = observer or TrainingObserver()
        self.display = display or ProgressDisplay(config.averaging.target_batch_size, interactive=False)
        self.on_progress = on_progress  # heartbeat for /healthz
        self.batch_size = config.training.batch_size or task.batch_size
        # GPU kernels run asynchronously: without a synchronize at phase boundaries their time would land
        # in whichever phase waits next. Only on CUDA, and only when the metrics are exported.
        measure_gpu = device.type == "cuda" and config.monitoring.metrics_port != "off"
        self._phase_boundary: Callable[[], None] = torch.cuda.synchronize if measure_gpu else (lambda: None)
        self._last_round_outcome: Optional[str] = None
        self._nonfinite_streak = 0
        self._reset_from_swarm = False  # whether this streak of non-finite losses already took the swarm's state
        self.summary = PeerSummary(run_id=config.training.run_id, task=task.name, peer_id=str(dht.peer_id))
        self.store = CheckpointStore(config.checkpoint.checkpoint_dir, keep=config.checkpoint.keep_checkpoints)

        torch.manual_seed(seed_from_run_id(config.training.run_id))
        self.model = task.build_model().to(device)
        self._restore_model()
        self.optimizer = build_swarm_optimizer(
            config.averaging,
            Replica(
                dht=dht,
                run_id=training_namespace(config.training.run_id, config.dht.swarm_key),
                params=self.model.parameters(),
                optimizer_factory=task.build_optimizer,
                scheduler_factory=task.build_scheduler,
                batch_size=self.batch_size,
                client_mode=config.dht.client_mode,
                hooks=AveragingHooks(
                    phase=timer.phase, round_finished=self._on_round, state_loaded=self._on_state_loaded
                ),
            ),
        )
        self._restore_optimizer()
        # once leaving, a round that has found no group within a matchmaking window (plus a second for the
        # leader's answer) never will: without this, Ctrl+C on a peer whose partners just left waits it out
        self._leaving = threading.Event()
        self._round_abandoner = RoundAbandoner(
            leaving=lambda: bool(self.stop) or self._leaving.is_set(),
            grace_seconds=lambda: self.optimizer.matchmaking_time + 1.0,
        )
        self._round_abandoner.start()
        self._payload_bytes = round_payload_bytes(  # after compression: what one round moves, per peer
            config.averaging, list(self.model.parameters()),
            opt_statistics=len(config.averaging.average_opt_statistics),
        )

        workers = config.training.data_workers
        self.train_loader = make_loader(
            task.build_train_dataset(), batch_size=self.batch_size, workers=workers,
            seed=config.training.seed, collate_fn=task.collate_fn,
        )
        self.val_loader = make_loader(
            task.build_val_dataset(), batch_size=self.batch_size, workers=0, seed=0,
            collate_fn=task.collate_fn, shuffle=False,
        )

    # --- checkpoints -------------------------------------------------------------------

    def _restore_model(self) -> None:
        self._checkpoint = self.store.load_latest()
        if self._checkpoint is None:
            return
        state = self._checkpoint.state
        if state.get("run_id") != self.config.training.run_id or state.get("task") != self.task.name:
            raise RuntimeError(
                f"checkpoint {self._checkpoint.path} belongs to run {state.get('run_id')!r} "
                f"(task {state.get('task')!r}), not run {self.config.training.run_id!r} (task {self.task.name!r}); "
                f"use another --checkpoint-dir"
            )
        if state.get("swarm_hash") != self.config.swarm_hash():
            logger.warning(f"{self._checkpoint.path} was written with different swarm settings; resuming anyway")
        self.model.load_state_dict(state["model"])

    def _restore_optimizer(self) -> None:
        if self._checkpoint is None:
            return
        state = self._checkpoint.state
        self.optimizer.load_state_dict(state["optimizer"])
        scheduler = self.optimizer.state_averager.scheduler
        if scheduler is not None and state.get("scheduler") is not None:
            scheduler.load_state_dict(state["scheduler"])
        self.summary.local_steps, self.summary.samples = state.get("local_steps", 0), state.get("samples", 0)
        self.summary.resumed_from = str(self._checkpoint.path)
        logger.info(f"resumed from {self._checkpoint.path} at epoch {self.optimizer.local_epoch}")

    def save_checkpoint(self) -> None:
        with self.timer.phase("checkpoint"):
            self.optimizer.wait_for_background_updates()
            scheduler = self.optimizer.state_averager.scheduler
            state = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "local_epoch": self.optimizer.local_epoch,
                "local_steps": self.summary.local_steps,
                "samples": self.summary.samples,
                "run_id": self.config.training.run_id,
                "task": self.task.name,
                "swarm_hash": self.config.swarm_hash(),
            }
            path = self.store.save(state, global_epoch=self.optimizer.local_epoch)
        logger.info(f"checkpoint written: {path}")

    # --- hooks from the optimizer ----------------------------------------------------------

    def _on_round(self, report: RoundReport) -> None:
        self._last_round_outcome = report.outcome
        self.summary.averaging_rounds[report.outcome] = self.summary.averaging_rounds.get(report.outcome, 0) + 1
        if report.outcome == "ok":
            self.summary.largest_group = max(self.summary.largest_group, report.group_size)
        self.observer.on_round(report, self._payload_bytes)

    def _on_state_loaded(self, epoch: int) -> None:
        self.summary.state_downloads += 1
        logger.info(f"downloaded the swarm's state: now at epoch {epoch}")

    # --- the loop ------------------------------------------------------------------------

    def catch_up(self) -> None:
        """Before the first step: if the swarm is ahead of us, download its state."""
        global_epoch = self.optimizer.tracker.global_epoch
        if global_epoch > self.optimizer.local_epoch:
            logger.info(f"the swarm is at epoch {global_epoch}, this peer at {self.optimizer.local_epoch}: "
                        f"downloading state from peers")
            self.optimizer.load_state_from_peers()

    def wait_for_swarm(self, min_peers: int, timeout_seconds: float) -> int:
        """Start gate: announce this peer, wait until min_peers peers are visible, then start together.

        hivemind's tracker only counts peers that have accumulated samples, so peers that start
        together would each train alone for a while. Announcing a zero-sample progress record
        makes every waiting peer visible to the others before anyone steps; the gate reads these
        records itself, since with no samples anywhere the tracker refreshes only every 10 s.
        Peers notice the quorum at slightly different moments, and a first epoch can be shorter
        than that: each peer publishes when it saw the quorum, and all start START_SETTLE_SECONDS
        after the earliest of those times.
        """
        tracker = self.optimizer.tracker
        gate_key = f"{tracker.training_progress_key}_start"
        deadline = time.monotonic() + timeout_seconds
        seen, start_at = 0, None
        while not self.stop and time.monotonic() < deadline:
            self._publish(tracker.training_progress_key, tracker.local_progress.dict())
            self.on_progress()  # waiting for peers by design is not a stall
            seen = len(self._records(tracker.training_progress_key))
            if seen >= min_peers and start_at is None:
                start_at, quorum = get_dht_time(), seen
                self._publish(gate_key, start_at)
            if start_at is not None:
                quorum_times = [t for t in self._records(gate_key).values() if isinstance(t, (int, float))]
                start_at = min([start_at, *quorum_times])
                if get_dht_time() >= start_at + START_SETTLE_SECONDS:
                    self._refresh_tracker()  # so that its first epoch counts the peers just seen
                    return quorum  # passed, even if a peer left meanwhile: swarms handle departures
            self.stop.wait(0.25)
        return seen

    def _publish(self, key: str, value) -> None:
        """Store value under key, in this peer's own signed subkey, for as long as the tracker's records live."""
        tracker = self.optimizer.tracker
        tracker.dht.store(key, subkey=tracker._local_public_key, value=value,
                          expiration_time=get_dht_time() + tracker.metadata_expiration)

    def _records(self, key: str) -> Dict[bytes, object]:
        """Every peer's value under key, by subkey (its owner), read from the DHT now."""
        found = self.dht.get(key, latest=True)
        entries = found.value.items() if found is not None and isinstance(found.value, dict) else []
        return {owner: entry.value for owner, entry in entries if getattr(entry, "value", None) is not None}

    def _refresh_tracker(self, timeout_seconds: float = 2.0) -> None:
        """Make hivemind's tracker fetch the swarm's progress now rather than at its next scheduled fetch."""
        tracker = self.optimizer.tracker
        tracker.fetched_global_progress_this_epoch.clear()
        tracker.global_progress.next_fetch_time = get_dht_time()
        tracker.global_state_updated.set()  # wakes the fetcher, which then finds its next fetch due
        tracker.fetched_global_progress_this_epoch.wait(timeout_seconds)

    def leave_in_step(self) -> None:
        """At the last epoch: end with the swarm's weights, and stay while a straggler may need ours.

        A peer whose last round failed downloads the final state from a peer that has it, if any.
        Then it stays for one matchmaking window, and while peer.leaving says another peer needs
        it, for at most three averaging timeouts: a peer that died behind must not keep it forever.
        """
        tracker = self.optimizer.tracker
        matchmaking, timeout = self.optimizer.matchmaking_time, self.optimizer.averaging_timeout
        epoch, me = self.optimizer.local_epoch, tracker._local_public_key
        leaving_key = tracker.training_progress_key + LEAVING_KEY_SUFFIX
        now = time.monotonic()
        stay_until, deadline = now + matchmaking, now + 3 * timeout + matchmaking
        progress = self._records(tracker.training_progress_key)  # fresh: the tracker's view may lag
        if self._last_round_outcome in ("failed", "timeout") and has_final_state_elsewhere(epoch, progress, me):
            self._publish(leaving_key, leave_record(epoch, DOWNLOADING))
            logger.info("the last averaging round failed: downloading the swarm's final state before leaving")
            self.optimizer.load_state_from_peers()
        self._publish(leaving_key, leave_record(epoch, DONE))
        silent_since: Dict[bytes, float] = {}
        while not self.stop and time.monotonic() < deadline:
            needs = needs_of_others(epoch, self._records(tracker.training_progress_key), self._records(leaving_key), me)
            now = time.monotonic()
            for owner, need in needs.items():
                if need is Need.GRACE:
                    silent_since.setdefault(owner, now)
            waiting = now < stay_until or any(
                need is Need.SERVE or (need is Need.GRACE and now < silent_since[owner] + timeout + matchmaking)
                for owner, need in needs.items()
            )
            if not waiting:
                return
            self.stop.wait(0.5)

    def validate(self) -> float:
        return evaluate(self.model, self.val_loader, self.task.loss_fn, self.device, self.config.training.val_batches)

    def run(self) -> str:
        """Train until a stop condition; return the exit reason."""
        try:
            return self._train()
        finally:
            self._leaving.set()

    def _train(self) -> str:
        training = self.config.training
        started = time.monotonic()
        self.model.train()
        batches = endless(self.train_loader)
        val_loss = self.validate()
        self.summary.val_loss_first = self.summary.val_loss_last = val_loss
        self.summary.global_epoch = self.optimizer.local_epoch
        self.observer.on_epoch(self.optimizer.local_epoch, val_loss)
        stats = EpochStats(started_at=time.monotonic())

        while True:
            if training.max_epochs is not None and self.optimizer.local_epoch >= training.max_epochs:
                self.leave_in_step()
                return "max_epochs"
            if training.max_seconds is not None and time.monotonic() - started >= training.max_seconds:
                return "max_seconds"
            if self.stop:
                return f"signal:{self.stop.signal_name}"

            epoch_before = self.optimizer.local_epoch
            step_started = time.monotonic()
            loss = self._step(batches)
            self.summary.longest_step_seconds = max(self.summary.longest_step_seconds, time.monotonic() - step_started)
            if math.isfinite(loss):
                stats.samples += self.batch_size
                stats.steps += 1
                stats.loss_sum += loss
            self.on_progress()
            self._report_swarm()

            if self.optimizer.local_epoch != epoch_before:
                self._finish_epoch(stats)
                stats = EpochStats(started_at=time.monotonic())

    def _step(self, batches) -> float:
        timer = self.timer
        with timer.phase("data_wait"):
            batch = next(batches)
        with timer.phase("h2d"):
            batch = move_to(batch, self.device)
            self._phase_boundary()
        with timer.phase("forward"):
            loss = self.task.loss_fn(self.model, batch)
            self._phase_boundary()
        with timer.phase("backward"):
            loss.backward()
            self._phase_boundary()
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            # never feed a non-finite gradient to the swarm: drop this batch and go on
            self.optimizer.zero_grad()
            self._on_nonfinite_loss(loss_value)
            return loss_value
        self._nonfinite_streak, self._reset_from_swarm = 0, False
        with timer.phase("optimizer"):
            self.optimizer.step(batch_size=self.batch_size)
            self.optimizer.zero_grad()
        self.summary.local_steps += 1
        self.summary.samples += self.batch_size
        self.summary.train_loss = loss_value
        self.observer.on_step(self.batch_size, loss_value)
        return loss_value

    def _on_nonfinite_loss(self, loss_value: float) -> None:
        """Skip the batch; after NONFINITE_LOSS_LIMIT in a row, take the swarm's weights once, then stop."""
        self.summary.nonfinite_batches += 1
        self._nonfinite_streak += 1
        if self._nonfinite_streak == 1:  # one line per streak: a diverged peer would otherwise flood its log
            logger.warning(f"non-finite loss ({loss_value}); skipping this batch")
        if self._nonfinite_streak < NONFINITE_LOSS_LIMIT:
            return
        self._nonfinite_streak = 0
        if not self._reset_from_swarm and self.optimizer.tracker.global_progress.num_peers > 1:
            logger.warning(f"the loss was non-finite for {NONFINITE_LOSS_LIMIT} batches in a row: "
                           f"replacing this peer's weights with the swarm's state")
            self._reset_from_swarm = True
            self.optimizer.load_state_from_peers()
            return
        after = " even with the swarm's weights" if self._reset_from_swarm else ""
        raise TrainingDiverged(
            f"the loss was non-finite for {NONFINITE_LOSS_LIMIT} batches in a row{after}: training diverged or "
            f"the task's data or loss function produce NaN/Inf; lower the learning rate or fix the task, "
            f"then restart (from the last checkpoint, or with a fresh --checkpoint-dir)"
        )

    def _report_swarm(self) -> None:
        progress = self.optimizer.tracker.global_progress
        ratio = progress.samples_accumulated / max(1, progress.target_batch_size)
        self.display.update(progress.samples_accumulated, self.optimizer.local_epoch)
        self.observer.on_swarm(
            progress.num_peers, self.optimizer.tracker.performance_ema.samples_per_second * progress.num_peers, ratio
        )

    def _finish_epoch(self, stats: EpochStats) -> None:
        epoch = self.optimizer.local_epoch
        val_loss = self.validate()
        self.summary.global_epoch = epoch
        self.summary.val_loss_last = val_loss
        self.observer.on_epoch(epoch, val_loss)
        elapsed = max(1e-9, time.monotonic() - stats.started_at)
        self.display.epoch_line(
            epoch=epoch,
            train_loss=stats.mean_loss,
            val_loss=val_loss,
            samples_per_second=stats.samples / elapsed,
            peers=max(1, self.optimizer.tracker.global_progress.num_peers),
        )
        if epoch % self.config.checkpoint.checkpoint_every_epochs == 0:
            self.save_checkpoint()

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        """Leave the swarm: stop averagers and the progress tracker, with bounded waits."""
        self._leaving.set()
        self.optimizer.shutdown()
        self._round_abandoner.finish()
        for averager in (self.optimizer.state_averager, self.optimizer.grad_averager):
            if averager is not None and averager.is_alive():
                averager.join(timeout_seconds)
                if averager.is_alive():
                    averager.terminate()
        # persistent DataLoader workers exit when their iterator is garbage collected
        self.train_loader = None
