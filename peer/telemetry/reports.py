"""What the training loop (peer/runtime/trainer.py) reports, and the observer interface it reports to.

Kept apart from the loop so that telemetry (observers.py) depends on this small contract, not on the loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from averaging.api import RoundLength, RoundReport


@dataclass(frozen=True)
class EpochReport:
    """A global epoch as this peer lived it."""

    epoch: int
    train_loss: Optional[float]
    """The mean loss of this peer's batches; None if it trained none (it downloaded the state)."""
    val_loss: Optional[float]
    samples: int
    seconds: float
    swarm_samples_per_second: float
    peers: int

    @property
    def samples_per_second(self) -> float:
        return self.samples / max(1e-9, self.seconds)


class TrainingObserver:
    """What the loop reports as it goes; the default does nothing. peer/telemetry/observers.py connects it to the
    metrics and the events file."""

    def on_joined(self, epoch: int, peers: int, val_loss: Optional[float]) -> None:
        """Training starts at `epoch` (after the start gate and any catching up)."""

    def on_step(self, samples: int, loss: float) -> None: ...

    def on_epoch(self, report: EpochReport) -> None: ...

    def on_round(self, report: RoundReport, payload_bytes: int) -> None: ...

    def on_state_loaded(self, epoch: int) -> None: ...

    def on_round_length(self, length: RoundLength) -> None:
        """As it enters an epoch (DiLoCo): the swarm's round factor, what this peer asks for, and its upload budget."""

    def on_swarm(self, peers: int, samples_per_second: float, progress_ratio: float) -> None: ...

    def on_checkpoint(self, epoch: int, path: Optional[str], problem: str = "") -> None:
        """A checkpoint was written to `path`, or not (path None): then `problem` is one line for a person."""

    def on_dropped_contribution(self, reason: str) -> None: ...

    def on_exclusion(self, peer_id: str) -> None: ...

    def on_harmful_updates(self, found) -> None:
        """Averaged updates raised this peer's held-out loss repeatedly: it refuses the peers of those rounds
        (averaging/pipeline/update_check.py HarmfulUpdates)."""

    def on_state_check(self, check) -> None:
        """This peer compared its state with the swarm's (averaging/swarm/digests.py StateCheck)."""

    def on_download_rejected(self, donor: str, reason: str) -> None: ...

    def on_reducing_changed(self, reduces: bool) -> None:
        """This peer stopped (False) or resumed (True) reducing parts of the average for its groups."""

    def on_paused(self, epoch: int, reasons: Dict[str, str], parked_bytes: int) -> None:
        """The loop stood aside (peer/runtime/pausing.py says why)."""

    def on_resumed(self, epoch: int, paused_seconds: float, seconds: float, downloaded: bool) -> None: ...

    def on_leaving(self, reason: str) -> None:
        """The loop has ended, for `reason`; the peer checkpoints and leaves."""
