"""The swarm monitor's collector: per-peer series from a snapshot of DHT records, removed when a peer leaves."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from monitoring.swarm_metrics import SWARM_METRICS, SwarmCollector


def snapshot(*short_ids: str) -> dict:
    peers = [
        {"short_id": short_id, "device": "cpu", "version": "0.1.0", "client_mode": False, "samples_per_second": 10.0,
         "epoch": 3, "bottleneck": "compute", "fractions": {"compute": 0.8, "other": 0.2}, "last_seen_seconds": 1.0}
        for short_id in short_ids
    ]
    swarm = {"peers": len(peers), "global_epoch": 3, "samples_per_second": 10.0 * len(peers), "progress": 0.25,
             "eta_next_epoch_seconds": None}
    return {"swarm": swarm, "peers": peers}


def test_collector_renders_the_latest_snapshot_only():
    registry = CollectorRegistry()
    collector = SwarmCollector(clock=lambda: 100.0)
    registry.register(collector)
    assert generate_latest(registry) == b""  # nothing before the first read of the swarm

    collector.update(snapshot("aaaaaaaa", "bbbbbbbb"))
    assert registry.get_sample_value("swarm_peers") == 2
    assert registry.get_sample_value("swarm_peer_bottleneck", {"peer": "aaaaaaaa", "category": "compute"}) == 1
    assert registry.get_sample_value("swarm_peer_category_fraction",
                                     {"peer": "bbbbbbbb", "category": "preprocessing"}) == 0
    exposed = generate_latest(registry).decode()
    assert all(name in exposed for name in SWARM_METRICS)

    collector.update(snapshot("aaaaaaaa"))
    assert registry.get_sample_value("swarm_peers") == 1
    assert registry.get_sample_value("swarm_peer_global_epoch", {"peer": "bbbbbbbb"}) is None
    assert registry.get_sample_value("swarm_peer_global_epoch", {"peer": "aaaaaaaa"}) == 3
    assert registry.get_sample_value("swarm_global_epoch") == 3

    collector.update(snapshot())  # the last peer left: a swarm with no peer has no epoch (not epoch 0)
    assert registry.get_sample_value("swarm_peers") == 0
    assert registry.get_sample_value("swarm_global_epoch") is None
