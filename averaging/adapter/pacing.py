"""Pacing: matchmaking re-reads its group key with no pause for the whole matchmaking window, and an averager
re-declares itself as a state donor once per averaged tensor: about 200 DHT requests a second per peer on a
2-peer test swarm (1.6 cores), paced here to about 20 (0.5 cores), with as many epochs a second.

A progress tracker also stores a signed progress record after every local step (about 4 a second per peer of the
default task on one core). Other peers extrapolate a record by the rate it carries, so a record a few seconds old
tells them as much: reports are paced to one a REPORT_INTERVAL_SECONDS, except those that begin an epoch, bring its
first samples or reset the count, which go at once. On a 20 Mbit/s link, 2 peers of DiLoCo with int4
(benchmarks/uplink.py, 16,384 samples) sent 737 wire bytes a sample unpaced, 458 at one report a second and 423
at one every 3 s: the payload itself is about 230."""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Dict

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time

from averaging.adapter.late_stores import retrieve_timeout

LOOKUP_INTERVAL_SECONDS = 0.1
DECLARE_INTERVAL_SECONDS = 0.5
REPORT_INTERVAL_SECONDS = 3.0


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


unpaced_get_averagers = GroupKeyManager.get_averagers  # the wrapper calls the original


async def paced_get_averagers(self: GroupKeyManager, group_key, only_active: bool):
    if not hasattr(self, "_lookup_pacer"):
        self._lookup_pacer = Pacer(LOOKUP_INTERVAL_SECONDS)
    await asyncio.sleep(self._lookup_pacer.delay())
    return await unpaced_get_averagers(self, group_key, only_active)


async def paced_declare_for_download_periodically(self: DecentralizedAverager):
    # upstream's DecentralizedAverager._declare_for_download_periodically, plus the pause marked below, and its
    # stores' timeouts retrieved
    download_key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
    sharing_was_allowed = self.allow_state_sharing
    while True:
        expiration_time = get_dht_time() + self.declare_state_period
        if self.allow_state_sharing or sharing_was_allowed:
            declared = asyncio.create_task(  # retrieved when it times out under load (adapter/late_stores.py)
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
            declared.add_done_callback(retrieve_timeout)
            sharing_was_allowed = self.allow_state_sharing
        self._state_updated.clear()
        # the pause: an update that arrives meanwhile leaves _state_updated set, so the next store carries it
        await asyncio.sleep(DECLARE_INTERVAL_SECONDS)
        try:
            await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, expiration_time - get_dht_time()))
        except asyncio.TimeoutError:
            pass


def paced_report_local_progress(self: ProgressTracker, local_epoch: int, samples_accumulated: int,
                                update_global_samples: bool = True):
    # upstream's ProgressTracker.report_local_progress, with the store it triggers paced (marked below)
    extra_samples = samples_accumulated - self.local_progress.samples_accumulated
    if update_global_samples and local_epoch == self.local_progress.epoch == self.global_progress.epoch:
        self.global_progress.samples_accumulated += extra_samples
    if extra_samples > 0:
        self.performance_ema.update(task_size=extra_samples)
    else:
        self.performance_ema.reset_timer()
    # at once: a new epoch, a reset, and an epoch's first samples (upstream's reporter stops storing the records of a
    # peer whose last store it woke for held no samples of the current epoch: pacing that one would silence it)
    at_once = (local_epoch != self.local_progress.epoch or extra_samples <= 0
               or self.local_progress.samples_accumulated == 0)
    self.local_progress = self._get_local_progress(local_epoch, samples_accumulated)
    # the pace: a step's report waits for the next slot; the reporter stores the newest progress when it wakes
    now = time.monotonic()
    if at_once or now >= getattr(self, "_next_report", float("-inf")):
        self._next_report = now + REPORT_INTERVAL_SECONDS
        self.should_report_progress.set()


PATCHES: Dict[str, Callable] = {
    "hivemind.averaging.key_manager.GroupKeyManager.get_averagers": paced_get_averagers,
    "hivemind.averaging.averager.DecentralizedAverager._declare_for_download_periodically":
        paced_declare_for_download_periodically,
    "hivemind.optim.progress_tracker.ProgressTracker.report_local_progress": paced_report_local_progress,
}
