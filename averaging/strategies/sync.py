"""SyncOptimizer: hivemind.Optimizer, instrumented and hardened; the sync, local-sgd and powersgd strategies.

What it adds to hivemind's optimizer:
- the SwarmOptimizer Protocol (averaging/api.py), so the training loop never reads hivemind's
  tracker or averagers;
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
- with error feedback, the gradient averager carries its codec's loss between rounds; the residuals
  are checkpointed and dropped when state is downloaded (averaging/pipeline/error_feedback.py).

It overrides upstream methods; averaging/adapter/ fingerprints each of them.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import hivemind
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.crypto import RSAPrivateKey

from averaging.api import RoundReport, SwarmView
from averaging.deadlines import Deadlines
from averaging.pipeline import completeness
from averaging.pipeline.error_feedback import ErrorFeedback
from averaging.pipeline.guards import all_finite
from averaging.pipeline.round_pipeline import including
from averaging.strategies.rounds import RoundKeeper, set_matchmaking_window
from averaging.strategies.state import ReportingStateAverager
from averaging.swarm import progress
from averaging.swarm.donor import DonorView, declare_apart, declare_whole, donor_view, offer_state
from dht.keys import SwarmKeys

logger = logging.getLogger(__name__)


class SyncOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer with round reports, phase timing, guards and bounded state download."""

    def __init__(
        self,
        *,
        keys: SwarmKeys,
        rounds: RoundKeeper,
        signing_key: RSAPrivateKey,
        report_state_rounds: bool = False,
        error_feedback: Optional[ErrorFeedback] = None,
        **kwargs,
    ):
        self.keys, self.rounds, self.signing_key = keys, rounds, signing_key
        self.error_feedback = error_feedback  # before super().__init__, which builds the gradient averager
        self.report_state_rounds = report_state_rounds
        requested_client_mode = kwargs.get("client_mode")
        super().__init__(run_id=keys.namespace, **kwargs)
        if requested_client_mode is not None and self.client_mode != requested_client_mode:
            raise ValueError(
                f"client_mode={requested_client_mode} conflicts with the DHT's client_mode={self.client_mode}; "
                f"start the DHT with the same client mode"
            )
        progress.believe_plausible_claims(self.tracker, signing_key, self.matchmaking_time,
                                          excluded=self.rounds.excluded_peer_ids)
        if rounds.deadlines.auto:
            self._apply_deadlines(rounds.deadlines.current)

    # --- the SwarmOptimizer Protocol, beyond what hivemind.Optimizer already offers --------------

    @property
    def scheduler(self):
        return self.state_averager.scheduler

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self.matchmaking_time, self.averaging_timeout)

    @property
    def apart(self) -> bool:
        return self.rounds.apart

    @property
    def downloaded_at_epoch(self) -> Optional[int]:
        return self.rounds.downloaded_at_epoch

    def swarm_view(self, refresh_timeout_seconds: Optional[float] = None) -> SwarmView:
        return progress.swarm_view(self.tracker, refresh_timeout_seconds)

    def announce(self) -> None:
        progress.announce(self.tracker, self.signing_key)

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

    def offer_final_state(self) -> bool:
        self.wait_for_background_updates()
        return offer_state((self.state_averager, self.grad_averager), self.local_epoch)

    def wait_for_background_updates(self) -> None:
        """Apply any in-flight background averaging, so local parameters are final (before a checkpoint)."""
        self.state_averager.step(wait_for_delayed_updates=True)

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        """Upstream's goodbye, then a bounded wait for each averager process (terminated if it hangs)."""
        super().shutdown()
        for averager in (self.state_averager, self.grad_averager):
            if averager is not None and averager.is_alive():
                averager.join(timeout_seconds)
                if averager.is_alive():
                    averager.terminate()
        self.rounds.close()

    # --- overrides of upstream methods ---------------------------------------------------------

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        report = self.rounds.hooks.round_finished if self.report_state_rounds else self._state_round_finished
        return ReportingStateAverager(
            report=report,
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

    def _make_gradient_averager(self, factory, **kwargs):
        with including(self.error_feedback):
            return super()._make_gradient_averager(factory, **kwargs)

    def _update_global_epoch(self, grad_scaler) -> None:
        super()._update_global_epoch(grad_scaler)  # which declares this peer's new epoch as its donor priority
        if self.use_gradient_averaging:  # with local updates (local-sgd), peers reach an epoch at their own pace
            self.rounds.entered_epoch()
        if self.rounds.apart:
            declare_apart((self.state_averager, self.grad_averager), self.local_epoch)
        retuned = self.rounds.retune(self.swarm_view())
        if retuned is not None:
            self._apply_deadlines(retuned)

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler) -> bool:
        """Upstream, but a batch with non-finite gradients is dropped: it never reaches the swarm."""
        if self.rounds.hooks.guards_gradients() and not all_finite(
                param.grad for param in self.state_averager.main_parameters):
            logger.warning("non-finite gradients in this batch: dropped, not accumulated or sent to peers")
            return False
        return super()._check_and_accumulate_gradients(batch_size, grad_scaler)

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        began = super()._begin_averaging_gradients(grad_scaler)
        if not began:  # alone in the swarm (or a pre-scheduled round was lost): this epoch uses local gradients
            self.rounds.hooks.round_finished(RoundReport("skipped", 0.0, 1, "no other peers"))
        return began

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        """Upstream logic, plus an outcome report for every round."""
        started = time.monotonic()
        with self.rounds.phase("averaging"):
            if maybe_step_control is None:
                report = RoundReport("skipped", 0.0, 1, "no other peers")
            else:
                try:
                    self.rounds.hooks.before_round(self.local_epoch)
                    group_info = maybe_step_control.result(self.averaging_timeout)
                    with self.grad_averager.get_tensors() as averaged:
                        finite = all_finite(averaged)
                    if finite:  # a partial average is still nearer the swarm's than this peer's own gradients
                        self._load_averaged_gradients_into_optimizer_()
                        report = completeness.round_report(self.grad_averager, time.monotonic() - started,
                                                           len(group_info))
                    else:  # a peer sent NaN/Inf: never apply it
                        report = RoundReport("failed", time.monotonic() - started, len(group_info),
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
                self._load_local_gradients_into_optimizer()
        # if others averaged without us, take their state instead of drifting apart
        self.rounds.finish_round(report, others_present=self.tracker.global_progress.num_peers > 1)

    def _state_round_finished(self, report: RoundReport) -> None:
        """A parameter-averaging round that undoes drift; a peer left out of one is apart from its group."""
        self.rounds.note_apart(report, others_present=self.tracker.global_progress.num_peers > 1)

    def _should_load_state_from_peers(self) -> bool:
        if not self.rounds.download_allowed():
            return False
        return (self.rounds.take_resync(self._donors, self._become_reference)
                or self.rounds.behind_after_settling(self.local_epoch, self.swarm_view)
                or super()._should_load_state_from_peers())

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

    def load_state_from_donor_ahead(self) -> bool:
        return self._donors().ahead and self.load_state_from_peers()

    def _donors(self) -> DonorView:
        return donor_view(self.state_averager, self.local_epoch, self.rounds.excluded_peer_ids())

    def _become_reference(self) -> None:
        declare_whole((self.state_averager, self.grad_averager), self.local_epoch)

    def _load_state_from_peers_bounded(self, **kwargs) -> bool:
        # upstream's load_state_from_peers, with the download loop bounded
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
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
        self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
        if self.grad_averager is not None:
            self.grad_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)
