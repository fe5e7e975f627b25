"""The run manifest: what it holds, how peers agree on it, how a peer joins a run with it (real DHTs, in process)."""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import hivemind
import pytest
import torch
from torch import nn

from dht.keys import SwarmKeys
from dht.manifest import MANIFEST_TTL_SECONDS, PROTOCOL_VERSION, agreed_manifest, read_manifests
from dht.records import (
    PeerInfo,
    RecordLimitsValidator,
    RecordPublisher,
    RunManifest,
    own_subkey,
    read_live,
    record_validators,
    store_own,
)
from dht.run_owner import KEY_FILE_NAME, RunOwnerKey, RunOwnerKeyError, fingerprint, is_signed
from peer.config import load_config
from peer.runtime.manifest import ManifestMismatch, ManifestUnreadable, differences, join_run, manifest_for
from peer.testing.forgery import forge_manifests
from tests.peers import wait_until

LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]


def model(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))


def manifest(width: int = 8, created: float = 100.0, **flags) -> RunManifest:
    config = load_config(flags={"task": "bytelm-tiny", **flags})
    made = manifest_for(config, config.training.task, model(width))
    return RunManifest(protocol=made.protocol, settings=made.settings, created=created)


def test_the_manifest_holds_the_shared_settings_of_the_strategy_and_the_model_layout():
    sync, diloco = manifest(), manifest(averaging="diloco")
    assert sync.protocol == PROTOCOL_VERSION
    assert {"task", "target_batch_size", "averaging", "grad_compression", "model"} <= set(sync.settings)
    assert "diloco_inner_steps" not in sync.settings and diloco.settings["diloco_inner_steps"] == 500
    assert "adaptive_large_codec" in manifest(grad_compression="adaptive").settings
    # top-k's settings decide how hivemind cuts a round into parts: peers must share them
    assert {"topk_fraction", "topk_value_bits", "topk_chunk"} <= set(manifest(grad_compression="topk").settings)
    assert "topk_chunk" not in sync.settings
    lines = differences(manifest(grad_compression="topk", topk_chunk=64), manifest(grad_compression="topk"))
    assert lines[0] == "--topk-chunk is 64 here but 256 in the swarm; start with --topk-chunk 256"
    assert manifest().settings == manifest(batch_size=2, matchmaking_seconds=2.0).settings  # local settings
    assert manifest(width=9).settings["model"] != sync.settings["model"]  # one wider layer


def test_differences_name_the_flag_and_the_swarms_value():
    lines = differences(manifest(target_batch_size=512), manifest(target_batch_size=4096))
    assert lines[0] == "--target-batch-size is 512 here but 4096 in the swarm; start with --target-batch-size 4096"
    assert "use a new --run-id" in lines[-1] and len(lines) == 2
    assert differences(manifest(), manifest(created=5.0)) == []  # when it was made is no setting


def test_another_strategy_or_task_is_named_without_the_settings_that_follow_from_it():
    lines = differences(manifest(averaging="diloco"), manifest())
    assert lines[0].startswith("--averaging is 'diloco' here but 'sync'") and len(lines) == 2
    lines = differences(manifest(width=16, task="bytelm"), manifest())
    assert lines[0] == "--task is 'bytelm' here but 'bytelm-tiny' in the swarm; start with --task bytelm-tiny"
    assert len(lines) == 2
    # a module:function task is known by its own name, which --task does not take
    lines = differences(manifest(task="bytelm"), manifest(task="slow-data"))
    assert lines[0] == ("--task is 'bytelm' here but 'slow-data' in the swarm; start with the --task "
                        "module:function that builds the task named 'slow-data'")
    lines = differences(manifest(width=16), manifest())
    assert lines[0].startswith("the model's parameters differ from the swarm's") and len(lines) == 2


def test_another_protocol_is_one_line_about_versions():
    old = manifest()
    newer = RunManifest(protocol=old.protocol + 1, settings=old.settings, created=old.created)
    assert differences(old, newer) == [
        f"this peer speaks swarm protocol {old.protocol}, the swarm {old.protocol + 1}: install the swarmtrain "
        f"version the swarm runs, or start a new run with another --run-id"]


def test_the_swarm_agrees_on_the_manifest_most_peers_hold_then_the_oldest():
    first, second = manifest(created=1.0), manifest(target_batch_size=512, created=0.5)
    assert agreed_manifest({}) is None
    assert agreed_manifest({b"a": first, b"b": manifest(created=3.0), b"c": second}).created == 1.0
    assert agreed_manifest({b"a": first, b"c": second}) is second  # one each: the older one


def test_manifest_records_are_bounded_like_peer_records():
    keys = SwarmKeys.for_run("bounded")
    limits = next(v for v in record_validators(keys) if isinstance(v, RecordLimitsValidator))
    assert RecordLimitsValidator([keys.manifest]).key_ids <= limits.key_ids


@pytest.fixture
def two_dhts():
    keys = SwarmKeys.for_run("manifest-test")
    first = hivemind.DHT(start=True, host_maddrs=LOCALHOST, record_validators=record_validators(keys))
    second = hivemind.DHT(start=True, host_maddrs=LOCALHOST, initial_peers=first.get_visible_maddrs(),
                          record_validators=record_validators(keys))
    try:
        yield keys, first, second
    finally:
        second.shutdown()
        first.shutdown()


def owner_in(directory: Path):
    return lambda: RunOwnerKey.load_or_create(directory)


def join(dht, keys, ours, directory: Path, run_owner=None, timeout_seconds=10.0, **kwargs):
    return join_run(dht, keys, ours, owner_in(directory), run_owner, timeout_seconds, **kwargs)


def announce_a_peer(dht: hivemind.DHT, keys: SwarmKeys) -> None:
    """A PeerInfo of the run, under this process's own subkey (where its copy of the manifest is, if any)."""
    info = PeerInfo(peer_id="QmOther", version="0", device="cpu", client_mode=False, samples_per_second=1.0,
                    global_epoch=3, uptime_seconds=1.0, time=time.time())
    store_own(dht, keys.peers, info.dict(), ttl_seconds=30)


@pytest.mark.timeout(120)
def test_the_first_peer_signs_the_run_and_a_mismatched_one_is_refused(two_dhts, tmp_path):
    keys, first, second = two_dhts
    ours = manifest(created=time.time())
    started = join(first, keys, ours, tmp_path / "a")  # nobody here: it starts the run
    owner = RunOwnerKey.load_or_create(tmp_path / "a").fingerprint
    assert (started.settings, started.created) == (ours.settings, ours.created) and is_signed(started, keys.manifest)
    assert list(read_manifests(second, keys.manifest, 10, owner=owner).values()) == [started]

    with pytest.raises(ManifestMismatch, match="--averaging is 'local-sgd' here but 'sync' in the swarm"):
        join(second, keys, manifest(averaging="local-sgd", created=time.time()), tmp_path / "b", run_owner=owner)
    assert join(second, keys, manifest(created=time.time()), tmp_path / "b", run_owner=owner) == started
    assert not (tmp_path / "b" / KEY_FILE_NAME).exists()  # a joiner makes no key of its own
    # without the owner, a peer whose settings are the run's joins too
    assert join(second, keys, manifest(created=time.time()), tmp_path / "c") == started


@pytest.mark.timeout(180)
def test_forged_manifests_before_and_during_the_run_refuse_and_reconfigure_nobody(two_dhts, tmp_path):
    keys, first, second = two_dhts
    address = str(first.get_visible_maddrs()[0])
    forged = manifest(target_batch_size=999).settings
    forge_manifests(address, keys, forged, copies=1, owner_key_dir=tmp_path / "forger")  # before the run
    started = join(first, keys, manifest(created=time.time()), tmp_path / "a")
    owner = fingerprint(started.owner)
    assert started.settings["target_batch_size"] == 4096 and owner != RunOwnerKey.load_or_create(
        tmp_path / "forger").fingerprint
    announce_a_peer(first, keys)  # the first peer trains now

    forge_manifests(address, keys, forged, copies=3, owner_key_dir=tmp_path / "forger")  # during it
    assert len(read_manifests(second, keys.manifest, 10)) == 5  # the peers of this process share one key; 4 forgers
    for run_owner in (owner, None):  # a newcomer told the owner, or not
        assert join(second, keys, manifest(created=time.time()), tmp_path / "b", run_owner=run_owner) == started

    # a genuinely mismatched newcomer still exits 2: told the owner, it learns the value the owner signed ...
    with pytest.raises(ManifestMismatch) as told:
        join(second, keys, manifest(target_batch_size=512, created=time.time()), tmp_path / "b", run_owner=owner)
    assert str(told.value).splitlines()[0] == ("--target-batch-size is 512 here but 4096 in the swarm; start with "
                                               "--target-batch-size 4096")
    # ... not told, it learns which setting differs, and never a value that nobody vouched for
    with pytest.raises(ManifestMismatch) as untold:
        join(second, keys, manifest(target_batch_size=512, created=time.time()), tmp_path / "b")
    lines = str(untold.value).splitlines()
    assert lines[0] == "--target-batch-size (512 here) differs from the run's manifest"
    assert f"signed by {owner}" in lines[1] and "--run-owner" in lines[1] and "use a new --run-id" in lines[2]
    assert "999" not in str(untold.value) and "4096" not in str(untold.value)


@pytest.mark.timeout(120)
def test_a_manifest_signed_for_another_run_or_altered_is_not_read(two_dhts, tmp_path):
    keys, first, second = two_dhts
    key = RunOwnerKey.load_or_create(tmp_path)
    for_another_run = key.sign(manifest(), SwarmKeys.for_run("another").manifest)
    altered = key.sign(manifest(), keys.manifest).copy(update={"settings": {**manifest().settings, "seed": 1}})
    unsigned = manifest()
    for record in (for_another_run, altered, unsigned):
        assert not is_signed(record, keys.manifest)
        assert store_own(first, keys.manifest, record.dict(), MANIFEST_TTL_SECONDS)
        assert read_live(second, keys.manifest, RunManifest, 10) and read_manifests(second, keys.manifest, 10) == {}


@pytest.mark.timeout(120)
def test_visible_peers_without_a_readable_manifest_stop_a_newcomer(two_dhts, tmp_path):
    keys, first, second = two_dhts
    announce_a_peer(first, keys)
    with pytest.raises(ManifestUnreadable, match="no run manifest of run 'manifest-test' could be read within 2s "
                                                 "while its peers are visible"):
        join(second, keys, manifest(), tmp_path, timeout_seconds=2)
    # told an owner whose manifest nobody holds, a newcomer waits for it, and never starts a run of its own
    with pytest.raises(ManifestUnreadable, match="no run manifest signed by run owner 0{32} of run"):
        join(second, keys, manifest(), tmp_path, run_owner="0" * 32, timeout_seconds=2)


@pytest.mark.timeout(60)
def test_a_stop_while_waiting_for_the_manifest_returns_none(two_dhts, tmp_path):
    keys, first, second = two_dhts
    announce_a_peer(first, keys)
    assert join(second, keys, manifest(), tmp_path, timeout_seconds=30, wait=lambda seconds: True) is None


@pytest.mark.timeout(60)
def test_a_manifest_copy_is_stored_in_this_processes_own_subkey(tmp_path):
    keys = SwarmKeys.for_run("own-subkey")
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST, record_validators=record_validators(keys))
    try:
        signed = RunOwnerKey.load_or_create(tmp_path).sign(manifest(), keys.manifest)
        assert store_own(dht, keys.manifest, signed.dict(), MANIFEST_TTL_SECONDS)
        assert list(read_manifests(dht, keys.manifest, 10)) == [own_subkey()]
    finally:
        dht.shutdown()


def test_the_run_owner_key_is_private_kept_across_restarts_and_never_replaced(tmp_path):
    key = RunOwnerKey.load_or_create(tmp_path / "new-dir")
    path = tmp_path / "new-dir" / KEY_FILE_NAME
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert RunOwnerKey.load_or_create(tmp_path / "new-dir").fingerprint == key.fingerprint
    path.write_bytes(b"not a key")
    with pytest.raises(RunOwnerKeyError, match=f"run owner key {path} is not a usable Ed25519 key .*left untouched"):
        RunOwnerKey.load_or_create(tmp_path / "new-dir")
    assert path.read_bytes() == b"not a key"


def test_model_fingerprint_ignores_values_but_not_dtypes():
    a, b = model(), model()
    with torch.no_grad():
        b[0].weight.add_(1.0)
    def layout(m: nn.Module) -> str:
        return manifest_for(load_config(), "bytelm", m).settings["model"]

    assert layout(a) == layout(b) and layout(a) != layout(a.double())


@pytest.mark.timeout(60)
def test_a_keeper_skips_when_there_is_nothing_to_keep_and_leaves_its_copy_when_it_stops():
    """How the manifest is kept alive (by peers, and by a bootstrap node that re-stores what the swarm agreed on)."""
    keys = SwarmKeys.for_run("keeper")
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST, record_validators=record_validators(keys))
    try:
        current = {"manifest": None}
        keeper = RecordPublisher(dht, keys.manifest, lambda: current["manifest"], period_seconds=0.2,
                                 ttl_seconds=30, withdraw_on_stop=False)
        assert keeper.publish_now() is False and read_live(dht, keys.manifest, RunManifest, 10) == {}
        current["manifest"] = manifest().dict()
        keeper.start()
        wait_until(lambda: read_live(dht, keys.manifest, RunManifest, 10) != {}, 20, message="the keeper to store")
        keeper.stop()
        assert list(read_live(dht, keys.manifest, RunManifest, 10).values()) == [manifest()]  # still there after stop
    finally:
        dht.shutdown()
