"""A record validator that remembers which records it found valid, so that it checks each one once.

A peer reads the swarm's dictionaries (progress, digests, peer infos, clock records: one signed subkey per peer)
every second or few, and each read gathers the same dictionary from several nodes. hivemind checks every subkey of
every copy again: an RSA signature and a pydantic schema each. With 16 peers on one 2-core machine, the DHT
processes took two thirds of the swarm's CPU time, five times what training took, and the swarm stalled.
Most of those records are ones this node has already checked: the same bytes, from another node or an earlier read.

Only valid verdicts are remembered: a record's validity can only change from invalid to valid as time passes (a
record that expires too far ahead, dht/records.py's RecordLimitsValidator, comes within the limit later), never the
other way, and an invalid record is rare and may be a forgery made to fill the memory. The memory is bounded, and
emptied when validators are added (they may judge a remembered record differently).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from hivemind.dht.validation import CompositeValidator, DHTRecord

REMEMBERED_RECORDS = 4096
"""About 0.5 MiB: a 16-byte digest and the order's bookkeeping per record; a swarm of 200 peers has about 1,000
records live at once."""


class RememberingValidator(CompositeValidator):
    """hivemind's CompositeValidator, which checks a record it found valid before only once."""

    def __init__(self, validators=(), capacity: int = REMEMBERED_RECORDS):
        self._valid: "OrderedDict[bytes, None]" = OrderedDict()
        self.capacity = capacity
        super().__init__(validators)

    def extend(self, validators) -> None:
        super().extend(validators)
        self._valid.clear()

    def validate(self, record: DHTRecord) -> bool:
        fingerprint = _fingerprint(record)
        if fingerprint in self._valid:
            self._valid.move_to_end(fingerprint)
            return True
        if not super().validate(record):
            return False
        self._valid[fingerprint] = None
        if len(self._valid) > self.capacity:
            self._valid.popitem(last=False)
        return True


def _fingerprint(record: DHTRecord) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    for part in (record.key, record.subkey, record.value):
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    digest.update(struct.pack("<d", record.expiration_time))
    return digest.digest()
