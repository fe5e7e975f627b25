"""The events file (`--events PATH`): what a peer does, one JSON object per line, for programs.

People read the log; programs read this: the asyncio harness (peer/testing/), an operator's
scripts, a dashboard. Every line is one event with `v` (the schema version), `event` (its kind)
and `time` (Unix seconds), then the fields of its kind below.

Each line is written with one `write` on a file opened for appending, then closed: lines of two
writers never interleave, a reader never sees half a line except the last one while it is being
written, and a peer killed with SIGKILL leaves only whole lines behind. A failure to write (a full
disk) is logged once and never stops training.

Versioning: fields may be added under the same version; removing a field or changing its meaning
raises SCHEMA_VERSION. Readers skip kinds they do not know.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Annotated, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: int = SCHEMA_VERSION
    time: float = Field(default_factory=time.time)


class Ready(Event):
    """The peer is a member of the swarm (its settings matched the run's manifest), or the bootstrap node
    serves: others can join through `multiaddrs`."""

    event: Literal["ready"] = "ready"
    role: Literal["peer", "bootstrap"] = "peer"
    peer_id: str
    run_id: str
    multiaddrs: List[str]
    metrics_url: Optional[str] = None
    run_owner: Optional[str] = None
    """The fingerprint of the run owner whose manifest it trains with (a bootstrap node: the one given, if any)."""


class Joined(Event):
    """Passed the --min-peers gate and caught up: training starts at `epoch`."""

    event: Literal["joined"] = "joined"
    epoch: int
    peers: int
    val_loss: Optional[float] = None


class StateDownloaded(Event):
    event: Literal["state_downloaded"] = "state_downloaded"
    epoch: int


class EpochEnded(Event):
    """A global epoch ended for this peer (once per epoch; a state download may skip some)."""

    event: Literal["epoch"] = "epoch"
    epoch: int
    train_loss: Optional[float] = None
    """The mean loss of this peer's batches in the epoch; None if it trained none (it downloaded state)."""
    val_loss: Optional[float] = None
    samples: int
    """This peer's samples in the epoch."""
    seconds: float
    samples_per_second: float
    """This peer's rate over the epoch."""
    swarm_samples_per_second: float
    peers: int


class RoundEnded(Event):
    event: Literal["round"] = "round"
    outcome: str
    """ok, partial, failed, timeout or skipped (averaging/api.py OUTCOMES)."""
    seconds: float
    group_size: int
    reason: str = ""
    left_out: float = 0.0
    """The share of this peer's contribution that reached its group after the reducers' grace window and was left
    out of the round (averaging/pipeline/stragglers.py); this peer still received the round's result."""
    group: List[str] = []
    """The peer ids (base58) of the round's group, this peer's among them, where the round formed one."""


class ReducingChanged(Event):
    """This peer stopped reducing parts of the average for its groups (its contributions came after their grace
    window: a slow uplink or a busy machine), or reduces again (in time for long enough)."""

    event: Literal["reducing"] = "reducing"
    reduces: bool


class RoundFactorChanged(Event):
    """The swarm's round factor changed at `epoch` (DiLoCo): outer rounds are `factor` x --target-batch-size samples
    from there on (averaging/swarm/round_factor.py)."""

    event: Literal["round_factor"] = "round_factor"
    epoch: int
    factor: int
    previous: int
    requested: int
    """What this peer asks for (1 without --max-upload-mbit)."""


class UploadBudgetUnmet(Event):
    """Not even the longest round the swarm allows keeps this peer's averaging within --max-upload-mbit (said once,
    and again only after it was met in between)."""

    event: Literal["upload_budget_unmet"] = "upload_budget_unmet"
    epoch: int
    budget_mbit: float
    needed_mbit: float
    """What averaging sends at the longest round, in Mbit/s."""
    max_round_factor: int


class CheckpointWritten(Event):
    event: Literal["checkpoint"] = "checkpoint"
    epoch: int
    ok: bool
    path: Optional[str] = None
    problem: str = ""


class BottleneckChanged(Event):
    event: Literal["bottleneck"] = "bottleneck"
    category: str
    """preprocessing, compute, communication or other (monitoring/classifier.py)."""
    previous: Optional[str] = None
    fractions: Dict[str, float]


class PeerExcluded(Event):
    event: Literal["excluded"] = "excluded"
    peer_id: str
    """The excluded peer, not this one."""


class UpdatesRefused(Event):
    """Averaged updates raised this peer's held-out loss in `epochs`: it stopped averaging with, and taking state
    from, the peers of those rounds (averaging/pipeline/update_check.py); no verdict on any one of them."""

    event: Literal["updates_refused"] = "updates_refused"
    peers: List[str]
    epochs: List[int]
    losses: List[List[float]]
    """Per epoch: the held-out loss before the update, and after it."""


class StateChecked(Event):
    """This peer compared its state digest with the digests other peers published for `epoch`
    (averaging/swarm/digests.py); emitted when whether it agrees changes."""

    event: Literal["state_checked"] = "state_checked"
    epoch: int
    agrees: bool
    """It holds the state most comparable peers at `epoch` hold (or no peer could be compared)."""
    peers: int
    """The peers whose digests for `epoch` were compared, this one included."""
    majority: Optional[str] = None
    """The digest this peer adopts as the swarm's, or None when there was nothing to compare."""


class DownloadRejected(Event):
    """A downloaded state was refused before it was applied (it is never applied)."""

    event: Literal["download_rejected"] = "download_rejected"
    donor: str
    reason: str
    """digest_mismatch (not what the donor published), not_majority (the donor's state is not the swarm's)."""


class SwarmSplit(Event):
    """Peers this one trained with can no longer be reached while others still can: the swarm looks split."""

    event: Literal["swarm_split"] = "swarm_split"
    reachable: int
    unreachable: List[str]


class SwarmRejoined(Event):
    """Peers that were unreachable (a SwarmSplit) can be reached again."""

    event: Literal["swarm_rejoined"] = "swarm_rejoined"
    peers: List[str]


class Paused(Event):
    """The peer stood aside after a whole step (peer pause, --active-hours, --yield-when-busy): it counts no samples
    and joins no round until it resumes. `reasons`: each reason that holds ("requested", "outside-active-hours",
    "busy") with a line for a person; `parked_bytes`: the GPU memory it gave back (0 off a GPU)."""

    event: Literal["paused"] = "paused"
    epoch: int
    reasons: Dict[str, str]
    parked_bytes: int = 0


class Resumed(Event):
    """No reason to pause holds any longer: the peer trains again, at `epoch` (after a download if the swarm had
    moved on: `downloaded`). `paused_seconds`: from pausing to now; `seconds`: what resuming itself took."""

    event: Literal["resumed"] = "resumed"
    epoch: int
    paused_seconds: float
    seconds: float
    downloaded: bool


class Leaving(Event):
    """The training loop ended; the peer checkpoints, may serve stragglers, and exits."""

    event: Literal["leaving"] = "leaving"
    reason: str


class Exited(Event):
    event: Literal["exit"] = "exit"
    reason: str
    code: int


AnyEvent = Annotated[
    Union[Ready, Joined, StateDownloaded, EpochEnded, RoundEnded, CheckpointWritten, BottleneckChanged,
          PeerExcluded, UpdatesRefused, StateChecked, DownloadRejected, ReducingChanged, SwarmSplit, SwarmRejoined,
          Paused, Resumed, Leaving, Exited, RoundFactorChanged, UploadBudgetUnmet],
    Field(discriminator="event"),
]
_ANY_EVENT = TypeAdapter(AnyEvent)


class EventLog:
    """Appends events to a file; with no path, does nothing."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        self._lock = threading.Lock()
        self._failed = False

    def emit(self, event: Event) -> None:
        if self.path is None or self._failed:
            return
        line = (event.model_dump_json() + "\n").encode()
        with self._lock:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            except OSError as e:
                self._failed = True
                logger.warning(f"--events {self.path}: cannot write ({e.strerror or e}); no more events are written")


def latest_epoch(events: Sequence[Event]) -> int:
    """The newest global epoch a peer reported (joined at, ended, or downloaded); -1 before it joined."""
    return max((event.epoch for event in events if isinstance(event, (Joined, EpochEnded, StateDownloaded))),
               default=-1)


def parse_line(line: str) -> Optional[Event]:
    """One line's event; None for a kind this version does not know (a newer peer's)."""
    try:
        return _ANY_EVENT.validate_json(line)
    except ValidationError as e:
        if any(error["type"] == "union_tag_invalid" for error in e.errors()):
            return None
        raise


def read_events(path: Path, offset: int = 0) -> Tuple[List[Event], int]:
    """The whole lines from byte `offset` on, parsed; and the offset after the last whole line (a line still
    being written is left for the next call). A missing file has no events yet."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    events = [event for event in _parse_lines(data[:end]) if event is not None]
    return events, offset + end


def _parse_lines(data: bytes) -> Iterator[Optional[Event]]:
    for line in data.decode().splitlines():
        if line.strip():
            yield parse_line(line)
