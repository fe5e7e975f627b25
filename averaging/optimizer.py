"""SwarmOptimizer: hivemind.Optimizer, instrumented and hardened.

What it adds to hivemind's optimizer:
- every averaging round reports an outcome (ok, failed, timeout, skipped), its duration
  and group size through `AveragingHooks`, and its blocking time is timed as the
  `averaging` phase; downloading state is timed as `state_sync`;
- `load_state_from_peers` gives up after a bounded number of attempts instead of
  retrying forever;
- an explicit `client_mode` is honoured (upstream replaces it with the DHT's value).

It must not know about metrics or the CLI: the caller connects the hooks.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional

import hivemind
import torch

from averaging.config import AveragingConfig

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "failed", "timeout", "skipped")


@dataclass(frozen=True)
class RoundReport:
    """One gradient-averaging round as this peer saw it."""

    outcome: str
    seconds: float
    group_size: int
    reason: str = ""


@dataclass
class AveragingHooks:
    """Callbacks from the optimizer to whoever is watching; all optional."""

    phase: Callable[[str], ContextManager] = lambda name: nullcontext()
    """Context manager timing a blocking phase on the training thread (averaging, state_sync)."""
    round_finished: Callable[[RoundReport], None] = lambda report: None
    state_loaded: Callable[[int], None] = lambda epoch: None
    """Called with the new local epoch after state was downloaded from peers."""


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with round reports, phase timing and bounded state download."""

    def __init__(self, *, hooks: Optional[AveragingHooks] = None, load_state_attempts: int = 3, **kwargs):
        self.hooks = hooks or AveragingHooks()
        self.load_state_attempts = load_state_attempts
        self._training_thread = threading.current_thread()
        requested_client_mode = kwargs.get("client_mode")
        super().__init__(**kwargs)
        if requested_client_mode is not None and self.client_mode != requested_client_mode:
            raise ValueError(
                f"client_mode={requested_client_mode} conflicts with the DHT's client_mode={self.client_mode}; "
                f"start the DHT with the same client mode"
            )

    def _phase(self, name: str) -> ContextManager:
        # delayed averaging runs in hivemind's background threads: time only what blocks training
        if threading.current_thread() is self._training_thread:
            return self.hooks.phase(name)
        return nullcontext()

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        began = super()._begin_averaging_gradients(grad_scaler)
        if not began:  # alone in the swarm (or a pre-scheduled round was lost): this epoch uses local gradients
            self.hooks.round_finished(RoundReport("skipped", 0.0, 1, "no other peers"))
        return began

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        """Upstream logic, plus an outcome report for every round."""
        started = time.monotonic()
        with self._phase("averaging"):
            if maybe_step_control is None:
                report = RoundReport("skipped", 0.0, 1, "no other peers")
            else:
                try:
                    group_info = maybe_step_control.result(self.averaging_timeout)
                    self._load_averaged_gradients_into_optimizer_()
                    report = RoundReport("ok", time.monotonic() - started, len(group_info))
                except TimeoutError as e:
                    report = RoundReport("timeout", time.monotonic() - started, 1, repr(e))
                except BaseException as e:  # hivemind raises many kinds; any of them means "use local grads"
                    report = RoundReport("failed", time.monotonic() - started, 1, repr(e))
            if report.outcome != "ok":
                if report.outcome != "skipped":
                    logger.warning(f"averaging round {report.outcome} ({report.reason}); using local gradients")
                self._load_local_gradients_into_optimizer()
        self.hooks.round_finished(report)

    def load_state_from_peers(self, **kwargs) -> None:
        with self._phase("state_sync"):
            self._load_state_from_peers_bounded(**kwargs)
        self.hooks.state_loaded(self.local_epoch)

    def _load_state_from_peers_bounded(self, **kwargs) -> None:
        """Upstream's load_state_from_peers, but a bounded number of attempts instead of `while True`."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)

        with self.tracker.pause_updates():
            for attempt in range(1, self.load_state_attempts + 1):
                try:
                    self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
                    if self.grad_averager is not None:
                        self.grad_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
                    break
                except KeyboardInterrupt:
                    raise
                except BaseException as e:
                    logger.warning(f"downloading state from peers failed ({e!r}), attempt {attempt}")

            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                self.state_averager.local_epoch = self.tracker.global_epoch
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch

    def wait_for_background_updates(self) -> None:
        """Apply any in-flight background averaging, so local parameters are final (before a checkpoint)."""
        self.state_averager.step(wait_for_delayed_updates=True)


def build_swarm_optimizer(
    config: AveragingConfig,
    *,
    dht: hivemind.DHT,
    run_id: str,
    params,
    optimizer_factory: Callable,
    scheduler_factory: Optional[Callable],
    batch_size: int,
    client_mode: bool,
    hooks: Optional[AveragingHooks] = None,
) -> SwarmOptimizer:
    """The default `sync` strategy: accumulate to the target batch, average gradients, same update everywhere."""
    return SwarmOptimizer(
        hooks=hooks,
        dht=dht,
        run_id=run_id,
        params=params,
        optimizer=optimizer_factory,
        scheduler=scheduler_factory,
        target_batch_size=config.target_batch_size,
        batch_size_per_step=batch_size,
        matchmaking_time=config.matchmaking_seconds,
        averaging_timeout=config.averaging_timeout_seconds,
        load_state_timeout=config.load_state_timeout_seconds,
        offload_optimizer=False,
        client_mode=client_mode,
        # a peer that died stops counting toward the swarm's progress after this long (upstream: 60 s)
        tracker_opts=dict(metadata_expiration=max(15.0, 3 * config.matchmaking_seconds)),
        # hivemind warns (and can deadlock) when a request may outlive the matchmaking window
        averager_opts=dict(request_timeout=min(3.0, config.matchmaking_seconds / 2)),
        verbose=False,
    )


def parameters_fingerprint(model: torch.nn.Module) -> float:
    """A cheap scalar summary of the weights, for logs and summaries (not a substitute for comparing tensors)."""
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))
