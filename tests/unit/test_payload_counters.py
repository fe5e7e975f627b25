"""The averaging byte counters carry the codec's payload and its replies': fp16 about half of fp32, 8-bit about a
quarter."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from averaging.api import RoundReport
from averaging.codecs.compression import round_payload_bytes
from monitoring import BottleneckClassifier, HealthCheck, PeerMetrics
from peer.config import load_config
from peer.runtime.builder import MetricsObserver
from peer.tasks import load_task


def sent_bytes_after_one_round(codec: str, params, group_size: int = 4) -> float:
    config = load_config(flags={"grad_compression": codec})
    registry = CollectorRegistry()
    observer = MetricsObserver(PeerMetrics(registry), BottleneckClassifier(), HealthCheck(60))
    observer.on_round(RoundReport("ok", 1.0, group_size), round_payload_bytes(config.averaging, params))
    sent = registry.get_sample_value("peer_averaging_payload_sent_bytes_total")
    assert registry.get_sample_value("peer_averaging_payload_received_bytes_total") == sent
    return sent


# every codec replies in itself: what moves weighs the codec's ratio of fp32, both ways
@pytest.mark.parametrize("codec, ratio, tolerance",
                         [("fp16", 0.5, 0.01), ("uint8", 0.25, 0.02), ("quantile8", 0.25, 0.02),
                          ("int8", 0.27, 0.01), ("int4", 0.14, 0.01),
                          ("topk", 0.0046, 0.0005)])  # 3 of each 256 values, 1.5625 bytes each (and headers)
def test_counters_show_the_codec_ratio_on_the_default_model(codec, ratio, tolerance):
    params = list(load_task("bytelm").build_model().parameters())  # codebooks of 8-bit codecs weigh on tiny tensors
    fp32 = sent_bytes_after_one_round("none", params)
    numel = sum(p.numel() for p in params)
    assert fp32 == int(2 * 3 / 4 * numel * 4)  # butterfly all-reduce: 2(N-1)/N of the payload, 4 bytes a value
    assert sent_bytes_after_one_round(codec, params) / fp32 == pytest.approx(ratio, abs=tolerance)


def test_failed_rounds_move_no_bytes():
    registry = CollectorRegistry()
    observer = MetricsObserver(PeerMetrics(registry), BottleneckClassifier(), HealthCheck(60))
    observer.on_round(RoundReport("timeout", 10.0, 1), 10**6)
    assert registry.get_sample_value("peer_averaging_payload_sent_bytes_total") == 0
    assert registry.get_sample_value("peer_averaging_rounds_total", {"outcome": "timeout"}) == 1
