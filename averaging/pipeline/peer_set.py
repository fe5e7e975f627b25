"""A set of peer ids that the training process writes and its averager processes read (shared memory)."""
from __future__ import annotations

import ctypes
import multiprocessing as mp
from typing import Iterable

from hivemind.p2p import PeerID

CAPACITY_BYTES = 64 * 1024  # about 1200 base58 peer ids


class SharedPeerSet:
    """Made in the training process before its averagers fork; `get` parses the ids once per change."""

    def __init__(self, capacity_bytes: int = CAPACITY_BYTES):
        self._raw = mp.Array(ctypes.c_char, capacity_bytes, lock=True)
        self._cached_raw, self._cached = b"", frozenset()

    def get(self) -> frozenset:
        """The peers, as PeerIDs."""
        with self._raw.get_lock():
            raw = self._raw.value
        if raw != self._cached_raw:
            self._cached_raw, self._cached = raw, frozenset(PeerID.from_base58(name) for name in raw.decode().split())
        return self._cached

    def set(self, peers: Iterable[str]) -> None:
        """Replace the set by these base58 peer ids."""
        peers = sorted(peers)
        raw = " ".join(peers).encode()
        if len(raw) >= len(self._raw):
            raise ValueError(f"too many peers to share ({len(peers)})")
        with self._raw.get_lock():
            self._raw.value = raw
