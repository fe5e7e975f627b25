"""The composition root: one place that assembles a peer from its config, and takes it apart.

PeerBuilder starts each part in order (monitoring, DHT, display, training, publisher) and pushes
its teardown onto an ExitStack as soon as the part exists, so that closing the stack stops
everything that was started, in reverse order, on every path: a clean stop, a crash half-way
through start-up, or bad input found late. `peer start`, `peer bootstrap` (the DHT alone) and
the benchmarks assemble peers with it.
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Optional

import hivemind
import torch
from prometheus_client import CollectorRegistry

from averaging import adapter
from averaging.api import Replica, SessionOptimizer
from averaging.codecs.compression import round_codec, round_payload_bytes
from averaging.config import AveragingConfig
from averaging.pipeline.update_check import UpdateCheck, UpdateCheckRule
from averaging.registry import STRATEGIES
from averaging.strategies.factory import build_swarm_optimizer, progress_record_ttl_seconds
from averaging.swarm.progress import clock_skew_allowed
from dht.clock import ClockRecordPublisher
from dht.identity import IdentityInUse
from dht.keys import SwarmKeys
from dht.manifest import MANIFEST_TTL_SECONDS, REFRESH_PERIOD_SECONDS, read_manifests, runs_manifest
from dht.node import DHTStartCancelled, quiet_dht_logs, shutdown_dht, start_dht
from dht.reconnect import Departures, Reconnector
from dht.records import PeerInfo, PeerInfoPublisher, RecordPublisher, RunManifest, read_peer_infos, record_validators
from dht.run_owner import KEY_FILE_NAME, RunOwnerKey, RunOwnerKeyError
from monitoring import (
    BottleneckClassifier,
    HealthCheck,
    MetricsBindError,
    MetricsExporter,
    PeerMetrics,
    PhaseTimer,
)
from peer.active_hours import parse_active_hours
from peer.checkpoint.lock import CheckpointDirLock
from peer.checkpoint.store import CheckpointStore
from peer.config import PeerConfig
from peer.exit_codes import BadInput
from peer.process.fork_sharing import freeze_before_fork
from peer.process.signals import StopRequest
from peer.runtime.busy import BusyRule, MachineUse
from peer.runtime.credit import CreditLedger
from peer.runtime.device import describe_device
from peer.runtime.manifest import join_run, manifest_for
from peer.runtime.pauser import Pauser
from peer.runtime.pausing import PauseGate, PauseWatch
from peer.runtime.precision import MixedPrecision
from peer.runtime.resume import restore_model, restore_optimizer
from peer.runtime.session import SwarmSession
from peer.runtime.tally import RoundTally
from peer.runtime.trainer import Trainer, seed_from_run_id
from peer.tasks import Task
from peer.tasks.contract import TaskContractError, call_task, check_first_batch, check_task
from peer.tasks.data import make_loader
from peer.tasks.order import DataOrder, resume_position, seed_for_peer
from peer.tasks.registry import run_within
from peer.telemetry.console import ProgressDisplay
from peer.telemetry.events import EventLog
from peer.telemetry.logs import silence_hivemind
from peer.telemetry.observers import EventsObserver, MetricsObserver, Observers
from peer.telemetry.reports import TrainingObserver
from peer.telemetry.summary import PeerSummary
from peer.testing.faults import FaultInjector, FaultPlan
from peer.version import __version__

logger = logging.getLogger("peer")


@dataclass
class Monitoring:
    """Phase timing, metrics and health of one peer; the exporter serves them when a port is set."""

    timer: PhaseTimer
    metrics: PeerMetrics
    classifier: BottleneckClassifier
    health: HealthCheck
    observer: TrainingObserver
    port: Optional[int] = None
    """Where /metrics is served; None with --metrics-port off."""


def update_check(config: AveragingConfig, own_peer_id: str) -> Optional[UpdateCheck]:
    """How this peer judges the swarm's averaged updates by its held-out loss; None with --harmful-update-rise 0."""
    if config.harmful_update_rise <= 0:
        return None
    rule = UpdateCheckRule(config.harmful_update_rise, config.harmful_updates, config.harmful_update_window)
    return UpdateCheck(rule, own_peer_id)


class PeerBuilder:
    """Builds a peer's parts in order; each part's teardown goes onto `stack` as soon as it exists."""

    def __init__(self, config: PeerConfig, stop: StopRequest, stack: ExitStack, faults: Optional[FaultPlan] = None):
        self.config, self.stop, self.stack = config, stop, stack
        self.faults = FaultInjector(faults, wait=stop.wait)  # nothing happens without a plan (tests only)
        self.events = EventLog(config.logging.events)
        self.keys = SwarmKeys.for_run(config.training.run_id, config.dht.swarm_key)
        self._dht_quiet = False
        self._checkpoint_lock: Optional[CheckpointDirLock] = None
        self.manifest: Optional[RunManifest] = None  # the run's signed manifest, once this peer is a member
        adapter.install()  # before anything forks: every hivemind process inherits the patches

    def monitoring(self, device: torch.device) -> Monitoring:
        """Metrics and the bottleneck classifier fed by one phase timer; /metrics served unless the port is off.

        :raises BadInput: the metrics port is taken
        """
        config = self.config.monitoring
        registry = CollectorRegistry()
        timer, metrics = PhaseTimer(), PeerMetrics(registry, cuda=device.type == "cuda")
        classifier = BottleneckClassifier()
        health = HealthCheck(config.health_window_seconds)
        timer.add_listener(metrics.observe_phase)
        timer.add_listener(classifier.observe)
        metrics.set_info(__version__, describe_device(device), self.config.averaging.strategy,
                         round_codec(self.config.averaging))
        events = EventsObserver(self.events)
        observer = Observers(MetricsObserver(metrics, classifier, health, on_bottleneck=events.on_bottleneck), events)
        monitoring = Monitoring(timer, metrics, classifier, health, observer)
        if config.metrics_port != "off":
            exporter = MetricsExporter(registry, config.metrics_port, config.metrics_host, health=health)
            try:
                monitoring.port = exporter.start()
            except MetricsBindError as e:
                raise BadInput(str(e)) from e
            self.stack.callback(exporter.stop)
            logger.debug(f"metrics on http://{config.metrics_host}:{monitoring.port}/metrics")  # in the start summary
        return monitoring

    def dht(self) -> hivemind.DHT:
        """The run's DHT node, with its record validators; retried, and abandoned on a stop request."""
        freeze_before_fork()  # the DHT's process
        try:
            dht = start_dht(self.config.dht, record_validators=record_validators(self.keys),
                            sleep=self.stop.wait, cancelled=lambda: bool(self.stop))
        except IdentityInUse as e:
            raise BadInput(str(e)) from e
        self.stack.callback(self._leave_dht, dht)
        # so that the halves of a partitioned swarm find each other again; stopped before the DHT is
        events = EventsObserver(self.events)
        reconnector = Reconnector(dht, self.config.dht.initial_peers, on_split=events.on_swarm_split,
                                  on_rejoined=events.on_swarm_rejoined,
                                  departed=Departures(dht, self.config.training.run_id))
        reconnector.start()
        self.stack.callback(reconnector.stop)
        return dht

    def display(self) -> ProgressDisplay:
        display = ProgressDisplay(self.config.averaging.target_batch_size)
        self.stack.callback(display.close)
        display.route_logs()  # on a terminal, log records print above the bar instead of into it
        return display

    def lock_checkpoint_dir(self) -> None:
        """Take --checkpoint-dir for this peer alone (peer/checkpoint/lock.py), until the stack closes; idempotent.

        `peer start` calls it first, so that a second peer on the same directory exits before it joins anything.

        :raises CheckpointDirInUse: another peer holds it (exit 2)
        """
        if self._checkpoint_lock is None:
            self._checkpoint_lock = CheckpointDirLock.acquire(self.config.checkpoint.checkpoint_dir)
            self.stack.callback(self._checkpoint_lock.release)

    def training(self, task: Task, device: torch.device, precision: str, dht: hivemind.DHT, monitoring: Monitoring,
                 display: Optional[ProgressDisplay] = None) -> Trainer:
        """The model (resumed from a checkpoint if there is one), its swarm optimizer, the session and the loop.

        `device` and `precision` are resolved and checked against this machine (peer/runtime/device.py)."""
        config = self.config
        summary = PeerSummary(run_id=config.training.run_id, task=task.name, peer_id=str(dht.peer_id),
                              device=str(device), precision=precision)
        self.lock_checkpoint_dir()  # before the first checkpoint is read
        store = CheckpointStore(config.checkpoint.checkpoint_dir, keep=config.checkpoint.keep_checkpoints)
        torch.manual_seed(seed_from_run_id(config.training.run_id))
        where = f"--task {task.name}"
        batch_size = config.training.batch_size or task.batch_size
        timeout = config.training.task_timeout_seconds
        averaging = config.averaging
        rank = averaging.powersgd_rank if STRATEGIES[averaging.strategy].uses("powersgd_rank") else None
        try:  # a task whose parts fail to build is bad input (hf-causal-lm: data it cannot read), in one line
            model = call_task(where, "build_model()", task.build_model).to(device)
            train_set = call_task(where, "build_train_dataset()", task.build_train_dataset)
            val_set = call_task(where, "build_val_dataset()", task.build_val_dataset)
            check_task(task, model, train_set, val_set, batch_size, device, averaging.average_opt_statistics, rank)
            # only the task's own code on samples is timed: under load, building an optimizer alone can take seconds
            run_within(timeout, lambda: check_first_batch(task, model, train_set, batch_size, device),
                       TaskContractError(f"{where}: reading its first batch and computing its loss took longer than "
                                         f"--task-timeout-seconds {timeout:g}; check the dataset's __getitem__ and "
                                         f"the loss"))
        except TaskContractError as e:
            raise BadInput(str(e)) from e
        checkpoint = restore_model(store, config, task.name, model, task.shared_digests)
        # before the optimizer: a mismatched peer must never count toward the swarm
        self._join_run(dht, task, model)
        payload_bytes = round_payload_bytes(config.averaging, list(model.parameters()),
                                            opt_statistics=len(config.averaging.average_opt_statistics))
        credit = CreditLedger(lambda: monitoring.timer.category_totals().get("compute", 0.0),
                              lambda: summary.averaging_sent_bytes)
        rounds = RoundTally(summary, monitoring.observer, payload_bytes,
                            update_check(config.averaging, summary.peer_id), credit)
        freeze_before_fork()  # the averagers' processes
        optimizer = build_swarm_optimizer(config.averaging, Replica(
            dht=dht, keys=self.keys, params=model.parameters(), optimizer_factory=task.build_optimizer,
            scheduler_factory=task.build_scheduler, batch_size=batch_size, client_mode=config.dht.client_mode,
            hooks=rounds.hooks(monitoring.timer, self.faults),
        ))
        if not self.faults.shares_state():
            for averager in getattr(optimizer, "donor_averagers", ()):
                averager.allow_state_sharing = False
        session = SwarmSession(dht, self.keys, optimizer, self.stop, progress_record_ttl_seconds(config.averaging),
                               on_progress=monitoring.health.beat)
        self.stack.callback(self._leave_training, dht, optimizer, session)
        mixed_precision = MixedPrecision(precision, device, model.parameters())
        restore_optimizer(checkpoint, optimizer, summary, mixed_precision)
        training, pinned = config.training, device.type == "cuda"
        position = resume_position(checkpoint.state.get("data") if checkpoint is not None else None, training.seed,
                                   seed_for_peer(training.run_id, str(dht.peer_id)))
        summary.data_seed, summary.data_started_at_sample = position.seed, position.samples_read
        logger.info(f"reading the training data in order {position.seed}, from sample {position.samples_read}")
        train_loader = make_loader(train_set, batch_size=batch_size, workers=training.data_workers,
                                   order=DataOrder(len(train_set), position.seed, position.samples_read),
                                   collate_fn=task.collate_fn, pin_memory=pinned)
        val_loader = make_loader(val_set, batch_size=batch_size, workers=0, collate_fn=task.collate_fn,
                                 pin_memory=pinned)
        gate = PauseGate()
        pauser = Pauser(gate, self._pause_watch(gate, device), config.checkpoint.checkpoint_dir, model, optimizer,
                        session, monitoring.observer, summary)
        trainer = Trainer(
            config, task, model, optimizer, train_loader, val_loader, device=device, session=session, rounds=rounds,
            store=store, stop=self.stop, timer=monitoring.timer, data_position=position, display=display,
            on_progress=monitoring.health.beat,
            precision=mixed_precision, faults=self.faults, pauser=pauser,
        )
        self.stack.callback(trainer.close)
        freeze_before_fork()  # the data workers', as the trainer first reads a batch
        return trainer

    def _pause_watch(self, gate: PauseGate, device: torch.device) -> PauseWatch:
        """What pauses this peer (peer/runtime/pausing.py): `peer pause`, --active-hours, --yield-when-busy."""
        volunteer = self.config.volunteer
        hours = parse_active_hours(volunteer.active_hours) if volunteer.active_hours else None
        busy = machine = None
        if volunteer.yield_when_busy:
            busy = BusyRule(volunteer.yield_cpu_share, volunteer.yield_gpu_share, volunteer.yield_after_seconds,
                            volunteer.resume_after_quiet_seconds)
            machine = MachineUse(gpu_index=device.index if device.type == "cuda" else None)
        watch = PauseWatch(gate, self.config.checkpoint.checkpoint_dir, hours, busy, machine)
        watch.start()
        self.stack.callback(watch.stop)
        return watch

    def publisher(self, dht: hivemind.DHT, trainer: Trainer, monitoring: Monitoring) -> PeerInfoPublisher:
        """Publishes this peer's PeerInfo every few seconds (what `peer status` and the monitor show), and its
        clock record (dht/clock.py)."""
        started, device, classifier = time.monotonic(), describe_device(trainer.device), monitoring.classifier
        optimizer, rounds = trainer.session.optimizer, trainer.rounds

        def round_length() -> dict:  # DiLoCo's, for peer status and the monitor's page
            length = rounds.round_length
            if length is None:
                return {}
            return dict(upload_budget_mbit=length.budget_mbit, round_factor_requested=length.requested,
                        round_factor=length.factor)

        publisher = PeerInfoPublisher(dht, self.config.training.run_id, lambda: PeerInfo(
            peer_id=str(dht.peer_id),
            version=__version__,
            device=device,
            client_mode=self.config.dht.client_mode,
            samples_per_second=float(optimizer.swarm_view().samples_per_second),
            global_epoch=int(optimizer.local_epoch),
            uptime_seconds=time.monotonic() - started,
            time=time.time(),
            fractions={k: float(v) for k, v in classifier.fractions().items()},
            bottleneck=classifier.dominant,
            val_loss=_finite_or_none(trainer.summary.val_loss_last),
            state=trainer.rounds.state,
            paused=sorted(trainer.pauser.gate.reasons()) if trainer.pauser else [],
            credit=trainer.rounds.credit.record(),
            **round_length(),
        ))
        publisher.start()
        self.stack.callback(publisher.stop)
        # so that a peer whose clock runs ahead, and so sees no one, is told why
        clock = ClockRecordPublisher(dht, self.keys.clock, clock_skew_allowed(optimizer.deadlines.matchmaking_seconds))
        clock.start()
        self.stack.callback(clock.stop)
        return publisher

    def _join_run(self, dht: hivemind.DHT, task: Task, model: torch.nn.Module) -> None:
        """Check this peer's settings against the run's manifest (or start the run), then keep our copy alive.

        :raises ManifestMismatch: other settings than the swarm's (exit 2)
        :raises BadInput: the run owner key in --checkpoint-dir is unusable (exit 2)
        :raises ManifestUnreadable: the run's peers are visible but their manifest is not (exit 1)
        """
        try:
            ours = manifest_for(self.config, task.name, model, task.shared_digests)
            manifest = join_run(dht, self.keys, ours, self.run_owner_key, self.config.dht.run_owner,
                                self.config.dht.startup_timeout_seconds, wait=self.stop.wait)
        except RunOwnerKeyError as e:
            raise BadInput(str(e)) from e
        if manifest is None:
            raise DHTStartCancelled("stopped while reading the run manifest")
        self.manifest = manifest
        self._keep_manifest(dht, manifest.dict)

    def run_owner_key(self) -> RunOwnerKey:
        """The key this peer signs a run's manifest with when it starts the run (kept in --checkpoint-dir)."""
        return RunOwnerKey.load_or_create(self.config.checkpoint.checkpoint_dir)

    @property
    def owns_run(self) -> bool:
        """Whether this peer's run owner key signed the run's manifest (it started the run)."""
        if self.manifest is None or not (self.config.checkpoint.checkpoint_dir / KEY_FILE_NAME).exists():
            return False  # no key here: this peer never started a run, nor waited alone for its owner
        return self.manifest.owner == self.run_owner_key().public_key

    def serve_manifest(self, dht: hivemind.DHT) -> None:
        """For a node that trains nothing (peer bootstrap): keep the run's manifest alive while it runs, so that
        it outlives a pause of every training peer."""

        def current() -> Optional[dict]:
            copies = read_manifests(dht, self.keys.manifest, timeout_seconds=10.0, owner=self.config.dht.run_owner)
            manifest = runs_manifest(copies, read_peer_infos(dht, self.keys.run_id, 10.0), self.config.dht.run_owner)
            return None if manifest is None else manifest.dict()

        self._keep_manifest(dht, current)

    def _keep_manifest(self, dht: hivemind.DHT, make_value: Callable[[], Optional[dict]]) -> None:
        keeper = RecordPublisher(dht, self.keys.manifest, make_value, period_seconds=REFRESH_PERIOD_SECONDS,
                                 ttl_seconds=MANIFEST_TTL_SECONDS, withdraw_on_stop=False)
        keeper.start()
        self.stack.callback(keeper.stop)

    # --- teardown ------------------------------------------------------------------------------

    def _quiet_hivemind(self, dht: hivemind.DHT) -> None:
        """While leaving, hivemind logs errors about peers and pipes going away; they mean nothing to users."""
        silence_hivemind()
        if not self.config.logging.verbose and not self._dht_quiet:
            quiet_dht_logs(dht)
            self._dht_quiet = True

    def _leave_training(self, dht: hivemind.DHT, optimizer: SessionOptimizer, session: SwarmSession) -> None:
        self._quiet_hivemind(dht)
        session.begin_leaving()  # rounds nobody will join are dropped while the optimizer waits for them
        try:
            optimizer.shutdown()
        except Exception as e:  # hivemind's shutdown can fail noisily once the peer is half gone
            logger.debug(f"optimizer shutdown raised {e!r}")
        session.close()

    def _leave_dht(self, dht: hivemind.DHT) -> None:
        self._quiet_hivemind(dht)
        shutdown_dht(dht)


def _finite_or_none(value: Optional[float]) -> Optional[float]:
    """A diverged peer's NaN loss is published as unknown: the record's schema takes finite values only."""
    return float(value) if value is not None and math.isfinite(value) else None
