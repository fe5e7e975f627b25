"""Signed, typed swarm records: who is in the run, how each peer is doing, and what the run is.

Each peer publishes a PeerInfo under the key "<run_id>_peers", a copy of the run's manifest
(dht/manifest.py) under "<training namespace>_manifest", its state digests under
"<training namespace>_digests" and (DiLoCo) its round factors under "<training namespace>_round_factor",
each in a subkey that holds its
own RSA public key. hivemind's RSASignatureValidator then lets only the owner of that key
write the subkey, and SchemaValidator rejects values of the wrong shape. hivemind's
schema validation is built on pydantic v1 models, so these records use `pydantic.v1`.
RecordLimitsValidator bounds what one peer can make every other node store: values of at
most MAX_VALUE_BYTES, expiring at most MAX_TTL_SECONDS ahead (both keys). A record that expires far in
the future would outlive its peer and, since the DHT keeps the entry that expires last,
could never be replaced by that peer's fresh records.
Every node of a run (peers, bootstrap nodes, `peer status`) installs the same validators.
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Callable, Dict, List, Optional, Type, Union

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from pydantic.v1 import (
    BaseModel,
    StrictBool,
    StrictFloat,
    StrictInt,
    conbytes,
    confloat,
    conint,
    conlist,
    constr,
    validator,
)

from dht.keys import SwarmKeys, peers_key

logger = logging.getLogger(__name__)

RECORD_TTL_SECONDS = 15.0
PUBLISH_PERIOD_SECONDS = 3.0
MAX_VALUE_BYTES = 4096  # serialized and signed; a typical PeerInfo takes under 1 KiB
MAX_TTL_SECONDS = 3600.0  # generous: clocks of volunteers' machines drift
CLOCK_RECORD_TTL_SECONDS = 7200.0  # dht/clock.py: long enough to reach a peer whose clock is an hour ahead
MAX_DIGEST_EPOCHS = 16
MAX_SCHEDULE_EPOCHS = 8
MAX_ROUND_FACTOR_RECORDED = 1024  # readers clamp to the run's --max-round-factor; this only bounds what is stored


MAX_OBSERVED_PEERS = 24
"""Peers a credit record names what it observed of (those it saw give most): it rides in a PeerInfo of 4 KiB."""


class CreditRecord(BaseModel):
    """What a peer says it gave the swarm, and what it observed the others give (peer/runtime/credit.py)."""

    samples: confloat(ge=0.0, strict=True) = 0.0
    """Its own claim: samples it accumulated toward epochs whose round it averaged in (ok or partial)."""
    device_seconds: confloat(ge=0.0, strict=True) = 0.0
    """Its compute time (forward, backward, optimizer)."""
    sent_bytes: conint(ge=0, strict=True) = 0
    observed: Dict[constr(strict=True, max_length=64), confloat(ge=0.0, strict=True)] = {}
    """By base58 peer id: the samples its reducers accepted from that peer's contributions (after the caps)."""

    @validator("observed")
    def _few_observed(cls, value: dict) -> dict:  # noqa: N805 (pydantic's signature)
        if len(value) > MAX_OBSERVED_PEERS:
            raise ValueError(f"observed names more than {MAX_OBSERVED_PEERS} peers")
        return value


class PeerInfo(BaseModel):
    """What one peer tells the swarm about itself."""

    peer_id: constr(strict=True, max_length=128)
    version: constr(strict=True, max_length=32)
    device: constr(strict=True, max_length=128)
    client_mode: StrictBool
    samples_per_second: confloat(ge=0.0, strict=True)
    global_epoch: conint(ge=0, strict=True)
    uptime_seconds: confloat(ge=0.0, strict=True)
    time: confloat(strict=True)
    maddrs: conlist(constr(strict=True, max_length=256), max_items=16) = []
    fractions: Dict[constr(strict=True, max_length=32), confloat(ge=0.0, le=1.0, strict=True)] = {}
    bottleneck: Optional[constr(strict=True, max_length=32)] = None
    val_loss: Optional[StrictFloat] = None
    """The peer's last validation loss (the monitor's page charts it); finite, or None before the first."""
    state: Optional[constr(strict=True, regex=r"^(agrees|apart)$")] = None
    """Whether its state digest is the swarm's at the last epoch it compared (averaging/swarm/digests.py);
    None before a comparison, or with a strategy whose peers hold different states."""
    paused: conlist(constr(strict=True, max_length=32), max_items=4) = []
    """The reasons it is paused for now (requested, outside-active-hours, busy); empty while it trains."""
    credit: Optional[CreditRecord] = None
    upload_budget_mbit: Optional[confloat(gt=0.0, strict=True)] = None
    """Its --max-upload-mbit (DiLoCo); None: no budget (or a peer of an older version)."""
    round_factor_requested: Optional[conint(ge=1, le=MAX_ROUND_FACTOR_RECORDED, strict=True)] = None
    """The round factor its budget asks the swarm for (averaging/budget.py); None: a strategy without one."""
    round_factor: Optional[conint(ge=1, le=MAX_ROUND_FACTOR_RECORDED, strict=True)] = None
    """The swarm's round factor at its epoch: its rounds are this many target batches long."""

    @validator("upload_budget_mbit")
    def _finite_budget(cls, value: Optional[float]) -> Optional[float]:  # noqa: N805 (pydantic's signature)
        if value is not None and not math.isfinite(value):
            raise ValueError("upload_budget_mbit must be finite")
        return value

    @validator("val_loss")
    def _finite_val_loss(cls, value: Optional[float]) -> Optional[float]:  # noqa: N805 (pydantic's signature)
        if value is not None and not math.isfinite(value):
            raise ValueError("val_loss must be finite")
        return value


class SwarmRecordsSchema(BaseModel):
    peers: Dict[BytesWithPublicKey, Optional[PeerInfo]]


_SettingText = constr(strict=True, max_length=256)


class RunManifest(BaseModel):
    """What every peer of a run must share (dht/manifest.py says how it is agreed on)."""

    protocol: conint(ge=0, strict=True)
    """The daemon's swarm protocol version: peers of different versions cannot train together."""
    settings: Dict[constr(strict=True, max_length=64), Union[StrictInt, StrictFloat, _SettingText]]
    """By the command-line name of the option that sets each one ("task", "target_batch_size", ...)."""
    created: confloat(strict=True)
    """When the run's first peer made it (DHT time)."""
    owner: conbytes(strict=True, max_length=32) = b""
    """The Ed25519 public key of the run's owner, who signed it (dht/run_owner.py); empty: not signed yet."""
    signature: conbytes(strict=True, max_length=64) = b""


class ClockRecord(BaseModel):
    """A peer's clock when it wrote this (dht/clock.py)."""

    time: confloat(strict=True)


_DIGEST_HEX = constr(strict=True, regex=r"^[0-9a-f]{16,64}$")


class StateDigests(BaseModel):
    """A peer's digests of the state it held at its recent epochs (averaging/swarm/digests.py)."""

    peer_id: constr(strict=True, max_length=128)
    """Its libp2p peer id (base58): which donor serves this state."""
    digests: Dict[constr(strict=True, regex=r"^[0-9]{1,12}$"), _DIGEST_HEX]
    """By epoch (as text: the DHT's msgpack keeps dict keys as they are, and JSON would not)."""
    serves: StrictBool = True
    """Whether it serves its state to peers that download it (a client-mode peer cannot): a tie goes to a state
    that a peer apart from it can download."""

    @validator("digests")
    def _few_epochs(cls, value: dict) -> dict:  # noqa: N805 (pydantic's signature)
        if len(value) > MAX_DIGEST_EPOCHS:
            raise ValueError(f"at most {MAX_DIGEST_EPOCHS} epochs")
        return value


class RoundFactorRecord(BaseModel):
    """A DiLoCo peer's round factors (averaging/swarm/round_factor.py): the one it asks for, and those it will apply
    at its next epochs."""

    peer_id: constr(strict=True, max_length=128)
    """Its libp2p peer id (base58): the requests of excluded peers do not count."""
    requested: conint(ge=1, le=MAX_ROUND_FACTOR_RECORDED, strict=True)
    """The factor its upload budget asks for (1 without a budget)."""
    schedule: Dict[constr(strict=True, regex=r"^[0-9]{1,12}$"), conint(ge=1, le=MAX_ROUND_FACTOR_RECORDED, strict=True)]
    """By epoch (as text, as StateDigests): the factor it applies there."""

    @validator("schedule")
    def _few_epochs(cls, value: dict) -> dict:  # noqa: N805 (pydantic's signature)
        if len(value) > MAX_SCHEDULE_EPOCHS:
            raise ValueError(f"at most {MAX_SCHEDULE_EPOCHS} epochs")
        return value


class TrainingRecordsSchema(BaseModel):
    manifest: Dict[BytesWithPublicKey, Optional[RunManifest]]
    clock: Dict[BytesWithPublicKey, Optional[ClockRecord]]
    digests: Dict[BytesWithPublicKey, Optional[StateDigests]]
    round_factor: Dict[BytesWithPublicKey, Optional[RoundFactorRecord]]


class RecordLimitsValidator(RecordValidatorBase):
    """Rejects records of the given keys that are too large or expire too far in the future.

    Other keys (hivemind's own) pass through.
    """

    def __init__(self, keys: List[str], max_value_bytes: int = MAX_VALUE_BYTES,
                 max_ttl_seconds: float = MAX_TTL_SECONDS):
        self.key_ids = {DHTID.generate(source=key).to_bytes() for key in keys}
        self.max_value_bytes, self.max_ttl_seconds = max_value_bytes, max_ttl_seconds

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self.key_ids:
            return True
        if len(record.value) > self.max_value_bytes:
            logger.debug(f"rejected a peer record of {len(record.value)} bytes (limit {self.max_value_bytes})")
            return False
        if record.expiration_time > get_dht_time() + self.max_ttl_seconds:
            logger.debug(f"rejected a peer record expiring {record.expiration_time - get_dht_time():.0f}s ahead")
            return False
        return True

    @property
    def priority(self) -> int:
        # above RSASignatureValidator's 10: these cheap checks run first, on the signed value as received
        return 20


def record_validators(keys: SwarmKeys) -> List:
    """Validators every DHT node of the run must install: typed, bounded values in owner-signed subkeys."""
    return [
        SchemaValidator(SwarmRecordsSchema, prefix=keys.run_id),
        SchemaValidator(TrainingRecordsSchema, prefix=keys.namespace),
        RecordLimitsValidator([keys.peers, keys.manifest, keys.digests, keys.round_factors]),
        # a clock record must outlive a clock that runs ahead (dht/clock.py)
        RecordLimitsValidator([keys.clock], max_ttl_seconds=MAX_TTL_SECONDS + CLOCK_RECORD_TTL_SECONDS),
        RSASignatureValidator(),
    ]


def read_peer_infos(dht: hivemind.DHT, run_id: str, timeout_seconds: float = 10.0) -> Dict[bytes, PeerInfo]:
    """Live, valid PeerInfo records of the run, by owner public key."""
    return read_live(dht, peers_key(run_id), PeerInfo, timeout_seconds)


def read_live(dht: hivemind.DHT, key: str, model: Type[BaseModel], timeout_seconds: float) -> Dict[bytes, BaseModel]:
    """Every live value under key that parses as `model`, by owner public key."""
    found = dht.get(key, latest=True, return_future=True).result(timeout=timeout_seconds)
    if found is None or not isinstance(found.value, dict):
        return {}
    now, records = get_dht_time(), {}
    for owner, entry in found.value.items():
        if entry.value is None or entry.expiration_time < now:
            continue
        try:
            records[owner] = model.parse_obj(entry.value)
        except Exception:  # a malformed value that slipped past an old validator: ignore, never crash
            continue
    return records


def own_subkey() -> bytes:
    """The subkey this process signs its records with: hivemind's process-wide RSA key, which its
    progress tracker uses too, so that a peer's records of every kind share one owner."""
    return RSASignatureValidator().local_public_key


def store_own(dht: hivemind.DHT, key: str, value, ttl_seconds: float, timeout_seconds: float = 10.0,
              subkey: Optional[bytes] = None) -> bool:
    """Store value (None withdraws it) under key, in this peer's own signed subkey (`subkey`: another key of this
    peer's, such as its progress tracker's); False if it was not stored in time. Every record of ours is advisory to
    the swarm, so a failed store is logged, never raised."""
    try:
        return bool(dht.store(key, subkey=subkey or own_subkey(), value=value,
                              expiration_time=get_dht_time() + ttl_seconds,
                              return_future=True).result(timeout=timeout_seconds))
    except Exception as e:  # the record expires by itself, or is stored again at its next refresh
        logger.debug(f"could not store {key}: {e!r}")
        return False


def read_by_owner(dht: hivemind.DHT, key: str) -> Dict[bytes, object]:
    """Every peer's current value under key, by subkey (its owner), read from the DHT now."""
    found = dht.get(key, latest=True)
    entries = found.value.items() if found is not None and isinstance(found.value, dict) else []
    return {owner: entry.value for owner, entry in entries if getattr(entry, "value", None) is not None}


class RecordPublisher(threading.Thread):
    """Stores make_value() in this peer's own subkey of key every period until stopped (None: skip this time)."""

    def __init__(
        self,
        dht: hivemind.DHT,
        key: str,
        make_value: Callable[[], Optional[dict]],
        period_seconds: float = PUBLISH_PERIOD_SECONDS,
        ttl_seconds: float = RECORD_TTL_SECONDS,
        withdraw_on_stop: bool = True,
        subkey: Optional[bytes] = None,
    ):
        super().__init__(name=f"RecordPublisher({key})", daemon=True)
        self.dht, self.key, self.make_value, self.subkey = dht, key, make_value, subkey
        self.period_seconds, self.ttl_seconds, self.withdraw_on_stop = period_seconds, ttl_seconds, withdraw_on_stop
        self._stop_event = threading.Event()

    def publish_now(self, timeout_seconds: float = 10.0) -> bool:
        try:
            value = self.make_value()
        except Exception as e:  # publishing is best-effort: training goes on without it
            logger.debug(f"could not make the value of {self.key}: {e!r}")
            return False
        return value is not None and store_own(self.dht, self.key, value, self.ttl_seconds, timeout_seconds,
                                               self.subkey)

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.publish_now()
            self._stop_event.wait(self.period_seconds)

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Stop publishing; with withdraw_on_stop, say goodbye with an empty record, so that readers drop us at once."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout_seconds)
        if self.withdraw_on_stop:
            store_own(self.dht, self.key, None, self.ttl_seconds, timeout_seconds, self.subkey)


class PeerInfoPublisher(RecordPublisher):
    """Publishes this peer's PeerInfo every few seconds until stopped, then withdraws it."""

    def __init__(self, dht: hivemind.DHT, run_id: str, make_info: Callable[[], PeerInfo], **kwargs):
        super().__init__(dht, peers_key(run_id), lambda: make_info().dict(), **kwargs)
