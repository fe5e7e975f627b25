"""hivemind's ProgressTracker, as every strategy reads and feeds it.

The tracker counts the swarm's samples toward the target batch from signed progress records
(one subkey per peer, owned by the peer's RSA key). This module turns it into a SwarmView, makes
it fetch afresh on demand, publishes a peer's record before it has any samples (the tracker
itself publishes only once a peer has accumulated some, so peers waiting at a start gate would be
invisible to each other), and makes it believe only plausible records (averaging/swarm/claims.py).
"""
from __future__ import annotations

from typing import Callable, Collection, Optional

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from averaging.api import SwarmView
from averaging.pipeline.evidence import SampleEvidence
from averaging.swarm.claims import ClaimFilter

MIN_CLOCK_SKEW_SECONDS = 5.0


def signing_key(tracker_opts: dict) -> RSAPrivateKey:
    """The key a tracker built with these options signs its record with (hivemind's default: the process's)."""
    return tracker_opts.get("private_key") or RSAPrivateKey.process_wide()


def swarm_view(tracker: ProgressTracker, refresh_timeout_seconds: Optional[float] = None) -> SwarmView:
    if refresh_timeout_seconds is not None:
        _fetch_now(tracker, refresh_timeout_seconds)
    progress = tracker.global_progress
    return SwarmView(
        peers=progress.num_peers,
        samples_per_second=float(tracker.performance_ema.samples_per_second),
        samples_accumulated=progress.samples_accumulated,
        target_batch_size=progress.target_batch_size,
        global_epoch=progress.epoch,
    )


def owner(key: RSAPrivateKey) -> bytes:
    """The subkey that records signed with `key` are stored in (a tracker's own: see signing_key)."""
    return RSASignatureValidator(key).local_public_key


def announce(tracker: ProgressTracker, key: RSAPrivateKey) -> None:
    """Store the tracker's local record now, in the subkey the tracker itself writes to."""
    tracker.dht.store(tracker.training_progress_key, subkey=owner(key), value=tracker.local_progress.dict(),
                      expiration_time=get_dht_time() + tracker.metadata_expiration)


def stand_idle(tracker: ProgressTracker, epoch: int) -> None:
    """A paused peer's record: no samples and no rate, so that the swarm neither counts nor expects any from it
    (hivemind estimates the time to the next epoch from every record's rate), and marked as a client's, so that the
    others do not count it as a peer to average with (averaging/swarm/claims.py is_paused) and its epoch drives no
    one's. The caller holds tracker.pause_updates(). The rate comes back with the first step after stand_active."""
    if not hasattr(tracker, "client_mode_when_active"):
        tracker.client_mode_when_active = tracker.client_mode
    tracker.client_mode = True
    tracker.performance_ema.samples_per_second = tracker.performance_ema.eps
    tracker.report_local_progress(epoch, samples_accumulated=0)


def stand_active(tracker: ProgressTracker) -> None:
    """After a pause: a peer that averages again, whose next step's rate is measured from now, not from before the
    pause."""
    tracker.client_mode = getattr(tracker, "client_mode_when_active", tracker.client_mode)
    tracker.performance_ema.reset_timer()


def clock_skew_allowed(matchmaking_seconds: float) -> float:
    """How far apart two peers' clocks may be: the matchmaking window, at least MIN_CLOCK_SKEW_SECONDS.
    A clock further off is wrong for averaging anyway (matchmaking schedules rounds on DHT time)."""
    return max(MIN_CLOCK_SKEW_SECONDS, matchmaking_seconds)


def believe_plausible_claims(tracker: ProgressTracker, key: RSAPrivateKey, matchmaking_seconds: float,
                             excluded: Callable[[], Collection[bytes]] = frozenset,
                             evidence: Optional[SampleEvidence] = None, longest_round: int = 1) -> None:
    """From its next fetch on, the tracker reads only the records a ClaimFilter believes (never its own), and
    shares what they say with the reducers that bound weights by it (`evidence`). `longest_round`: the most target
    batches an epoch can take (DiLoCo's --max-round-factor).

    A peer whose clock is more than clock_skew_allowed ahead of ours writes records that are not believed,
    so it cannot drive the swarm's epochs.
    """
    skew = clock_skew_allowed(matchmaking_seconds)
    tracker.claims = ClaimFilter(owner(key), tracker.target_batch_size,
                                 max_ttl_seconds=tracker.metadata_expiration + skew, max_clock_skew_seconds=skew,
                                 excluded=excluded, believed=evidence.record if evidence is not None else None,
                                 longest_round=longest_round)


def served(tracker: ProgressTracker, epoch: int, refresh_timeout_seconds: float = 2.0) -> None:
    """After a state download reached `epoch`: claims far beyond it are judged from there, starting now."""
    tracker.claims.served(epoch, get_dht_time())
    _fetch_now(tracker, refresh_timeout_seconds)


def _fetch_now(tracker: ProgressTracker, timeout_seconds: float) -> None:
    """Make the tracker's fetcher read the swarm's progress now rather than at its next scheduled fetch
    (with no samples anywhere, that is up to 10 s away)."""
    tracker.fetched_global_progress_this_epoch.clear()
    tracker.global_progress.next_fetch_time = get_dht_time()
    tracker.global_state_updated.set()  # wakes the fetcher, which then finds its next fetch due
    tracker.fetched_global_progress_this_epoch.wait(timeout_seconds)
