"""Swarm-level metrics for `peer monitor`: one Prometheus target for a whole swarm.

The monitor reads every peer's DHT record, so it also covers peers that cannot be scraped
(client mode, behind NAT). Per-peer series are labelled with the peer's short ID, a label
bounded by the swarm's size; a peer that leaves disappears from the next scrape because
the collector renders only the latest snapshot. It must not read the DHT itself: the
caller hands it snapshots shaped like `peer status --json`.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Iterator, Optional

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from monitoring.phases import CATEGORIES

SWARM_METRICS: Dict[str, str] = {
    "swarm_peers": "gauge",
    "swarm_global_epoch": "gauge",
    "swarm_samples_per_second": "gauge",
    "swarm_target_progress_ratio": "gauge",
    "swarm_eta_next_epoch_seconds": "gauge",
    "swarm_snapshot_age_seconds": "gauge",
    "swarm_peer_info": "gauge",
    "swarm_peer_samples_per_second": "gauge",
    "swarm_peer_global_epoch": "gauge",
    "swarm_peer_category_fraction": "gauge",
    "swarm_peer_bottleneck": "gauge",
    "swarm_peer_last_seen_seconds": "gauge",
}


class SwarmCollector(Collector):
    """Renders the latest swarm snapshot as metrics on every scrape."""

    def __init__(self, clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot: Optional[Dict[str, Any]] = None
        self._taken_at = 0.0

    def update(self, snapshot: Dict[str, Any]) -> None:
        """snapshot: {"swarm": {peers, global_epoch, samples_per_second, progress, eta_next_epoch_seconds},
        "peers": [{short_id, device, version, client_mode, samples_per_second, epoch, bottleneck,
        fractions, last_seen_seconds}]}"""
        with self._lock:
            self._snapshot, self._taken_at = snapshot, self._clock()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            snapshot, taken_at = self._snapshot, self._taken_at
        if snapshot is None:
            return
        swarm, peers = snapshot["swarm"], snapshot["peers"]
        yield _gauge("swarm_peers", "Live peers with a valid record in the DHT.", swarm["peers"])
        if peers:  # with no live peer, the swarm has no epoch (0 would read as a run that restarted)
            yield _gauge("swarm_global_epoch", "The swarm's global epoch.", swarm["global_epoch"])
        yield _gauge("swarm_samples_per_second", "Sum of the peers' reported samples per second.",
                     swarm["samples_per_second"])
        yield _gauge("swarm_target_progress_ratio", "Samples accumulated toward the target batch, over the target.",
                     swarm["progress"])
        eta = swarm.get("eta_next_epoch_seconds")
        yield _gauge("swarm_eta_next_epoch_seconds", "Estimated seconds until the next global epoch (NaN: unknown).",
                     float("nan") if eta is None else eta)
        yield _gauge("swarm_snapshot_age_seconds", "Seconds since the monitor last read the swarm successfully.",
                     max(0.0, self._clock() - taken_at))

        info = GaugeMetricFamily("swarm_peer_info", "1 per live peer, with its description.",
                                 labels=["peer", "version", "device", "client_mode"])
        speed = GaugeMetricFamily("swarm_peer_samples_per_second", "A peer's reported samples per second.",
                                  labels=["peer"])
        epoch = GaugeMetricFamily("swarm_peer_global_epoch", "A peer's last global epoch.", labels=["peer"])
        last_seen = GaugeMetricFamily("swarm_peer_last_seen_seconds", "Seconds since a peer last published its record.",
                                      labels=["peer"])
        fraction = GaugeMetricFamily("swarm_peer_category_fraction",
                                     "A peer's fraction of wall time per category, from its record.",
                                     labels=["peer", "category"])
        bottleneck = GaugeMetricFamily("swarm_peer_bottleneck", "1 for a peer's dominant category, 0 for the others.",
                                       labels=["peer", "category"])
        for peer in peers:
            peer_id = peer["short_id"]
            info.add_metric([peer_id, peer["version"], peer["device"], str(peer["client_mode"]).lower()], 1)
            speed.add_metric([peer_id], peer["samples_per_second"])
            epoch.add_metric([peer_id], peer["epoch"])
            last_seen.add_metric([peer_id], peer["last_seen_seconds"])
            for category in CATEGORIES:
                fraction.add_metric([peer_id, category], peer["fractions"].get(category, 0.0))
                bottleneck.add_metric([peer_id, category], 1 if peer["bottleneck"] == category else 0)
        yield from (info, speed, epoch, last_seen, fraction, bottleneck)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
