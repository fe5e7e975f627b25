"""SwarmOptimizer: hivemind.Optimizer, instrumented and hardened.

What it adds to hivemind's optimizer:
- every averaging round reports an outcome (ok, failed, timeout, skipped), its duration
  and group size through `AveragingHooks`, and its blocking time is timed as the
  `averaging` phase; downloading state is timed as `state_sync`;
- `load_state_from_peers` gives up after a bounded number of attempts instead of
  retrying forever;
- an explicit `client_mode` is honoured (upstream replaces it with the DHT's value);
- with `--matchmaking-seconds auto` / `--averaging-timeout-seconds auto`, the deadlines are
  chosen again after every epoch (averaging/deadlines.py) and applied where hivemind reads them;
- with local-sgd, the parameter-averaging rounds are reported too (they are its only rounds).

`build_swarm_optimizer` turns an AveragingConfig into the optimizer of the chosen strategy
(sync, local-sgd and powersgd are hivemind.Optimizer configurations; diloco is ours, in
averaging/diloco.py, with the same interface). It must not know about metrics or the CLI:
the caller connects the hooks.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, ContextManager, Iterable, Optional

import hivemind
import torch
from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
from hivemind.optim.state_averager import TrainingStateAverager

from averaging.compression import codecs_from_config
from averaging.config import AveragingConfig
from averaging.deadlines import AdaptiveDeadlines, Deadlines
from averaging.guards import all_finite
from averaging.open_rounds import track_open_rounds
from averaging.pacing import pace_averager_dht_traffic

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


@dataclass
class Replica:
    """What an optimizer of any strategy is built for: this peer's model and the swarm it trains with."""

    dht: hivemind.DHT
    run_id: str
    params: Iterable[torch.Tensor]
    optimizer_factory: Callable
    scheduler_factory: Optional[Callable] = None
    batch_size: int = 1
    client_mode: Optional[bool] = None
    """None: the DHT's mode."""
    hooks: AveragingHooks = field(default_factory=AveragingHooks)


def try_attempts(attempts: int, download: Callable[[], None]) -> bool:
    """Run a state download up to `attempts` times; True once one succeeds."""
    for attempt in range(1, attempts + 1):
        try:
            download()
            return True
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # hivemind raises many kinds; each means "try again"
            logger.warning(f"downloading state from peers failed ({e}), attempt {attempt} of {attempts}")
    return False


def retune_deadlines(deadlines: AdaptiveDeadlines, tracker, target_batch_size: int) -> Deadlines:
    """After an epoch: feed the swarm's accumulation rate to the adaptive deadlines; log and return the new ones."""
    progress = tracker.global_progress
    deadlines.observe_swarm(tracker.performance_ema.samples_per_second * max(1, progress.num_peers), target_batch_size)
    before, after = deadlines.current, deadlines.update()
    if after != before:
        logger.info(f"adaptive deadlines: matchmaking {after.matchmaking_seconds:.1f}s, "
                    f"averaging timeout {after.averaging_timeout_seconds:.1f}s")
    return after


def report_state_download(hooks: "AveragingHooks", loaded: bool, epoch: int, attempts: int) -> None:
    if loaded:
        hooks.state_loaded(epoch)
    else:
        logger.warning(f"no peer sent a usable state in {attempts} attempts; going on with this peer's own state")


class SwarmOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with round reports, phase timing and bounded state download."""

    def __init__(
        self,
        *,
        hooks: Optional[AveragingHooks] = None,
        load_state_attempts: int = 3,
        deadlines: Optional[AdaptiveDeadlines] = None,
        report_state_rounds: bool = False,
        **kwargs,
    ):
        self.hooks = hooks or AveragingHooks()
        self.load_state_attempts = load_state_attempts
        self.deadlines = deadlines
        self.report_state_rounds = report_state_rounds
        self._resync_requested = False
        self._training_thread = threading.current_thread()
        requested_client_mode = kwargs.get("client_mode")
        super().__init__(**kwargs)
        if requested_client_mode is not None and self.client_mode != requested_client_mode:
            raise ValueError(
                f"client_mode={requested_client_mode} conflicts with the DHT's client_mode={self.client_mode}; "
                f"start the DHT with the same client mode"
            )
        if self.deadlines is not None and self.deadlines.auto:
            self._apply_deadlines(self.deadlines.current)

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        averager_class = GuardedStateAverager
        if self.report_state_rounds:
            averager_class = partial(ReportingStateAverager, hooks=self.hooks)
        return averager_class(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    # --- adaptive deadlines ----------------------------------------------------------------

    def _apply_deadlines(self, deadlines: Deadlines) -> None:
        """Put the deadlines where hivemind reads them on every round.

        Optimizer.matchmaking_time decides when a round is pre-scheduled; averaging_timeout bounds
        each round (and the state-averaging rounds); each averager's matchmaking_kwargs sets the
        default start time of a round it schedules. The averager processes' own floor
        (min_matchmaking_time) and all-reduce timeout were fixed at start to the lower and upper bounds.
        """
        self.matchmaking_time = deadlines.matchmaking_seconds
        self.averaging_timeout = deadlines.averaging_timeout_seconds
        for averager in (self.state_averager, self.grad_averager):
            if averager is not None:
                averager.matchmaking_kwargs["min_matchmaking_time"] = deadlines.matchmaking_seconds

    def _update_global_epoch(self, grad_scaler) -> None:
        super()._update_global_epoch(grad_scaler)
        if self.deadlines is not None and self.deadlines.auto:
            self._apply_deadlines(retune_deadlines(self.deadlines, self.tracker, self.target_batch_size))

    def _phase(self, name: str) -> ContextManager:
        # delayed averaging runs in hivemind's background threads: time only what blocks training
        if threading.current_thread() is self._training_thread:
            return self.hooks.phase(name)
        return nullcontext()

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler) -> bool:
        """Upstream, but a batch with non-finite gradients is dropped: it never reaches the swarm."""
        if not all_finite(param.grad for param in self.state_averager.main_parameters):
            logger.warning("non-finite gradients in this batch: dropped, not accumulated or sent to peers")
            return False
        return super()._check_and_accumulate_gradients(batch_size, grad_scaler)

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
                    with self.grad_averager.get_tensors() as averaged:
                        finite = all_finite(averaged)
                    if finite:
                        self._load_averaged_gradients_into_optimizer_()
                        report = RoundReport("ok", time.monotonic() - started, len(group_info))
                    else:  # a peer sent NaN/Inf: never apply it
                        report = RoundReport("failed", time.monotonic() - started, len(group_info),
                                             "the averaged gradients hold NaN or Inf")
                except TimeoutError as e:
                    report = RoundReport("timeout", time.monotonic() - started, 1, repr(e))
                except BaseException as e:  # hivemind raises many kinds; any of them means "use local grads"
                    report = RoundReport("failed", time.monotonic() - started, 1, repr(e))
            if report.outcome != "ok":
                if report.outcome != "skipped":
                    logger.warning(f"averaging round {report.outcome} ({report.reason}); using local gradients")
                    # if others got past this epoch without us, take their state instead of drifting apart
                    self._resync_requested = self.tracker.global_epoch > self.local_epoch
                self._load_local_gradients_into_optimizer()
        if self.deadlines is not None:
            self.deadlines.observe_round(report.outcome, report.seconds)
        self.hooks.round_finished(report)

    def _should_load_state_from_peers(self) -> bool:
        if self._resync_requested:
            self._resync_requested = False
            return True
        return super()._should_load_state_from_peers()

    def load_state_from_peers(self, **kwargs) -> bool:
        """Upstream's, with a bounded number of attempts instead of `while True`; True if state was loaded."""
        with self._phase("state_sync"):
            loaded = self._load_state_from_peers_bounded(**kwargs)
        report_state_download(self.hooks, loaded, self.local_epoch, self.load_state_attempts)
        return loaded

    def _load_state_from_peers_bounded(self, **kwargs) -> bool:
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)

        with self.tracker.pause_updates():
            loaded = try_attempts(self.load_state_attempts, lambda: self._download_state(**kwargs))
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                self.state_averager.local_epoch = self.tracker.global_epoch
            self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
            if not self.client_mode:
                self.state_averager.state_sharing_priority = self.local_epoch
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
                if not self.client_mode:
                    self.grad_averager.state_sharing_priority = self.local_epoch
        return loaded

    def _download_state(self, **kwargs) -> None:
        self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
        if self.grad_averager is not None:
            self.grad_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)

    def wait_for_background_updates(self) -> None:
        """Apply any in-flight background averaging, so local parameters are final (before a checkpoint)."""
        self.state_averager.step(wait_for_delayed_updates=True)


class StateDownloadFailed(RuntimeError):
    """No peer sent a usable state."""


class _DownloadRecorder(hivemind.DecentralizedAverager):
    """Remembers what the last state download returned: TrainingStateAverager, which sits above this
    class in the method order, returns None whether or not any peer sent its state."""

    last_download = None

    def load_state_from_peers(self, *args, **kwargs):
        self.last_download = super().load_state_from_peers(*args, **kwargs)
        return self.last_download


class GuardedStateAverager(TrainingStateAverager, _DownloadRecorder):
    """TrainingStateAverager that discards a parameter-averaging result holding NaN or Inf, and
    whose state download raises StateDownloadFailed unless a peer's state was actually loaded."""

    def _apply_averaging_results_(self):
        with self.get_tensors() as averaged:
            finite = all_finite(averaged)
        if not finite:
            logger.warning("a parameter-averaging round returned NaN or Inf; keeping this peer's own parameters")
            self._load_local_tensors_into_averager_()  # so the next round starts from sane values
            return
        super()._apply_averaging_results_()

    def load_state_from_peers(self, **kwargs) -> None:
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        with torch.no_grad():
            before = [param.detach().clone() for param in params]
        epoch_before = self.local_epoch
        self.last_download = None
        super().load_state_from_peers(**kwargs)
        if self.last_download is None:
            raise StateDownloadFailed("no peer sent its state")
        if self.local_epoch != self.last_download[0].get("epoch"):  # upstream refused it and logged why
            raise StateDownloadFailed("the state a peer sent was not loaded")
        if not all_finite(params):
            logger.warning("the state downloaded from a peer holds NaN or Inf; discarded")
            with torch.no_grad():
                for param, saved in zip(params, before):
                    param.copy_(saved)
            self.local_epoch = epoch_before
            raise StateDownloadFailed("downloaded state was not finite")


class ReportingStateAverager(GuardedStateAverager):
    """TrainingStateAverager that reports each parameter-averaging round (local-sgd's only rounds).

    Upstream creates the round inside `_do` and swallows its outcome; here the round is created
    first, so that its outcome can be read after upstream's `_do` has run it. Runs in hivemind's
    background thread, so it reports but never times a phase.
    """

    def __init__(self, *, hooks: AveragingHooks, **kwargs):
        self._hooks = hooks
        super().__init__(**kwargs)

    def _do(self, wait_for_trigger, optimizer_step, zero_grad, averaging_round, averaging_control, grad_scaler,
            set_to_none, timeout=None, **kwargs):
        if not averaging_round:
            return super()._do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, averaging_control,
                               grad_scaler, set_to_none, timeout=timeout, **kwargs)
        started = time.monotonic()
        if averaging_control is None or averaging_control.triggered or averaging_control.done():
            try:
                averaging_control = hivemind.DecentralizedAverager.step(
                    self, gather=self.local_epoch, require_trigger=True, timeout=timeout, wait=False, **kwargs
                )
            except BaseException as e:  # let upstream retry and handle it the way it always does
                self._hooks.round_finished(RoundReport("failed", time.monotonic() - started, 1, repr(e)))
                return super()._do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, None,
                                   grad_scaler, set_to_none, timeout=timeout, **kwargs)
        super()._do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, averaging_control, grad_scaler,
                    set_to_none, timeout=timeout)
        try:
            gathered = averaging_control.result(timeout=0)
            report = RoundReport("ok", time.monotonic() - started, len(gathered))
        except TimeoutError as e:
            report = RoundReport("timeout", time.monotonic() - started, 1, repr(e))
        except BaseException as e:
            report = RoundReport("failed", time.monotonic() - started, 1, repr(e))
        self._hooks.round_finished(report)


def build_swarm_optimizer(config: AveragingConfig, replica: Replica):
    """The optimizer of config.strategy; every one offers the interface the training loop uses."""
    pace_averager_dht_traffic()  # before any averager process forks
    track_open_rounds()
    deadlines = AdaptiveDeadlines(
        matchmaking_seconds=config.seconds("matchmaking_seconds"),
        averaging_timeout_seconds=config.seconds("averaging_timeout_seconds"),
        matchmaking_bounds=(config.matchmaking_seconds_min, config.matchmaking_seconds_max),
        timeout_bounds=(config.averaging_timeout_seconds_min, config.averaging_timeout_seconds_max),
    )
    # what the averager processes fix at start: the matchmaking floor and the all-reduce timeout
    matchmaking_floor = config.seconds("matchmaking_seconds") or config.matchmaking_seconds_min
    allreduce_timeout = config.seconds("averaging_timeout_seconds") or config.averaging_timeout_seconds_max
    longest_matchmaking = config.seconds("matchmaking_seconds") or config.matchmaking_seconds_max
    # a peer that died stops counting toward the swarm's progress after this long (upstream: 60 s)
    tracker_opts = dict(metadata_expiration=max(15.0, 3 * longest_matchmaking))
    # hivemind warns (and can deadlock) when a request may outlive the matchmaking window
    averager_opts = dict(request_timeout=min(3.0, matchmaking_floor / 2))
    # upstream waits one matchmaking window for a peer's next chunk, then averages without it: a peer on a
    # busy CPU then silently keeps its own values for part of the model and drifts from the swarm (seen:
    # "received 75% of input tensors" with a 1 s window). A quarter of the round's timeout still drops a
    # stalled peer well within the round.
    next_chunk_timeout = max(matchmaking_floor, allreduce_timeout / 4)
    if config.strategy == "diloco":
        from averaging.diloco import DiLoCoOptimizer  # imported here: it imports this module

        return DiLoCoOptimizer(
            config, replica, deadlines=deadlines, tracker_opts=tracker_opts, averager_opts=averager_opts,
            matchmaking_floor=matchmaking_floor, allreduce_timeout=allreduce_timeout,
        )

    strategy_args = {}
    if config.strategy == "local-sgd":
        strategy_args = dict(use_local_updates=True, average_opt_statistics=tuple(config.average_opt_statistics))
    elif config.strategy == "powersgd":
        strategy_args = dict(grad_averager_factory=partial(PowerSGDGradientAverager, averager_rank=config.powersgd_rank))
    if config.average_opt_statistics and config.strategy != "local-sgd":
        strategy_args["average_opt_statistics"] = tuple(config.average_opt_statistics)
    return SwarmOptimizer(
        hooks=replica.hooks,
        deadlines=deadlines,
        report_state_rounds=config.strategy == "local-sgd",
        dht=replica.dht,
        run_id=replica.run_id,
        params=replica.params,
        optimizer=replica.optimizer_factory,
        scheduler=replica.scheduler_factory,
        target_batch_size=config.target_batch_size,
        batch_size_per_step=replica.batch_size,
        matchmaking_time=matchmaking_floor,
        averaging_timeout=allreduce_timeout,
        next_chunk_timeout=next_chunk_timeout,
        load_state_timeout=config.load_state_timeout_seconds,
        average_state_every=config.average_state_every,
        offload_optimizer=config.offload_optimizer,
        delay_optimizer_step=config.delay_updates,
        delay_grad_averaging=config.delay_updates,
        client_mode=replica.client_mode,
        tracker_opts=tracker_opts,
        averager_opts=averager_opts,
        verbose=False,
        **codecs_from_config(config),
        **strategy_args,
    )
