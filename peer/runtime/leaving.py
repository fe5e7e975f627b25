"""Leaving at --max-epochs without stranding a straggler.

A peer whose last averaging round failed still advances its epoch, and then downloads the
swarm's final state before it leaves, if another peer has it. Peers at the same epoch may hold
different states (each one whose last round failed applied only its own gradients), so a peer
whose last round averaged offers its state ("offers" in its leave record, and a higher donor
priority), and one whose round failed downloads only once such an offer is there, or a peer at its
epoch is done (it holds the final state it took), or one is ahead. If every peer
at that epoch had its last round fail, the one with the smallest id offers its state and the
others download it: all of them end with the same weights. With grouped rounds (--target-group-size),
each group ends its last round whole with a state of its own, so every peer leaves as one whose last
round failed, and all take the smallest id's state. A round that fails at once can bring a
peer to the last epoch before its group has averaged, so a peer one epoch behind counts as still
in its last round: the failed peer waits for it (at most a matchmaking window and an averaging
timeout); if nobody has reached the last epoch by then, its own state is the newest there is.

It needs a peer to download from, so a peer that finishes stays while another may still need it:

- a peer behind (a lower epoch) is still in its last round, or about to download;
- a peer that announced it is downloading needs someone to serve it;
- a peer at the same epoch that has not announced anything may still have to download: it is
  given a grace period, since peers without --max-epochs never announce;
- a peer that announced it is done (at whatever epoch it stopped), or that is ahead, needs nothing;
- nor does a paused peer (peer pause, --active-hours, --yield-when-busy): it downloads the swarm's state when it
  resumes, from whoever is there then.

Each leaving peer announces itself under "<progress key>_leaving": "downloading" first if it must,
then "done". When every other peer is done, all leave at once instead of waiting out a timer.
"""
from __future__ import annotations

import enum
from collections import Counter
from typing import Dict, Mapping, Optional, Tuple

DOWNLOADING, DONE, PAUSED = "downloading", "done", "paused"


class Source(enum.Enum):
    """Where a peer whose last round failed takes its final state from."""
    WAIT = "wait"  # a peer at our epoch has not said whether its round averaged
    DOWNLOAD = "download"  # a peer offers the final state, or is ahead
    OFFER = "offer"  # every peer at our epoch failed too, and ours is the smallest id: ours is the final state


class Need(enum.Enum):
    NOTHING = "nothing"
    GRACE = "grace"  # at our epoch and silent: may still download, or may simply train on
    SERVE = "serve"  # behind, or downloading: stay for it


def leave_record(epoch: int, state: str, offers: bool = False, downloaded: bool = False) -> dict:
    """downloaded: this peer's state at `epoch` is a copy of a donor's; it waits for an offer, never offers instead.
    offers: whether it offers its state; no peer decides by it any more (any peer done at `epoch` holds the final
    state), so it only says what the peer did to whoever reads the record."""
    return {"epoch": epoch, "state": state, "offers": offers, "downloaded": downloaded}


def _epoch(record: object) -> Optional[int]:
    epoch = record.get("epoch") if isinstance(record, dict) else None
    return epoch if isinstance(epoch, int) else None


def _current_epochs(progress: Mapping[bytes, object], leaving: Mapping[bytes, object],
                    me: bytes) -> Dict[bytes, int]:
    """Every other peer's epoch: its progress record's, or its leave record's where that one is newer.

    hivemind publishes no progress for a peer that accumulates no samples (an auxiliary peer, to it), so a peer
    that downloaded the state at its last epoch and left at once keeps a progress record an epoch behind (seen:
    its partner, whose own last round had failed, waited two patience windows for it). A leave record is written
    by its owner at the epoch it leaves at: never ahead of it.
    """
    epochs = {}
    for owner, record in progress.items():
        epoch = _epoch(record)
        if owner != me and epoch is not None:
            announced = _epoch(leaving.get(owner))
            epochs[owner] = epoch if announced is None else max(epoch, announced)
    return epochs


def has_final_state_elsewhere(epoch: int, progress: Mapping[bytes, object], me: bytes) -> bool:
    """Whether another peer has reached `epoch` too: only then is there a final state to download.
    If everyone else is behind, this peer's own state is the newest there is."""
    return any(owner != me and (_epoch(record) or -1) >= epoch for owner, record in progress.items())


def has_peer_behind(epoch: int, progress: Mapping[bytes, object], me: bytes) -> bool:
    """Whether another peer is one epoch behind `epoch`: a straggler that may download this peer's state."""
    return any(owner != me and _epoch(record) == epoch - 1 for owner, record in progress.items())


def may_have_final_state(epoch: int, progress: Mapping[bytes, object], me: bytes) -> bool:
    """Whether another peer has reached `epoch`, or may be in its last round toward it (one epoch behind):
    a peer whose own last round failed at once can reach the last epoch before its group has averaged."""
    return any(owner != me and (_epoch(record) or -1) >= epoch - 1 for owner, record in progress.items())


def final_state_source(epoch: int, progress: Mapping[bytes, object], leaving: Mapping[bytes, object],
                       me: bytes, waits: int = 0, candidate: bool = True) -> Source:
    """For a peer whose last round failed, leaving at `epoch`: download, offer its own state, or wait.

    A peer that holds the final state makes it a download at once, whatever the others have said: one that offers
    it, one done at `epoch` (it took the final state, or its offer did not show in time), or one ahead. Waiting for
    the silent peers only decides whether this peer offers instead (seen, 16 peers in groups: a peer waited for
    silent peers while an offer stood, until every offering peer had left, then offered its own state, and the
    peers still there took it: two final states).
    waits: how many patience windows this peer has waited out. After one, a silent peer at `epoch` counts as one
    whose round failed too (it may still be in a round that will fail: the smallest id must offer, or the peers that
    gave up at the same time would each download another's state), and one behind is no longer waited for. After
    two, a peer still silent is busy in a round of its own and takes whatever is offered once it is done: only the
    peers that said they download are candidates (seen, 16 peers in groups: the smallest id was in a round of 57 s,
    and the others, having waited for its offer, each downloaded from any donor: three final states).
    candidate: False for a peer whose state at `epoch` was downloaded: it only copies a donor's, so it waits for an
    offer and never offers in the place of the peers whose rounds failed (nor do they wait for it to).
    """
    others = _near_epoch(epoch, progress, leaving, me)
    if any(their_epoch >= epoch and (state == DONE or (their_epoch > epoch and state is None))
           for their_epoch, state in others.values()):
        return Source.DOWNLOAD
    failed, undecided = [], False
    for owner, (their_epoch, state) in others.items():
        if state == PAUSED or (state is None and waits >= 2):  # in no round of the last epoch's, or busy in its own
            continue
        if their_epoch == epoch - 1:  # may be in its last round: wait, unless it is done at that epoch
            undecided |= waits == 0 and state != DONE
        elif state is None and waits == 0:
            undecided = True
        elif their_epoch == epoch and state != DONE and not _announced_copy(leaving.get(owner), their_epoch):
            failed.append(owner)
    if undecided:
        return Source.WAIT
    return Source.OFFER if candidate and all(me < owner for owner in failed) else Source.WAIT


def seen_at_epoch(epoch: int, progress: Mapping[bytes, object], leaving: Mapping[bytes, object], me: bytes) -> str:
    """What this peer sees of the others at `epoch` and one behind, for its log: how many said what."""
    def where(their_epoch: int) -> str:
        return "ahead" if their_epoch > epoch else "behind" if their_epoch < epoch else "at it"

    said = Counter(f"{state or 'silent'} {where(their_epoch)}"
                   for their_epoch, state in _near_epoch(epoch, progress, leaving, me).values())
    return ", ".join(f"{count} {what}" for what, count in sorted(said.items())) or "no other peer"


def _near_epoch(epoch: int, progress: Mapping[bytes, object], leaving: Mapping[bytes, object],
                me: bytes) -> Dict[bytes, Tuple[int, Optional[str]]]:
    """The other peers at `epoch`, one behind it or ahead: owner -> (its epoch, the state its leave record says)."""
    return {owner: (their_epoch, _announced(leaving.get(owner), their_epoch))
            for owner, their_epoch in _current_epochs(progress, leaving, me).items() if their_epoch >= epoch - 1}


def _announced(record: object, epoch: int) -> Optional[str]:
    """A leave record's state, if it is for `epoch` (an older one is stale)."""
    if not isinstance(record, dict) or record.get("epoch") != epoch:
        return None
    return record.get("state")


def _announced_copy(record: object, epoch: int) -> bool:
    """Whether a leave record for `epoch` says that its owner's state there is a downloaded copy."""
    return _announced(record, epoch) is not None and record.get("downloaded") is True


def everyone_else_done(progress: Mapping[bytes, object], leaving: Mapping[bytes, object], me: bytes) -> bool:
    """Whether there are other peers and each has announced that it is done (or paused): nobody is left to wait
    for."""
    return _everyone_else_announced(progress, leaving, me, (DONE, PAUSED))


def everyone_else_leaving(progress: Mapping[bytes, object], leaving: Mapping[bytes, object], me: bytes) -> bool:
    """Whether there are other peers and each has announced that it leaves (downloading or done): none of them
    will look for an averaging group again, so a round of this peer's that is still looking will find none (a
    paused peer joins none either)."""
    return _everyone_else_announced(progress, leaving, me, (DOWNLOADING, DONE, PAUSED))


def _everyone_else_announced(progress: Mapping[bytes, object], leaving: Mapping[bytes, object], me: bytes,
                             states: Tuple[str, ...]) -> bool:
    others = _current_epochs(progress, leaving, me)
    return bool(others) and all(_announced(leaving.get(owner), epoch) in states for owner, epoch in others.items())


def may_join_round_to(epoch: int, progress: Mapping[bytes, object], leaving: Mapping[bytes, object],
                      me: bytes, at_epoch: bool = False) -> bool:
    """Whether another peer may still join a round that leads to `epoch`: one behind it that has not said it
    leaves or pauses. Rounds meet only rounds that lead to the same epoch (averaging/adapter/epoch_keys.py), so a
    peer already past it never will, nor one at it, unless rounds run once their epoch has begun (`at_epoch`:
    local-sgd averages parameters in the background while its peers train on in the epoch)."""
    return any((their_epoch < epoch or (at_epoch and their_epoch == epoch))
               and _announced(leaving.get(owner), their_epoch) is None
               for owner, their_epoch in _current_epochs(progress, leaving, me).items())


def may_publish_digest(epoch: int, progress: Mapping[bytes, object], leaving: Mapping[bytes, object],
                       me: bytes) -> int:
    """How many other peers may still publish a state digest for `epoch`, the last: those at it or one behind it (in
    their last round), but not those that announced they download (a peer whose last round failed publishes its
    digest only once it holds the final state, which may be this peer's: waiting for it, this peer kept it waiting
    for an offer), are done at a lower epoch, or pause."""
    count = 0
    for owner, their_epoch in _current_epochs(progress, leaving, me).items():
        state = _announced(leaving.get(owner), their_epoch)
        done_below = their_epoch < epoch and state == DONE
        count += their_epoch >= epoch - 1 and state not in (DOWNLOADING, PAUSED) and not done_below
    return count


def needs_of_others(epoch: int, progress: Mapping[bytes, object], leaving: Mapping[bytes, object],
                    me: bytes) -> Dict[bytes, Need]:
    """What every other peer with a progress record may still need from a peer leaving at `epoch`.

    progress: hivemind's training progress records by owner (dicts with an "epoch");
    leaving: the leave records by owner. Malformed records count as silence, never as an error.
    """
    needs = {}
    for owner, their_epoch in _current_epochs(progress, leaving, me).items():
        state = _announced(leaving.get(owner), their_epoch)
        if state in (DONE, PAUSED) or (their_epoch > epoch and state is None):
            needs[owner] = Need.NOTHING  # done at its own epoch (a lower --max-epochs, too), paused, or ahead
        elif their_epoch < epoch or state == DOWNLOADING:
            needs[owner] = Need.SERVE
        else:
            needs[owner] = Need.GRACE
    return needs
