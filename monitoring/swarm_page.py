"""The monitor's live swarm page: `GET /` (a static page) and `GET /swarm.json` (what it draws).

For volunteers who run no Grafana: the page polls /swarm.json and redraws itself, with no
build step and nothing fetched from the internet (page/swarm.html holds its HTML, CSS and
JS). The monitor hands `SwarmPage` each snapshot it reads (shaped like `peer status
--json`); the page keeps a bounded history of the swarm's epoch, speed and validation loss
for its charts. Like the collector, it must not read the DHT itself.

Peer records are written by other machines, so every string in them is untrusted: the
page inserts them as text, never as HTML.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from importlib import resources
from statistics import fmean
from typing import Any, Callable, Deque, Dict, Optional, Tuple

from monitoring.exporter import HealthFn, Route

__all__ = ["HISTORY_POINTS", "SwarmPage"]

HISTORY_POINTS = 2880
"""Snapshots kept for the charts: four hours at the monitor's default 5 s refresh."""


class SwarmPage:
    """The latest snapshot and a ring of past ones, served as the page and its JSON."""

    def __init__(self, health: HealthFn, refresh_seconds: float, clock: Callable[[], float] = time.time,
                 history_points: int = HISTORY_POINTS) -> None:
        self._health = health
        self._refresh_seconds = refresh_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot: Optional[Dict[str, Any]] = None
        self._history: Deque[Dict[str, Any]] = deque(maxlen=history_points)

    def update(self, snapshot: Dict[str, Any]) -> None:
        """Record one read of the swarm (see SwarmCollector.update for its shape)."""
        swarm, peers = snapshot["swarm"], snapshot["peers"]
        losses = [peer["val_loss"] for peer in peers if _finite(peer.get("val_loss"))]
        point = {
            "time": self._clock(),
            "peers": len(peers),
            "epoch": swarm["global_epoch"] if peers else None,
            "samples_per_second": swarm["samples_per_second"],
            # peers validate on the same split, so their mean is the swarm's loss; None before any validated
            "val_loss": fmean(losses) if losses else None,
        }
        with self._lock:
            self._snapshot = snapshot
            self._history.append(point)

    def state(self) -> Dict[str, Any]:
        """Everything the page draws, JSON-ready (non-finite numbers become null)."""
        ok, reason = self._health()
        with self._lock:
            snapshot, history = self._snapshot, list(self._history)
        return _json_ready({
            "time": self._clock(),
            "refresh_seconds": self._refresh_seconds,
            "healthy": ok,
            "health": reason,
            "read": snapshot is not None,
            "swarm": snapshot["swarm"] if snapshot else None,
            "peers": snapshot["peers"] if snapshot else [],
            "contributors": snapshot.get("contributors", []) if snapshot else [],
            "history": history,
        })

    def routes(self) -> Dict[str, Route]:
        """Paths for MetricsExporter: the page and its data."""
        return {"/": _page, "/swarm.json": self._json}

    def _json(self) -> Tuple[bytes, str]:
        return json.dumps(self.state(), allow_nan=False).encode(), "application/json"


def _page() -> Tuple[bytes, str]:
    return resources.files("monitoring").joinpath("page/swarm.html").read_bytes(), "text/html; charset=utf-8"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _json_ready(value: Any) -> Any:
    """A peer may report an infinite rate; JSON has no such number, and the page shows null as unknown."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    return value
