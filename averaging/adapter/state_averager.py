"""hivemind's TrainingStateAverager, guarded: nothing non-finite is applied, and a download that got nothing fails.

- GuardedStateAverager discards a parameter-averaging result holding NaN or Inf, and its state
  download raises StateDownloadFailed unless a peer's state was really loaded (upstream returns
  None either way) and is finite.
- ReportingStateAverager also reports every parameter-averaging round: local-sgd's only rounds, and
  sync's rounds that undo drift (a peer left out of its group's last one is apart from it).

Both override upstream methods, fingerprinted in averaging/adapter/upstream.py.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import hivemind
import torch
from hivemind.optim.state_averager import TrainingStateAverager

from averaging.api import RoundReport
from averaging.pipeline import completeness
from averaging.pipeline.guards import all_finite

logger = logging.getLogger(__name__)


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
    """TrainingStateAverager that reports each parameter-averaging round to `report`.

    Upstream creates the round inside `_do` and swallows its outcome; here the round is created
    first, so that its outcome can be read after upstream's `_do` has run it. Runs in hivemind's
    background thread, so it reports but never times a phase.
    """

    def __init__(self, *, report: Callable[[RoundReport], None], **kwargs):
        self._report = report
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
                self._report(RoundReport("failed", time.monotonic() - started, 1, repr(e)))
                return super()._do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, None,
                                   grad_scaler, set_to_none, timeout=timeout, **kwargs)
        super()._do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, averaging_control, grad_scaler,
                    set_to_none, timeout=timeout)
        try:
            gathered = averaging_control.result(timeout=0)
            # a partial parameter average is healed by the next whole round; the last one, by the end of run
            report = completeness.round_report(self, time.monotonic() - started, len(gathered))
        except TimeoutError as e:
            report = RoundReport("timeout", time.monotonic() - started, 1, repr(e))
        except BaseException as e:
            report = RoundReport("failed", time.monotonic() - started, 1, repr(e))
        self._report(report)
