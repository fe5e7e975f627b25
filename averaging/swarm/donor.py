"""How this peer ranks as a state donor.

hivemind's state download tries donors in order of their declared priority (a float, normally the
donor's epoch; ties are broken at random). Peers at the same epoch may hold different states: one
whose round was partial or failed applied (partly) its own update.
- Apart: such a peer declares its epoch minus APART_PENALTY until it has downloaded, so that it
  ranks below every peer at its epoch whose round was whole, and below those one epoch behind too
  (a whole peer's declaration of its new epoch can lag its round: with a penalty of 0.5, a peer
  downloading then could take an apart peer's state over a whole one's: likely the 1.5e-4 of one CI run), and it waits
  for a donor that declares its epoch or later (averaging/strategies/rounds.py). When a reducer died
  mid-round, every survivor is apart: then the one with the smallest peer id among those apart at
  the epoch becomes the reference (it declares its epoch again) and the others download its state.
- The final state: at the end of a run, raising the priority by DONOR_BONUS ranks a peer whose
  state is the swarm's above the others at the same epoch, and still below any peer an epoch ahead.
  Offers rank among themselves by peer id, the smallest first (`offer_priority`): hivemind breaks ties
  at random, and with grouped rounds two offers may hold different states (two peers that each saw no
  smaller id at the last epoch both offer theirs; 16 peers on one machine ended with 4 states).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Collection, Dict, Iterable, Optional

from hivemind.averaging import DecentralizedAverager

logger = logging.getLogger(__name__)

DONOR_BONUS = 0.5
OFFER_SPREAD = 0.25
"""Offers at an epoch declare epoch + DONOR_BONUS plus up to this much, more the smaller the offering peer's id."""
APART_PENALTY = 1.5
VISIBLE_WITHIN_SECONDS = 5.0


def declare_apart(averagers: Iterable[Optional[DecentralizedAverager]], epoch: int) -> None:
    """Rank this peer below the others at `epoch` until it downloads or becomes the reference (declare_whole)."""
    for averager in _sharing(averagers):
        averager.state_sharing_priority = epoch - APART_PENALTY


def declare_whole(averagers: Iterable[Optional[DecentralizedAverager]], epoch: int) -> None:
    """Declare `epoch` again: this peer's state is the one peers apart at `epoch` download."""
    for averager in _sharing(averagers):
        averager.state_sharing_priority = epoch


@dataclass(frozen=True)
class DonorView:
    """What a peer apart from the swarm at some epoch sees of the donors."""

    ahead: bool
    """Another peer declares a state at that epoch or later: download it."""
    smallest_apart: bool
    """No peer is ahead, and this one has the smallest id among the sharing peers apart at that epoch."""


def donor_view(averager: DecentralizedAverager, epoch: int, excluded: Collection[bytes] = ()) -> DonorView:
    """The donors declared in the DHT (but the `excluded` peer ids), as seen by this peer apart at `epoch`."""
    me = averager.peer_id.to_bytes()
    declared = {owner: priority for owner, priority in declared_priorities(averager).items()
                if owner not in excluded}
    if any(owner != me and priority >= epoch for owner, priority in declared.items()):
        return DonorView(ahead=True, smallest_apart=False)
    apart = [owner for owner, priority in declared.items() if owner != me and priority == epoch - APART_PENALTY]
    shares = bool(_sharing([averager]))  # a peer that serves no state cannot be the reference
    return DonorView(ahead=False, smallest_apart=shares and all(me < owner for owner in apart))


def offer_priority(epoch: int, peer_id: bytes) -> float:
    """What a peer offering its final state at `epoch` declares: above every plain donor at `epoch`, below any an
    epoch ahead, and above the offers of larger peer ids (by the first 4 of their last 32 bytes, the key or its
    hash: the bytes before them are a prefix that ids of one kind share). A float holds these 32 bits exactly up to
    epoch 2 ** 18; two ids alike in them (a chance of 2 ** -32 a pair) tie, and hivemind picks one at random."""
    fraction = int.from_bytes(peer_id[-32:][:4], "big") / 2 ** 32
    return epoch + DONOR_BONUS + OFFER_SPREAD * (1.0 - fraction)


def final_offers(averager: DecentralizedAverager, epoch: int, excluded: Collection[bytes] = ()) -> Dict[bytes, float]:
    """The final-state offers declared for `epoch` (owner -> priority), but the `excluded` peers'."""
    return {owner: priority for owner, priority in declared_priorities(averager).items()
            if owner not in excluded and epoch + DONOR_BONUS <= priority <= epoch + DONOR_BONUS + OFFER_SPREAD}


def offer_state(averagers: Iterable[DecentralizedAverager], epoch: int,
                visible_within_seconds: float = VISIBLE_WITHIN_SECONDS) -> bool:
    """Declare `offer_priority` for each averager that shares state, and wait until the DHT shows it,
    so that a peer told to download next picks this one. False if none shares state (client mode) or
    the offer is not visible in time: then this peer must not tell others to download from it."""
    sharing = _sharing(averagers)
    for averager in sharing:
        averager.state_sharing_priority = offer_priority(epoch, averager.peer_id.to_bytes())
    give_up_at = time.monotonic() + visible_within_seconds
    pending = list(sharing)
    while pending and time.monotonic() < give_up_at:
        pending = [averager for averager in pending if _declared_priority(averager) != averager.state_sharing_priority]
        if pending:
            time.sleep(0.2)
    if pending:
        logger.warning(f"this peer's offer of its final state was not visible in the DHT within "
                       f"{visible_within_seconds:.0f} s; peers downloading now may pick another donor")
    return bool(sharing) and not pending


def _sharing(averagers: Iterable[Optional[DecentralizedAverager]]) -> list:
    return [averager for averager in averagers
            if averager is not None and not averager.client_mode and averager.allow_state_sharing]


def declared_priorities(averager: DecentralizedAverager) -> dict:
    """Owner (peer id bytes) -> the priority it declares, for every well-formed declaration in the DHT."""
    found = averager.dht.get(f"{averager.prefix}.all_averagers", latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    declared = {owner: getattr(entry, "value", None) for owner, entry in found.value.items()}
    return {owner: float(priority) for owner, priority in declared.items()
            if isinstance(priority, (int, float)) and not isinstance(priority, bool)}


def _declared_priority(averager: DecentralizedAverager):
    return declared_priorities(averager).get(averager.peer_id.to_bytes())
