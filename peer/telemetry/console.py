"""What a person watching `peer start` sees: a bar toward the target batch, a line per epoch.

On a terminal, one rich console draws a bar of the swarm's samples toward the target batch size
(with the swarm's rate and the time to the next epoch) and prints the log records above it, so
that the two never run into each other. When stdout is not a terminal (logs, systemd, tests),
only the per-epoch lines are printed, and log records go to stderr as plain lines.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional

from rich.console import Console
from rich.file_proxy import FileProxy
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    if seconds < 10:
        return f"{seconds:.1f}s"
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class ConsoleLogHandler(logging.Handler):
    """Log records printed by the display's console, above its live bar.

    In a process forked from the peer (hivemind's DHT and averagers, data workers), records are written to stderr
    directly: the fork copied rich's locks as the peer's threads held them at that moment, and a child that waits
    for a lock whose holder it does not have waits for ever (seen: an averager that never started).
    """

    def __init__(self, console: Console):
        super().__init__()
        self.console = console
        self._pid = os.getpid()

    def handle(self, record: logging.LogRecord) -> bool:
        if os.getpid() != self._pid:
            return self._write_from_child(record)
        return super().handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record), highlight=False, markup=False, soft_wrap=True)
        except Exception:  # logging must never take the peer down
            self.handleError(record)

    def _write_from_child(self, record: logging.LogRecord) -> bool:
        if not self.filter(record):
            return False
        try:
            # on the bar's terminal, a line of its own over the bar's (the peer draws the bar again below it)
            stderr = sys.__stderr__
            start = "\r\x1b[2K" if stderr.isatty() else ""
            stderr.write(f"{start}{self.format(record)}\n")
            stderr.flush()
        except Exception:
            self.handleError(record)
        return True


_streams_hook_registered = False


def _own_streams_in_forked_children() -> None:
    """While the bar is drawn, rich has stdout and stderr print through its console (and its locks): a process
    forked from the peer writes to its own streams instead (a warning printed there would wait for ever)."""
    global _streams_hook_registered
    if not _streams_hook_registered:
        os.register_at_fork(after_in_child=_own_streams)
        _streams_hook_registered = True


def _own_streams() -> None:
    if isinstance(sys.stdout, FileProxy):
        sys.stdout = sys.__stdout__
    if isinstance(sys.stderr, FileProxy):
        sys.stderr = sys.__stderr__


class ProgressDisplay:
    def __init__(self, target_batch_size: int, interactive: Optional[bool] = None, clock=time.time):
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self.target = target_batch_size
        self.clock = clock
        self._progress: Optional[Progress] = None
        self._log_handler: Optional[ConsoleLogHandler] = None
        self._replaced_handlers: list = []
        if self.interactive:
            self._progress = Progress(
                TextColumn("epoch {task.fields[epoch]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("samples toward the target batch  swarm {task.fields[rate]}  next epoch in "
                           "{task.fields[eta]}"),
                console=Console(),
                transient=True,
            )
            self._bar = self._progress.add_task("swarm", total=target_batch_size, epoch=0, rate="?", eta="?")
            _own_streams_in_forked_children()
            self._progress.start()

    def route_logs(self) -> None:
        """On a terminal, print the root logger's records through this display's console until close()."""
        if self._progress is None or self._log_handler is not None:
            return
        root = logging.getLogger()
        self._log_handler = ConsoleLogHandler(self._progress.console)
        if root.handlers:  # keep the format and filters that setup_logging chose
            self._log_handler.setFormatter(root.handlers[0].formatter)
            for log_filter in root.handlers[0].filters:
                self._log_handler.addFilter(log_filter)
        self._replaced_handlers, root.handlers[:] = list(root.handlers), [self._log_handler]

    def print(self, line: str) -> None:
        if self._progress is not None:  # long lines are left to the terminal to wrap: addresses stay whole
            self._progress.console.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            print(line, flush=True)

    def update(self, samples_accumulated: int, epoch: int, swarm_samples_per_second: float = 0.0,
               target_batch_size: Optional[int] = None) -> None:
        """`target_batch_size`: the epoch's own (DiLoCo's round factor lengthens it), if not the configured one."""
        if self._progress is None:
            return
        if target_batch_size is not None and target_batch_size != self.target:
            self.target = target_batch_size
            self._progress.update(self._bar, total=target_batch_size)
        done = min(samples_accumulated, self.target)
        rate, eta = "?", "?"
        if swarm_samples_per_second > 0:
            rate = f"{swarm_samples_per_second:.1f} samples/s"
            eta = _duration((self.target - done) / swarm_samples_per_second)
        self._progress.update(self._bar, completed=done, epoch=epoch, rate=rate, eta=eta)

    def epoch_line(self, *, epoch: int, train_loss, val_loss, samples_per_second: float,
                   swarm_samples_per_second: float, peers: int, seconds: float) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.clock()))
        self.print(
            f"{stamp} epoch {epoch}: loss {_fmt(train_loss)}  val_loss {_fmt(val_loss)}  "
            f"this peer {samples_per_second:.1f} samples/s  swarm {swarm_samples_per_second:.1f} samples/s  "
            f"peers {peers}  took {_duration(seconds)}"
        )

    def close(self) -> None:
        if self._log_handler is not None:
            logging.getLogger().handlers[:] = self._replaced_handlers
            self._log_handler = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
