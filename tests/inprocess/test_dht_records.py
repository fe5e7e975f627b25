"""Swarm records: only the owner can write its subkey, and bad values never get stored.

The validator chain is checked directly on DHTRecords (fast, exact), then once across two
real DHT nodes, where a forger with its own key tries to overwrite a victim's record.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.keys import SwarmKeys, peers_key
from dht.node import shutdown_dht, visible_maddrs
from dht.records import (
    MAX_TTL_SECONDS,
    MAX_VALUE_BYTES,
    PeerInfo,
    RecordLimitsValidator,
    SwarmRecordsSchema,
    read_peer_infos,
    record_validators,
)
from dht.verdicts import RememberingValidator

RUN_ID = "records-test"


def peer_info(**overrides) -> dict:
    values = dict(
        peer_id="QmVictim", version="0.1.0", device="cpu", client_mode=False, samples_per_second=12.5,
        global_epoch=3, uptime_seconds=42.0, time=time.time(), maddrs=["/ip4/127.0.0.1/tcp/1"],
        fractions={"compute": 0.7, "communication": 0.3}, bottleneck="compute",
    )
    values.update(overrides)
    return PeerInfo(**values).dict()


class AlwaysSigns(RSASignatureValidator):
    """A forger's validator: signs every record with its own key, whoever the subkey names."""

    def sign_value(self, record: DHTRecord) -> bytes:
        signature = self._private_key.sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)


def chain(signer: RSASignatureValidator, kind=CompositeValidator) -> CompositeValidator:
    return kind(
        [SchemaValidator(SwarmRecordsSchema, prefix=RUN_ID), RecordLimitsValidator([peers_key(RUN_ID)]), signer]
    )


def signed_record(signer: RSASignatureValidator, owner: bytes, value, expiration_time: float = None) -> DHTRecord:
    record = DHTRecord(
        key=DHTID.generate(source=peers_key(RUN_ID)).to_bytes(),
        subkey=MSGPackSerializer.dumps(owner),
        value=MSGPackSerializer.dumps(value),
        expiration_time=expiration_time if expiration_time is not None else get_dht_time() + 15,
    )
    return dataclasses.replace(record, value=chain(signer).sign_value(record))


@pytest.fixture(scope="module")
def victim() -> RSASignatureValidator:
    return RSASignatureValidator(RSAPrivateKey())


@pytest.fixture(scope="module")
def forger() -> AlwaysSigns:
    return AlwaysSigns(RSAPrivateKey())


def test_valid_record_round_trips(victim):
    info = peer_info()
    record = signed_record(victim, victim.local_public_key, info)
    validators = chain(RSASignatureValidator(RSAPrivateKey()))  # any node of the run, with its own key
    assert validators.validate(record)
    assert MSGPackSerializer.loads(validators.strip_value(record)) == info


def test_record_signed_by_another_key_is_rejected(victim, forger):
    forged = signed_record(forger, victim.local_public_key, peer_info(peer_id="QmForged"))
    assert not chain(victim).validate(forged)
    unsigned = signed_record(RSASignatureValidator(RSAPrivateKey()), victim.local_public_key, peer_info())
    assert not chain(victim).validate(unsigned)  # signer's key not in the subkey: not signed at all


@pytest.mark.parametrize(
    "value",
    [
        {**peer_info(), "samples_per_second": "fast"},  # wrong type
        {**peer_info(), "global_epoch": 3.0},  # a float where an int belongs
        {**peer_info(), "admin": True},  # an unknown field
        {k: v for k, v in peer_info().items() if k != "device"},  # a missing field
        "not a record",
    ],
    ids=["wrong-type", "float-for-int", "extra-field", "missing-field", "not-a-dict"],
)
def test_malformed_values_are_rejected(victim, value):
    assert not chain(victim).validate(signed_record(victim, victim.local_public_key, value))


def test_oversized_value_is_rejected_even_when_it_fits_the_schema(victim):
    big = peer_info(maddrs=["/ip4/127.0.0.1/tcp/1/" + "x" * 230] * 16, fractions={f"phase{i}": 0.1 for i in range(40)})
    assert len(MSGPackSerializer.dumps(big)) > MAX_VALUE_BYTES
    assert SchemaValidator(SwarmRecordsSchema, prefix=RUN_ID).validate(
        DHTRecord(DHTID.generate(source=peers_key(RUN_ID)).to_bytes(), MSGPackSerializer.dumps(victim.local_public_key),
                  MSGPackSerializer.dumps(big), get_dht_time() + 15)
    ), "the schema alone would accept it"
    assert not chain(victim).validate(signed_record(victim, victim.local_public_key, big))


def test_far_future_expiration_is_rejected(victim):
    far = get_dht_time() + MAX_TTL_SECONDS + 600
    assert not chain(victim).validate(signed_record(victim, victim.local_public_key, peer_info(), far))
    assert chain(victim).validate(signed_record(victim, victim.local_public_key, peer_info(), get_dht_time() + 600))


def test_other_keys_are_not_limited(victim):
    record = DHTRecord(
        DHTID.generate(source="elsewhere").to_bytes(), b"", b"x" * (2 * MAX_VALUE_BYTES), get_dht_time() + 10**6
    )
    assert RecordLimitsValidator([peers_key(RUN_ID)]).validate(record)


@pytest.mark.timeout(120)
def test_forger_cannot_overwrite_or_pollute_across_real_nodes(victim):
    honest = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                 record_validators=record_validators(SwarmKeys.for_run(RUN_ID)))
    forging_node = None
    try:
        forger_key = RSAPrivateKey()
        forging = [SchemaValidator(SwarmRecordsSchema, prefix=RUN_ID), RecordLimitsValidator([peers_key(RUN_ID)]),
                   AlwaysSigns(forger_key)]
        forging_node = DHT(initial_peers=visible_maddrs(honest), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                           record_validators=forging)
        key, own_subkey = peers_key(RUN_ID), RSASignatureValidator().local_public_key  # the honest node's key
        forger_subkey = AlwaysSigns(forger_key).local_public_key

        def store(node, subkey, value, ttl=15.0) -> bool:
            return node.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + ttl,
                              return_future=True).result(timeout=20)

        assert store(honest, own_subkey, peer_info(peer_id="QmHonest"))
        # a later expiration would win if it were accepted
        assert not store(forging_node, own_subkey, peer_info(peer_id="QmForged"), ttl=60)
        assert not store(forging_node, forger_subkey, {**peer_info(peer_id="QmBad"), "samples_per_second": "fast"})
        assert not store(forging_node, forger_subkey, peer_info(peer_id="QmBig", maddrs=["/" + "x" * 250] * 16,
                                                                  fractions={f"p{i}": 0.1 for i in range(40)}))
        assert not store(forging_node, forger_subkey, peer_info(peer_id="QmForever"), ttl=MAX_TTL_SECONDS * 10)

        for reader in (honest, forging_node):
            infos = read_peer_infos(reader, RUN_ID, timeout_seconds=20)
            assert [info.peer_id for info in infos.values()] == ["QmHonest"]
    finally:
        shutdown_dht(forging_node)
        shutdown_dht(honest)


def test_validation_loss_is_optional_and_finite(victim):
    assert peer_info()["val_loss"] is None  # before the first validation
    validators = chain(victim)
    assert validators.validate(signed_record(victim, victim.local_public_key, peer_info(val_loss=2.5)))
    for loss in (float("nan"), float("inf")):  # the page charts it: a diverged peer publishes None instead
        diverged = {**peer_info(), "val_loss": loss}
        assert not validators.validate(signed_record(victim, victim.local_public_key, diverged))


class Counting(RecordLimitsValidator):
    """Counts the records it is asked to check."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checked = 0

    def validate(self, record: DHTRecord) -> bool:
        self.checked += 1
        return super().validate(record)


def test_a_remembering_chain_checks_a_valid_record_once_and_rejects_what_the_plain_one_does(victim, forger):
    remembering = chain(RSASignatureValidator(RSAPrivateKey()), kind=RememberingValidator)
    counting = Counting([peers_key(RUN_ID)])
    remembering.extend([counting])
    genuine = signed_record(victim, victim.local_public_key, peer_info())
    assert remembering.validate(genuine) and remembering.validate(genuine)
    assert counting.checked == 1
    tampered = dataclasses.replace(genuine, value=genuine.value.replace(b"cpu", b"gpu"))
    assert tampered.value != genuine.value
    refreshed = signed_record(victim, victim.local_public_key, peer_info(), genuine.expiration_time + 1)
    forged = signed_record(forger, victim.local_public_key, peer_info(peer_id="QmForged"))
    malformed = signed_record(victim, victim.local_public_key, {**peer_info(), "admin": True})
    for _ in range(2):  # nothing about them is remembered
        assert not remembering.validate(tampered)
        assert not remembering.validate(forged)
        assert not remembering.validate(malformed)
    assert remembering.validate(refreshed)  # a record that changed in any field is checked anew
    assert counting.checked == 8


def test_a_far_future_record_rejected_once_is_accepted_once_within_the_limit(victim):
    remembering = chain(victim, kind=RememberingValidator)
    record = signed_record(victim, victim.local_public_key, peer_info(), get_dht_time() + MAX_TTL_SECONDS + 600)
    assert not remembering.validate(record)
    limits = next(check for check in remembering._validators if isinstance(check, RecordLimitsValidator))
    limits.max_ttl_seconds += 3600  # as if its expiration had come within the limit as time passed
    assert remembering.validate(record)


def test_the_memory_is_bounded_and_emptied_when_validators_are_added(victim):
    counting = Counting([peers_key(RUN_ID)])
    remembering = RememberingValidator([counting, victim], capacity=2)
    records = [signed_record(victim, victim.local_public_key, peer_info(), get_dht_time() + 15 + i) for i in range(3)]
    for record in records:
        assert remembering.validate(record)
    assert remembering.validate(records[2]) and counting.checked == 3  # the newest is remembered
    assert remembering.validate(records[0]) and counting.checked == 4  # the oldest was forgotten
    remembering.extend([SchemaValidator(SwarmRecordsSchema, prefix=RUN_ID)])
    assert remembering.validate(records[0]) and counting.checked == 5
