"""Round bookkeeping that every strategy shares, written once.

- Phases: a blocking round or download is timed as a phase, but only on the training thread
  (delayed averaging runs in hivemind's background threads and must not count as blocking).
- Outcomes: every round ends in one RoundReport, fed to the adaptive deadlines and the hooks.
- Resync: a round that failed or timed out while the swarm went on without this peer leaves it
  apart; it then downloads the swarm's state before its next step instead of drifting.
- Deadlines: with 'auto', they are chosen again after every epoch from the swarm's rate.
- Exclusion: the watch that turns reducers' verdicts into excluded peers runs as long as the rounds.
- State downloads: a bounded number of attempts instead of hivemind's `while True`, and after a
  download that got nothing, the next one waits (2 s, doubling up to a minute): a peer whose
  downloads keep failing (another model's shapes, a claimed epoch nobody can serve) must not ask
  the swarm for its whole state on every step.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable, Optional

from averaging.api import AveragingHooks, RoundReport, SwarmView
from averaging.deadlines import AdaptiveDeadlines, Deadlines
from averaging.exclusion import ExclusionWatch

logger = logging.getLogger(__name__)

LOAD_STATE_ATTEMPTS = 3
DOWNLOAD_BACKOFF_SECONDS = (2.0, 60.0)


class RoundKeeper:
    """One per optimizer; created on the training thread."""

    def __init__(
        self, hooks: AveragingHooks, deadlines: AdaptiveDeadlines, load_state_attempts: int = LOAD_STATE_ATTEMPTS,
        exclusion: Optional[ExclusionWatch] = None,
    ):
        self.hooks, self.deadlines, self.load_state_attempts = hooks, deadlines, load_state_attempts
        self.exclusion = exclusion
        self._training_thread = threading.current_thread()
        self._resync_requested = False
        self._failed_downloads, self._next_download_at = 0, float("-inf")
        self.clock = time.monotonic

    def excluded_peer_ids(self) -> frozenset:
        """The peers excluded so far, as peer id bytes (as in their progress records)."""
        if self.exclusion is None:
            return frozenset()
        return frozenset(peer.to_bytes() for peer in self.exclusion.defence.excluded())

    def close(self) -> None:
        """After the averagers have stopped."""
        if self.exclusion is not None:
            self.exclusion.close()

    def phase(self, name: str) -> ContextManager:
        if threading.current_thread() is self._training_thread:
            return self.hooks.phase(name)
        return nullcontext()

    def finish_round(self, report: RoundReport, left_behind: bool) -> None:
        """Record a round's outcome; `left_behind`: whether the swarm may have moved on without this peer."""
        if report.outcome in ("failed", "timeout") and left_behind:
            self._resync_requested = True
        self.deadlines.observe_round(report.outcome, report.seconds)
        self.hooks.round_finished(report)

    def take_resync(self) -> bool:
        """Whether a resync is due (once: asking clears it)."""
        due, self._resync_requested = self._resync_requested, False
        return due

    def retune(self, view: SwarmView) -> Optional[Deadlines]:
        """After an epoch, with 'auto' deadlines: the new deadlines from the swarm's rate (None when fixed)."""
        if not self.deadlines.auto:
            return None
        self.deadlines.observe_swarm(view.swarm_samples_per_second, view.target_batch_size)
        before, after = self.deadlines.current, self.deadlines.update()
        if after != before:
            logger.info(f"adaptive deadlines: matchmaking {after.matchmaking_seconds:.1f}s, "
                        f"averaging timeout {after.averaging_timeout_seconds:.1f}s")
        return after

    def download_allowed(self) -> bool:
        """Whether an automatic download may start now (after failed ones it backs off)."""
        return self.clock() >= self._next_download_at

    def download_state(self, download: Callable[[], None]) -> bool:
        """Run `download` up to load_state_attempts times; True once one succeeds."""
        loaded = self._attempt_download(download)
        if loaded:
            self._failed_downloads, self._next_download_at = 0, float("-inf")
        else:
            first, longest = DOWNLOAD_BACKOFF_SECONDS
            self._next_download_at = self.clock() + min(longest, first * 2**self._failed_downloads)
            self._failed_downloads += 1
        return loaded

    def _attempt_download(self, download: Callable[[], None]) -> bool:
        for attempt in range(1, self.load_state_attempts + 1):
            try:
                download()
                return True
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # hivemind raises many kinds; each means "try again"
                logger.warning(f"downloading state from peers failed ({e}), "
                               f"attempt {attempt} of {self.load_state_attempts}")
        return False

    def report_download(self, loaded: bool, local_epoch: int) -> None:
        if loaded:
            self.hooks.state_loaded(local_epoch)
        else:
            logger.warning(f"no peer sent a usable state in {self.load_state_attempts} attempts; "
                           f"going on with this peer's own state")


def set_matchmaking_window(averagers: Iterable, seconds: float) -> None:
    """The default matchmaking time of the rounds these averagers schedule from now on."""
    for averager in averagers:
        if averager is not None:
            averager.matchmaking_kwargs["min_matchmaking_time"] = seconds
