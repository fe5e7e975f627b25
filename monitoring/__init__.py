"""Monitoring: phase timing, metrics, bottleneck classification and the metrics endpoint. Imports nothing of ours."""
from monitoring.classifier import BottleneckChange, BottleneckClassifier
from monitoring.exporter import MetricsBindError, MetricsExporter
from monitoring.health import HealthCheck
from monitoring.metrics import CONTRACT_METRIC_NAMES, CONTRACT_METRICS, CUDA_ONLY_METRICS, ROUND_OUTCOMES, PeerMetrics
from monitoring.phases import CATEGORIES, CATEGORY_OF_PHASE, PHASES, PhaseTimer

__all__ = [
    "CATEGORIES",
    "CATEGORY_OF_PHASE",
    "CONTRACT_METRICS",
    "CONTRACT_METRIC_NAMES",
    "CUDA_ONLY_METRICS",
    "PHASES",
    "ROUND_OUTCOMES",
    "BottleneckChange",
    "BottleneckClassifier",
    "HealthCheck",
    "MetricsExporter",
    "MetricsBindError",
    "PeerMetrics",
    "PhaseTimer",
]
