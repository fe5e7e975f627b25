"""Progress claims: a tracker with a ClaimFilter attached (averaging/swarm/claims.py) reads only the progress
records that filter believes; one with RecentPeers attached (grouped rounds, averaging/swarm/groups.py) tells it the
training peers of each read, whom grouped rounds deal into groups."""
from __future__ import annotations

from typing import Callable, Dict, Iterator, Tuple

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time

_unfiltered_parse = ProgressTracker._parse_swarm_progress_data


def filtered_parse(self: ProgressTracker, metadata):
    claims = getattr(self, "claims", None)  # set by averaging/swarm/progress.py on the trackers we build
    if claims is not None and isinstance(metadata, dict):
        metadata = claims.filter(metadata, get_dht_time(), local_epoch=self.local_progress.epoch)
    members = getattr(self, "members", None)  # set on the trackers of grouped rounds (averaging/strategies/sync.py)
    if members is not None:
        members.read(training_records(metadata), get_dht_time())
    return _unfiltered_parse(self, metadata)


def training_records(metadata) -> Iterator[Tuple[bytes, float]]:
    """The peer id and expiration time of each training peer's (not a client's) record read; malformed records are
    left out (upstream refuses them in its own way)."""
    for entry in metadata.values() if isinstance(metadata, dict) else ():
        record, expiration = getattr(entry, "value", None), getattr(entry, "expiration_time", None)
        if (isinstance(record, dict) and record.get("client_mode") is False and isinstance(record.get("peer_id"), bytes)
                and isinstance(expiration, (int, float))):
            yield record["peer_id"], float(expiration)


PATCHES: Dict[str, Callable] = {
    "hivemind.optim.progress_tracker.ProgressTracker._parse_swarm_progress_data": filtered_parse,
}
