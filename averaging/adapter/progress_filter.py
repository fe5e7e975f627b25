"""Progress claims: a tracker with a ClaimFilter attached (averaging/swarm/claims.py) reads only the progress
records that filter believes; it keeps the ids of the training peers it read (`training_peers`), whom grouped
rounds deal into groups (averaging/swarm/groups.py)."""
from __future__ import annotations

from typing import Callable, Dict, FrozenSet

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time

_unfiltered_parse = ProgressTracker._parse_swarm_progress_data


def filtered_parse(self: ProgressTracker, metadata):
    claims = getattr(self, "claims", None)  # set by averaging/swarm/progress.py on the trackers we build
    if claims is not None and isinstance(metadata, dict):
        metadata = claims.filter(metadata, get_dht_time(), local_epoch=self.local_progress.epoch)
    self.training_peers = training_peers(metadata)
    return _unfiltered_parse(self, metadata)


def training_peers(metadata) -> FrozenSet[bytes]:
    """The peer ids of the training peers (not clients) whose records were read; malformed records are left out
    (upstream refuses them in its own way)."""
    records = [getattr(entry, "value", None) for entry in (metadata.values() if isinstance(metadata, dict) else ())]
    return frozenset(record["peer_id"] for record in records
                     if isinstance(record, dict) and record.get("client_mode") is False
                     and isinstance(record.get("peer_id"), bytes))


PATCHES: Dict[str, Callable] = {
    "hivemind.optim.progress_tracker.ProgressTracker._parse_swarm_progress_data": filtered_parse,
}
