"""What a person watching `peer start` sees: a bar toward the target batch, a line per epoch.

On a terminal, a rich progress bar shows the swarm's samples toward the target batch size.
When stdout is not a terminal (logs, systemd, tests), only the per-epoch lines are printed.
"""
from __future__ import annotations

import sys
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.4f}"


class ProgressDisplay:
    def __init__(self, target_batch_size: int, interactive: Optional[bool] = None):
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self.target = target_batch_size
        self._progress: Optional[Progress] = None
        if self.interactive:
            self._progress = Progress(
                TextColumn("epoch {task.fields[epoch]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("samples toward the target batch"),
                console=Console(),
                transient=True,
            )
            self._bar = self._progress.add_task("swarm", total=target_batch_size, epoch=0)
            self._progress.start()

    def print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, highlight=False, markup=False)
        else:
            print(line, flush=True)

    def update(self, samples_accumulated: int, epoch: int) -> None:
        if self._progress is not None:
            self._progress.update(self._bar, completed=min(samples_accumulated, self.target), epoch=epoch)

    def epoch_line(self, *, epoch: int, train_loss, val_loss, samples_per_second: float, peers: int) -> None:
        self.print(
            f"epoch {epoch}: loss {_fmt(train_loss)}  val_loss {_fmt(val_loss)}  "
            f"{samples_per_second:.1f} samples/s  peers {peers}"
        )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
