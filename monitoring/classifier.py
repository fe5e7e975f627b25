"""Names a peer's bottleneck: which category of work dominates its recent wall time.

Fed with `(phase, seconds)` slices (it is a `PhaseTimer` listener), it keeps per-category
seconds in one-second buckets over a sliding window, so memory stays bounded however
fast the training loop runs. Wall time inside the window that no phase covered counts as
"other". The dominant category changes only when a challenger leads by more than the
hysteresis margin, and each change is logged once, with advice a person can act on.

It must not publish metrics or import other packages of this project: the caller copies
`fractions()` and `dominant` into `PeerMetrics.set_bottleneck`.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, NamedTuple, Optional

from monitoring.phases import CATEGORIES, CATEGORY_OF_PHASE, PHASES

logger = logging.getLogger(__name__)

BUCKET_SECONDS = 1.0

ADVICE: Dict[str, str] = {
    "preprocessing": "raise --data-workers or move tokenization offline",
    "compute": "this peer is compute-bound: a larger --batch-size or a faster device helps most",
    "communication": "raise --target-batch-size, enable gradient compression (--grad-compression fp16) "
    "or use --averaging local-sgd/diloco",
    "other": "checkpoint less often, or look for untimed work between steps (logging, evaluation, stalls)",
}


JOINING_ADVICE = ("most of it was joining the swarm (and waiting for --min-peers, and downloading its state), "
                  "which ends once this peer has joined")


class BottleneckChange(NamedTuple):
    """The dominant category changed from `old` (None at the first decision) to `new`, at `fraction` of wall time;
    `joining`: most of that was the `joining` phase and the state downloads around it, not the swarm's rounds."""

    old: Optional[str]
    new: str
    fraction: float
    joining: bool = False


class BottleneckClassifier:
    """Sliding-window per-category time fractions and a hysteresis-stable dominant category."""

    def __init__(
        self,
        window_seconds: float = 60.0,
        hysteresis: float = 0.05,
        min_window_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not window_seconds >= 2 * BUCKET_SECONDS:
            raise ValueError(f"window_seconds must be >= {2 * BUCKET_SECONDS:g} (got {window_seconds!r})")
        if not 0.0 <= hysteresis < 1.0:
            raise ValueError(f"hysteresis must be in [0, 1) (got {hysteresis!r})")
        if not 0.0 <= min_window_seconds <= window_seconds:
            raise ValueError(
                f"min_window_seconds must be between 0 and window_seconds={window_seconds:g} "
                f"(got {min_window_seconds!r})"
            )
        self.window_seconds = float(window_seconds)
        self.hysteresis = float(hysteresis)
        self.min_window_seconds = float(min_window_seconds)
        self._clock = clock
        self._lock = threading.Lock()  # fed on the training thread, read from wherever metrics are refreshed
        # (bucket index, seconds per category) in increasing bucket order; at most window/bucket + 2 entries.
        self._buckets: Deque[tuple[int, List[float]]] = deque()
        self._first_slice_started_at: Optional[float] = None
        self._dominant: Optional[str] = None
        self._joining: Deque[tuple[float, float]] = deque(maxlen=16)  # (start, end) of the `joining` phase's slices

    def observe(self, phase: str, seconds: float) -> None:
        """Add a slice of `seconds` of `phase` that ended now; usable as a `PhaseTimer` listener."""
        category = CATEGORY_OF_PHASE.get(phase)
        if category is None:
            raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
        if not seconds > 0:  # also drops NaN
            return
        index = CATEGORIES.index(category)
        with self._lock:
            now = self._clock()
            if phase == "joining":
                self._joining.append((now - seconds, now))
            start = now - seconds
            if self._first_slice_started_at is None or start < self._first_slice_started_at:
                self._first_slice_started_at = start
            # Only the part inside the window can matter; this also bounds the loop for huge slices.
            start = max(start, now - self.window_seconds - BUCKET_SECONDS)
            while start < now:
                bucket = math.floor(start / BUCKET_SECONDS)
                end = min(now, (bucket + 1) * BUCKET_SECONDS)
                self._bucket(bucket)[index] += end - start
                start = end
            self._prune(now)

    __call__ = observe

    def fractions(self) -> Dict[str, float]:
        """Per-category fraction of the window's wall time; they sum to 1 once any slice was seen, else all 0."""
        with self._lock:
            return self._fractions(self._clock())

    @property
    def dominant(self) -> Optional[str]:
        """The current bottleneck category, or None before the first decision."""
        return self._dominant

    def update(self) -> Optional[BottleneckChange]:
        """Re-decide the dominant category; returns (and logs once) a change, else None."""
        with self._lock:
            now = self._clock()
            if self._first_slice_started_at is None or now - self._first_slice_started_at < self.min_window_seconds:
                return None  # too little history to judge
            fractions = self._fractions(now)
            old = self._dominant
            leader = max(CATEGORIES, key=lambda c: fractions[c])  # ties go to the earlier category
            if leader == old:
                return None
            if old is not None and fractions[leader] <= fractions[old] + self.hysteresis:
                return None
            self._dominant = leader
            change = BottleneckChange(old, leader, fractions[leader], self._mostly_joining(leader, fractions, now))
        logger.info(describe(change, self.window_seconds))
        return change

    def _mostly_joining(self, leader: str, fractions: Dict[str, float], now: float) -> bool:
        """Whether the `joining` phase is at least half of the window's communication time."""
        if leader != "communication":
            return False
        window_start = max(now - self.window_seconds, self._first_slice_started_at)
        joining = sum(max(0.0, min(end, now) - max(start, window_start)) for start, end in self._joining)
        return joining >= 0.5 * fractions["communication"] * (now - window_start)

    def _bucket(self, index: int) -> List[float]:
        if self._buckets and self._buckets[-1][0] == index:
            return self._buckets[-1][1]
        for bucket_index, seconds in reversed(self._buckets):  # an older bucket: only for slices spanning buckets
            if bucket_index == index:
                return seconds
            if bucket_index < index:
                break
        seconds = [0.0] * len(CATEGORIES)
        position = len(self._buckets)
        while position > 0 and self._buckets[position - 1][0] > index:
            position -= 1
        self._buckets.insert(position, (index, seconds))
        return seconds

    def _prune(self, now: float) -> None:
        window_start = now - self.window_seconds
        while self._buckets and (self._buckets[0][0] + 1) * BUCKET_SECONDS <= window_start:
            self._buckets.popleft()

    def _fractions(self, now: float) -> Dict[str, float]:
        result = {category: 0.0 for category in CATEGORIES}
        if self._first_slice_started_at is None:
            return result
        self._prune(now)
        window_start = max(now - self.window_seconds, self._first_slice_started_at)
        covered = [0.0] * len(CATEGORIES)
        for bucket_index, seconds in self._buckets:
            bucket_start = bucket_index * BUCKET_SECONDS
            # The oldest bucket straddles the window start: count the share inside, assuming even spread.
            weight = min(1.0, ((bucket_start + BUCKET_SECONDS) - window_start) / BUCKET_SECONDS)
            if weight <= 0:
                continue
            for i, value in enumerate(seconds):
                covered[i] += value * weight
        wall = max(0.0, now - window_start)
        total_covered = sum(covered)
        # Time reported from elsewhere (PhaseTimer.record) or bucket rounding can exceed the wall time:
        # then fractions are shares of the covered time, so they still sum to 1.
        denominator = max(wall, total_covered)
        if denominator <= 0:
            return result
        for category, value in zip(CATEGORIES, covered):
            result[category] = value / denominator
        result["other"] += max(0.0, wall - total_covered) / denominator
        return result


def describe(change: BottleneckChange, window_seconds: float) -> str:
    """One line a person understands: what dominates, how much, and what to do about it."""
    what = "other work (checkpoints, untimed code)" if change.new == "other" else change.new
    was = f" (bottleneck was {change.old})" if change.old is not None else ""
    return (
        f"{what} now takes {change.fraction:.0%} of wall time over the last {window_seconds:g}s{was}; "
        f"{JOINING_ADVICE if change.joining else ADVICE[change.new]}"
    )
