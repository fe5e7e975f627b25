"""Liveness of the training loop, as served on `/healthz`.

The training loop calls `HealthCheck.beat()` whenever it makes progress; the exporter calls
the check to answer `/healthz`. It must not inspect the swarm, the DHT or the device: a peer
that waits for others still beats (or is judged by the window the operator chose).

A peer that trains but cannot do part of its job (its checkpoints fail) is `degrade()`d with a
reason until `recover()`: unhealthy, so that an operator looks, while training goes on.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Tuple

PAUSED_PREFIX = "paused: "
"""How a paused peer's reason begins (peer pause, --active-hours, --yield-when-busy): healthy, and idle on purpose."""


class HealthCheck:
    """Healthy while the last beat is at most `window_seconds` old; a start-up grace of one window before the first."""

    def __init__(self, window_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not window_seconds > 0:
            raise ValueError(f"window_seconds must be > 0 (got {window_seconds!r})")
        self.window_seconds = float(window_seconds)
        self._clock = clock
        self._created_at = clock()
        self._last_beat: Optional[float] = None
        self._degraded: Optional[str] = None
        self._paused: Optional[Tuple[str, float]] = None  # why, and since when
        self._lock = threading.Lock()

    def beat(self) -> None:
        """The training loop made progress (a step, a round, a loaded state)."""
        now = self._clock()
        with self._lock:
            self._last_beat = now

    def degrade(self, reason: str) -> None:
        """Unhealthy for `reason` (one line for a person) until recover(), whatever the training loop does."""
        with self._lock:
            self._degraded = " ".join(str(reason).split()) or "degraded"

    def pause(self, reason: str) -> None:
        """Healthy while paused on purpose (`peer pause`, --active-hours, --yield-when-busy), whatever the loop does:
        the body says why. A later pause() replaces the reason and keeps the start."""
        now = self._clock()
        with self._lock:
            self._paused = (" ".join(str(reason).split()) or "paused", self._paused[1] if self._paused else now)

    def unpause(self) -> None:
        """Training again: the loop's liveness decides, counted from now."""
        now = self._clock()
        with self._lock:
            self._paused, self._last_beat = None, now

    def recover(self) -> None:
        """Undo degrade(); the training loop's liveness decides again. Harmless when not degraded."""
        with self._lock:
            self._degraded = None

    def __call__(self) -> Tuple[bool, str]:
        """(ok, reason): the reason is one line for a person, e.g. "no training progress for 93s (window 60s)"."""
        ok, reason = self._liveness()
        with self._lock:
            degraded = self._degraded
        if degraded is None:
            return ok, reason
        return False, f"degraded: {degraded}" if ok else f"{reason}; degraded: {degraded}"

    def _liveness(self) -> Tuple[bool, str]:
        now = self._clock()
        with self._lock:
            last_beat, paused = self._last_beat, self._paused
        if paused is not None:
            return True, f"{PAUSED_PREFIX}{paused[0]} (for {now - paused[1]:.0f}s)"
        window = f"window {self.window_seconds:g}s"
        if last_beat is None:
            waited = now - self._created_at
            if waited <= self.window_seconds:
                return True, f"starting: no training step yet ({waited:.0f}s since start, {window})"
            return False, f"training loop has not started ({waited:.0f}s since start, {window})"
        idle = now - last_beat
        if idle <= self.window_seconds:
            return True, f"ok: last training progress {idle:.0f}s ago ({window})"
        return False, f"no training progress for {idle:.0f}s ({window})"
