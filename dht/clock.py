"""Telling a peer that its own clock is ahead of the swarm's.

hivemind stamps every DHT record with an expiry on its writer's clock and drops, on reading, the ones
that have expired by the reader's clock. A peer whose clock runs ahead of the others' by more than a
record's lifetime therefore sees none of their records: it trains alone and believes it is alone,
while the others refuse its records as written in the future (averaging/swarm/claims.py), so it cannot
drive the swarm's epochs either. Without a record that outlives the skew, nothing would tell it why.

Each peer stores a small clock record, {"time": its clock}, every period_seconds, with a lifetime
(CLOCK_RECORD_TTL_SECONDS, two hours) far longer than any other record's. A record a peer has
rewritten since the last look is live, and was written at most one of its writer's intervals (plus the
DHT's delay) ago: by a right clock, `now - time` is about that interval at most, with `now` taken as the
look begins. Under load a writer's interval stretches well past the period, and a late record must not
read as a fast clock (seen: eight peers on 2 cores, each warning that its clock was 10-13 s ahead): so the
interval allowed is the one the writer's own stamps show (its last two records' times, on its own clock,
whatever the skew), and a peer's lag counts only once it held over LOOKS_TO_JUDGE fresh looks in a row
(its smallest). When the median over live peers is ahead by more than the allowed skew (the lower median,
so that one peer behind among two cannot tip it), this peer's clock is ahead of theirs: it says so once,
and says when its clock agrees again. A clock behind
the swarm's is found from the progress records' expiries instead (averaging/swarm/claims.py); a clock more
than the lifetime ahead sees no clock record either. (A clock off when the peer starts is refused by
hivemind's bootstrap, which dht/node.py explains.)
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Deque, Dict, Mapping, Optional

import hivemind
from hivemind.utils import get_dht_time

from dht.records import CLOCK_RECORD_TTL_SECONDS, RecordPublisher, own_subkey

logger = logging.getLogger(__name__)

CLOCK_PERIOD_SECONDS = 5.0
LOOKS_TO_JUDGE = 3
"""Fresh records of a peer in a row that must all lag before its lag counts: one late record is no skew."""


class ClockRecordPublisher(RecordPublisher):
    """Stores this peer's clock record every period and, after each store, checks this peer's clock against
    the live records of the others."""

    def __init__(self, dht: hivemind.DHT, key: str, max_skew_seconds: float,
                 period_seconds: float = CLOCK_PERIOD_SECONDS):
        super().__init__(dht, key, lambda: {"time": get_dht_time()}, period_seconds=period_seconds,
                         ttl_seconds=CLOCK_RECORD_TTL_SECONDS)
        self.me = own_subkey()
        self.judge = ClockJudge(max_skew_seconds, period_seconds)

    def publish_now(self, timeout_seconds: float = 10.0) -> bool:
        stored = super().publish_now(timeout_seconds)
        now = get_dht_time()  # as the look begins: a slow read must not age what it finds
        try:
            found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=timeout_seconds)
        except Exception as e:  # advisory: the next period looks again
            logger.debug(f"could not read the clock records: {e!r}")
            return stored
        entries = found.value.items() if found is not None and isinstance(found.value, dict) else []
        times = {owner: entry.value.get("time") for owner, entry in entries
                 if owner != self.me and isinstance(getattr(entry, "value", None), dict)}
        self.judge.look({owner: time for owner, time in times.items() if isinstance(time, (int, float))}, now)
        return stored


class ClockJudge:
    """Whether this peer's clock is ahead of the others', from successive looks at their clock records."""

    def __init__(self, max_skew_seconds: float, period_seconds: float):
        self.max_skew_seconds, self.period_seconds = max_skew_seconds, period_seconds
        self.lead_seconds: Optional[float] = None  # how far ahead this peer's clock is, while it is
        self._last_seen: Dict[bytes, float] = {}
        self._lags: Dict[bytes, Deque[float]] = {}  # by owner: its last fresh records' lags, less their intervals

    def look(self, times: Mapping[bytes, float], now: float) -> None:
        """times: every other peer's clock record, by owner, read at `now` (this peer's clock, as the look began)."""
        fresh = [owner for owner, written in times.items() if written > self._last_seen.get(owner, written)]
        for owner in fresh:  # rewritten since the last look: live, and written about an interval ago at most
            interval = max(self.period_seconds, times[owner] - self._last_seen[owner])  # on the writer's own clock
            self._lags.setdefault(owner, deque(maxlen=LOOKS_TO_JUDGE)).append(now - times[owner] - interval)
        self._last_seen = dict(times)
        self._lags = {owner: lags for owner, lags in self._lags.items() if owner in times}  # departed: forgotten
        live = [min(self._lags[owner]) for owner in fresh if len(self._lags[owner]) == LOOKS_TO_JUDGE]
        if not live:
            return
        # the lower median: with two others, one of them behind must not make this peer blame its own clock
        lead = statistics.median_low(live)
        if lead > self.max_skew_seconds:
            if self.lead_seconds is None:
                logger.warning(
                    f"this peer's clock is at least {lead:.0f}s ahead of the clocks of {len(live)} other peer(s): "
                    f"records of the swarm look expired to it, so it trains alone, and the others do not believe "
                    f"its progress; set this machine's clock right (e.g. enable NTP: timedatectl set-ntp true)")
            self.lead_seconds = lead
        elif self.lead_seconds is not None:
            logger.info("this peer's clock agrees with the swarm's again")
            self.lead_seconds = None
