"""DiLoCo on hivemind: local inner steps, then an outer Nesterov step on the averaged pseudo-gradient.

One outer round is one global epoch. Between rounds every peer runs the task's own optimizer
(the inner optimizer, AdamW for the built-in task) on its own replica. A round begins when the
swarm has accumulated --target-batch-size samples, counted by hivemind's ProgressTracker exactly
as for the other strategies, so epochs, LR schedules, --max-epochs and catching up mean the same
thing everywhere. Then each peer:
1. computes its pseudo-gradient  delta = round-start params - current params  (in host memory);
2. averages it with its group (a hivemind DecentralizedAverager, weighted by the samples each peer
   stepped on; --grad-compression applies); alone, or if the round fails, it uses its own delta;
3. applies the outer optimizer to the round-start params: SGD with Nesterov momentum,
   v = mu*v + delta; params -= lr*(delta + mu*v)  (torch.optim.SGD(nesterov=True) semantics);
4. copies the result into the model, which is the next round's start.

With --diloco-overlap, step 2 runs in the background: the peer launches the all-reduce of round
t's pseudo-gradient and goes on with round t+1's inner steps from where it is. When the average
lands (checked before every batch; at the latest at the end of round t+1, or after the averaging
timeout), steps 3 and 4 happen one round late: the outer step moves the round-start params, and
the model moves by as much as it would have, keeping the progress it made meanwhile
(model += new start - old start + delta_t). Every peer of the round applies the same update, so
peers stay equal up to their own progress since the launch, as without overlap. A peer that
is asked for its state while a round is in flight serves it once the round has landed (a newcomer
would otherwise get a start that lacks that round), and landing it is what
wait_for_background_updates waits for (before a checkpoint, and on leaving). Its rounds run once the
epoch they lead to has begun (`averages_after_epoch`): a peer that launched a round is at its epoch
while the round still looks for its group.

H (--diloco-inner-steps) is a per-peer upper bound, not the round length: the round length
comes from the target batch (each peer takes about target / (peers x batch) inner steps). A
peer that reaches H inner steps before the swarm reaches the target keeps counting its samples
toward the target (so the swarm can never stall on it) but no longer updates its replica.

The swarm's round factor k (averaging/strategies/round_length.py; upload budgets ask for it) makes a round k target
batches long: the tracker's target is k x --target-batch-size, H counts per target batch, and a round's weight is
its samples / k, so that the reducers' weight bounds, made for one target batch, hold at any k (the credit they
observe of others is scaled back to samples: RoundKeeper.samples_per_weight).

State lives in a hivemind TrainingStateAverager that owns the inner optimizer and the LR
scheduler and carries the round-start params and the outer momentum as extra tensors, so
load_state_from_peers brings params + outer momentum + inner optimizer state + epoch. A peer
whose round was partial or failed while others exist downloads the state of a peer whose round
was whole (averaging/strategies/rounds.py), so one lost round does not leave it apart for good.

The outer round itself (the all-reduce, in the foreground or in flight, and the outer step) is
averaging/strategies/outer.py; what DiLoCo does alike with the sync strategies is
averaging/strategies/membership.py. It implements the Protocols of averaging/api.py on hivemind's
public pieces (DecentralizedAverager, ProgressTracker) and the guarded state averager
(averaging/adapter/state_averager.py); build_diloco is its builder (averaging/registry.py names it).
This module must not know about metrics or the CLI; it reports through AveragingHooks.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import List, Optional, Tuple

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.progress_tracker import ProgressTracker

from averaging.adapter.fresh_optimizer import with_fresh_state
from averaging.adapter.state_averager import GuardedStateAverager
from averaging.api import Replica, RoundReport
from averaging.codecs.compression import configured_codec, round_payload_bytes
from averaging.config import AveragingConfig
from averaging.deadlines import AdaptiveDeadlines, Deadlines
from averaging.pipeline.error_feedback import ErrorFeedback
from averaging.pipeline.robust import WeightBound
from averaging.pipeline.round_pipeline import including
from averaging.strategies.agreement import StateAgreement
from averaging.strategies.membership import SharesState, join_or_terminate, step_scheduler_to
from averaging.strategies.outer import OuterRound, collect_round, launch_round, outer_nesterov_step_
from averaging.strategies.parts import StrategyParts, next_chunk_timeout
from averaging.strategies.round_length import RoundLengthKeeper
from averaging.strategies.rounds import RoundKeeper, set_matchmaking_window
from averaging.swarm import progress

logger = logging.getLogger(__name__)


class DiLoCoOptimizer(SharesState):
    """The Protocols of averaging/api.py for DiLoCo."""

    def __init__(
        self,
        config: AveragingConfig,
        replica: Replica,
        *,
        rounds: Optional[RoundKeeper] = None,
        tracker_opts: Optional[dict] = None,
        averager_opts: Optional[dict] = None,
        matchmaking_floor: float = 5.0,
        allreduce_timeout: float = 60.0,
        error_feedback: Optional[ErrorFeedback] = None,
        weight_bound: Optional[WeightBound] = None,
        agreement: Optional[StateAgreement] = None,
    ):
        dht, keys = replica.dht, replica.keys
        self.error_feedback = error_feedback
        self.config, self.dht = config, dht
        self.rounds = rounds or RoundKeeper(replica.hooks, AdaptiveDeadlines(
            matchmaking_seconds=matchmaking_floor, averaging_timeout_seconds=allreduce_timeout))
        self.client_mode = dht.client_mode if replica.client_mode is None else replica.client_mode
        self.batch_size, self.target_batch_size = replica.batch_size, config.target_batch_size
        self.load_state_timeout = config.load_state_timeout_seconds
        tracker_opts = dict(tracker_opts or {})
        self.signing_key = progress.signing_key(tracker_opts)
        self.main_parameters: List[torch.Tensor] = list(replica.params)
        averager_opts = dict(averager_opts or {})

        # the outer state lives in host memory, in fp32, whatever the model's device and dtype
        self.global_params = [p.detach().to("cpu", torch.float32, copy=True) for p in self.main_parameters]
        self.outer_momentum = [torch.zeros_like(p) for p in self.global_params]

        self.tracker = ProgressTracker(
            dht=dht, prefix=keys.namespace, target_batch_size=config.target_batch_size, client_mode=self.client_mode,
            start=True, **dict(tracker_opts, private_key=self.signing_key),
        )
        progress.believe_plausible_claims(self.tracker, self.signing_key, matchmaking_floor,
                                          excluded=self.rounds.excluded_peer_ids,
                                          evidence=weight_bound.evidence if weight_bound else None)
        # what a round uploads, for the budget's arithmetic (a codec pass over the model: only with a budget)
        payload = round_payload_bytes(config, self.main_parameters) if config.max_upload_mbit is not None else 0
        self.round_length = RoundLengthKeeper(config, dht, keys.round_factors, self.rounds.hooks, payload,
                                              excluded=self.rounds.excluded_peers,
                                              ttl_seconds=self.tracker.metadata_expiration,
                                              subkey=progress.owner(self.signing_key))
        download_chunk_timeout = next_chunk_timeout(matchmaking_floor, allreduce_timeout)
        self.state_averager = GuardedStateAverager(
            serve=self.rounds.hooks.serve_state,
            landing_wait_seconds=download_chunk_timeout / 2,  # a downloader waits that long for the first part
            next_chunk_timeout=download_chunk_timeout,
            dht=dht,
            prefix=keys.diloco_state,
            optimizer=with_fresh_state(replica.optimizer_factory),
            params=self.main_parameters,
            scheduler=replica.scheduler_factory,
            extra_tensors=self.global_params + self.outer_momentum,
            min_matchmaking_time=matchmaking_floor,
            allreduce_timeout=allreduce_timeout,
            client_mode=self.client_mode,
            compression=configured_codec(config, config.state_compression),
            state_compression=configured_codec(config, config.load_state_compression),
            start=True,
            **averager_opts,
        )
        # its weights are the samples each peer stepped on (_launch): the weight bound goes with it (the state
        # averager only serves state, it never averages)
        with including(error_feedback), including(weight_bound):
            self.grad_averager = DecentralizedAverager(
                averaged_tensors=[torch.zeros_like(p) for p in self.global_params],
                dht=dht,
                prefix=keys.diloco_outer,
                min_matchmaking_time=matchmaking_floor,
                allreduce_timeout=allreduce_timeout,
                compression=configured_codec(config, config.grad_compression),
                client_mode=self.client_mode,
                allow_state_sharing=False,  # it holds no state: everything a newcomer needs is in state_averager
                start=True,
                **averager_opts,
            )
        self._apply_deadlines(self.rounds.deadlines.current)
        self._inner_steps = self._samples = self._samples_stepped = 0
        self._check_sync_on_next_step = True
        self._flight: Optional[OuterRound] = None  # --diloco-overlap: the round whose average has not landed yet
        # peers agree on the outer state (round-start parameters and outer momentum), served after the parameters
        count = len(self.main_parameters)
        self._start_agreement(agreement, slice(count, 3 * count))
        self.round_length.start()
        with self.tracker.pause_updates():
            self.round_length.enter(self.local_epoch, self.tracker, trained=False)

    # --- the Protocols, beyond what SharesState already offers ------------------------------

    @property
    def local_epoch(self) -> int:
        return self.state_averager.local_epoch

    @property
    def deadlines(self) -> Deadlines:
        return self._deadlines

    @property
    def averages_after_epoch(self) -> bool:
        return self.config.diloco_overlap

    @property
    def donor_averagers(self) -> Tuple:
        return (self.state_averager,)  # the outer averager holds no state

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        return self.state_averager.optimizer

    def step(self, batch_size: Optional[int] = None) -> None:
        """One local batch: maybe an inner step; when the swarm reached the target batch, an outer round."""
        batch_size = batch_size if batch_size is not None else self.batch_size
        if self._flight is not None and self._flight.landed():
            self._land()
        if self._should_load_state_from_peers():
            self.load_state_from_peers()
            return  # these gradients were computed on parameters that were just replaced
        self.round_length.stepping()
        inner_steps = self.config.diloco_inner_steps * self.round_length.factor
        if self._inner_steps < inner_steps:
            self.inner_optimizer.step()
            self._inner_steps += 1
            self._samples_stepped += batch_size
        elif self._inner_steps == inner_steps:
            self._inner_steps += 1  # log once per round
            logger.info(f"reached {inner_steps} inner steps (--diloco-inner-steps x the round factor) before the "
                        f"swarm reached the round's target batch; counting samples only until the round starts")
        self._samples += batch_size
        self.tracker.report_local_progress(self.local_epoch, self._samples)
        if self.tracker.ready_to_update_epoch:
            self._outer_round()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.main_parameters:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def load_state_from_peers(self, **kwargs) -> bool:
        """Download round-start params, outer momentum, inner optimizer state and epoch; bounded attempts."""
        self._abandon_flight()  # the state that comes replaces what it would have updated
        with self.rounds.phase("state_sync"), self.tracker.pause_updates():
            loaded = self.rounds.download_state(lambda: self._download_state(**kwargs))
            if loaded and self.error_feedback is not None:
                self.error_feedback.reset()  # what this peer's old state lost is no part of the new one
            # the sender's model was somewhere inside its round; the swarm agrees on the round start
            self._load_round_start_into_model()
            if self.tracker.global_epoch - 1 <= self.local_epoch < self.tracker.global_epoch:
                self.state_averager.local_epoch = self.tracker.global_epoch
                step_scheduler_to(self.scheduler, self.local_epoch)
            self._start_next_round(trained=False)
        if loaded:
            progress.served(self.tracker, self.local_epoch)
        self.rounds.report_download(loaded, self.local_epoch)
        return loaded

    def _download_state(self, **kwargs) -> None:
        self._before_download_attempt()
        self.state_averager.load_state_from_peers(timeout=self.load_state_timeout, **kwargs)

    def state_dict(self) -> dict:
        state = self.inner_optimizer.state_dict()
        state["state"]["local_epoch"] = self.local_epoch
        state["diloco"] = {
            "global_params": [t.clone() for t in self.global_params],
            "outer_momentum": [t.clone() for t in self.outer_momentum],
        }
        if self.error_feedback is not None:
            state["diloco"]["error_feedback"] = self.error_feedback.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        outer = state_dict.pop("diloco", None)
        inner_state = dict(state_dict["state"])
        if "local_epoch" in inner_state:
            self.state_averager.local_epoch = inner_state.pop("local_epoch")
        self.inner_optimizer.load_state_dict(dict(state_dict, state=inner_state))
        with torch.no_grad(), self.state_averager.lock_averaged_tensors:
            if outer is None:  # a checkpoint from another strategy: start a fresh outer state from the model
                self._reset_round_start(lock=False)
                for velocity in self.outer_momentum:
                    velocity.zero_()
            else:
                for mine, saved in zip(self.global_params + self.outer_momentum,
                                       outer["global_params"] + outer["outer_momentum"]):
                    mine.copy_(saved)
        if self.error_feedback is not None:
            self.error_feedback.load_state_dict((outer or {}).get("error_feedback"))
        with self.tracker.pause_updates():
            self.round_length.enter(self.local_epoch, self.tracker, trained=False)
        self.tracker.report_local_progress(self.local_epoch, 0)

    def wait_for_background_updates(self) -> None:
        """Land the round in flight (--diloco-overlap), within its averaging timeout; without overlap, nothing
        runs in the background between rounds."""
        if self._flight is not None:
            with self.rounds.phase("averaging"):
                self._land()

    @property
    def task_optimizer(self) -> torch.optim.Optimizer:
        return self.inner_optimizer

    def pause(self) -> None:
        """The inner steps of this round are dropped with the samples they counted: the round's start is the
        state this peer holds while paused, and its next round's weight is the samples it steps after resuming."""
        self.wait_for_background_updates()
        with self.tracker.pause_updates():
            self._load_round_start_into_model()
            self._inner_steps = self._samples = self._samples_stepped = 0
            self.round_length.paused()
            progress.stand_idle(self.tracker, self.local_epoch)

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        self._close_agreement()
        self._abandon_flight()
        self.tracker.shutdown(min(5.0, timeout_seconds))
        for averager in (self.state_averager, self.grad_averager):
            if averager.is_alive():
                averager.shutdown()
        join_or_terminate((self.state_averager, self.grad_averager), timeout_seconds)
        self.round_length.close()
        self.rounds.close()

    # --- one outer round -----------------------------------------------------------------------

    def _outer_round(self) -> None:
        report = None
        self.round_length.round_begins()
        with self.tracker.pause_updates():
            if self._flight is not None:  # the previous round must land before this one is measured from it
                with self.rounds.phase("averaging"):
                    self._land()
            with torch.no_grad():
                pseudo_grads = [g - p.detach().to("cpu", torch.float32)
                                for g, p in zip(self.global_params, self.main_parameters)]
            if self.config.diloco_overlap:
                self._flight = self._launch(pseudo_grads)  # lands during the next round
            else:
                with self.rounds.phase("averaging"):
                    report, averaged = self._collect(self._launch(pseudo_grads))
            with self.state_averager.serving_lock:  # what it serves is the old state or the new one, whole
                if report is not None:
                    with torch.no_grad(), self.state_averager.lock_averaged_tensors:
                        outer_nesterov_step_(self.global_params, self.outer_momentum, averaged,
                                             self.config.outer_lr, self.config.outer_momentum)
                    self._load_round_start_into_model()
                if self._flight is not None:  # the new epoch's state is whole once the round lands
                    self.state_averager.state_in_flight()
                self.state_averager.local_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
                step_scheduler_to(self.scheduler, self.local_epoch)
                self._start_next_round(trained=True)
        if report is not None:
            self._round_finished(report)

    def _round_finished(self, report: RoundReport) -> None:
        # the outer state of this epoch is final; others may have averaged without us: then take their state
        self._record_state()
        self.rounds.finish_round(report, others_present=self._others_present(), swarm_peers=self._round_should_gather())
        self._after_round()

    def _land(self) -> None:
        """Apply the round in flight: the outer step, and the same move to the model, which keeps the progress
        it made since the launch."""
        flight, self._flight = self._flight, None
        report, averaged = self._collect(flight)
        with self.state_averager.serving_lock, torch.no_grad(), self.state_averager.lock_averaged_tensors:
            before = [start.clone() for start in self.global_params]
            outer_nesterov_step_(self.global_params, self.outer_momentum, averaged, self.config.outer_lr,
                                 self.config.outer_momentum)
            for param, start, old_start, delta in zip(self.main_parameters, self.global_params, before,
                                                      flight.pseudo_grads):
                param.add_((start - old_start + delta).to(device=param.device, dtype=param.dtype))
            self.state_averager.state_landed()
        self._round_finished(report)

    def _abandon_flight(self) -> None:
        flight, self._flight = self._flight, None
        if flight is not None:
            flight.cancel()
            self.state_averager.state_landed()

    def _launch(self, pseudo_grads: List[torch.Tensor]) -> OuterRound:
        # weighted like the sync strategy's gradients: by the samples this peer took inner steps on, per target batch
        weight = float(max(1, self._samples_stepped)) / self.round_length.factor
        self.rounds.samples_per_weight = float(self.round_length.factor)  # what the reducers credit others with
        return launch_round(self.grad_averager, pseudo_grads, epoch=self.local_epoch + 1, weight=weight,
                            timeout_seconds=self._deadlines.averaging_timeout_seconds, alone=not self._others_present(),
                            before_round=lambda: self.rounds.hooks.before_round(self.local_epoch))

    def _collect(self, flight: OuterRound) -> Tuple[RoundReport, List[torch.Tensor]]:
        report, averaged = collect_round(self.grad_averager, flight)
        self.round_length.round_measured(report)
        return report, averaged

    # --- helpers -------------------------------------------------------------------------------

    def _should_load_state_from_peers(self) -> bool:
        """Upstream hivemind.Optimizer's rule, plus a resync after a round that left this peer apart."""
        if not self.rounds.download_allowed():
            return False
        if self._resync_due():
            return True
        if self._check_sync_on_next_step and self.tracker.fetched_global_progress_this_epoch.is_set():
            self._check_sync_on_next_step = False
            return self.local_epoch != self.tracker.global_epoch
        return self.local_epoch < self.tracker.global_epoch - 1

    def _start_next_round(self, trained: bool) -> None:
        """Reset the round's counters, take the epoch's round factor and tell the swarm (caller holds
        tracker.pause_updates()); `trained`: through this peer's own round."""
        self._inner_steps = self._samples = self._samples_stepped = 0
        self.round_length.enter(self.local_epoch, self.tracker, trained)
        self.tracker.update_epoch(new_epoch=self.local_epoch)
        self._check_sync_on_next_step = True
        self.rounds.entered_epoch()
        if not self.client_mode:
            self.state_averager.state_sharing_priority = self.local_epoch

    @torch.no_grad()
    def _load_round_start_into_model(self) -> None:
        for param, start in zip(self.main_parameters, self.global_params):
            param.copy_(start.to(device=param.device, dtype=param.dtype))

    @torch.no_grad()
    def _reset_round_start(self, lock: bool = True) -> None:
        with self.state_averager.lock_averaged_tensors if lock else nullcontext():
            for start, param in zip(self.global_params, self.main_parameters):
                start.copy_(param.detach())

    def _apply_deadlines(self, deadlines: Deadlines) -> None:
        self._deadlines = deadlines
        set_matchmaking_window([self.grad_averager], deadlines.matchmaking_seconds)


def build_diloco(config: AveragingConfig, replica: Replica, parts: StrategyParts) -> DiLoCoOptimizer:
    return DiLoCoOptimizer(
        config, replica, rounds=parts.rounds, tracker_opts=parts.tracker_opts, averager_opts=parts.averager_opts,
        matchmaking_floor=parts.matchmaking_floor, allreduce_timeout=parts.allreduce_timeout,
        error_feedback=parts.error_feedback, weight_bound=parts.weight_bound, agreement=parts.agreement,
    )
