"""Graceful stop on SIGINT/SIGTERM: the first signal asks, the second one insists.

The first signal only sets a flag: the training loop finishes its step, checkpoints and
shuts down in order. A second signal kills the children and exits at once.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

from peer.exit_codes import ExitCode
from peer.process.lifeline import kill_descendants

logger = logging.getLogger(__name__)



def start_shared_memory_manager() -> None:
    """Start torch's shared-memory manager now, before our signal handlers exist.

    hivemind shares a block of bytes between processes for its futures (one per DHT
    request), under torch's file_system strategy, and torch starts a manager process on the
    first one. A signal with a Python handler that arrives during that start leaves torch
    2.13 spinning in start_manager at 100% CPU forever (seen: a peer stopped right after
    start-up never exited). Started here, a signal at that moment still has its default action.
    """
    from hivemind.utils.mpfuture import SharedBytes

    SharedBytes.next()  # hivemind's own first allocation, which starts the manager


class StopRequest:
    """Set by a signal (or by code); polled by the training loop."""

    def __init__(self, first_signal_does: str = "finishing the current step, saving a checkpoint, leaving the swarm"):
        self._event = threading.Event()
        self.signal_name: str | None = None
        self.first_signal_does = first_signal_does

    def __bool__(self) -> bool:
        return self._event.is_set()

    def set(self, reason: str = "requested") -> None:
        self.signal_name = self.signal_name or reason
        self._event.set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def install_handlers(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self:
            logger.warning(f"second {name}: exiting now, without the rest of the shutdown")
            kill_descendants()
            os._exit(ExitCode.SECOND_SIGNAL)
        logger.warning(f"{name} received: {self.first_signal_does} (send it again to exit at once)")
        self.set(name)
