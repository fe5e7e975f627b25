"""Why a peer is paused, and the files through which `peer pause` and `peer resume` reach a running peer.

A peer pauses for any of three reasons, and trains again once none holds (peer/runtime/trainer.py does
the pausing itself):

- requested: `peer pause --checkpoint-dir DIR` asked, until `peer resume --checkpoint-dir DIR`;
- outside-active-hours: --active-hours says this machine is not lent now (peer/active_hours.py);
- busy: with --yield-when-busy, the owner's other programs use the machine (peer/runtime/busy.py).

`peer pause` writes a request into the peer's checkpoint directory, naming the peer's pid (so a request
left behind never pauses the next peer started there), and the peer writes what it does into a state file
beside it. Only the peer's own user may control it: the peer reads a request only from a file that user
owns and nobody else may write to, and the command writes it readable by that user alone.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Dict, Optional

from dht.files import replace_private_json
from peer.active_hours import ActiveHours
from peer.runtime.busy import BusyRule, MachineUse

logger = logging.getLogger(__name__)

REQUESTED, OUTSIDE_HOURS, BUSY = "requested", "outside-active-hours", "busy"
REQUEST_FILE, STATE_FILE = "pause-request.json", "peer-state.json"
PAUSED, TRAINING = "paused", "training"


class PauseGate:
    """The reasons this peer is paused for now, each with a line for a person; it trains while there are none."""

    def __init__(self):
        self._reasons: Dict[str, str] = {}
        self._lock = threading.Lock()
        self._changed = threading.Event()

    def hold(self, reason: str, detail: str) -> None:
        with self._lock:
            if self._reasons.get(reason) != detail:
                self._reasons[reason] = detail
                self._changed.set()

    def release(self, reason: str) -> None:
        with self._lock:
            if self._reasons.pop(reason, None) is not None:
                self._changed.set()

    @property
    def paused(self) -> bool:
        with self._lock:
            return bool(self._reasons)

    def reasons(self) -> Dict[str, str]:
        with self._lock:
            return dict(self._reasons)

    def wait_for_change(self, timeout_seconds: float) -> bool:
        """Wait until a reason comes or goes (at most `timeout_seconds`); whether one did."""
        changed = self._changed.wait(timeout_seconds)
        self._changed.clear()
        return changed


def describe(reasons: Dict[str, str]) -> str:
    return "; ".join(reasons.values())


# --- the files between `peer pause`/`peer resume` and the running peer --------------------------------------


def request(directory: Path, pid: int, paused: bool) -> float:
    """Ask the peer `pid` that holds `directory` to pause or resume; the request's stamp, which it echoes."""
    stamp = time.time()
    replace_private_json(directory / REQUEST_FILE, {"pid": pid, "paused": paused, "at": stamp})
    return stamp


def read_json(path: Path) -> Optional[dict]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or replaced while read: the next poll reads it again
        return None
    return value if isinstance(value, dict) else None


def trusted(path: Path) -> bool:
    """Whether a request file may steer this peer: its owner is this process's user and no one else may write it."""
    try:
        status = path.stat()
    except OSError:
        return False
    return status.st_uid == os.geteuid() and not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class PauseWatch(threading.Thread):
    """Reads the pause request, the active hours and the machine's use, and sets the gate's reasons to match."""

    def __init__(self, gate: PauseGate, directory: Path, active_hours: Optional[ActiveHours] = None,
                 busy: Optional[BusyRule] = None, machine: Optional[MachineUse] = None,
                 now: Callable[[], datetime] = datetime.now, poll_seconds: float = 0.5, busy_poll_seconds: float = 2.0):
        super().__init__(name="PauseWatch", daemon=True)
        self.gate, self.directory, self.active_hours = gate, directory, active_hours
        self.busy, self.machine = busy, machine
        self.now, self.poll_seconds, self.busy_poll_seconds = now, poll_seconds, busy_poll_seconds
        self.request_seen: Optional[float] = None
        """The stamp of the last request this peer read (`peer pause` waits for it in the state file)."""
        self._stop_event = threading.Event()
        self._next_busy_poll = 0.0
        self._warned_untrusted = False

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.poll()
            except Exception as e:  # a reading that fails must not take the peer down: the next poll tries again
                logger.debug(f"pause watch: {e!r}")
            self._stop_event.wait(self.poll_seconds)

    def stop(self, timeout_seconds: float = 2.0) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_seconds)

    def poll(self) -> None:
        self._read_request()
        if self.active_hours is not None:
            if self.active_hours.active(self.now()):
                self.gate.release(OUTSIDE_HOURS)
            else:
                self.gate.hold(OUTSIDE_HOURS, f"outside --active-hours {self.active_hours.text}")
        if self.busy is not None and self.machine is not None and time.monotonic() >= self._next_busy_poll:
            self._next_busy_poll = time.monotonic() + self.busy_poll_seconds
            use = self.machine.read()
            if use is not None and self.busy.observe(use):
                self.gate.hold(BUSY, f"--yield-when-busy: {use.describe()}")
            elif use is not None:
                self.gate.release(BUSY)

    def _read_request(self) -> None:
        path = self.directory / REQUEST_FILE
        if not path.exists():
            return
        if not trusted(path):
            if not self._warned_untrusted:
                self._warned_untrusted = True
                logger.warning(f"ignoring {path}: it is not owned by this peer's user or others may write to it; "
                               f"only `peer pause` and `peer resume`, run by this user, control this peer")
            return
        found = read_json(path)
        if found is None or found.get("pid") != os.getpid() or not isinstance(found.get("paused"), bool):
            return  # a request for an earlier peer in this directory, or not one at all
        stamp = found.get("at")
        self.request_seen = stamp if isinstance(stamp, (int, float)) else None  # before the gate wakes the loop
        if found["paused"]:
            self.gate.hold(REQUESTED, "requested by peer pause")
        else:
            self.gate.release(REQUESTED)


def write_state(directory: Path, state: str, reasons: Dict[str, str], request_seen: Optional[float]) -> None:
    """What this peer does now, for `peer pause`/`peer resume` to read back; a failed write is only logged."""
    try:
        replace_private_json(directory / STATE_FILE, {"pid": os.getpid(), "state": state, "reasons": reasons,
                                                    "request_seen": request_seen, "time": time.time()})
    except OSError as e:
        logger.debug(f"cannot write {directory / STATE_FILE}: {e}")
