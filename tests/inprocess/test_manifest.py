"""The run manifest: what it holds, how peers agree on it, how a peer joins a run with it (real DHTs, in process)."""
from __future__ import annotations

import time

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
    record_validators,
    store_own,
)
from peer.config import load_config
from peer.runtime.manifest import ManifestMismatch, ManifestUnreadable, differences, join_run, manifest_for
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


@pytest.mark.timeout(120)
def test_the_first_peer_starts_the_run_and_a_mismatched_one_is_refused(two_dhts):
    keys, first, second = two_dhts
    ours = manifest(created=time.time())
    assert join_run(first, keys, ours, timeout_seconds=10) == ours  # nobody here: it starts the run
    assert list(read_manifests(second, keys.manifest, 10).values()) == [ours]

    with pytest.raises(ManifestMismatch, match="--averaging is 'local-sgd' here but 'sync' in the swarm"):
        join_run(second, keys, manifest(averaging="local-sgd", created=time.time()), timeout_seconds=10)
    assert join_run(second, keys, manifest(created=time.time()), timeout_seconds=10) == ours  # equal settings


def another_peer_without_a_manifest(dht: hivemind.DHT, keys: SwarmKeys) -> None:
    info = PeerInfo(peer_id="QmOther", version="0", device="cpu", client_mode=False, samples_per_second=1.0,
                    global_epoch=3, uptime_seconds=1.0, time=time.time())
    store_own(dht, keys.peers, info.dict(), ttl_seconds=30)


@pytest.mark.timeout(120)
def test_visible_peers_without_a_readable_manifest_stop_a_newcomer(two_dhts):
    keys, first, second = two_dhts
    another_peer_without_a_manifest(first, keys)
    with pytest.raises(ManifestUnreadable, match="peers of run 'manifest-test' are visible but no run manifest"):
        join_run(second, keys, manifest(), timeout_seconds=2)


@pytest.mark.timeout(60)
def test_a_stop_while_waiting_for_the_manifest_returns_none(two_dhts):
    keys, first, second = two_dhts
    another_peer_without_a_manifest(first, keys)
    assert join_run(second, keys, manifest(), timeout_seconds=30, wait=lambda seconds: True) is None


@pytest.mark.timeout(60)
def test_a_manifest_copy_is_stored_in_this_processes_own_subkey():
    keys = SwarmKeys.for_run("own-subkey")
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST, record_validators=record_validators(keys))
    try:
        assert store_own(dht, keys.manifest, manifest().dict(), MANIFEST_TTL_SECONDS)
        assert list(read_manifests(dht, keys.manifest, 10)) == [own_subkey()]
    finally:
        dht.shutdown()


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
        assert keeper.publish_now() is False and read_manifests(dht, keys.manifest, 10) == {}
        current["manifest"] = manifest().dict()
        keeper.start()
        wait_until(lambda: read_manifests(dht, keys.manifest, 10) != {}, 20, message="the keeper to store")
        keeper.stop()
        assert list(read_manifests(dht, keys.manifest, 10).values()) == [manifest()]  # still there after stop
    finally:
        dht.shutdown()
