"""hivemind.Optimizer with its private steps turned into hooks that a strategy implements with public names.

SyncOptimizer (averaging/strategies/sync.py) needs to change what hivemind's Optimizer does at several private
points: how its state averager is built, what a new global epoch triggers, which batches are accumulated, how a
gradient round's outcome is applied and reported, when state is downloaded. Each override of a private method
lives here, fingerprinted in averaging/adapter/upstream.py, and calls a hook; the strategy implements the hooks
and never names a hivemind private.
"""
from __future__ import annotations

from typing import Callable, Optional

import hivemind
from hivemind.optim.state_averager import TrainingStateAverager

from averaging.adapter.epoch_keys import gather_epochs
from averaging.pipeline.error_feedback import ErrorFeedback
from averaging.pipeline.robust import WeightBound
from averaging.pipeline.round_pipeline import including


class HookedOptimizer(hivemind.Optimizer):
    """hivemind.Optimizer whose private steps call the hooks below (each one's default is upstream's behaviour).

    :param error_feedback: carried by the gradient averager alone
    :param weight_bound: carried by the gradient averager alone: its weights are the samples each peer accumulated
      (hivemind's GradientAverager, PowerSGD's too). The state averager's parameter rounds weigh each peer 1, no
      sample count, so a bound from the target batch means nothing there.
    """

    def __init__(self, *, error_feedback: Optional[ErrorFeedback] = None, weight_bound: Optional[WeightBound] = None,
                 **kwargs):
        # before super().__init__, which builds the gradient averager
        self.error_feedback, self.weight_bound = error_feedback, weight_bound
        self._averager_opts = dict(kwargs.get("averager_opts") or {})
        super().__init__(**kwargs)
        if self.grad_averager is not None:  # a gradient round leads to the next epoch (local SGD has none)
            gather_epochs(self.grad_averager, lambda: self.local_epoch + 1)

    # --- hooks ---------------------------------------------------------------------------------

    def make_state_averager(self, **upstream_kwargs) -> TrainingStateAverager:
        """Build the state averager from the arguments upstream passes (the optimizer, parameters...)."""
        return super()._make_state_averager(**upstream_kwargs)

    def entered_global_epoch(self) -> None:
        """The swarm's global epoch was taken over (after upstream declared it as the donor priority)."""

    def accepts_batch(self) -> bool:
        """Whether the gradients of the batch just computed may be accumulated and sent to the swarm."""
        return True

    def round_skipped(self) -> None:
        """No gradient round began this epoch (alone in the swarm, or a pre-scheduled round was lost)."""

    def average_gradients(self, step_control, use_averaged: Callable[[], None],
                          use_local: Callable[[], None]) -> None:
        """Await a gradient round (`step_control` None: none began) and load its result with `use_averaged`,
        or this peer's own gradients with `use_local`, into the optimizer."""
        super()._average_gradients_and_load_into_optimizer(step_control)

    def should_download_state(self, upstream_says: Callable[[], bool]) -> bool:
        """Whether to download the swarm's state now; `upstream_says` is hivemind's own rule."""
        return upstream_says()

    def drop_scheduled_gradients(self) -> None:
        """Before a download: a pre-scheduled gradient round goes on with this peer at zero weight."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None

    def drop_scheduled_rounds(self) -> None:
        """Before a pause: the gradient round and the state round scheduled ahead go on with this peer at zero
        weight, so that the groups they join never wait on it."""
        self.drop_scheduled_gradients()
        if self.scheduled_state is not None and not self.scheduled_state.done():
            self._tag_along_with_zero_weight(self.scheduled_state)
            self.scheduled_state = None

    # --- upstream's private steps, each calling its hook ----------------------------------------

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        return self.make_state_averager(**kwargs)

    def _make_gradient_averager(self, factory, **kwargs):
        # upstream says averager_opts go to both averagers but passes them to the state averager only: the gradient
        # averager, whose rounds run every epoch, kept hivemind's 3 s request timeout against a 1 s matchmaking
        # window, which hivemind itself warns can deadlock matchmaking
        kwargs = {**self._averager_opts, **kwargs}
        with including(self.error_feedback), including(self.weight_bound):  # the gradient averager alone
            return super()._make_gradient_averager(factory, **kwargs)

    def _update_global_epoch(self, grad_scaler) -> None:
        super()._update_global_epoch(grad_scaler)  # which declares this peer's new epoch as its donor priority
        self.entered_global_epoch()

    def _check_and_accumulate_gradients(self, batch_size: int, grad_scaler) -> bool:
        if not self.accepts_batch():
            return False
        return super()._check_and_accumulate_gradients(batch_size, grad_scaler)

    def _begin_averaging_gradients(self, grad_scaler) -> bool:
        if self.scheduled_grads is not None and self.scheduled_grads.done():
            # a round scheduled ahead that ended before this peer reached the epoch (its matchmaking failed, or its
            # deadline passed while a loaded machine ran late): upstream skips this epoch's round and steps on local
            # gradients, leaving this peer apart from its group; a fresh round can still meet the others
            self.scheduled_grads = None
        began = super()._begin_averaging_gradients(grad_scaler)
        if not began:
            self.round_skipped()
        return began

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        self.average_gradients(maybe_step_control, self._load_averaged_gradients_into_optimizer_,
                               self._load_local_gradients_into_optimizer)

    def _should_load_state_from_peers(self) -> bool:
        return self.should_download_state(super()._should_load_state_from_peers)
