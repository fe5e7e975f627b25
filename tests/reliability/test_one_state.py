"""One swarm, one state (averaging/swarm/digests.py): a peer that drifts is found apart by digest and brought
back, and a donor that serves a corrupted state is refused by digest and excluded.

One swarm of four: two honest peers, `drifter` (its parameters perturbed after epoch 10, as a bit flip or a bug
would) and `liar` (trains honestly, serves its state negated, and claims to be a step ahead so that a downloading
peer picks it first). Parameter averaging is off (--average-state-every 1000), so that nothing but a download can
bring the drifter back.

- Whoever downloads from the liar first refuses its state: the drifter as it resyncs, or an honest peer, which
  downloads too whenever it falls an epoch behind. Under load the liar is behind as often, and then ranks below
  the honest peers as a donor: the drifter may resync from one of them and never ask the liar.
- The drifter serves no state. Its perturbed state differs from the digest it published before the perturbation:
  a peer that took it would refuse it, exclude the drifter and serve it nothing (CI: the liar, behind under load,
  took it at epoch 10, and the drifter never got the liar's state to refuse).
- Two honest peers, so that each has an honest donor: with one, a peer that had excluded the liar and fell behind
  had none (the drifter serves none), failed every round beside the liar and published no digest, and the drifter
  had nobody to compare with.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Sequence, Tuple

import pytest

from averaging.swarm.digests import DIGEST_MISMATCH
from peer.process.launcher import Peer
from peer.telemetry.events import DownloadRejected, PeerExcluded, RoundEnded, StateChecked, StateDownloaded
from peer.testing import Swarm, max_parameter_difference
from peer.testing.faults import FaultPlan

# Past the first epochs, whose rounds a swarm still joining under load leaves partial: a peer apart then (the drifter
# too, at epoch 2 in one run) is not the drift this test looks for.
PERTURBED_AFTER = 10
EPOCHS = 80  # only the bound: the run ends two epochs after the checks


@pytest.mark.solo  # four peers whose epochs take a second: run alone, after the suite (.ci/run)
@pytest.mark.timeout(400)
async def test_a_drifted_peer_resyncs_by_digest_and_refuses_and_excludes_a_donor_serving_a_corrupted_state(
        tmp_path: Path):
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", fast=True) as swarm:
        run = ("--min-peers", "4", "--max-epochs", str(EPOCHS), "--average-state-every", "1000")
        honest = [await swarm.add(*run, *swarm.ends_on_request(), name=f"honest-{index}") for index in (1, 2)]
        drifter = await swarm.add(*run, *swarm.ends_on_request(FaultPlan(perturb_params_at_epoch=PERTURBED_AFTER,
                                                                         serve_no_state=True)), name="drifter")
        liar = await swarm.add(*run, *swarm.ends_on_request(FaultPlan(serve_corrupted_state=True)), name="liar")

        # a peer may be apart at the first epochs too, which a swarm still joining leaves partial
        apart = await drifter.wait_for(StateChecked, lambda event: not event.agrees and event.epoch > PERTURBED_AFTER,
                                       timeout=180, what="the drifter to find itself apart from the swarm")
        assert apart.peers >= 2
        refuser, rejected = await first_refusal(of=liar, by=(drifter, *honest), timeout=180)
        await refuser.wait_for(PeerExcluded, lambda event: event.peer_id == liar.peer_id, timeout=60,
                               what="the liar to be excluded")
        if refuser is drifter:
            await drifter.wait_for(StateDownloaded, lambda event: event.time > rejected.time, timeout=120,
                                   what="a download from an honest donor")
        # said once per change: where the drifter resynced before the liar served it, that came before the refusal
        await drifter.wait_for(StateChecked, lambda event: event.agrees and event.time > apart.time,
                               timeout=120, what="the drifter's digest to be the swarm's again")
        swarm.end_soon([*honest, drifter, liar])
        assert await swarm.all_exited(timeout=240) == [0, 0, 0, 0]

    assert json.loads((tmp_path / "drifter.json").read_text())["state_disagreements"] >= 1
    summary = json.loads((tmp_path / f"{refuser.name}.json").read_text())
    assert summary["rejected_downloads"] >= 1 and summary["excluded_peers"] == [liar.peer_id]
    served_by_drifter = [event for peer in (*honest, liar) for event in peer.events
                         if isinstance(event, DownloadRejected) and event.donor == drifter.peer_id]
    assert not served_by_drifter, "the drifter served its state"
    assert "refused the state downloaded from" in refuser.log()
    # the victim kept no part of the corrupted state: it holds the honest swarm's, bit for bit
    for peer in (honest[1], drifter):
        assert max_parameter_difference(honest[0].model_state(), peer.model_state()) == 0.0, peer.name


async def first_refusal(of: Peer, by: Sequence[Peer], timeout: float) -> Tuple[Peer, DownloadRejected]:
    """The first of `by` to refuse a state downloaded from `of` for its digest, and that refusal."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for peer in by:
            for event in peer.events:
                if isinstance(event, DownloadRejected) and (event.donor, event.reason) == (of.peer_id, DIGEST_MISMATCH):
                    return peer, event
        await asyncio.sleep(0.5)
    raise AssertionError(f"nobody refused the state of {of.name} within {timeout:g} s\n"
                         + "\n".join(peer.warnings() for peer in by))


LAST_EPOCH = 6


@pytest.mark.timeout(300)
async def test_peers_found_apart_at_their_last_epoch_leave_with_one_state(tmp_path: Path):
    """A peer that drifts on its way to the last epoch: where every round there was whole, only the digests can tell,
    and the peers compare them before they leave (two peers that disagree: the smaller id's state wins)."""
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", fast=True) as swarm:
        run = ("--min-peers", "2", "--max-epochs", str(LAST_EPOCH), "--average-state-every", "1000")
        first = await swarm.add(*run, name="first")
        drifter = await swarm.add(*run, *swarm.ends_on_request(FaultPlan(perturb_params_at_epoch=LAST_EPOCH - 1)),
                                  name="drifter")
        assert await swarm.all_exited(timeout=240) == [0, 0]

    apart = [event for peer in (first, drifter) for event in peer.events
             if isinstance(event, StateChecked) and not event.agrees and event.epoch == LAST_EPOCH]
    last_rounds = [[event for event in peer.events if isinstance(event, RoundEnded)][-1] for peer in (first, drifter)]
    # a last round left partial by a late part (CI load) says by itself that the two are apart, without the digests
    if all(event.outcome == "ok" for event in last_rounds):
        assert apart, f"nobody found the drift at the last epoch\n{first.warnings()}\n{drifter.warnings()}"
    downloads = [event for peer in (first, drifter) for event in peer.events
                 if isinstance(event, StateDownloaded) and event.epoch == LAST_EPOCH]
    assert downloads, "the peer apart left with its own state"
    assert max_parameter_difference(first.model_state(), drifter.model_state()) == 0.0


@pytest.mark.timeout(240)
async def test_a_peer_left_behind_downloading_while_the_others_finish_is_served_before_they_leave(tmp_path: Path):
    """The 3-peer lock-step test's failure in CI, made on purpose. Every round to epoch 6 fails, so no peer holds a
    state it may publish a digest of; `behind` also stalls there. The other two train on in step, and `behind`
    spends its attempts on their unpublished states while they reach --max-epochs. They must not leave before it has
    the final state: it stores its progress record as it tries (hivemind's tracker stops storing the record of a
    peer two epochs behind), so they see it behind and stay. Without that, it trained the last epochs alone and
    ended 3e-2 apart."""
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", fast=True) as swarm:
        run = ("--min-peers", "3", "--max-epochs", "12")

        def faults(**plan) -> Tuple[str, str]:
            return "--inject-faults", FaultPlan(fail_round_at_epoch=5, **plan).model_dump_json()

        peers = [await swarm.add(*run, *faults(), name="first"), await swarm.add(*run, *faults(), name="second"),
                 await swarm.add(*run, *faults(stall_after_epoch=5, stall_seconds=8), name="behind")]
        assert await swarm.all_exited(timeout=200) == [0, 0, 0]

    behind = peers[2]
    trained_alone = [event for event in behind.events if isinstance(event, RoundEnded) and event.outcome == "skipped"]
    assert not trained_alone, f"it trained epochs alone: its partners had left\n{behind.warnings()}"
    for peer in peers[1:]:
        assert max_parameter_difference(peers[0].model_state(), peer.model_state()) == 0.0, (
            f"{peer.name} ended apart\n{peer.warnings()}")
