"""Telling a peer that its own clock is ahead of the swarm's.

hivemind stamps every DHT record with an expiry on its writer's clock and drops, on reading, the ones
that have expired by the reader's clock. A peer whose clock runs ahead of the others' by more than a
record's lifetime therefore sees none of their records: it trains alone and believes it is alone,
while the others refuse its records as written in the future (averaging/swarm/claims.py), so it cannot
drive the swarm's epochs either. Without a record that outlives the skew, nothing would tell it why.

Each peer stores a small clock record, {"time": its clock}, every period_seconds, with a lifetime
(CLOCK_RECORD_TTL_SECONDS, two hours) far longer than any other record's. A record a peer has
rewritten since the last look is live, and was written at most a period (plus the DHT's delay) ago:
by a right clock, `now - time` is about that period at most. When the median over live peers is ahead
by more than the allowed skew (the lower median, so that one peer behind among two cannot tip it), this
peer's clock is ahead of theirs: it says so once, and says when its clock agrees again. A clock behind
the swarm's is found from the progress records' expiries instead (averaging/swarm/claims.py); a clock more
than the lifetime ahead sees no clock record either. (A clock off when the peer starts is refused by
hivemind's bootstrap, which dht/node.py explains.)
"""
from __future__ import annotations

import logging
import statistics
from typing import Dict, Mapping, Optional

import hivemind
from hivemind.utils import get_dht_time

from dht.records import CLOCK_RECORD_TTL_SECONDS, RecordPublisher, own_subkey

logger = logging.getLogger(__name__)

CLOCK_PERIOD_SECONDS = 5.0


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
        try:
            found = self.dht.get(self.key, latest=True, return_future=True).result(timeout=timeout_seconds)
        except Exception as e:  # advisory: the next period looks again
            logger.debug(f"could not read the clock records: {e!r}")
            return stored
        entries = found.value.items() if found is not None and isinstance(found.value, dict) else []
        times = {owner: entry.value.get("time") for owner, entry in entries
                 if owner != self.me and isinstance(getattr(entry, "value", None), dict)}
        now = get_dht_time()  # looked up at each call: a clock that jumps moves it too
        self.judge.look({owner: time for owner, time in times.items() if isinstance(time, (int, float))}, now)
        return stored


class ClockJudge:
    """Whether this peer's clock is ahead of the others', from successive looks at their clock records."""

    def __init__(self, max_skew_seconds: float, period_seconds: float):
        self.max_skew_seconds, self.period_seconds = max_skew_seconds, period_seconds
        self.lead_seconds: Optional[float] = None  # how far ahead this peer's clock is, while it is
        self._last_seen: Dict[bytes, float] = {}

    def look(self, times: Mapping[bytes, float], now: float) -> None:
        """times: every other peer's clock record, by owner, read at `now` (this peer's clock)."""
        live = [now - written for owner, written in times.items()
                if owner in self._last_seen and written > self._last_seen[owner]]
        self._last_seen = dict(times)
        if not live:
            return
        # the lower median: with two others, one of them behind must not make this peer blame its own clock
        lead = statistics.median_low(live) - self.period_seconds  # records are up to a period old: at least this
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
