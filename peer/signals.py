"""Graceful stop on SIGINT/SIGTERM: the first signal asks, the second one insists.

The first signal only sets a flag: the training loop finishes its step, checkpoints and
shuts down in order. A second signal kills the children and exits at once.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

from peer.lifeline import kill_descendants

logger = logging.getLogger(__name__)

EXIT_ON_SECOND_SIGNAL = 130


class StopRequest:
    """Set by a signal (or by code); polled by the training loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

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
            logger.warning(f"second {name}: exiting now without a checkpoint")
            kill_descendants()
            os._exit(EXIT_ON_SECOND_SIGNAL)
        logger.warning(f"{name} received: finishing the current step, saving a checkpoint, leaving the swarm "
                       f"(send it again to exit at once)")
        self.set(name)
