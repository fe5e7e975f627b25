"""Phase timing for the training loop: where does a peer's time go?

Phases are timed on the training thread with a monotonic clock. Nested phases are
exclusive: while `averaging` runs inside `optimizer`, the time counts for `averaging`
only, so the phase totals add up to the timed wall time. This module never touches a
device: synchronizing a GPU at phase boundaries is the caller's decision.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional

PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer", "averaging", "state_sync", "joining", "checkpoint")
CATEGORIES = ("preprocessing", "compute", "communication", "other")
CATEGORY_OF_PHASE: Dict[str, str] = {
    "data_wait": "preprocessing",
    "h2d": "preprocessing",
    "forward": "compute",
    "backward": "compute",
    "optimizer": "compute",
    "averaging": "communication",
    "state_sync": "communication",
    "joining": "communication",  # joining the DHT, waiting for --min-peers, catching up (its download: state_sync)
    "checkpoint": "other",
}

PhaseListener = Callable[[str, float], None]
"""Called as listener(phase, seconds) each time a slice of exclusive phase time ends."""


class PhaseTimer:
    """Accumulates exclusive seconds per phase; optionally reports each slice to listeners."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._totals: Dict[str, float] = {phase: 0.0 for phase in PHASES}
        self._stack: List[str] = []
        self._slice_started_at = 0.0
        self._listeners: List[PhaseListener] = []
        self._lock = threading.Lock()  # totals are read from other threads (exporter, records)

    def add_listener(self, listener: PhaseListener) -> None:
        self._listeners.append(listener)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self._totals:
            raise ValueError(f"unknown phase {name!r}; phases are {', '.join(PHASES)}")
        now = self._clock()
        if self._stack:
            self._close_slice(now)  # pause the enclosing phase
        self._stack.append(name)
        self._slice_started_at = now
        try:
            yield
        finally:
            now = self._clock()
            self._close_slice(now)
            self._stack.pop()
            self._slice_started_at = now  # resume the enclosing phase, if any

    def record(self, name: str, seconds: float) -> None:
        """Add time measured elsewhere (e.g. a phase that ran before the timer existed)."""
        if name not in self._totals:
            raise ValueError(f"unknown phase {name!r}; phases are {', '.join(PHASES)}")
        self._add(name, seconds)

    def _close_slice(self, now: float) -> None:
        self._add(self._stack[-1], now - self._slice_started_at)

    def _add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._totals[name] += seconds
        for listener in self._listeners:
            listener(name, seconds)

    @property
    def current_phase(self) -> Optional[str]:
        return self._stack[-1] if self._stack else None

    def totals(self) -> Dict[str, float]:
        """Seconds spent in each phase so far."""
        with self._lock:
            return dict(self._totals)

    def category_totals(self) -> Dict[str, float]:
        """Seconds spent in each category so far."""
        result = {category: 0.0 for category in CATEGORIES}
        for phase, seconds in self.totals().items():
            result[CATEGORY_OF_PHASE[phase]] += seconds
        return result
