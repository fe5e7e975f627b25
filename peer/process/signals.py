"""Graceful stop on SIGINT/SIGTERM: the first signal asks, the second one insists.

The first signal only sets a flag: the training loop finishes its step, checkpoints and
shuts down in order. A second signal kills the children and exits at once.

The handler itself does nothing but write the signal's number into a pipe. Python runs a handler in the main
thread between any two bytecodes, inside whatever that thread holds: logging from there (through rich's console,
whose lock the main thread may hold while rich's refresh thread holds the bar's and waits for it) or setting an
Event (whose lock the main thread holds inside Event.wait) can deadlock the peer for good; seen: a Ctrl+C that
froze a peer at a terminal. A thread of its own reads the pipe and does the rest.
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
    start-up never exited). Started here, a signal at that moment still has its default action. A peer shares by
    file descriptor (peer/process/tensor_sharing.py), which starts no manager: this matters where the environment
    asks for file_system.
    """
    from hivemind.utils.mpfuture import SharedBytes

    SharedBytes.next()  # hivemind's own first allocation, which starts the manager


class StopRequest:
    """Set by a signal (or by code); polled by the training loop."""

    def __init__(self, first_signal_does: str = "finishing the current step, saving a checkpoint, leaving the swarm"):
        self._event = threading.Event()
        self.signal_name: str | None = None
        self.first_signal_does = first_signal_does
        self._signal_pipe: tuple[int, int] | None = None  # (read end, write end), once handlers are installed

    def __bool__(self) -> bool:
        return self._event.is_set()

    def set(self, reason: str = "requested") -> None:
        self.signal_name = self.signal_name or reason
        self._event.set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def install_handlers(self) -> None:
        """Handle SIGINT and SIGTERM from now on (again: hivemind sets SIGINT to "ignore" when it starts)."""
        if self._signal_pipe is None:
            self._signal_pipe = os.pipe()
            os.set_blocking(self._signal_pipe[1], False)  # a full pipe drops a signal rather than block the handler
            threading.Thread(target=self._watch_signals, name="signal-watch", daemon=True).start()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        try:
            os.write(self._signal_pipe[1], bytes([signum]))
        except BlockingIOError:  # a hundred signals are already waiting: this one adds nothing
            pass

    def _watch_signals(self) -> None:
        while True:
            for signum in os.read(self._signal_pipe[0], 64):
                self._on_signal(signal.Signals(signum).name)

    def _on_signal(self, name: str) -> None:
        if self:
            logger.warning(f"second {name}: exiting now, without the rest of the shutdown")
            kill_descendants()
            os._exit(ExitCode.SECOND_SIGNAL)
        logger.warning(f"{name} received: {self.first_signal_does} (send it again to exit at once)")
        self.set(name)
