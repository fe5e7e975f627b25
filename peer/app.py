"""`peer start`: compose the DHT, metrics, records and the training loop, and tear down in order.

Exit codes: 0 after a clean stop (max epochs, max seconds, a signal), 1 when the peer
could not run (swarm unreachable, --min-peers not met, a crash), 2 for bad input.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Optional

import torch
from prometheus_client import CollectorRegistry

from averaging.optimizer import RoundReport
from dht.node import DHTStartCancelled, DHTStartError, quiet_dht_logs, shutdown_dht, start_dht, visible_maddrs
from dht.records import PeerInfo, PeerInfoPublisher, record_validators
from monitoring import BottleneckClassifier, HealthCheck, MetricsExporter, MetricsPortInUseError, PeerMetrics, PhaseTimer
from peer import lifeline
from peer.config import PeerConfig
from peer.data import resolve_device
from peer.logs import setup_logging, silence_hivemind
from peer.progress import ProgressDisplay
from peer.signals import StopRequest, start_shared_memory_manager
from peer.tasks import TaskLoadError, load_task
from peer.trainer import Trainer, TrainingDiverged, TrainingObserver
from peer.version import __version__

logger = logging.getLogger("peer")

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
SHUTDOWN_DEADLINE_SECONDS = 25.0


class BadInput(Exception):
    """A problem with what the user asked for, found after config validation (exit code 2)."""


class MetricsObserver(TrainingObserver):
    """Feeds the training loop's reports into the Prometheus metrics and the bottleneck classifier."""

    def __init__(self, metrics: PeerMetrics, classifier: BottleneckClassifier, health: HealthCheck):
        self.metrics, self.classifier, self.health = metrics, classifier, health
        self._next_classification = 0.0

    def on_step(self, samples: int, loss: float) -> None:
        self.metrics.record_step(samples, loss)
        self.health.beat()
        now = time.monotonic()
        if now >= self._next_classification:  # once a second is plenty for a 60 s window
            self._next_classification = now + 1.0
            self.classifier.update()
            self.metrics.set_bottleneck(self.classifier.fractions(), self.classifier.dominant)
            self.metrics.update_gpu_memory()

    def on_epoch(self, epoch: int, val_loss: Optional[float]) -> None:
        self.metrics.set_global_epoch(epoch)
        if val_loss is not None:
            self.metrics.set_validation_loss(val_loss)

    def on_round(self, report: RoundReport, payload_bytes: int) -> None:
        # butterfly all-reduce: each peer sends (N-1)/N of the payload out and gets as much back, twice
        n = max(1, report.group_size)
        moved = int(2 * (n - 1) / n * payload_bytes) if report.outcome == "ok" else 0
        self.metrics.record_round(report.outcome, report.seconds, report.group_size, moved, moved)

    def on_swarm(self, peers: int, samples_per_second: float, progress_ratio: float) -> None:
        self.metrics.set_swarm(peers, samples_per_second, progress_ratio)


def describe_device(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run_peer(config: PeerConfig) -> int:
    lifeline.install()
    setup_logging(config.logging.log_format, config.logging.verbose)
    start_shared_memory_manager()
    stop = StopRequest()
    stop.install_handlers()
    logger.info(f"swarmtrain {__version__}; config: {config.model_dump_json()}")  # from here on, signals stop cleanly
    resources = _Resources()
    trainer: Optional[Trainer] = None
    exit_code, reason = EXIT_FAILED, "crashed"
    try:
        try:
            task = load_task(config.training.task)
            device = resolve_device(config.training.device)
        except (TaskLoadError, RuntimeError) as e:
            raise BadInput(str(e)) from e

        timer = PhaseTimer()
        registry = CollectorRegistry()
        metrics, classifier = PeerMetrics(registry), BottleneckClassifier()
        health = HealthCheck(config.monitoring.health_window_seconds)
        timer.add_listener(metrics.observe_phase)
        timer.add_listener(classifier.observe)
        averaging = config.averaging
        compression = averaging.state_compression if averaging.strategy == "local-sgd" else averaging.grad_compression
        metrics.set_info(__version__, describe_device(device), averaging.strategy, compression)
        if config.monitoring.metrics_port != "off":
            resources.exporter = MetricsExporter(
                registry, config.monitoring.metrics_port, config.monitoring.metrics_host, health=health
            )
            try:
                port = resources.exporter.start()
            except MetricsPortInUseError as e:
                raise BadInput(str(e)) from e
            logger.info(f"metrics on http://{config.monitoring.metrics_host}:{port}/metrics")

        resources.dht = start_dht(config.dht, record_validators=record_validators(config.training.run_id),
                                  sleep=stop.wait, cancelled=lambda: bool(stop))
        print_join_instructions(config, resources.dht)

        display = ProgressDisplay(config.averaging.target_batch_size)
        resources.display = display
        trainer = Trainer(
            config, task, resources.dht, device, stop, timer,
            observer=MetricsObserver(metrics, classifier, health), display=display, on_progress=health.beat,
        )
        # hivemind's averagers set SIGINT to "ignore" in this process when they start: take it back
        stop.install_handlers()
        started = time.monotonic()
        resources.publisher = PeerInfoPublisher(
            resources.dht,
            config.training.run_id,
            lambda: PeerInfo(
                peer_id=str(resources.dht.peer_id),
                version=__version__,
                device=describe_device(device),
                client_mode=config.dht.client_mode,
                samples_per_second=float(trainer.optimizer.tracker.performance_ema.samples_per_second),
                global_epoch=int(trainer.optimizer.local_epoch),
                uptime_seconds=time.monotonic() - started,
                time=time.time(),
                fractions={k: float(v) for k, v in classifier.fractions().items()},
                bottleneck=classifier.dominant,
            ),
        )
        resources.publisher.start()

        if not wait_for_min_peers(config, trainer):
            reason = "min_peers_timeout"
            return EXIT_FAILED
        trainer.catch_up()
        reason = trainer.run()
        exit_code = EXIT_OK
        return EXIT_OK
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        reason, exit_code = "bad_input", EXIT_BAD_INPUT
        return EXIT_BAD_INPUT
    except DHTStartCancelled:
        reason, exit_code = f"signal:{stop.signal_name}", EXIT_OK
        return EXIT_OK
    except DHTStartError as e:
        logger.error(str(e))
        reason = "dht_start_failed"
        return EXIT_FAILED
    except TrainingDiverged as e:
        logger.error(str(e))
        reason = "diverged"
        return EXIT_FAILED
    except Exception as e:
        logger.error(f"peer failed: {type(e).__name__}: {e}", exc_info=True)
        return EXIT_FAILED
    finally:
        finish(config, trainer, resources, reason, exit_code)


def wait_for_min_peers(config: PeerConfig, trainer: Trainer) -> bool:
    needed, timeout = config.averaging.min_peers, config.averaging.min_peers_timeout_seconds
    if needed <= 1:
        return True
    logger.info(f"waiting for {needed} peers (--min-peers) for up to {timeout:.0f}s")
    seen = trainer.wait_for_swarm(needed, timeout)
    if seen >= needed or trainer.stop:
        return True
    logger.error(f"--min-peers {needed}: only {seen} peer(s) visible after {timeout:.0f}s; "
                 f"start more peers or lower --min-peers")
    return False


def print_join_instructions(config: PeerConfig, dht) -> None:
    maddrs = visible_maddrs(dht)
    logger.info(f"peer id {dht.peer_id}; listening on {', '.join(maddrs)}")
    if config.dht.client_mode or not maddrs:
        return
    command = (
        f"peer start --run-id {config.training.run_id} --task {config.training.task} "
        f"--target-batch-size {config.averaging.target_batch_size}"
    )
    if config.averaging.strategy != "sync":  # settings every peer of the run must share
        command += f" --averaging {config.averaging.strategy}"
    if config.dht.swarm_key is not None:
        command += " --swarm-key <a copy of this swarm's key file>"
    print(f"To join this swarm from another machine, run:\n  {command} --initial-peers {maddrs[0]}", flush=True)


class _Resources:
    """What run_peer started, so that finish() can stop it in reverse order."""

    exporter: Optional[MetricsExporter] = None
    dht = None
    publisher: Optional[PeerInfoPublisher] = None
    display: Optional[ProgressDisplay] = None


def finish(config: PeerConfig, trainer: Optional[Trainer], resources: _Resources, reason: str, exit_code: int) -> None:
    """Checkpoint, leave the swarm, write the summary; bounded by a hard deadline."""
    deadline = threading.Timer(SHUTDOWN_DEADLINE_SECONDS, _give_up_shutdown)
    deadline.daemon = True
    deadline.start()
    try:
        if resources.display is not None:
            resources.display.close()
        if trainer is not None and exit_code == EXIT_OK:
            try:
                trainer.save_checkpoint()
            except Exception as e:
                logger.error(f"final checkpoint failed: {e}")
        if resources.publisher is not None:
            resources.publisher.stop()
        silence_hivemind()
        if not config.logging.verbose:
            quiet_dht_logs(resources.dht)
        if trainer is not None:
            trainer.summary.exit_reason = reason
            trainer.summary.phase_seconds = trainer.timer.totals()
            try:
                trainer.shutdown()
            except Exception as e:
                logger.debug(f"optimizer shutdown raised {e!r}")
        shutdown_dht(resources.dht)
        if resources.exporter is not None:
            resources.exporter.stop()
        if config.logging.summary_json is not None and trainer is not None:
            trainer.summary.write(config.logging.summary_json)
        logger.info(f"peer stopped ({reason})")
    finally:
        deadline.cancel()


def _give_up_shutdown() -> None:
    import os

    logger.error(f"shutdown took longer than {SHUTDOWN_DEADLINE_SECONDS:.0f}s; exiting now")
    lifeline.kill_descendants()
    os._exit(EXIT_FAILED)
