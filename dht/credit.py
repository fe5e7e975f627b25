"""The contributors table of `peer status` and the monitor's page: each peer's own claim beside what others saw.

Every peer's credit record (dht/records.py CreditRecord) rides in its own signed PeerInfo, so nobody can write
another peer's claim. What peers say they observed of a peer is combined by the median over the observers that
name it: one observer that inflates a friend's count (or belittles a rival's) moves it no further than the
honest observers around it allow.
"""
from __future__ import annotations

from statistics import median
from typing import Any, Dict, Iterable, List

from dht.records import PeerInfo


def contributors(infos: Iterable[PeerInfo]) -> List[Dict[str, Any]]:
    """One row per peer that publishes credit, those the others saw give most first."""
    records = {info.peer_id: info.credit for info in infos if info.credit is not None}
    rows = []
    for peer_id, record in records.items():
        seen = [other.observed[peer_id] for observer, other in records.items()
                if observer != peer_id and peer_id in other.observed]
        rows.append({
            "peer_id": peer_id,
            "claimed_samples": round(record.samples),
            "observed_samples": round(median(seen)) if seen else None,
            "observers": len(seen),
            "device_seconds": round(record.device_seconds, 1),
            "sent_bytes": record.sent_bytes,
        })
    return sorted(rows, key=lambda row: (-(row["observed_samples"] or 0), -row["claimed_samples"], row["peer_id"]))
