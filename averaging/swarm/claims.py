"""Which progress records to believe: a single forged record must not freeze a swarm.

hivemind's progress tracker takes every validly signed progress record at its word: one record
claiming epoch 10^9 (any DHT client can store one under its own key) makes every honest peer
"behind", and it downloads state in a loop for as long as the record lives. Before the tracker
reads the records, ClaimFilter drops those that cannot be true:

- absurd values: more samples than MAX_TARGETS_OF_SAMPLES target batches in one epoch, a rate
  above MAX_SAMPLES_PER_SECOND, a record written more than max_clock_skew_seconds in the future
  (by our clock), or one set to expire more than max_ttl_seconds ahead;
- epochs the swarm cannot have reached: once this peer has seen another peer's epoch, or has trained
  through an epoch itself, the swarm's epoch can only grow as fast as it accumulates samples. A record
  claiming more than reference epoch + EPOCH_LEAD + (time since the swarm reached it x rates x RATE_MARGIN / target)
  is not believed, where the rates are the highest total of believed records' rates in the last minute
  plus the claimant's own (records written while a peer waits, or at start-up, report low rates: a peer
  stuck for a few seconds must still believe a swarm that went on at its usual pace). After a state
  download, the epoch actually served becomes the reference, so a claim that
  made a newcomer download costs one download, not a loop.

Clocks: a record's expiry is its writer's clock plus the record lifetime, so when most other peers'
records expire further ahead than any record could, it is this peer's clock that is behind: it says so
(once), judges records by the swarm's time instead of ignoring every peer, and the others do not believe
its records, so it cannot drive the swarm's epochs. A clock ahead of the swarm's by more than the
matchmaking window writes records the others refuse ("written in the future"); it sees few or none of
theirs (they look expired to it), and learns so from the swarm's longer-lived clock records (dht/clock.py).
Records of peers this peer has excluded (averaging/pipeline/exclusion.py) are not believed either: an excluded
peer's samples were never averaged, so they must not count toward the target. Nor are paused peers' records
(`is_paused`): such a peer joins no round, and counted as a peer it would make one whose only partner paused wait
out every round's matchmaking (seen: one epoch per 20 s instead of 870 a minute).

The owner of an absurd record is ignored for the rest of the run; an epoch beyond the bound is only
not believed for now (an honest peer that trained alone for a while becomes believable as time
passes at its own rate). Both are logged once per owner. This peer's own record is always believed.
What it does not stop: samples claimed at a plausible rate but never trained on (hivemind counts
claimed samples); a lie told before this peer's first look costs that one download; a liar that
claims a high rate can lead by that rate's worth of epochs and so pull peers into a download now
and then (downloads back off when they fail, averaging/strategies/rounds.py). Excluding such peers for good
needs the averaging rounds to judge what they send, which this filter cannot see.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Callable, Collection, Deque, Dict, Mapping, Optional, Set, Tuple

logger = logging.getLogger(__name__)

MAX_SAMPLES_PER_SECOND = 1e6
MAX_TARGETS_OF_SAMPLES = 16
RATE_MARGIN = 3.0
EPOCH_LEAD = 8
"""Epochs a claim may lead by beyond the measured rate: rates are averages, and tiny epochs end early."""
RATE_MEMORY_SECONDS = 60.0
PAUSED_RATE_AT_MOST = 1e-9
"""A paused peer's record carries hivemind's "no rate" (1e-20; averaging/swarm/progress.py stand_idle)."""


def is_paused(value) -> bool:
    """Whether a progress record is a paused peer's: it marks itself a client, with no samples and no rate. (A peer
    that has not stepped yet has no rate either, but counts: it is about to join the rounds.)"""
    try:
        return (value["client_mode"] is True and int(value["samples_accumulated"]) == 0
                and float(value["samples_per_second"]) <= PAUSED_RATE_AT_MOST)
    except (KeyError, TypeError, ValueError):
        return False


class ClaimFilter:
    def __init__(self, own_owner: bytes, target_batch_size: int, max_ttl_seconds: float,
                 max_clock_skew_seconds: float = 60.0, excluded: Callable[[], Collection[bytes]] = frozenset,
                 believed: Optional[Callable[[Dict[str, tuple]], None]] = None, longest_round: int = 1):
        """:param excluded: the peer ids (bytes) this peer has excluded, asked afresh at each fetch
        :param believed: told after each fetch what the other peers' believed records say, by peer id (hex):
            (samples accumulated, samples per second, when written, by this machine's clock)
        :param longest_round: the most target batches one epoch can take (DiLoCo's --max-round-factor): honest
            samples in one epoch reach that many times the target"""
        self.own_owner, self.target_batch_size, self.excluded = own_owner, target_batch_size, excluded
        self.longest_round = max(1, longest_round)
        self.believed = believed
        self.clock_offset = 0.0  # the swarm's clock minus ours, when ours is found wrong
        self.max_ttl_seconds, self.max_clock_skew_seconds = max_ttl_seconds, max_clock_skew_seconds
        self.ignored: Set[bytes] = set()  # owners of absurd records: never believed again
        self._doubted: Set[bytes] = set()  # owners whose epoch was beyond the bound once (logged once)
        self._reference: Optional[tuple] = None  # (epoch, when the swarm reached it, as far as this peer knows)
        self._rates: Deque[Tuple[float, float]] = deque()  # (when, total samples/s of the records believed)

    def filter(self, metadata: Mapping[bytes, object], now: float, local_epoch: int = 0) -> Dict[bytes, object]:
        """The entries worth believing, from hivemind's {owner: ValueWithExpiration(progress dict)}.

        :param local_epoch: this peer's epoch now; once it has trained through one, it knows where the swarm was
        """
        if local_epoch >= 1:  # a fresh peer's epoch 0 says nothing about where the swarm is
            self._advance_reference(local_epoch, now)
        self._check_own_clock(metadata, now)
        now += self.clock_offset
        excluded = self.excluded()
        kept = {}
        for owner, entry in metadata.items():
            value = getattr(entry, "value", None)
            if owner == self.own_owner or value is None:
                kept[owner] = entry
                continue
            if owner in self.ignored or _get(entry, "peer_id") in excluded or is_paused(value):
                continue
            absurd = self._absurd(value, getattr(entry, "expiration_time", now), now)
            if absurd is not None:
                self.ignored.add(owner)
                logger.warning(f"ignoring the progress records of {_short(owner)} for the rest of the run: {absurd}")
                continue
            bound = self._epoch_bound(now, _number(value, "samples_per_second"))
            if bound is not None and _number(value, "epoch") > bound:
                if owner not in self._doubted:
                    self._doubted.add(owner)
                    logger.warning(f"not believing the progress records of {_short(owner)} for now: epoch "
                                   f"{int(_number(value, 'epoch'))} claimed while the swarm can be at most at epoch "
                                   f"{bound}")
                continue
            kept[owner] = entry
        self._remember(kept, now)
        if self.believed is not None:
            self.believed(self._evidence(kept))
        return kept

    def _evidence(self, kept: Mapping[bytes, object]) -> Dict[str, tuple]:
        evidence = {}
        for owner, entry in kept.items():
            peer_id = _get(entry, "peer_id")
            if owner != self.own_owner and isinstance(peer_id, bytes):
                value = entry.value
                evidence[peer_id.hex()] = (_number(value, "samples_accumulated"), _number(value, "samples_per_second"),
                                           _number(value, "time") - self.clock_offset)
        return evidence

    def _check_own_clock(self, metadata: Mapping[bytes, object], now: float) -> None:
        """Most other records (two or more) expiring beyond the longest lifetime a record can have: our clock
        is behind theirs by about how far beyond."""
        ahead = [getattr(entry, "expiration_time", now) - now for owner, entry in metadata.items()
                 if owner != self.own_owner and getattr(entry, "value", None) is not None]
        if len(ahead) < 2:
            return
        # the lower median: with two others, one of them ahead must not make this peer blame its own clock
        behind = statistics.median_low(ahead) - self.max_ttl_seconds
        if behind > 0 and not self.clock_offset:
            logger.warning(f"this peer's clock is at least {behind:.0f}s behind the swarm's (the median of "
                           f"{len(ahead)} peers' progress records): matchmaking and progress use wall-clock time, "
                           f"so the others do not believe this peer's records; set this machine's clock right "
                           f"(e.g. enable NTP: timedatectl set-ntp true)")
        elif behind <= 0 and self.clock_offset:
            logger.info("this peer's clock agrees with the swarm's again")
        self.clock_offset = behind + self.max_clock_skew_seconds if behind > 0 else 0.0

    def served(self, epoch: int, now: float) -> None:
        """A state download brought this peer to `epoch`: that is what the swarm can really serve."""
        self._reference = (epoch, now)

    def _absurd(self, value, expiration_time: float, now: float) -> Optional[str]:
        try:
            samples, rate, written = int(value["samples_accumulated"]), float(value["samples_per_second"]), float(
                value["time"])
        except (KeyError, TypeError, ValueError):
            return None  # hivemind's schema validator rejects malformed records; nothing to decide here
        if samples > MAX_TARGETS_OF_SAMPLES * self.target_batch_size * self.longest_round:
            return f"{samples} samples claimed in one epoch of {self.target_batch_size * self.longest_round} at most"
        if not rate <= MAX_SAMPLES_PER_SECOND:
            return f"a rate of {rate:g} samples/s"
        if written > now + self.max_clock_skew_seconds:
            return f"a record written {written - now:.0f}s in the future (its clock, or ours, is wrong)"
        if expiration_time > now + self.max_ttl_seconds:
            return f"a record set to expire {expiration_time - now:.0f}s ahead"
        return None

    def _epoch_bound(self, now: float, claimant_rate: float) -> Optional[int]:
        """The highest epoch the swarm can have reached by now, at the rates believed last time plus the claimant's."""
        if self._reference is None:
            return None  # a newcomer has nothing to compare with yet
        epoch, since = self._reference
        believed = max((rate for _, rate in self._rates), default=0.0)
        rate = believed + min(MAX_SAMPLES_PER_SECOND, max(0.0, claimant_rate))
        samples = max(0.0, now - since) * rate * RATE_MARGIN
        return epoch + EPOCH_LEAD + math.ceil(samples / max(1, self.target_batch_size))

    def _advance_reference(self, epoch: int, now: float) -> None:
        if self._reference is None or epoch > self._reference[0]:
            self._reference = (epoch, now)

    def _remember(self, kept: Mapping[bytes, object], now: float) -> None:
        others = [entry for owner, entry in kept.items()
                  if owner != self.own_owner and _get(entry, "epoch") is not None]
        if others:
            self._advance_reference(max(int(_number(entry.value, "epoch")) for entry in others), now)
        self._rates.append((now, sum(min(MAX_SAMPLES_PER_SECOND, _number(entry.value, "samples_per_second"))
                                     for entry in kept.values() if _get(entry, "samples_per_second") is not None)))
        while self._rates and self._rates[0][0] < now - RATE_MEMORY_SECONDS:
            self._rates.popleft()


def _get(entry, field: str):
    value = getattr(entry, "value", None)
    return value.get(field) if isinstance(value, dict) else None


def _number(value: dict, field: str) -> float:
    try:
        return float(value[field])
    except (KeyError, TypeError, ValueError):
        return 0.0


def _short(owner: bytes) -> str:
    return owner[-12:].hex()
