"""Exclusion: a peer whose contributions this peer's reducers keep dropping is refused from then on.

Reducers judge each sender once per round (averaging/adapter/reducer.py): an offence is a contribution dropped
(NaN/Inf, norm, direction) or a weight claim above twice the target batch (its contribution was used, capped).
A peer is excluded once `threshold` of its last `window` judged rounds were offences, so that one transient
NaN, or an honest peer's rare outlier, never excludes anyone. A clean round counts only for the checks that ran
on it, so each peer has two windows:
- every round in which at least the norm check ran (three or more senders): an honest peer's rare norm outliers
  are diluted by its clean rounds. Counting only rounds in which every check ran let an honest peer's three
  outliers over any number of rounds in groups of three exclude it (seen: a 7-peer swarm once its attackers were
  gone);
- the rounds in which its direction was judged too (four or more senders that agree on a direction): a group of
  three cannot tell a sign flip, and its rounds would otherwise fill a sign flipper's window (in groups of 3 and 4
  under load, the sign flipper went unexcluded for 120 s).

Exclusion lasts for the rest of the run, or `seconds` when set; it is logged once with the peer's id and counted.
This peer is never judged: reducers leave their own contribution out of the verdicts.

Peers refused for harmful updates (averaging/pipeline/update_check.py) are refused alongside, for the rest of the
run, with no verdict on any of them.

A donor that served a state other than the one it published (BAD_STATE, averaging/swarm/digests.py) is
excluded at its first offence: an honest donor's served state is its published one, bit for bit.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple

from averaging.pipeline.defence import Credit, Defence, Verdict

logger = logging.getLogger(__name__)

BAD_STATE = "bad_state"
IMMEDIATE_OFFENCES = (BAD_STATE,)


@dataclass(frozen=True)
class ExclusionRule:
    threshold: int = 3
    window: int = 10
    seconds: Optional[float] = None  # None: for the rest of the run


class ExclusionBook:
    """Keeps each peer's recent verdicts and who is excluded until when."""

    def __init__(self, rule: ExclusionRule, clock: Callable[[], float] = time.monotonic):
        self.rule, self.clock = rule, clock
        # peer -> offences ("" for a clean round), newest last: in every judged round, and in those whose direction
        # was judged
        self._recent: Dict[str, Deque[str]] = {}
        self._directional: Dict[str, Deque[str]] = {}
        self._until: Dict[str, float] = {}

    def record(self, verdicts: Iterable[Verdict]) -> List[Tuple[str, str]]:
        """Take verdicts in; return (peer, why) for each peer they exclude."""
        newly_excluded = []
        for verdict in verdicts:
            if verdict.peer in self._until:
                continue
            windows = [("judged rounds", self._recent.setdefault(verdict.peer, deque(maxlen=self.rule.window)))]
            if verdict.direction_judged:
                windows.append(("rounds that judged its direction",
                                self._directional.setdefault(verdict.peer, deque(maxlen=self.rule.window))))
            why = (verdict.detail or verdict.offence) if verdict.offence in IMMEDIATE_OFFENCES else None
            for what, recent in windows:
                recent.append(verdict.offence)
                offences = [offence for offence in recent if offence]
                if why is None and len(offences) >= self.rule.threshold:
                    why = (f"{len(offences)} of its last {len(recent)} {what} were offences "
                           f"({', '.join(sorted(set(offences)))}; last: {verdict.detail or verdict.offence})")
            if why is not None:
                self._until[verdict.peer] = self.clock() + (self.rule.seconds or float("inf"))
                self._recent.pop(verdict.peer, None)
                self._directional.pop(verdict.peer, None)
                newly_excluded.append((verdict.peer, why))
        return newly_excluded

    def expire(self) -> List[str]:
        """Peers whose exclusion has just ended."""
        now = self.clock()
        ended = [peer for peer, until in self._until.items() if until <= now]
        for peer in ended:
            del self._until[peer]
        return ended

    @property
    def excluded(self) -> List[str]:
        return sorted(self._until)


class ExclusionWatch:
    """A thread in the peer's main process: reads the verdicts its averager processes send, keeps the
    book, and shares the excluded list back with them; passes on the credits they send (on_credit)."""

    POLL_SECONDS = 0.5

    def __init__(self, defence: Defence, book: ExclusionBook, on_drop: Callable[[str], None] = lambda reason: None,
                 on_exclude: Callable[[str], None] = lambda peer: None,
                 on_credit: Callable[[List[Credit]], None] = lambda credits: None):
        self.defence, self.book = defence, book
        self.on_drop, self.on_exclude, self.on_credit = on_drop, on_exclude, on_credit
        self._refused: Set[str] = set()  # refused for harmful updates (averaging/pipeline/update_check.py)
        self._lock = threading.Lock()  # refuse() comes from the training thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="exclusion-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._take(self.defence.take_verdicts(timeout=self.POLL_SECONDS))
                credits = self.defence.take_credits()
                if credits:
                    self.on_credit(credits)
            except Exception:  # a listener's bug must not end exclusion for the rest of the run
                logger.exception("the exclusion watch failed to take verdicts; it goes on")

    def _take(self, verdicts: List[Verdict]) -> None:
        for verdict in verdicts:
            if verdict.dropped:  # not a capped weight claim (its contribution was used), nor a bad state
                self.on_drop(verdict.offence)
        changed = False
        for peer, why in self.book.record(verdicts):
            until = "for the rest of the run" if self.book.rule.seconds is None else \
                f"for {self.book.rule.seconds:g} s"
            logger.warning(f"excluding peer {peer} {until}, from averaging and state sharing: {why}")
            self.on_exclude(peer)
            changed = True
        for peer in self.book.expire():
            logger.info(f"peer {peer} is no longer excluded (its {self.book.rule.seconds:g} s are over)")
            changed = True
        if changed:
            self._share()

    def refuse(self, peers: Iterable[str]) -> None:
        """Refuse these peers (base58) for the rest of the run, as if excluded, with no verdict on any of them."""
        with self._lock:
            self._refused.update(peers)
        self._share()

    def _share(self) -> None:
        with self._lock:
            self.defence.set_excluded(sorted(set(self.book.excluded) | self._refused))

    def close(self, timeout_seconds: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_seconds)
        self.defence.close()
