"""hivemind's TrainingStateAverager, guarded: nothing non-finite is applied, and a download that got nothing fails.

- GuardedStateAverager discards a parameter-averaging result holding NaN or Inf, and its state
  download raises StateDownloadFailed unless a peer's state was really loaded (upstream returns
  None either way) and is finite. A `check_download` (averaging/strategies/agreement.py) sees a
  downloaded state before anything of it is applied, and may refuse it (DownloadRejected).
- It serves a consistent state: upstream hands the averager process references to the live tensors,
  which a step may change while they are being sent (and it counts the new epoch before the step
  runs). Here a step and the snapshot of what is served hold one lock (`serving_lock`), and the
  snapshot is a copy; `served_digest` digests the same state under the same lock.
- While a round that its state waits for is in flight (DiLoCo's overlap: the peer has entered the
  epoch, its outer step has not landed), a download waits for it to land, up to `landing_wait_seconds`,
  then gets the whole new state; past that, the downloader moves on to the next donor.
- ReportingStateAverager also reports every parameter-averaging round: local-sgd's only rounds, and
  sync's rounds that undo drift (a peer left out of its group's last one is apart from it). With grouped
  rounds, it chooses each round's group before the round starts (averaging/adapter/epoch_keys.py).

Both override upstream methods, fingerprinted in averaging/adapter/upstream.py.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
import time
from typing import AsyncIterator, Callable, List, Optional, Tuple

import hivemind
import torch
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from averaging.adapter.epoch_keys import ChosenGroup
from averaging.api import RoundReport
from averaging.pipeline import completeness
from averaging.pipeline.guards import all_finite
from averaging.pipeline.state_digest import state_digest

logger = logging.getLogger(__name__)


HOSTILE_DONOR_BONUS = 1.9
"""What a hostile donor (tests) adds to its declared priority: it ranks first even while its declaration of a new
epoch lags the others' (with 0.9, a downloader that asked just as the honest peers entered the epoch took their
state first, in CI, and never met the hostile one)."""


class StateDownloadFailed(RuntimeError):
    """No peer sent a usable state."""


class StateInFlight(RuntimeError):
    """The state a peer was asked for waits for a round in flight that did not land in time."""


class DownloadRejected(StateDownloadFailed):
    """A downloaded state failed its check; nothing of it was applied."""


class _DownloadRecorder(hivemind.DecentralizedAverager):
    """Remembers what the last state download returned (TrainingStateAverager, which sits above this
    class in the method order, returns None whether or not any peer sent its state), after
    `check_download(metadata, tensors)` had its say: it raises DownloadRejected to refuse it."""

    last_download = None
    check_download: Optional[Callable[[dict, List[torch.Tensor]], None]] = None

    def load_state_from_peers(self, *args, **kwargs):
        loaded = super().load_state_from_peers(*args, **kwargs)
        if loaded is not None and self.check_download is not None:
            self.check_download(*loaded)
        self.last_download = loaded
        return loaded


class GuardedStateAverager(TrainingStateAverager, _DownloadRecorder):
    """TrainingStateAverager that discards a parameter-averaging result holding NaN or Inf, whose state
    download raises StateDownloadFailed unless a peer's state was actually loaded, and which serves a
    consistent copy of its state.

    :param serve: what it serves instead of its state's tensors (tests' hostile donor; None: its state)
    :param landing_wait_seconds: how long a download waits for a round in flight to land (`state_in_flight`); keep
      it below the downloaders' next_chunk_timeout, which bounds their wait for the first part
    """

    def __init__(self, *, serve: Optional[Callable[[List[torch.Tensor]], List[torch.Tensor]]] = None,
                 landing_wait_seconds: float = 0.0, **kwargs):
        self.serving_lock = threading.RLock()
        self._serve = serve
        self.landing_wait_seconds = landing_wait_seconds
        self._whole = mp.Event()  # created before the averager process is forked: both processes see it
        self._whole.set()
        super().__init__(**kwargs)

    def state_in_flight(self) -> None:
        """Its state now waits for a round in flight: serve nothing until `state_landed` (call under serving_lock,
        with the change of epoch that the round's launch makes)."""
        self._whole.clear()

    def state_landed(self) -> None:
        """The round in flight landed, or was given up: its state is whole again."""
        self._whole.set()

    def shutdown(self) -> None:
        self.state_landed()  # a download waiting for a landing that will not come ends now
        super().shutdown()

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:  # hivemind's servicer reads these annotations
        # in the averager process: wait here, not in the host's one fetching thread, and refuse quietly as
        # upstream does when sharing is off (the downloader moves on to its next donor)
        if not self._whole.is_set() and not await asyncio.get_running_loop().run_in_executor(
                None, self._whole.wait, self.landing_wait_seconds):
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    @property
    def state_sharing_priority(self) -> float:
        return hivemind.DecentralizedAverager.state_sharing_priority.fget(self)

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: float) -> None:
        # a hostile donor (tests) claims to be a step ahead, so that peers downloading pick it first
        bonus = HOSTILE_DONOR_BONUS if self._serve is not None else 0.0
        hivemind.DecentralizedAverager.state_sharing_priority.fset(self, value + bonus)

    def step(self, *args, **kwargs):
        if kwargs.get("delay_optimizer_step") or kwargs.get("delay_averaging"):
            return super().step(*args, **kwargs)  # goes on in the background: its state is never digested
        with self.serving_lock:
            return super().step(*args, **kwargs)

    def get_current_state(self):
        give_up_at = time.monotonic() + self.landing_wait_seconds
        while True:
            with self.serving_lock:
                if self._whole.is_set():
                    metadata, tensors, infos = super().get_current_state()
                    tensors = [tensor.clone() for tensor in tensors]
                    break
            # a round was launched after the averager process saw the state whole
            if not self._whole.wait(max(0.0, give_up_at - time.monotonic())):
                raise StateInFlight("this peer's round in flight did not land in time; ask another donor")
        return metadata, (self._serve(tensors) if self._serve is not None else tensors), infos

    def served_digest(self, select: slice) -> str:
        """The digest of the `select`ed tensors of what this averager serves now (averaging/swarm/digests.py)."""
        with self.serving_lock:
            _, tensors, _ = super().get_current_state()
            return state_digest(tensors[select])
    def _apply_averaging_results_(self):
        with self.get_tensors() as averaged:
            finite = all_finite(averaged)
        if not finite:
            logger.warning("a parameter-averaging round returned NaN or Inf; keeping this peer's own parameters")
            self._load_local_tensors_into_averager_()  # so the next round starts from sane values
            return
        super()._apply_averaging_results_()

    def load_state_from_peers(self, **kwargs) -> None:
        with self.serving_lock:
            self._load_state_from_peers_guarded(**kwargs)

    def _load_state_from_peers_guarded(self, **kwargs) -> None:
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

    def __init__(self, *, report: Callable[[RoundReport], None],
                 group_for: Optional[Callable[[int], Tuple[int, int]]] = None, **kwargs):
        """:param group_for: for grouped rounds, the group of the round that leads to an epoch and how many peers
        were dealt into it (averaging/swarm/groups.py); its rounds meet under that group's key and close once they
        are all in (averaging/adapter/epoch_keys.py)"""
        self._report, self._group_for = report, group_for
        # made before the averager process forks: shared with it
        self.chosen_group = ChosenGroup() if group_for is not None else None
        super().__init__(**kwargs)

    def run(self):  # the averager's own process
        if self.chosen_group is not None:
            self.chosen_group.use()
        super().run()

    def schedule_step(self, scheduled_time=None, **kwargs):
        """A round pre-scheduled before its epoch: it looks for the group of the epoch it gathers."""
        self._choose_group(kwargs.get("gather"))
        return super().schedule_step(scheduled_time, **kwargs)

    def _choose_group(self, epoch) -> None:
        if self._group_for is not None and isinstance(epoch, int):
            self.chosen_group.choose(epoch, *self._group_for(epoch))

    def _do(self, wait_for_trigger, optimizer_step, zero_grad, averaging_round, averaging_control, grad_scaler,
            set_to_none, timeout=None, **kwargs):
        if not averaging_round:
            return super()._do(wait_for_trigger, optimizer_step, zero_grad, averaging_round, averaging_control,
                               grad_scaler, set_to_none, timeout=timeout, **kwargs)
        started = time.monotonic()
        if averaging_control is None or averaging_control.triggered or averaging_control.done():
            try:
                self._choose_group(self.local_epoch)
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
            report = completeness.round_report(self, time.monotonic() - started, len(gathered),
                                               tuple(peer.to_base58() for peer in gathered))
        except TimeoutError as e:
            report = RoundReport("timeout", time.monotonic() - started, 1, repr(e))
        except BaseException as e:
            report = RoundReport("failed", time.monotonic() - started, 1, repr(e))
        self._report(report)
