"""What the swarm can attribute to each peer: the samples its believed progress records account for.

A peer's weight in a gradient round is the sample count it sends with its contribution, and hivemind takes it at
its word. The same peer also publishes progress records (samples accumulated this epoch, and its rate), which
the swarm counts toward the target batch once the progress filter believes them (averaging/swarm/claims.py).
The training process writes what the believed records say into a SampleEvidence; its averager processes read
it, and a reducer counts a sender's weight as at most EVIDENCE_MARGIN times the samples its last record
accounts for by now (the samples it reported, plus its rate times the time since), but never less than an
equal share of the target: a record written at start-up, or just before the peer's last steps, says too little
(averaging/pipeline/robust.py). A sender that claims more weight in a round than its own progress records
account for is capped to them.

What it cannot tell: a peer whose progress records lie as much as its weights (hivemind writes both from the
same count); the fair-share bound and the median hold those.
"""
from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import time
from typing import Dict, Mapping, Optional, Tuple

CAPACITY_BYTES = 256 * 1024  # about 2500 peers' records
EVIDENCE_MARGIN = 2.0
"""Rates are averages and records are a few seconds old: twice what a record accounts for is still plausible."""

Record = Tuple[float, float, float]  # samples accumulated, samples per second, when (this machine's clock)


class SampleEvidence:
    """Made in the training process before its averagers fork; the averager processes read it."""

    def __init__(self, capacity_bytes: int = CAPACITY_BYTES, clock=time.time):
        self._raw = mp.Array(ctypes.c_char, capacity_bytes, lock=True)
        self._cached_raw, self._cached = b"", {}
        self.clock = clock

    def record(self, records: Mapping[str, Record]) -> None:
        """Replace the table by these records, by peer id (hex of its bytes); the newest fit if all do not."""
        raw = json.dumps(dict(records), separators=(",", ":")).encode()
        while len(raw) >= len(self._raw) and records:
            records = dict(sorted(records.items(), key=lambda item: item[1][2])[len(records) // 10 + 1:])
            raw = json.dumps(records, separators=(",", ":")).encode()
        with self._raw.get_lock():
            self._raw.value = raw

    def attributed(self, peer: str) -> Optional[float]:
        """The most samples this peer's believed records make plausible by now (None: no record of it)."""
        record = self._table().get(peer)
        if record is None:
            return None
        samples, rate, when = record
        return EVIDENCE_MARGIN * (samples + rate * max(0.0, self.clock() - when))

    def _table(self) -> Dict[str, Record]:
        with self._raw.get_lock():
            raw = self._raw.value
        if raw != self._cached_raw:
            self._cached_raw, self._cached = raw, {peer: tuple(record) for peer, record in json.loads(raw).items()}
        return self._cached
