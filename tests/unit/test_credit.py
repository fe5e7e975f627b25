"""Credit: a peer's own claim counts what its rounds averaged, and the contributors table sets it beside the median
of what the other peers observed, so that no observer can raise (or sink) another peer's count on its own."""
from __future__ import annotations

import time

import pytest
from pydantic.v1 import ValidationError

from dht.credit import contributors
from dht.records import MAX_OBSERVED_PEERS, CreditRecord, PeerInfo
from peer.runtime.credit import CreditLedger


def info(peer_id: str, credit: CreditRecord) -> PeerInfo:
    return PeerInfo(peer_id=peer_id, version="1", device="cpu", client_mode=False, samples_per_second=1.0,
                    global_epoch=3, uptime_seconds=1.0, time=time.time(), credit=credit)


def test_own_samples_count_only_for_epochs_whose_round_averaged_them():
    ledger = CreditLedger(lambda: 12.5, lambda: 2048)
    for outcome in ("ok", "partial", "failed", "timeout", "skipped", ""):
        ledger.epoch_ended(16, outcome)
    ledger.observed("peer-b", 16.0)
    ledger.observed("peer-b", 8.0)
    assert ledger.record() == CreditRecord(samples=32.0, device_seconds=12.5, sent_bytes=2048,
                                           observed={"peer-b": 24.0})


def test_a_record_names_the_peers_it_saw_give_most_within_the_limit():
    ledger = CreditLedger(lambda: 0.0, lambda: 0)
    for index in range(MAX_OBSERVED_PEERS + 5):
        ledger.observed(f"peer-{index:02d}", float(index))
    observed = ledger.record().observed
    assert len(observed) == MAX_OBSERVED_PEERS and "peer-00" not in observed and observed["peer-28"] == 28.0
    with pytest.raises(ValidationError, match="more than"):
        CreditRecord(observed={f"peer-{index}": 1.0 for index in range(MAX_OBSERVED_PEERS + 1)})


def test_one_lying_observer_moves_nobodys_observed_count():
    honest = {"a": 100.0, "b": 100.0, "c": 100.0}
    records = {
        "a": CreditRecord(samples=100.0, observed={"b": 100.0, "c": 100.0, "d": 100.0}),
        "b": CreditRecord(samples=100.0, observed={"a": 100.0, "c": 100.0, "d": 100.0}),
        "c": CreditRecord(samples=100.0, observed={"a": 100.0, "b": 100.0, "d": 100.0}),
        # d inflates itself, boosts c, belittles a, and writes a count for a peer that never ran
        "d": CreditRecord(samples=1e9, observed={"a": 0.0, "c": 1e9, "e": 1e9}),
    }
    rows = {row["peer_id"]: row for row in contributors(info(peer, record) for peer, record in records.items())}
    for peer, samples in honest.items():
        assert rows[peer]["observed_samples"] == samples, rows[peer]
    assert rows["d"]["claimed_samples"] == 10**9 and rows["d"]["observed_samples"] == 100  # its claim, beside the truth
    assert "e" not in rows  # a peer with no record of its own has no row
    assert rows["a"]["observers"] == 3


def test_a_peer_nobody_averaged_with_shows_its_claim_and_no_observation():
    rows = contributors([info("a", CreditRecord(samples=64.0)), info("b", CreditRecord(samples=0.0))])
    assert [(row["peer_id"], row["claimed_samples"], row["observed_samples"]) for row in rows] == [
        ("a", 64, None), ("b", 0, None)]
