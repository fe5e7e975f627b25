"""Stragglers: a round waits for a slow member only up to a grace window, and a slow member stops reducing.

Two rules, one on each side of a round:

1. The grace window (the reducer's side, in the averager processes: averaging/adapter/grace.py). A reducer
   receives each part of the average from every sender of its group. Once a quorum of them (more than half, in
   groups of three senders or more; with two, neither can be told slow) has delivered a part, it waits for the
   rest at most `window(quorum_seconds)`: `ratio` times as long as the quorum took since the part became current,
   and at least `min_seconds`. A sender that misses it is left out of the part and the rest of the round, and
   still receives the round's average when its contribution arrives, marked as left out: it ends the round with
   the same values as its group (canonical replies, averaging/adapter/runner.py), its samples just did not count.
2. Standing aside (who reduces). While a slow peer reduces a part, its whole group waits for its replies, which
   queue behind its own uploads; a reducer cannot see that itself, its senders can. So every peer notes the
   reducers whose replies reached it after the same grace window (`late_arrivals`: the others' replies and its own
   part being the arrivals), and tells its next group, in the bandwidth hivemind gathers from every member for
   load balancing (a `claim`: the bandwidth it declares, and the reducers it found late). Every member
   reads the same claims, so they agree: a member that more than half of the others found late reduces nothing
   in that round (`judged_bandwidths`). A peer that was given nothing that way, or whose contribution was left
   out, is slower than its group (a slow link, a busy machine): from its next round on it declares no bandwidth
   itself (ReducerRole) and only sends and receives; after some rounds in a row in which its contributions
   arrived in time it reduces again, and a return that ends in lateness doubles how many it needs next time, so
   that a peer on the edge does not flap.

What neither does: make a slow peer's samples count (its contribution is left out for as long as it is late),
speed up a group whose majority is slow (the quorum waits for them), or judge groups of two (neither can be told
slow; a reducer's share changes nothing of its upload there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Sequence

from averaging.pipeline.round_pipeline import RoundStage


@dataclass(frozen=True)
class GraceWindow(RoundStage):
    """The grace window's policy, carried into the averager processes as a stage of their pipeline."""

    ratio: float = 1.0
    """How long, as a multiple of the time the quorum took, a reducer waits for the rest; 0 turns it off."""
    min_seconds: float = 0.1

    @property
    def enabled(self) -> bool:
        return self.ratio > 0

    def quorum(self, senders: int) -> Optional[int]:
        """How many of `senders` must have delivered a part before the window opens (None: it never does)."""
        if not self.enabled or senders < 3:
            return None
        return senders // 2 + 1

    def window(self, quorum_seconds: float) -> float:
        """How long to wait for the rest, once the quorum delivered `quorum_seconds` after the part became current."""
        return max(self.min_seconds, self.ratio * quorum_seconds)


def late_arrivals(arrived_after_seconds: Mapping[str, float], grace: GraceWindow) -> frozenset:
    """Of one arrival per member (seconds into the round), those after the grace window that the quorum's opened."""
    quorum = grace.quorum(len(arrived_after_seconds))
    if quorum is None:
        return frozenset()
    quorum_seconds = sorted(arrived_after_seconds.values())[quorum - 1]
    deadline = quorum_seconds + grace.window(quorum_seconds)
    return frozenset(member for member, seconds in arrived_after_seconds.items() if seconds > deadline)


def claim(bandwidth: Optional[float], late_reducers: Iterable[str], me: str) -> dict:
    """What a peer declares as its bandwidth to its next group: its own bandwidth (hivemind's meaning), and the
    reducers (base58 ids) whose replies it received late in its last round."""
    return {"bandwidth": bandwidth, "late": sorted(late_reducers), "me": me}


def declared(entry) -> Optional[float]:
    """The bandwidth a member declared (a claim's, or hivemind's plain value)."""
    return entry.get("bandwidth") if isinstance(entry, dict) else entry


def judged_bandwidths(entries: Sequence) -> List[Optional[float]]:
    """hivemind's bandwidths of a group's members (in its order) from what they declared: in a group of three or
    more, a member that more than half of the others found late as a reducer gets 0 (no part to reduce)."""
    bandwidths = [declared(entry) for entry in entries]
    claims = [entry for entry in entries if isinstance(entry, dict)]
    if len(entries) < 3:
        return bandwidths
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        reporters = sum(1 for other in claims if other is not entry and entry["me"] in other["late"])
        if 2 * reporters > len(entries) - 1:
            bandwidths[index] = 0.0
    return bandwidths


STANDING_ASIDE_BANDWIDTH = 0.0
"""What a peer standing aside declares as its bandwidth: hivemind's load balancing then gives it no part."""
REDUCING_BANDWIDTH = None
"""What a reducing peer declares: hivemind's default (the group's mean), an equal share for every reducer."""


class ReducerRole:
    """Whether this peer reduces parts of the average for its group, from its rounds' reports (training thread)."""

    def __init__(self, on_time_rounds_to_return: int = 3, most_rounds_to_return: int = 48):
        self.reduces = True
        self.needed, self.most_needed = on_time_rounds_to_return, most_rounds_to_return
        self._on_time = 0  # rounds in a row on time while standing aside
        self._probation = 0  # rounds since it reduces again in which lateness sends it back for twice as long

    def observe(self, late: bool, whole: bool) -> Optional[bool]:
        """One round of this peer: whether it was too slow for its group (its contribution left out, or its group
        gave it nothing to reduce), and whether it received the whole average (a round that failed says nothing
        about its timing). Returns the new `reduces` when it changes."""
        if late:
            self._on_time = 0
            if not self.reduces:
                return None
            if self._probation > 0:
                self.needed = min(self.most_needed, 2 * self.needed)
            self.reduces, self._probation = False, 0
            return False
        if not whole:
            return None
        if self.reduces:
            self._probation = max(0, self._probation - 1)
            return None
        self._on_time += 1
        if self._on_time < self.needed:
            return None
        self.reduces, self._on_time, self._probation = True, 0, self.needed
        return True

    @property
    def bandwidth(self) -> Optional[float]:
        """What this peer declares to its next groups (hivemind's `bandwidth` of an averager)."""
        return REDUCING_BANDWIDTH if self.reduces else STANDING_ASIDE_BANDWIDTH
