"""Leaving at --max-epochs without stranding a straggler.

A peer whose last averaging round failed still advances its epoch, and then downloads the
swarm's final state before it leaves, if another peer has it. It needs a peer to download
from, so a peer that finishes stays while another may still need it:

- a peer behind (a lower epoch) is still in its last round, or about to download;
- a peer that announced it is downloading needs someone to serve it;
- a peer at the same epoch that has not announced anything may still have to download: it is
  given a grace period, since peers without --max-epochs never announce;
- a peer that announced it is done (at whatever epoch it stopped), or that is ahead, needs nothing.

Each leaving peer announces itself under "<progress key>_leaving": "downloading" first if it must,
then "done". When every other peer is done, all leave at once instead of waiting out a timer.
"""
from __future__ import annotations

import enum
from typing import Dict, Mapping, Optional

LEAVING_KEY_SUFFIX = "_leaving"
DOWNLOADING, DONE = "downloading", "done"


class Need(enum.Enum):
    NOTHING = "nothing"
    GRACE = "grace"  # at our epoch and silent: may still download, or may simply train on
    SERVE = "serve"  # behind, or downloading: stay for it


def leave_record(epoch: int, state: str) -> dict:
    return {"epoch": epoch, "state": state}


def _epoch(record: object) -> Optional[int]:
    epoch = record.get("epoch") if isinstance(record, dict) else None
    return epoch if isinstance(epoch, int) else None


def has_final_state_elsewhere(epoch: int, progress: Mapping[bytes, object], me: bytes) -> bool:
    """Whether another peer has reached `epoch` too: only then is there a final state to download.
    If everyone else is behind, this peer's own state is the newest there is."""
    return any(owner != me and (_epoch(record) or -1) >= epoch for owner, record in progress.items())


def needs_of_others(epoch: int, progress: Mapping[bytes, object], leaving: Mapping[bytes, object],
                    me: bytes) -> Dict[bytes, Need]:
    """What every other peer with a progress record may still need from a peer leaving at `epoch`.

    progress: hivemind's training progress records by owner (dicts with an "epoch");
    leaving: the leave records by owner. Malformed records count as silence, never as an error.
    """
    needs = {}
    for owner, record in progress.items():
        their_epoch = _epoch(record)
        if owner == me or their_epoch is None:
            continue
        announced = leaving.get(owner)
        state = (announced.get("state")
                 if isinstance(announced, dict) and announced.get("epoch") == their_epoch else None)
        if state == DONE or (their_epoch > epoch and state is None):
            needs[owner] = Need.NOTHING  # done at its own epoch (a lower --max-epochs, too), or training on ahead
        elif their_epoch < epoch or state == DOWNLOADING:
            needs[owner] = Need.SERVE
        else:
            needs[owner] = Need.GRACE
    return needs
