"""SyncOptimizer: hivemind.Optimizer, instrumented and hardened; the sync, local-sgd and powersgd strategies.

build_sync, build_local_sgd and build_powersgd are their builders (averaging/registry.py names them):
the same optimizer, configured three ways.

What it adds to hivemind's optimizer:
- the Protocols of averaging/api.py (SwarmOptimizer), so the training loop and the swarm session never
  read hivemind's tracker or averagers (what it shares with DiLoCo: averaging/strategies/membership.py);
- every averaging round reports an outcome (ok, partial, failed, timeout, skipped), its duration and
  group size, and its blocking time is timed as the `averaging` phase; downloading state is timed as
  `state_sync` (averaging/strategies/rounds.py);
- after a round that left this peer apart from the others (partial, failed, timed out), it downloads
  the state of a peer whose round was whole (averaging/strategies/rounds.py, averaging/swarm/donor.py);
- a batch with non-finite gradients never reaches the swarm, and an averaged result holding
  NaN/Inf is never applied;
- `load_state_from_peers` gives up after a bounded number of attempts instead of retrying forever;
- an explicit `client_mode` is honoured (upstream replaces it with the DHT's value);
- with 'auto' deadlines, they are chosen again after every epoch and applied where hivemind reads them;
- with local-sgd, the parameter-averaging rounds are reported too (they are its only rounds); with sync
  and powersgd, one that left this peer out of its group leaves it apart, as a gradient round would;
- with local-sgd and --target-group-size, its parameter rounds average groups of about that many peers,
  dealt anew every round (averaging/swarm/groups.py): peers whose rounds were whole may still differ, so
  they settle on one final state when they leave (peer/runtime/session.py);
- with error feedback, the gradient averager carries its codec's loss between rounds; the residuals
  are checkpointed and dropped when state is downloaded (averaging/pipeline/error_feedback.py).

It changes the private steps of hivemind's Optimizer only through the hooks of averaging/adapter/optimizer.py;
its public methods (load_state_from_peers, state_dict, shutdown) extend upstream's, fingerprinted there too.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import Optional, Tuple

from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.crypto import RSAPrivateKey

from averaging.adapter.fresh_optimizer import with_fresh_state
from averaging.adapter.optimizer import HookedOptimizer
from averaging.adapter.state_averager import ReportingStateAverager
from averaging.api import Replica, RoundReport
from averaging.codecs.compression import codecs_from_config
from averaging.config import AveragingConfig
from averaging.deadlines import Deadlines
from averaging.pipeline import completeness
from averaging.pipeline.guards import all_finite
from averaging.strategies.agreement import StateAgreement
from averaging.strategies.membership import SharesState, join_or_terminate
from averaging.strategies.parts import StrategyParts, next_chunk_timeout
from averaging.strategies.rounds import RoundKeeper, set_matchmaking_window
from averaging.swarm import progress
from averaging.swarm.groups import DealtGroup, RecentPeers, round_group
from dht.keys import SwarmKeys

logger = logging.getLogger(__name__)


class SyncOptimizer(SharesState, HookedOptimizer):
    """hivemind.Optimizer with round reports, phase timing, guards and bounded state download."""

    def __init__(
        self,
        *,
        keys: SwarmKeys,
        rounds: RoundKeeper,
        signing_key: RSAPrivateKey,
        report_state_rounds: bool = False,
        group_size: Optional[int] = None,
        agreement: Optional[StateAgreement] = None,
        **kwargs,
    ):
        self.keys, self.rounds, self.signing_key = keys, rounds, signing_key
        self.report_state_rounds, self.group_size = report_state_rounds, group_size
        requested_client_mode = kwargs.get("client_mode")
        super().__init__(run_id=keys.namespace, **kwargs)
        if requested_client_mode is not None and self.client_mode != requested_client_mode:
            raise ValueError(
                f"client_mode={requested_client_mode} conflicts with the DHT's client_mode={self.client_mode}; "
                f"start the DHT with the same client mode"
            )
        progress.believe_plausible_claims(self.tracker, signing_key, self.matchmaking_time,
                                          excluded=self.rounds.excluded_peer_ids,
                                          evidence=self.weight_bound.evidence if self.weight_bound else None)
        if rounds.deadlines.auto:
            self._apply_deadlines(rounds.deadlines.current)
        if self.averages_in_groups:
            self.tracker.members = RecentPeers()  # filled by its reads (averaging/adapter/progress_filter.py)
        self._start_agreement(agreement, slice(None))  # everything it serves: parameters and optimizer state
        # local-sgd's parameter rounds land in the background, while the peer trains on in the epoch they lead to
        self.averages_after_epoch = self.use_local_updates and self.delay_state_averaging

    # --- the Protocols, beyond what hivemind.Optimizer and SharesState already offer ---------------

    @property
    def averages_in_groups(self) -> bool:
        return self.group_size is not None

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self.matchmaking_time, self.averaging_timeout)

    @property
    def donor_averagers(self) -> Tuple:
        return self.state_averager, self.grad_averager

    def load_state_from_peers(self, **kwargs) -> bool:
        """Upstream's, with a bounded number of attempts instead of `while True`; True if state was loaded."""
        with self.rounds.phase("state_sync"):
            loaded = self._load_state_from_peers_bounded(**kwargs)
            if loaded:
                progress.served(self.tracker, self.local_epoch)
        self.rounds.report_download(loaded, self.local_epoch)
        return loaded

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.error_feedback is not None:
            state["error_feedback"] = self.error_feedback.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        residuals = state_dict.pop("error_feedback", None)
        super().load_state_dict(state_dict)
        if self.error_feedback is not None:
            self.error_feedback.load_state_dict(residuals)

    def wait_for_background_updates(self) -> None:
        """Apply any in-flight background averaging, so local parameters are final (before a checkpoint)."""
        self.state_averager.step(wait_for_delayed_updates=True)

    @property
    def task_optimizer(self):
        return self.state_averager.optimizer

    def pause(self) -> None:
        self.drop_scheduled_rounds()
        self.wait_for_background_updates()
        with self.tracker.pause_updates():
            if self.use_gradient_averaging:
                self.grad_averager.reset_accumulated_grads_()
            progress.stand_idle(self.tracker, self.local_epoch)

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        """Upstream's goodbye, then a bounded wait for each averager process (terminated if it hangs)."""
        self._close_agreement()
        super().shutdown()
        join_or_terminate((self.state_averager, self.grad_averager), timeout_seconds)
        self.rounds.close()

    # --- the hooks of HookedOptimizer ------------------------------------------------------------

    def make_state_averager(self, **kwargs) -> TrainingStateAverager:
        report = self.rounds.report if self.report_state_rounds else self._state_round_finished
        return ReportingStateAverager(
            report=report,
            group_for=self._round_group if self.averages_in_groups else None,
            serve=self.rounds.hooks.serve_state,
            dht=self.dht,
            prefix=self.keys.state_averager,
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

    def _round_group(self, epoch: int) -> DealtGroup:
        """This peer's group in the round that leads to `epoch`, among the training peers its tracker has read: their
        epochs are not asked, since a record may lag its peer's epoch by a refresh (a peer far behind downloads)."""
        return round_group(epoch, self.tracker.members.current(), self.dht.peer_id.to_bytes(), self.group_size)

    def entered_global_epoch(self) -> None:
        if self.use_gradient_averaging:  # with local updates (local-sgd), peers reach an epoch at their own pace
            self.rounds.entered_epoch()
        self._record_state()
        self._after_round()

    def accepts_batch(self) -> bool:
        """A batch with non-finite gradients is dropped: it never reaches the swarm."""
        if self.rounds.hooks.guards_gradients() and not all_finite(
                param.grad for param in self.state_averager.main_parameters):
            logger.warning("non-finite gradients in this batch: dropped, not accumulated or sent to peers")
            return False
        return True

    def round_skipped(self) -> None:  # alone in the swarm (or a pre-scheduled round was lost): local gradients
        self.rounds.hooks.round_finished(RoundReport("skipped", 0.0, 1, "no other peers"))

    def average_gradients(self, maybe_step_control, use_averaged, use_local) -> None:
        """Upstream logic, plus an outcome report for every round."""
        started = time.monotonic()
        with self.rounds.phase("averaging"):
            if maybe_step_control is None:
                report = RoundReport("skipped", 0.0, 1, "no other peers")
            else:
                try:
                    self.rounds.hooks.before_round(self.local_epoch)
                    gathered = maybe_step_control.result(self.averaging_timeout)  # by the group's peer ids
                    with self.grad_averager.get_tensors() as averaged:
                        finite = all_finite(averaged)
                    if finite:  # a partial average is still nearer the swarm's than this peer's own gradients
                        use_averaged()
                        report = completeness.round_report(self.grad_averager, time.monotonic() - started,
                                                           len(gathered), tuple(peer.to_base58() for peer in gathered))
                    else:  # a peer sent NaN/Inf: never apply it
                        report = RoundReport("failed", time.monotonic() - started, len(gathered),
                                             "the averaged gradients hold NaN or Inf")
                except TimeoutError as e:
                    report = RoundReport("timeout", time.monotonic() - started, 1, repr(e))
                except BaseException as e:  # hivemind raises many kinds; any of them means "use local grads"
                    report = RoundReport("failed", time.monotonic() - started, 1, repr(e))
            if report.outcome == "partial":
                logger.warning(f"averaging round partial ({report.reason})")
            elif report.outcome != "ok":
                if report.outcome != "skipped":
                    logger.warning(f"averaging round {report.outcome} ({report.reason}); using local gradients")
                use_local()
        # if others averaged without us, take their state instead of drifting apart
        self.rounds.finish_round(report, others_present=self._others_present(), swarm_peers=self._round_should_gather())

    def _state_round_finished(self, report: RoundReport) -> None:
        """A parameter-averaging round that undoes drift; a peer left out of one is apart from its group."""
        self.rounds.observe_timing(report)
        self.rounds.note_apart(report, others_present=self._others_present())

    def should_download_state(self, upstream_says) -> bool:
        if not self.rounds.download_allowed():
            return False
        return self._resync_due() or upstream_says()

    # --- helpers -------------------------------------------------------------------------------

    def _apply_deadlines(self, deadlines: Deadlines) -> None:
        """Put the deadlines where hivemind reads them on every round.

        Optimizer.matchmaking_time decides when a round is pre-scheduled; averaging_timeout bounds
        each round (and the state-averaging rounds); each averager's matchmaking_kwargs sets the
        default start time of a round it schedules. The averager processes' own floor
        (min_matchmaking_time) and all-reduce timeout were fixed at start to the lower and upper bounds.
        """
        self.matchmaking_time = deadlines.matchmaking_seconds
        self.averaging_timeout = deadlines.averaging_timeout_seconds
        set_matchmaking_window((self.state_averager, self.grad_averager), deadlines.matchmaking_seconds)

    def _load_state_from_peers_bounded(self, **kwargs) -> bool:
        # upstream's load_state_from_peers, with the download loop bounded
        self.drop_scheduled_gradients()
        self.state_averager.step(wait_for_delayed_updates=True)

        with self.tracker.pause_updates():
            loaded = self.rounds.download_state(lambda: self._download_state(**kwargs))
            if loaded and self.error_feedback is not None:
                self.error_feedback.reset()  # what this peer's old state lost is no part of the new one
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
        self._before_download_attempt()
        self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
        if self.grad_averager is not None:
            self.grad_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)


def build_sync(config: AveragingConfig, replica: Replica, parts: StrategyParts, **strategy_args) -> SyncOptimizer:
    """sync: gradients averaged every epoch, the same update everywhere (`strategy_args`: for the variants below)."""
    signing_key = progress.signing_key(parts.tracker_opts)
    return SyncOptimizer(
        keys=replica.keys,
        rounds=parts.rounds,
        signing_key=signing_key,
        error_feedback=parts.error_feedback,
        weight_bound=parts.weight_bound,  # local-sgd has no gradient averager: its rounds weigh each peer 1
        agreement=parts.agreement,
        dht=replica.dht,
        params=replica.params,
        optimizer=with_fresh_state(replica.optimizer_factory),
        scheduler=replica.scheduler_factory,
        target_batch_size=config.target_batch_size,
        batch_size_per_step=replica.batch_size,
        matchmaking_time=parts.matchmaking_floor,
        averaging_timeout=parts.allreduce_timeout,
        next_chunk_timeout=next_chunk_timeout(parts.matchmaking_floor, parts.allreduce_timeout),
        load_state_timeout=config.load_state_timeout_seconds,
        average_state_every=config.average_state_every,
        average_opt_statistics=tuple(config.average_opt_statistics),
        offload_optimizer=config.offload_optimizer,
        delay_optimizer_step=config.delay_updates,
        delay_grad_averaging=config.delay_updates,
        # upstream lands a parameter round a few steps into the next epoch, changing the state a peer has already
        # digested and is serving; checked peers finish it within the epoch's step (averaging/swarm/digests.py)
        delay_state_averaging=not config.checks_state,
        client_mode=replica.client_mode,
        tracker_opts=dict(parts.tracker_opts, private_key=signing_key),
        averager_opts=parts.averager_opts,
        verbose=False,
        **codecs_from_config(config),
        **strategy_args,
    )


def build_local_sgd(config: AveragingConfig, replica: Replica, parts: StrategyParts) -> SyncOptimizer:
    """local-sgd: local steps, and parameters averaged every --average-state-every epochs (its only rounds), by the
    whole swarm or in groups of about --target-group-size peers."""
    return build_sync(config, replica, parts, use_local_updates=True, report_state_rounds=True,
                      group_size=config.target_group_size)


def build_powersgd(config: AveragingConfig, replica: Replica, parts: StrategyParts) -> SyncOptimizer:
    """powersgd: gradients averaged as low-rank factors."""
    powersgd = partial(PowerSGDGradientAverager, averager_rank=config.powersgd_rank)
    return build_sync(config, replica, parts, grad_averager_factory=powersgd)
