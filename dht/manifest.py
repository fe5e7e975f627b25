"""The run manifest in the DHT: one copy per peer, all signed by the run's owner, and which copy to take.

The first peer of a run signs the manifest with the run owner's key (dht/run_owner.py) and stores
it (dht/records.py: RunManifest); every peer that agrees with it stores the same signed manifest
under its own subkey, and keeps it alive while it runs (so does a bootstrap node), so the manifest
outlives any one peer. Copies whose signature does not hold are never read.

What this defends against: a peer started with other settings by mistake, a stray peer of another
version, and (for peers given --run-owner, as the join command the first peer prints does) any
number of manifests stored by other keys, before or during the run: they are not signed by the
owner, so such a peer never reads them. A peer given no owner believes a manifest only as far as
peer/runtime/manifest.py says.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import hivemind

from dht.records import RunManifest, read_live
from dht.run_owner import fingerprint, is_signed

PROTOCOL_VERSION = 10
"""Raise it whenever peers of two versions of this daemon can no longer train together, or read each other's
records (2: PeerInfo carries val_loss, a field the schema of version 1 refuses; 3: int8 and int4 reducers reply
in dense fp16, and topk messages may carry int8 values, which version 2 decodes as garbage; 4: a
reducer replies with the average itself, not a delta to it, which version 3 would add to its own values; 5: a
reducer leaves a late sender out of the round and marks its replies so, which version 4 would read as a round that
counted it, and never stand aside; 6: manifests are signed by the run's owner, and version 5's unsigned
ones are not read; 7: int8, int4 and topk reducers reply in their own codec, which version 6 decodes as dense
fp16, and topk messages carry indices within chunks; 8: peers look for a group under a key that names the epoch
their round leads to, and never meet version 7's peers, who look under the averager's bare key; 9: optimizer state is
made without a counted step (averaging/adapter/fresh_optimizer.py), so a version 8 peer's Adam step counts run one
ahead and its state digest never agrees; 10: a digest record says whether its peer serves its state, a field that
version 9's schema refuses, and version 9's records lack)."""
MANIFEST_TTL_SECONDS = 600.0
"""How long a copy lives after its holder last refreshed it: a swarm that pauses briefly keeps its manifest."""
REFRESH_PERIOD_SECONDS = 60.0


def read_manifests(dht: hivemind.DHT, key: str, timeout_seconds: float,
                   owner: Optional[str] = None) -> Dict[bytes, RunManifest]:
    """Every live copy of the manifest whose signature holds, by the subkey (holder) that stores it; only those
    signed by the run owner with this fingerprint, if one is given."""
    return {holder: manifest for holder, manifest in read_live(dht, key, RunManifest, timeout_seconds).items()
            if is_signed(manifest, key) and owner in (None, fingerprint(manifest.owner))}


def agreed_manifest(copies: Dict[bytes, RunManifest]) -> Optional[RunManifest]:
    """The manifest held by the most holders; the oldest among equally held ones; None when there is none."""
    groups: Dict[tuple, list] = {}
    for manifest in copies.values():
        groups.setdefault(manifest_identity(manifest), []).append(manifest)
    if not groups:
        return None
    best = max(groups.values(), key=lambda group: (len(group), -min(m.created for m in group)))
    return min(best, key=lambda manifest: manifest.created)


def held_by_peers(copies: Dict[bytes, RunManifest], peer_infos: Mapping[bytes, object]) -> Dict[bytes, RunManifest]:
    """The copies whose holder is a live peer of the run: a peer stores its PeerInfo and its copy of the manifest
    under one key (dht/records.py: own_subkey), so these are manifests that some peer trains with. A bare DHT
    client's copies, and a bootstrap node's, are not among them."""
    return {holder: manifest for holder, manifest in copies.items() if holder in peer_infos}


def runs_manifest(copies: Dict[bytes, RunManifest], peer_infos: Mapping[bytes, object],
                  owner: Optional[str]) -> Optional[RunManifest]:
    """For a reader that trains nothing (peer status, a bootstrap node): the manifest of the owner given (copies
    read with `owner`), else the one the live peers hold, else the most held one (anyone can store one)."""
    return agreed_manifest(copies if owner else held_by_peers(copies, peer_infos) or copies)


def manifest_identity(manifest: RunManifest) -> tuple:
    """What two manifests must share to be the same run: the owner, the protocol and every setting."""
    return manifest.owner, manifest.protocol, tuple(sorted(manifest.settings.items()))
