"""The run manifest in the DHT: one signed copy per peer, and which copy the swarm agrees on.

The first peer of a run stores the manifest (dht/records.py: RunManifest); every peer that
agrees with it stores the same manifest under its own subkey, and keeps it alive while it runs
(so does a bootstrap node), so the manifest outlives any one peer. A newcomer reads every
copy and takes the manifest held by the most peers (the oldest among equals).

What this defends against: a peer started with other settings by mistake, or a stray peer of
another version. What it does not: a hostile peer can store its own manifest under as many
subkeys as it has keys; it can then confuse newcomers (who refuse to train rather than train
wrongly), but never the peers that already checked the manifest.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional

import hivemind

from dht.records import RunManifest, read_live

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 5
"""Raise it whenever peers of two versions of this daemon can no longer train together, or read each other's
records (2: PeerInfo carries val_loss, a field the schema of version 1 refuses; 3: int8 and int4 reducers reply
in dense fp16, and topk messages may carry int8 values, which version 2 decodes as garbage; 4: a
reducer replies with the average itself, not a delta to it, which version 3 would add to its own values; 5: a
reducer leaves a late sender out of the round and marks its replies so, which version 4 would read as a round that
counted it, and never stand aside)."""
MANIFEST_TTL_SECONDS = 600.0
"""How long a copy lives after its holder last refreshed it: a swarm that pauses briefly keeps its manifest."""
REFRESH_PERIOD_SECONDS = 60.0


def read_manifests(dht: hivemind.DHT, key: str, timeout_seconds: float) -> Dict[bytes, RunManifest]:
    """Every live, valid copy of the manifest, by the subkey (owner) that holds it."""
    return read_live(dht, key, RunManifest, timeout_seconds)


def agreed_manifest(copies: Dict[bytes, RunManifest]) -> Optional[RunManifest]:
    """The manifest held by the most owners; the oldest among equally held ones; None when there is none."""
    groups: Dict[tuple, list] = {}
    for manifest in copies.values():
        identity = (manifest.protocol, tuple(sorted(manifest.settings.items())))
        groups.setdefault(identity, []).append(manifest)
    if not groups:
        return None
    best = max(groups.values(), key=lambda group: (len(group), -min(m.created for m in group)))
    return min(best, key=lambda manifest: manifest.created)
