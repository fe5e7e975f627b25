"""Pace the DHT traffic of hivemind's averagers.

hivemind 1.1.12 talks to the DHT in two unpaced loops while it averages:
- a peer looking for a group re-reads its group key whenever its queue of candidate leaders is
  empty, with no pause in between: for the whole matchmaking window, as fast as the DHT answers;
- every averager re-declares itself as a state donor (`<prefix>.all_averagers`) whenever its state
  changes, and an all-reduce "changes" it once per averaged tensor: the same record, stored dozens
  of times per round.
On a 2-peer swarm of the tiny test model that was about 200 DHT requests a second per peer and 1.6
cores in all, most of it in hivemind's DHT process and p2pd; paced as below, about 20 a second and 0.5
cores, with as many epochs a second. Over a real network each of those requests also reaches other
peers' DHT nodes.

`pace_averager_dht_traffic()` makes a group key be read at most every LOOKUP_INTERVAL_SECONDS
(far below any matchmaking window, so a group forms as before) and a donor record be stored at
most every DECLARE_INTERVAL_SECONDS; updates in between are merged, and the newest always goes
out. It patches hivemind's classes, so it must run before the averager processes fork (their
code is inherited at fork). hivemind is pinned, so the one method copied below cannot drift.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.utils import get_dht_time

LOOKUP_INTERVAL_SECONDS = 0.1
DECLARE_INTERVAL_SECONDS = 0.5


class Pacer:
    """Spaces calls at least `interval` seconds apart; `delay()` reserves the next slot."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval, self.clock = interval, clock
        self._next_slot = float("-inf")

    def delay(self) -> float:
        """Seconds to wait before the caller's turn; callers that arrive together queue up."""
        now = self.clock()
        slot = max(now, self._next_slot)
        self._next_slot = slot + self.interval
        return slot - now


_unpaced_get_averagers = GroupKeyManager.get_averagers


async def _paced_get_averagers(self: GroupKeyManager, group_key, only_active: bool):
    if not hasattr(self, "_lookup_pacer"):
        self._lookup_pacer = Pacer(LOOKUP_INTERVAL_SECONDS)
    await asyncio.sleep(self._lookup_pacer.delay())
    return await _unpaced_get_averagers(self, group_key, only_active)


async def _paced_declare_for_download_periodically(self: DecentralizedAverager):
    # upstream's DecentralizedAverager._declare_for_download_periodically, plus the pause marked below
    download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
    sharing_was_allowed = self.allow_state_sharing
    while True:
        expiration_time = get_dht_time() + self.declare_state_period
        if self.allow_state_sharing or sharing_was_allowed:
            asyncio.create_task(
                asyncio.wait_for(
                    self.dht.store(
                        download_key,
                        subkey=self.peer_id.to_bytes(),
                        value=self.state_sharing_priority if self.allow_state_sharing else None,
                        expiration_time=expiration_time,
                        return_future=True,
                    ),
                    timeout=expiration_time - get_dht_time(),
                )
            )
            sharing_was_allowed = self.allow_state_sharing
        self._state_updated.clear()
        # the pause: an update that arrives meanwhile leaves _state_updated set, so the next store carries it
        await asyncio.sleep(DECLARE_INTERVAL_SECONDS)
        try:
            await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, expiration_time - get_dht_time()))
        except asyncio.TimeoutError:
            pass


def pace_averager_dht_traffic() -> None:
    """Install the pacing (idempotent)."""
    GroupKeyManager.get_averagers = _paced_get_averagers
    DecentralizedAverager._declare_for_download_periodically = _paced_declare_for_download_periodically
