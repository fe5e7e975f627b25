"""One swarm, one state (averaging/swarm/digests.py): a peer that drifts is found apart by digest and brought
back, and a donor that serves a corrupted state is refused by digest and excluded.

One swarm of three: `honest`, `drifter` (its parameters perturbed after epoch 10, as a bit flip or a bug would)
and `liar` (trains honestly, serves its state negated, and claims to be a step ahead so that a downloading peer
picks it first). Parameter averaging is off (--average-state-every 1000), so that nothing but a download can
bring the drifter back.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from peer.telemetry.events import DownloadRejected, PeerExcluded, RoundEnded, StateChecked, StateDownloaded
from peer.testing import Swarm, max_parameter_difference
from peer.testing.faults import FaultPlan

# Past the first epochs, whose rounds a swarm still joining under load leaves partial: an honest peer left apart then
# downloads, and may take the drifter's state (CI: its round to epoch 4 was partial, and it took the drifter's at
# epoch 8); two of three then hold the drifted state, and it is the swarm's.
PERTURBED_AFTER = 10
EPOCHS = 80  # only the bound: the run ends two epochs after the checks


@pytest.mark.timeout(400)
async def test_a_drifted_peer_resyncs_by_digest_and_refuses_and_excludes_a_donor_serving_a_corrupted_state(
        tmp_path: Path):
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", fast=True) as swarm:
        run = ("--min-peers", "3", "--max-epochs", str(EPOCHS), "--average-state-every", "1000")
        honest = await swarm.add(*run, *swarm.ends_on_request(), name="honest")
        drifter = await swarm.add(*run, *swarm.ends_on_request(FaultPlan(perturb_params_at_epoch=PERTURBED_AFTER)),
                                  name="drifter")
        liar = await swarm.add(*run, *swarm.ends_on_request(FaultPlan(serve_corrupted_state=True)), name="liar")

        apart = await drifter.wait_for(StateChecked, lambda event: not event.agrees, timeout=180,
                                       what="the drifter to find itself apart from the swarm")
        assert apart.epoch > PERTURBED_AFTER and apart.peers >= 2
        rejected = await drifter.wait_for(  # an honest donor may be skipped first, its digest not out yet
            DownloadRejected, lambda event: event.reason == "digest_mismatch", timeout=120,
            what="the liar's state to be refused")
        assert (rejected.donor, rejected.reason) == (liar.peer_id, "digest_mismatch")
        await drifter.wait_for(PeerExcluded, lambda event: event.peer_id == liar.peer_id, timeout=60,
                               what="the liar to be excluded")
        await drifter.wait_for(StateDownloaded, lambda event: event.time > rejected.time, timeout=120,
                               what="a download from an honest donor")
        # said once per change: where the drifter resynced before the liar served it, that came before the refusal
        await drifter.wait_for(StateChecked, lambda event: event.agrees and event.time > apart.time,
                               timeout=120, what="the drifter's digest to be the swarm's again")
        swarm.end_soon([honest, drifter, liar])
        assert await swarm.all_exited(timeout=240) == [0, 0, 0]

    summary = json.loads((tmp_path / "drifter.json").read_text())
    assert summary["state_disagreements"] >= 1 and summary["rejected_downloads"] >= 1
    assert summary["excluded_peers"] == [liar.peer_id]
    assert "refused the state downloaded from" in drifter.log()
    # the victim kept no part of the corrupted state: it holds the honest swarm's, bit for bit
    assert max_parameter_difference(honest.model_state(), drifter.model_state()) == 0.0


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
