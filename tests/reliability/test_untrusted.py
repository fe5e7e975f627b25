"""Mistaken and hostile peers against a real swarm on 127.0.0.1: the run manifest refuses the incompatible, forged
manifests refuse and reconfigure nobody, and forged progress records freeze nobody (one swarm for all, to keep the
suite short)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress, TrainingProgressSchema
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.keys import SwarmKeys
from peer.telemetry.events import EpochEnded
from peer.testing import Peer, Swarm
from peer.testing.forgery import forge_manifests

TARGET = "192"
# the first peer trains alone for most of the test: on the built-in task it would take a whole core, while this
# one's data loader sleeps (20 ms a sample)
TASK = "tests.tasks_for_tests:make_slow_data_task"
MISMATCHED = {  # name: (flags, the first error line it must print)
    "task": (["--task", "bytelm", "--target-batch-size", TARGET], "--task is 'bytelm' here but 'slow-data'"),
    "target": (["--target-batch-size", "512"], f"--target-batch-size is 512 here but {TARGET} in the swarm"),
    "strategy": (["--averaging", "local-sgd", "--target-batch-size", TARGET], "--averaging is 'local-sgd' here"),
}


def forge_progress(address: str, epoch: int, samples: int) -> hivemind.DHT:
    """A DHT client (no training, a key pair of its own) storing one validly signed progress record."""
    signer = RSASignatureValidator(RSAPrivateKey())
    keys = SwarmKeys.for_run("swarmtrain")
    forger = hivemind.DHT(start=True, client_mode=True, initial_peers=[address], record_validators=[
        SchemaValidator(TrainingProgressSchema, prefix=keys.namespace), signer])
    claim = LocalTrainingProgress(peer_id=forger.peer_id.to_bytes(), epoch=epoch, samples_accumulated=samples,
                                  samples_per_second=10.0, time=get_dht_time(), client_mode=False)
    # expiring as soon as hivemind's own records do: only the lie itself gives it away
    assert forger.store(keys.progress, claim.dict(), get_dht_time() + 14, subkey=signer.local_public_key)
    return forger


def peers_per_epoch(peer: Peer) -> List[int]:
    return [event.peers for event in peer.events if isinstance(event, EpochEnded)]


@pytest.mark.timeout(300)
async def test_incompatible_peers_are_refused_and_forged_manifests_or_progress_sway_nobody(tmp_path: Path):
    async with Swarm(tmp_path, "--task", TASK, fast=True) as swarm:
        bootstrap = await swarm.bootstrap()
        keys = SwarmKeys.for_run("swarmtrain")
        # 1. a squatter's manifest, stored before the run's first peer starts, with the attacker's target batch
        squatted = {"task": "slow-data", "target_batch_size": 999, "averaging": "sync"}
        forge_manifests(bootstrap.address, keys, squatted, copies=1, owner_key_dir=tmp_path / "squatter")
        first = await swarm.add("--target-batch-size", TARGET, "--max-seconds", "240", name="a")
        assert "ignoring run manifests signed by" in first.log() and first.run_owner is not None
        # and three more copies while it trains: newcomers given the owner never read them
        forge_manifests(bootstrap.address, keys, squatted, copies=3, owner_key_dir=tmp_path / "squatter")
        owner = ["--run-owner", first.run_owner]

        # 2. the run manifest: each mismatched peer exits 2 naming the setting, before it can join a round
        mismatched = {name: await swarm.add(*args, *owner, name=name, ready=False)
                      for name, (args, _) in MISMATCHED.items()}
        # not told the owner, a mismatched peer is refused too, and told no value that nobody vouched for
        unverified = await swarm.add("--target-batch-size", "512", name="untold", ready=False)
        for name, (_, expected) in [*MISMATCHED.items(), ("untold", ("", "--target-batch-size (512 here) differs"))]:
            peer = unverified if name == "untold" else mismatched[name]
            assert (await peer.exited(timeout=120)).code == 2, peer.log_tail()
            errors = [line for line in peer.log().splitlines() if line.startswith("error: ")]
            assert errors[0].startswith("error: " + expected), errors
            assert "use a new --run-id" in errors[-1]
            assert not any("but 999" in line or "size 999" in line for line in errors), errors  # the squatter's
            assert "Traceback" not in peer.log()
        errors = [line for line in unverified.log().splitlines() if line.startswith("error: ")]
        assert any("with --run-owner" in line for line in errors)
        assert not any(f"but {TARGET}" in line or "start with --target-batch-size" in line for line in errors), errors
        # the training peer never counted them: every epoch so far had it alone in the swarm
        await first.reach(2, timeout=90)
        assert peers_per_epoch(first) and set(peers_per_epoch(first)) == {1}, first.events
        epoch_after_refusals = first.epoch

        # 3. forged progress: epoch 10^9, and 10^12 samples
        forgers = [forge_progress(first.address, 10**9, 0), forge_progress(first.address, first.epoch, 10**12)]
        try:
            epoch_at_forgery = first.epoch
            second = await swarm.add("--target-batch-size", TARGET, "--max-seconds", "200", *owner, name="b")
            await second.wait_for(EpochEnded, lambda event: event.epoch >= epoch_at_forgery + 3 and event.peers == 2,
                                  timeout=120, what="the newcomer to train with the first peer, three epochs past "
                                                    "the forgery")
            # nor was the first peer frozen (its epoch event may come a moment after the newcomer's)
            await first.reach(epoch_at_forgery + 3, timeout=60)
            assert epoch_at_forgery >= epoch_after_refusals
            for peer in (first, second):
                peer.terminate()
                assert await peer.exit_code(timeout=60) == 0, peer.log_tail()
        finally:
            for forger in forgers:
                forger.shutdown()

    a, b = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("a", "b"))
    # the peer says why it believes none of it
    assert "not believing the progress records" in first.log() and "epoch 1000000000 claimed" in first.log()
    assert "1000000000000 samples claimed in one epoch" in first.log()
    # believed, the lie makes a peer download in a loop (~520 times in 80 s, mostly failing); a download or two
    # is the ordinary resync of two peers in a fast swarm
    assert a["state_downloads"] <= 2 and "no peer sent a usable state" not in first.log()
    # a newcomer believes its first look once; then what it was served settles it. The rest is the usual chase of
    # a newcomer in a fast swarm (2 to 11 seen here, about one per epoch it was behind); the lie believed would be
    # a download at every step, hundreds by now
    assert b["state_downloads"] <= 30
