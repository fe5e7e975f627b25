"""Progress claims: a tracker with a ClaimFilter attached (averaging/swarm/claims.py) reads only the progress
records that filter believes."""
from __future__ import annotations

from typing import Callable, Dict

from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time

_unfiltered_parse = ProgressTracker._parse_swarm_progress_data


def filtered_parse(self: ProgressTracker, metadata):
    claims = getattr(self, "claims", None)  # set by averaging/swarm/progress.py on the trackers we build
    if claims is not None and isinstance(metadata, dict):
        metadata = claims.filter(metadata, get_dht_time(), local_epoch=self.local_progress.epoch)
    return _unfiltered_parse(self, metadata)


PATCHES: Dict[str, Callable] = {
    "hivemind.optim.progress_tracker.ProgressTracker._parse_swarm_progress_data": filtered_parse,
}
