"""Round bookkeeping that every strategy shares, written once.

- Phases: a blocking round or download is timed as a phase, but only on the training thread
  (delayed averaging runs in hivemind's background threads and must not count as blocking).
- Outcomes: every round ends in one RoundReport, fed to the adaptive deadlines and the hooks.
- Resync: a round that was partial, failed or timed out while other peers averaged leaves this peer
  apart (gradient and pseudo-gradient averaging never bring it back). It declares itself a worse
  donor than its epoch (averaging/swarm/donor.py) and downloads the state of a peer that declares its
  epoch or later, which only a peer whose round was whole does. If none shows up within an
  averaging timeout (by then any whole peer's round has ended), every peer's round went wrong alike,
  as when a reducer died: the apart peer with the smallest id becomes the reference and the others
  download its state, instead of trading states at random. After two timeouts, a peer that has
  still seen no donor goes on with its own state.
- Settling: a peer can come out of its transition one epoch behind the others for good, with other
  parameters: its round failed or timed out while theirs went on, or it was abandoned once they had all
  moved past its epoch (rounds meet only rounds that lead to the same epoch: averaging/adapter/
  epoch_keys.py). Upstream checks only once, right after the transition, when the others may not have
  reported their new epoch yet. So the check is made again SETTLE_SECONDS later, on a fresh read of the
  swarm's progress: no peer can finish another round that soon (a round takes a matchmaking window), so
  a swarm already ahead then means this peer is out of step, and it downloads.
- Deadlines: with 'auto', they are chosen again after every epoch from the swarm's rate.
- Split rounds: SHORT_ROUNDS_WARNING averaged rounds in a row whose groups fell short of the peers the
  swarm counts make the peer say, once, that the matchmaking window is too short for the swarm.
- Exclusion: the watch that turns reducers' verdicts into excluded peers runs as long as the rounds.
- Role: a peer whose contribution its group's reducers left out as late stands aside from reducing parts for
  others until its contributions arrive in time again (averaging/pipeline/stragglers.py ReducerRole); the
  strategy declares `role.bandwidth` to its next groups.
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

from averaging.api import APART, AveragingHooks, RoundReport, SwarmView
from averaging.deadlines import AdaptiveDeadlines, Deadlines
from averaging.pipeline.exclusion import ExclusionWatch
from averaging.pipeline.stragglers import ReducerRole
from averaging.swarm.donor import DonorView

logger = logging.getLogger(__name__)

LOAD_STATE_ATTEMPTS = 3
DOWNLOAD_BACKOFF_SECONDS = (2.0, 60.0)
DONOR_CHECK_SECONDS = 0.5  # a pending resync reads the DHT's donors at most this often
SETTLE_SECONDS = 0.5  # after its own transition, a peer checks this much later that the swarm is not ahead
FRESH_READ_SECONDS = 2.0  # how long that check waits for a fresh read of the swarm's progress
SHORT_ROUNDS_WARNING = 3


class RoundKeeper:
    """One per optimizer; created on the training thread."""

    def __init__(
        self, hooks: AveragingHooks, deadlines: AdaptiveDeadlines, load_state_attempts: int = LOAD_STATE_ATTEMPTS,
        exclusion: Optional[ExclusionWatch] = None,
    ):
        self.hooks, self.deadlines, self.load_state_attempts = hooks, deadlines, load_state_attempts
        self.exclusion = exclusion
        self._training_thread = threading.current_thread()
        self._apart_since: Optional[float] = None
        self._next_donor_check = float("-inf")
        self._settled_check_at: Optional[float] = None
        self._failed_downloads, self._next_download_at = 0, float("-inf")
        self._short_rounds, self._warned_short = 0, False
        self.downloaded_at_epoch: Optional[int] = None  # the epoch of the last state this peer downloaded
        self.role = ReducerRole()
        self.clock = time.monotonic
        self.samples_per_weight = 1.0
        """What one unit of a round's weight stands for in samples, for the credit the reducers observe (DiLoCo's
        weights are per target batch of its round: its round factor)."""

    def excluded_peer_ids(self) -> frozenset:
        """The peers excluded so far, as peer id bytes (as in their progress records)."""
        if self.exclusion is None:
            return frozenset()
        return frozenset(peer.to_bytes() for peer in self.exclusion.defence.excluded())

    def excluded_peers(self) -> frozenset:
        """The peers excluded or refused so far, as base58 ids."""
        if self.exclusion is None:
            return frozenset()
        return frozenset(peer.to_base58() for peer in self.exclusion.defence.excluded())

    def refuse(self, peers: Iterable[str]) -> None:
        """Refuse these peers (base58) in matchmaking and state sharing for the rest of the run."""
        if self.exclusion is not None:
            self.exclusion.refuse(peers)

    def close(self) -> None:
        """After the averagers have stopped."""
        if self.exclusion is not None:
            self.exclusion.close()

    def phase(self, name: str) -> ContextManager:
        if threading.current_thread() is self._training_thread:
            return self.hooks.phase(name)
        return nullcontext()

    def finish_round(self, report: RoundReport, others_present: bool, swarm_peers: Optional[int] = None) -> None:
        """Record a round's outcome; `others_present`: whether other peers may have averaged without this one;
        `swarm_peers`: how many peers the swarm counts, where each round should gather all of them."""
        self.note_apart(report, others_present)
        self.deadlines.observe_round(report.outcome, report.seconds)
        if swarm_peers is not None and report.outcome in ("ok", "partial"):
            self._observe_group(report.group_size, swarm_peers)
        self.report(report)

    def _observe_group(self, group_size: int, swarm_peers: int) -> None:
        self._short_rounds = self._short_rounds + 1 if group_size < swarm_peers else 0
        if self._short_rounds >= SHORT_ROUNDS_WARNING and not self._warned_short:
            self._warned_short = True
            window = self.deadlines.current.matchmaking_seconds
            logger.warning(f"the last {self._short_rounds} averaging rounds each gathered fewer peers than the "
                           f"swarm counts (this one {group_size} of {swarm_peers}): the peers reach the end of an "
                           f"epoch further apart than the matchmaking window ({window:g}s) and average in separate "
                           f"groups, whose states then have to be repaired by download; raise --matchmaking-seconds")

    def report(self, report: RoundReport) -> None:
        """A round to report (local-sgd's parameter rounds come here directly): its outcome, and what its timing
        says of this peer's role."""
        self.observe_timing(report)
        self.hooks.round_finished(report)

    def observe_timing(self, report: RoundReport) -> None:
        """Whether this peer's contribution came too late for its group: it stands aside from reducing, or, on time
        again for long enough, reduces again."""
        reduces = self.role.observe(report.late, whole=report.outcome == "ok")
        if reduces is None:
            return
        if reduces:
            logger.info("this peer's contributions arrive in time again: it reduces parts of the average again")
        else:
            why = (f"{100 * report.left_out:.0f}% of its contribution reached its group after the reducers' grace "
                   f"window and was left out" if report.left_out else "its group found its replies late")
            logger.warning(f"this peer is too slow for its group ({why}: a slow link or a busy machine): it stops "
                           f"reducing parts of the average for others, so that they do not wait for it, and still "
                           f"receives each round's result")
        self.hooks.reducing_changed(reduces)

    def note_apart(self, report: RoundReport, others_present: bool) -> None:
        """Only whether the round left this peer apart (for rounds that are not reported, as sync's state rounds)."""
        if report.outcome in APART and others_present:
            self._apart_since = self.clock()
            self._next_donor_check = float("-inf")

    @property
    def apart(self) -> bool:
        """Whether this peer's state may differ from the swarm's until it downloads (a resync is pending)."""
        return self._apart_since is not None

    def take_resync(self, donors: Callable[[], DonorView], become_reference: Callable[[], None]) -> bool:
        """Whether to download the swarm's state now (once: a True clears the pending resync).

        `donors`: what this peer sees of the donors at its epoch; `become_reference`: declare this
        peer's epoch again, as the state that the other apart peers download.
        """
        if self._apart_since is None or self.clock() < self._next_donor_check:
            return False
        view = donors()
        if view.ahead:
            self._apart_since = None
            return True
        self._next_donor_check = self.clock() + DONOR_CHECK_SECONDS
        waited, timeout = self.clock() - self._apart_since, self.deadlines.current.averaging_timeout_seconds
        if view.smallest_apart and waited > timeout:
            logger.info("no peer's last round was whole: this peer's state is the reference, "
                        "the other peers apart from the swarm download it")
            become_reference()
            self._apart_since = None
        elif waited > 2 * timeout:
            logger.warning("no peer offers a state from a whole averaging round: "
                           "this peer goes on with its own state")
            self._apart_since = None
        return False

    def entered_epoch(self) -> None:
        """This peer moved to a new epoch through its own round: check once, a little later, that it is in step."""
        self._settled_check_at = self.clock() + SETTLE_SECONDS

    def behind_after_settling(self, local_epoch: int, swarm_view: Callable[[float], SwarmView]) -> bool:
        """Whether the swarm is ahead of this peer, SETTLE_SECONDS after it entered `local_epoch` (once per
        epoch; `swarm_view(timeout)` reads the swarm's progress afresh)."""
        if self._settled_check_at is None or self.clock() < self._settled_check_at:
            return False
        self._settled_check_at = None
        swarm_epoch = swarm_view(FRESH_READ_SECONDS).global_epoch
        if local_epoch < swarm_epoch:
            logger.info(f"the swarm is at epoch {swarm_epoch} just after this peer entered epoch {local_epoch} "
                        f"(it is out of step): downloading the swarm's state")
            return True
        return False

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
            self.downloaded_at_epoch = local_epoch
            self.hooks.state_loaded(local_epoch)
        else:
            logger.warning(f"no peer sent a usable state in {self.load_state_attempts} attempts; "
                           f"going on with this peer's own state")


def set_matchmaking_window(averagers: Iterable, seconds: float) -> None:
    """The default matchmaking time of the rounds these averagers schedule from now on."""
    for averager in averagers:
        if averager is not None:
            averager.matchmaking_kwargs["min_matchmaking_time"] = seconds
