"""The metric contract of a peer: every Prometheus series it exports, defined in one place.

Dashboards, alerts and tests depend on these names, label sets and label values; change
them only together with `deploy/` and the tests. `PeerMetrics` registers everything on
the `CollectorRegistry` it is given and never on prometheus_client's global registry.
Label values come from small closed sets (phases, categories, outcomes), which are all
pre-created, so every series exists from the first scrape.

This module records values it is handed; it must not time anything, talk to the swarm,
or import other packages of this project.
"""
from __future__ import annotations

import math
import sys
from typing import Dict, Iterable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from monitoring.phases import CATEGORIES, CATEGORY_OF_PHASE, PHASES

ROUND_OUTCOMES = ("ok", "partial", "failed", "timeout", "skipped")
"""Values of the `outcome` label of `peer_averaging_rounds_total`."""

DROP_REASONS = ("weight", "non-finite", "norm", "direction")
"""Values of the `reason` label of `peer_dropped_contributions_total` (averaging/pipeline/robust.py)."""

REJECTION_REASONS = ("digest_mismatch", "not_majority", "unpublished")
"""Values of the `reason` label of `peer_rejected_state_downloads_total` (averaging/swarm/digests.py)."""

PAUSE_REASONS = ("requested", "outside-active-hours", "busy")
"""Values of the `reason` label of `peer_paused` (peer/runtime/pausing.py)."""

ROUND_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, math.inf)
"""Averaging round durations: from a LAN round of tens of ms to a 5-minute timeout."""

# Exposed names as written in PromQL (counters with `_total`; the histogram by its base
# name, whose series are `_bucket`, `_sum` and `_count`), mapped to their Prometheus type.
PEER_METRICS: Dict[str, str] = {
    "peer_phase_seconds_total": "counter",
    "peer_category_seconds_total": "counter",
    "peer_category_fraction": "gauge",
    "peer_bottleneck": "gauge",
    "peer_samples_total": "counter",
    "peer_local_steps_total": "counter",
    "peer_global_epoch": "gauge",
    "peer_train_loss": "gauge",
    "peer_validation_loss": "gauge",
    "peer_swarm_peers": "gauge",
    "peer_swarm_samples_per_second": "gauge",
    "peer_target_progress_ratio": "gauge",
    "peer_averaging_rounds_total": "counter",
    "peer_averaging_round_seconds": "histogram",
    "peer_averaging_group_size": "gauge",
    "peer_averaging_payload_sent_bytes_total": "counter",
    "peer_averaging_payload_received_bytes_total": "counter",
    "peer_checkpoint_failures_total": "counter",
    "peer_dropped_contributions_total": "counter",
    "peer_exclusions_total": "counter",
    "peer_state_agrees": "gauge",
    "peer_state_disagreements_total": "counter",
    "peer_rejected_state_downloads_total": "counter",
    "peer_late_contributions_total": "counter",
    "peer_averaging_reducing": "gauge",
    "peer_paused": "gauge",
    "peer_paused_seconds_total": "counter",
    "peer_upload_budget_bits_per_second": "gauge",
    "peer_upload_bits_per_second": "gauge",
    "peer_round_factor_requested": "gauge",
    "peer_round_factor": "gauge",
    "peer_info": "gauge",
    "peer_gpu_memory_allocated_bytes": "gauge",
    "peer_gpu_memory_peak_bytes": "gauge",
}
CUDA_ONLY_METRICS = ("peer_gpu_memory_allocated_bytes", "peer_gpu_memory_peak_bytes")
"""Exported only by a peer that trains on CUDA: on the CPU they would read 0, as if the GPU were idle."""
PROCESS_METRICS: Dict[str, str] = {
    # From prometheus_client's ProcessCollector (Linux /proc); only these two are part of the contract.
    "process_cpu_seconds_total": "counter",
    "process_resident_memory_bytes": "gauge",
}
CONTRACT_METRICS: Dict[str, str] = {**PEER_METRICS, **PROCESS_METRICS}
CONTRACT_METRIC_NAMES = tuple(CONTRACT_METRICS)

INFO_LABELS = ("version", "device", "strategy", "compression")


class PeerMetrics:
    """All metrics of one peer, registered on `registry`; the training loop calls the methods below.
    The CUDA_ONLY_METRICS only with `cuda`."""

    def __init__(self, registry: CollectorRegistry, cuda: bool = False) -> None:
        self.registry = registry
        r = registry
        # Counters are declared without `_total`: prometheus_client appends it when exposing.
        self.phase_seconds = Counter(
            "peer_phase_seconds", "Exclusive wall seconds spent in each training-loop phase.", ["phase"], registry=r
        )
        self.category_seconds = Counter(
            "peer_category_seconds",
            "Exclusive wall seconds per category (preprocessing, compute, communication, other); "
            "the sum of peer_phase_seconds_total over the phases of each category.",
            ["category"],
            registry=r,
        )
        self.category_fraction = Gauge(
            "peer_category_fraction",
            "Fraction of wall time spent in each category over the classifier's sliding window; "
            "time outside any timed phase counts as other.",
            ["category"],
            registry=r,
        )
        self.bottleneck = Gauge(
            "peer_bottleneck", "1 for the category that currently dominates this peer's time, 0 for the others.",
            ["category"], registry=r,
        )
        self.samples = Counter("peer_samples", "Training samples processed by this peer.", registry=r)
        self.local_steps = Counter("peer_local_steps", "Local optimizer steps (batches) taken by this peer.",
                                   registry=r)
        self.global_epoch = Gauge("peer_global_epoch", "Global epoch (averaged update) this peer is at.", registry=r)
        self.train_loss = Gauge("peer_train_loss", "Training loss of this peer's latest local step.", registry=r)
        self.validation_loss = Gauge("peer_validation_loss", "Latest validation loss measured by this peer.",
                                     registry=r)
        self.swarm_peers = Gauge("peer_swarm_peers", "Peers of the swarm visible to this peer, itself included.",
                                 registry=r)
        self.swarm_samples_per_second = Gauge(
            "peer_swarm_samples_per_second", "Training throughput of the whole swarm as this peer sees it.",
            registry=r,
        )
        self.target_progress_ratio = Gauge(
            "peer_target_progress_ratio",
            "Samples the swarm has accumulated in this global epoch divided by the target batch size.",
            registry=r,
        )
        self.averaging_rounds = Counter(
            "peer_averaging_rounds", "Averaging rounds by outcome (ok, partial, failed, timeout, skipped).",
            ["outcome"], registry=r,
        )
        self.averaging_round_seconds = Histogram(
            "peer_averaging_round_seconds",
            "Duration of attempted averaging rounds (matchmaking and all-reduce); skipped rounds are not observed.",
            buckets=ROUND_SECONDS_BUCKETS,
            registry=r,
        )
        self.averaging_group_size = Gauge(
            "peer_averaging_group_size", "Number of peers in this peer's latest averaging group.", registry=r
        )
        self.sent_bytes = Counter(
            "peer_averaging_payload_sent_bytes",
            "Averaging payload bytes sent, after compression; computed from tensor sizes and the codec, "
            "not measured on the wire (excludes protocol overhead, DHT and state-download traffic).",
            registry=r,
        )
        self.received_bytes = Counter(
            "peer_averaging_payload_received_bytes",
            "Averaging payload bytes received, after compression; computed from tensor sizes and the codec, "
            "not measured on the wire (excludes protocol overhead, DHT and state-download traffic).",
            registry=r,
        )
        self.checkpoint_failures = Counter(
            "peer_checkpoint_failures",
            "Checkpoints that could not be written (full, read-only or missing disk); the peer kept training.",
            registry=r,
        )
        self.dropped_contributions = Counter(
            "peer_dropped_contributions",
            "Other peers' contributions that this peer's reducers left out of a round, by reason.", ["reason"],
            registry=r,
        )
        self.exclusions = Counter(
            "peer_exclusions",
            "Peers this peer excluded from averaging and state sharing after repeated dropped contributions.",
            registry=r,
        )
        self.harmful_updates = Counter(
            "peer_harmful_updates",
            "Averaged updates that raised this peer's held-out loss past --harmful-update-rise, counted when it "
            "acted on them (refused the peers of those rounds).", registry=r,
        )
        self.refused_peers = Counter(
            "peer_refused_peers",
            "Peers this peer stopped averaging with because the updates of their groups were harmful.", registry=r,
        )
        self.state_agrees = Gauge(
            "peer_state_agrees",
            "1 while this peer's state digest is the swarm's at the last epoch compared, 0 while it is apart; "
            "NaN before any comparison (or with a strategy whose peers hold different states).", registry=r,
        )
        self.state_disagreements = Counter(
            "peer_state_disagreements",
            "Epochs at which this peer found its state apart from the swarm's (then it downloads).", registry=r,
        )
        self.rejected_downloads = Counter(
            "peer_rejected_state_downloads",
            "Downloaded states refused before they were applied, by reason.", ["reason"], registry=r,
        )
        self.late_contributions = Counter(
            "peer_late_contributions",
            "Rounds in which this peer's contribution reached its group after the reducers' grace window and was "
            "left out (it still received the round's result): a slow uplink or a busy machine.", registry=r,
        )
        self.reducing = Gauge(
            "peer_averaging_reducing",
            "1 while this peer reduces parts of the average for its groups, 0 while it stands aside because its "
            "contributions came too late for them.", registry=r,
        )
        self.paused = Gauge(
            "peer_paused",
            "1 for each reason this peer is paused for now (requested, outside-active-hours, busy), else 0: a paused "
            "peer counts no samples and joins no round.", ["reason"], registry=r,
        )
        self.paused_seconds = Counter(
            "peer_paused_seconds", "Time this peer spent paused, counted as each pause ends.", registry=r,
        )
        self.upload_budget = Gauge(
            "peer_upload_budget_bits_per_second",
            "This peer's upload budget for averaging (--max-upload-mbit x 1e6); NaN: no budget.", registry=r,
        )
        self.upload_rate = Gauge(
            "peer_upload_bits_per_second",
            "What this peer's averaging rounds uploaded over the last minute (over the last round interval where "
            "rounds are further apart); computed like peer_averaging_payload_sent_bytes_total.",
            registry=r,
        )
        self.round_factor_requested = Gauge(
            "peer_round_factor_requested",
            "The round factor this peer's upload budget asks the swarm for (1 without a budget): rounds of this many "
            "target batches.", registry=r,
        )
        self.round_factor = Gauge(
            "peer_round_factor",
            "The swarm's round factor at this peer's epoch: its outer rounds are this many target batches long.",
            registry=r,
        )
        self.info = Gauge(
            "peer_info", "Constant 1, labelled with this peer's software version, device, strategy and compression.",
            list(INFO_LABELS), registry=r,
        )
        self.gpu_memory_allocated = self.gpu_memory_peak = None
        if cuda:
            self.gpu_memory_allocated = Gauge(
                "peer_gpu_memory_allocated_bytes", "CUDA memory currently allocated by tensors of this process.",
                registry=r,
            )
            self.gpu_memory_peak = Gauge(
                "peer_gpu_memory_peak_bytes", "Peak CUDA memory allocated by tensors of this process.", registry=r
            )
        self.process = ProcessCollector(registry=r)

        for phase in PHASES:
            self.phase_seconds.labels(phase=phase)
        for category in CATEGORIES:
            self.category_seconds.labels(category=category)
            self.category_fraction.labels(category=category)
            self.bottleneck.labels(category=category)
        for outcome in ROUND_OUTCOMES:
            self.averaging_rounds.labels(outcome=outcome)
        for reason in DROP_REASONS:
            self.dropped_contributions.labels(reason=reason)
        for reason in REJECTION_REASONS:
            self.rejected_downloads.labels(reason=reason)
        self.state_agrees.set(math.nan)
        self.upload_budget.set(math.nan)
        self.round_factor_requested.set(1)
        self.round_factor.set(1)
        self.reducing.set(1)
        for reason in PAUSE_REASONS:
            self.paused.labels(reason=reason).set(0)
        self.train_loss.set(math.nan)  # NaN, not 0, until a loss is known: 0 would read as a perfect model
        self.validation_loss.set(math.nan)

    def observe_phase(self, phase: str, seconds: float) -> None:
        """Add one slice of exclusive phase time; usable as a `PhaseTimer` listener."""
        category = CATEGORY_OF_PHASE.get(phase)
        if category is None:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        seconds = max(0.0, seconds)  # a listener must never raise into the training loop over clock noise
        self.phase_seconds.labels(phase=phase).inc(seconds)
        self.category_seconds.labels(category=category).inc(seconds)

    def record_step(self, samples: int, loss: float) -> None:
        """One local step of `samples` samples ended with training loss `loss`."""
        self.samples.inc(max(0, samples))
        self.local_steps.inc()
        self.train_loss.set(loss)

    def set_global_epoch(self, epoch: int) -> None:
        self.global_epoch.set(epoch)

    def set_validation_loss(self, value: float) -> None:
        self.validation_loss.set(value)

    def set_swarm(self, peers: int, samples_per_second: float, progress_ratio: float) -> None:
        """What this peer sees of the swarm: visible peers, total throughput, progress toward the target batch."""
        self.swarm_peers.set(peers)
        self.swarm_samples_per_second.set(samples_per_second)
        self.target_progress_ratio.set(progress_ratio)

    def record_round(self, outcome: str, seconds: float, group_size: int, sent_bytes: int,
                     received_bytes: int, left_out: bool = False) -> None:
        """One averaging round ended. Bytes are payload after compression, as computed by the caller; `left_out`:
        this peer's contribution came after the reducers' grace window."""
        if outcome not in ROUND_OUTCOMES:
            raise ValueError(f"unknown averaging outcome {outcome!r}; outcomes are {', '.join(ROUND_OUTCOMES)}")
        self.averaging_rounds.labels(outcome=outcome).inc()
        if outcome != "skipped":
            self.averaging_round_seconds.observe(max(0.0, seconds))
            if group_size > 0:
                self.averaging_group_size.set(group_size)
        self.sent_bytes.inc(max(0, sent_bytes))
        self.received_bytes.inc(max(0, received_bytes))
        if left_out:
            self.late_contributions.inc()

    def set_reducing(self, reduces: bool) -> None:
        """Whether this peer reduces parts of the average for its groups (0: it stands aside, too slow for them)."""
        self.reducing.set(1 if reduces else 0)

    def set_paused(self, reasons: Iterable[str]) -> None:
        """The reasons this peer is paused for now (none: it trains)."""
        reasons = set(reasons)
        for reason in PAUSE_REASONS:
            self.paused.labels(reason=reason).set(1 if reason in reasons else 0)

    def set_round_length(self, factor: int, requested: int, budget_mbit: Optional[float]) -> None:
        """The swarm's round factor at this peer's epoch, the one it asks for, and its upload budget (None: none)."""
        self.round_factor.set(factor)
        self.round_factor_requested.set(requested)
        self.upload_budget.set(math.nan if budget_mbit is None else budget_mbit * 1e6)

    def set_upload_rate(self, mbit: float) -> None:
        """What averaging uploaded over the last minute, in Mbit/s (exported in bits per second)."""
        self.upload_rate.set(max(0.0, mbit) * 1e6)

    def record_pause(self, seconds: float) -> None:
        self.paused_seconds.inc(max(0.0, seconds))

    def record_checkpoint_failure(self) -> None:
        """A checkpoint could not be written."""
        self.checkpoint_failures.inc()

    def record_dropped_contribution(self, reason: str) -> None:
        """A reducer of this peer left another peer's contribution out of a round."""
        if reason not in DROP_REASONS:
            raise ValueError(f"unknown drop reason {reason!r}; reasons are {', '.join(DROP_REASONS)}")
        self.dropped_contributions.labels(reason=reason).inc()

    def record_exclusion(self) -> None:
        """This peer excluded another one."""
        self.exclusions.inc()

    def record_harmful_updates(self, updates: int, peers: int) -> None:
        """This peer acted on `updates` harmful averaged updates by refusing `peers` peers."""
        self.harmful_updates.inc(updates)
        self.refused_peers.inc(peers)

    def record_state_check(self, agrees: bool) -> None:
        """This peer compared its state digest with the swarm's (once per change, and per epoch it is apart)."""
        self.state_agrees.set(1.0 if agrees else 0.0)
        if not agrees:
            self.state_disagreements.inc()

    def record_rejected_download(self, reason: str) -> None:
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}; reasons are {', '.join(REJECTION_REASONS)}")
        self.rejected_downloads.labels(reason=reason).inc()

    def set_info(self, version: str, device: str, strategy: str, compression: str) -> None:
        """Describe this peer; replaces any earlier description, so `peer_info` has exactly one series."""
        self.info.clear()
        self.info.labels(version=version, device=device, strategy=strategy, compression=compression).set(1)

    def set_bottleneck(self, fractions: Mapping[str, float], dominant: Optional[str]) -> None:
        """Publish the classifier's view: per-category fractions, and which category dominates (None: unknown)."""
        if dominant is not None and dominant not in CATEGORIES:
            raise ValueError(f"unknown category {dominant!r}; categories are {', '.join(CATEGORIES)}")
        for category in CATEGORIES:
            self.category_fraction.labels(category=category).set(fractions.get(category, 0.0))
            self.bottleneck.labels(category=category).set(1 if category == dominant else 0)

    def update_gpu_memory(self) -> bool:
        """Read CUDA memory of the current device into the GPU gauges; returns False (and does nothing) off CUDA
        or for a peer built without them.

        torch is looked up, not imported: if this process has not imported torch, CUDA cannot be
        initialized either, and importing torch here would cost seconds for nothing.
        """
        torch = sys.modules.get("torch")
        if self.gpu_memory_allocated is None or torch is None or not torch.cuda.is_available() \
                or not torch.cuda.is_initialized():
            return False
        device = torch.cuda.current_device()
        self.gpu_memory_allocated.set(torch.cuda.memory_allocated(device))
        self.gpu_memory_peak.set(torch.cuda.max_memory_allocated(device))
        return True
