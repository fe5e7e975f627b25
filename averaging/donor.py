"""Offering this peer's state as the swarm's final state.

hivemind's state download tries donors in order of their declared priority (a float, normally the
donor's epoch; ties are broken at random). At the end of a run, peers at the same epoch may hold
different states: one whose last round failed applied only its own gradients. Raising the priority
by DONOR_BONUS ranks a peer whose state is the swarm's above those, at the same epoch, and still
below any peer that is an epoch ahead.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

from hivemind.averaging import DecentralizedAverager

logger = logging.getLogger(__name__)

DONOR_BONUS = 0.5
VISIBLE_WITHIN_SECONDS = 5.0


def offer_state(averagers: Iterable[DecentralizedAverager], epoch: int,
                visible_within_seconds: float = VISIBLE_WITHIN_SECONDS) -> bool:
    """Declare `epoch + DONOR_BONUS` for each averager that shares state, and wait until the DHT shows it,
    so that a peer told to download next picks this one. False if none shares state (client mode) or
    the offer is not visible in time: then this peer must not tell others to download from it."""
    sharing = [averager for averager in averagers
               if averager is not None and not averager.client_mode and averager.allow_state_sharing]
    priority = epoch + DONOR_BONUS
    for averager in sharing:
        averager.state_sharing_priority = priority
    give_up_at = time.monotonic() + visible_within_seconds
    pending = list(sharing)
    while pending and time.monotonic() < give_up_at:
        pending = [averager for averager in pending if _declared_priority(averager) != priority]
        if pending:
            time.sleep(0.2)
    if pending:
        logger.warning(f"this peer's offer of its final state was not visible in the DHT within "
                       f"{visible_within_seconds:.0f} s; peers downloading now may pick another donor")
    return bool(sharing) and not pending


def _declared_priority(averager: DecentralizedAverager):
    found = averager.dht.get(f"{averager.prefix}.all_averagers", latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    return getattr(found.value.get(averager.peer_id.to_bytes()), "value", None)
