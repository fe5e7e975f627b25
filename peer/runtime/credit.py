"""Credit: what this peer gave the swarm, by its own count, and what it observed the others give.

A volunteer wants to see what their machine contributed, and a swarm cannot take anyone's word for it. So
each peer publishes, in its signed PeerInfo (dht/records.py CreditRecord):

- its own claim: the samples it accumulated toward epochs whose round it averaged in (ok or partial), its
  compute time, and the bytes it sent;
- what its reducers observed of every other peer: the samples they accepted from that peer's contributions,
  after the weight caps, leaving out contributions dropped or sent by an excluded peer (the reducer of
  averaging/adapter/reducer.py reports them).

A peer's record is signed by its own key: nobody can write another peer's claim, and what one observer says
of a peer is one voice among the observers that `peer status` takes the median of (dht/credit.py).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict

from dht.records import MAX_OBSERVED_PEERS, CreditRecord


class CreditLedger:
    def __init__(self, device_seconds: Callable[[], float], sent_bytes: Callable[[], int]):
        self.device_seconds, self.sent_bytes = device_seconds, sent_bytes
        self.samples = 0
        self._observed: Dict[str, float] = {}
        self._lock = threading.Lock()  # observations come from the exclusion watch's thread

    def epoch_ended(self, samples: int, round_outcome: str) -> None:
        """The samples of an epoch count once its round averaged them into the swarm's update."""
        if round_outcome in ("ok", "partial"):
            self.samples += samples

    def observed(self, peer_id: str, samples: float) -> None:
        with self._lock:
            self._observed[peer_id] = self._observed.get(peer_id, 0.0) + samples

    def record(self) -> CreditRecord:
        with self._lock:
            most = sorted(self._observed.items(), key=lambda item: (-item[1], item[0]))[:MAX_OBSERVED_PEERS]
        return CreditRecord(samples=float(self.samples), device_seconds=round(float(self.device_seconds()), 3),
                            sent_bytes=int(self.sent_bytes()), observed={peer: round(value, 1) for peer, value in most})
