"""Hostile peers against a 3-peer honest swarm: one attacker at a time joins (4 peers), its contributions are
dropped at the reducers and at least two of the three honest peers exclude it; the honest peers train on, end
equal, with a falling loss. After them, while the honest peers train on, a peer whose clock runs an hour ahead
joins, and says so. Then a group of three: two honest peers and one that claims ten times the samples it trains
on, with a flipped loss; both honest peers exclude it for its claims, and train on equal."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import pytest
import torch

from peer.telemetry.events import EpochEnded, Joined, PeerExcluded
from peer.testing import Peer, Swarm, max_parameter_difference, until
from peer.testing.faults import HOSTILE_PEERS, FaultPlan

# A sign flip is told from an honest gradient only while honest gradients agree in direction: early in
# training. Late, with single-batch noise, its cosine to the others' median nears 0 (as an honest one's does),
# and it does little harm. So it goes first; NaN and x1e4 are caught at any stage.
ATTACKS = ("sign-flipped", "nan", "scaled-1e4")  # peer/testing/faults.py's HOSTILE_PEERS
HONEST = ("a", "b", "c")
CLOCK_AHEAD = re.compile(r"this peer's clock is at least (\d+)s ahead of the clocks of 3 other peer")
# alone, the three attacks are over by epoch 20 and the run ends about epoch 30; under suite load, when each
# attacker still started from scratch, the second was once excluded only at epoch 80 and the honest peers reached
# 100 before the third had joined, and on a slower machine the honest peers reached 130 while the third was
# still being judged. It is only the bound: the run ends 2 epochs after the checks.
EPOCHS = 250
RECOVERED = 0.2  # how far below its starting validation loss an honest peer must be before the run ends


class Waiting(NamedTuple):
    """A peer started ahead of its turn: imported and built, it joins once `turn` exists (a test-only fault plan)."""

    peer: Peer
    turn: Path

    async def let_in(self) -> Peer:
        self.turn.touch()
        await self.peer.ready()
        return self.peer


async def start_waiting(swarm: Swarm, name: str, *args: str, plan: Optional[FaultPlan] = None,
                        env: Optional[Dict[str, str]] = None) -> Waiting:
    turn = swarm.workdir / f"turn-{name}"
    plan = (plan or FaultPlan()).model_copy(update={"join_when_file_exists": str(turn)})
    peer = await swarm.add(*args, "--inject-faults", plan.model_dump_json(), name=name, ready=False, env=env)
    return Waiting(peer, turn)


async def excluded_by_a_majority(honest: List[Peer], attacker_id: str, *, timeout: float, what: str) -> None:
    """Until more than half of the honest peers have excluded the attacker. Not all: once two of three refuse it, the
    third meets it in groups of two or not at all, where it cannot be judged (CI: the third had judged a scaled
    attacker twice, of the three times it takes, when the attacker could find no group any more)."""
    def of_attacker(event: PeerExcluded) -> bool:
        return event.peer_id == attacker_id

    waits = {asyncio.create_task(peer.wait_for(PeerExcluded, of_attacker, timeout=timeout, what=f"{what} excluded"))
             for peer in honest}
    try:
        done = set()
        while len(done) <= len(honest) // 2:
            finished, _ = await asyncio.wait(waits - done, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()  # a peer that timed out or exited fails the test here
            done |= finished
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)


async def trained_below_their_start(honest: List[Peer]) -> None:
    """Until each honest peer's validation loss, at an epoch after the checks so far, is RECOVERED below the one it
    joined with."""
    checked_at = max(peer.epoch for peer in honest)
    for peer in honest:
        goal = (await peer.wait_for(Joined, timeout=10)).val_loss - RECOVERED

        def recovered(event: EpochEnded, goal: float = goal) -> bool:
            return event.epoch > checked_at and event.val_loss is not None and event.val_loss < goal

        await peer.wait_for(EpochEnded, recovered, timeout=240, what=f"a validation loss below {goal:.2f}")


@pytest.mark.solo  # seven peer processes on the CI's 2 cores: run alone, after the suite (.ci/run)
@pytest.mark.timeout(600)
async def test_honest_peers_drop_then_exclude_each_kind_of_attacker_and_train_on(tmp_path: Path):
    # The default --exclude-after 3: with 2, an honest peer a round out of step (13x the others' gradient
    # norm under suite load) was excluded once. One attacker at a time, each in the honest swarm until every
    # honest peer has excluded it: one swarm for the three kinds (one each would triple the suite time).
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", fast=True) as swarm:
        # a sign flip is judged only in groups of four (averaging/pipeline/robust.py): with the 1 s window of the
        # fast swarms, four peers under suite load met in 5 rounds of 101 (groups of two and three), and once two
        # honest peers had excluded the attacker, the third could never judge it again; 2 s: 10 of 23
        swarm.args += ["--matchmaking-seconds", "2"]
        run = ("--min-peers", "3", "--max-epochs", str(EPOCHS), *swarm.ends_on_request())
        first = await swarm.add(*run, name=HONEST[0])
        honest = [first] + [await swarm.add(*run, name=name, ready=False) for name in HONEST[1:]]
        await asyncio.gather(*(peer.ready() for peer in honest[1:]))

        # the attackers and the clock-ahead peer start now and wait, imported and built, until their turn
        waiting = {attack: await start_waiting(swarm, attack, "--min-peers", "4", plan=HOSTILE_PEERS[attack])
                   for attack in ATTACKS}
        jump = tmp_path / "clock-jump"
        ahead_waiting = await start_waiting(
            swarm, "clock-ahead", "--task", "tests.tasks_for_tests:make_clock_ahead_task",
            env={"CLOCK_AHEAD_SECONDS": "3600", "CLOCK_JUMP_FILE": str(jump)})
        attackers, excluded = {}, []
        for attack in ATTACKS:
            attacker = await waiting[attack].let_in()
            attackers[attack] = attacker.peer_id
            # a sign flip joined late in training takes longest: under suite load, once more than 120 s
            await excluded_by_a_majority(honest, attacker.peer_id, timeout=240, what=f"the {attack} attacker")
            attacker.terminate()  # its exit is awaited below: the next peer starts meanwhile, excluded it is harmless
            excluded.append(attacker)

        # The honest swarm trains on to --max-epochs, and leaves together. Meanwhile a peer whose clock jumps an
        # hour ahead once it has joined sees none of the swarm's records (they look expired), and the swarm
        # believes none of its own: it trains alone, so it must say why.
        ahead = await ahead_waiting.let_in()
        jump.touch()
        for attacker in excluded:
            assert await attacker.exit_code(timeout=60) in (0, 1), attacker.log_tail()  # 1: NaN diverges alone
        warning = await until(lambda: CLOCK_AHEAD.search(ahead.log()), 90, "the clock-ahead peer to say so")
        assert 3500 <= int(warning.group(1)) < 3700, warning.group(0)
        ahead.terminate()
        # what the attackers did before they were judged (a sign flip only in groups of four) may have set the
        # honest peers back past where they started (CI: 5.99 from 5.49, the run ended 2 epochs later): they train
        # on until each is clearly below its start again
        await trained_below_their_start(honest)
        final_epoch = min(EPOCHS, swarm.end_soon(honest))  # --max-epochs still bounds it
        assert await ahead.exit_code(timeout=60) == 0, ahead.log_tail()
        assert await swarm.all_exited(timeout=240, peers=honest) == [0, 0, 0]

    summaries = [json.loads((tmp_path / f"{name}.json").read_text()) for name in HONEST]
    for attacker_id in attackers.values():
        assert sum(attacker_id in summary["excluded_peers"] for summary in summaries) >= 2, (summaries, attackers)
    for peer, summary in zip(honest, summaries):
        assert not CLOCK_AHEAD.search(peer.log())
        assert set(summary["excluded_peers"]) <= set(attackers.values()), (summary["excluded_peers"], attackers)
        assert summary["global_epoch"] == final_epoch and summary["val_loss_last"] < summary["val_loss_first"], summary
    states = [peer.model_state() for peer in honest]
    for state in states:
        assert all(bool(torch.isfinite(tensor).all()) for tensor in state.values())
    for state in states[1:]:
        assert max_parameter_difference(states[0], state) <= 1e-4


@pytest.mark.timeout(480)
async def test_two_honest_peers_outvote_and_exclude_a_peer_that_over_claims_its_samples(tmp_path: Path):
    # issue 31: with the weighted mean, this peer's 10x claim made every round its own, "ok", and the honest peers
    # ended at a validation loss of 13.5 (5.47 untrained). In groups of three the median outvotes it; wherever an
    # honest peer reduces, its claim is capped to 2 x 48 / 3 = 32 samples and, above twice the target (96), is an
    # offence.
    async with Swarm(tmp_path, "--task", "bytelm-tiny", "--target-batch-size", "48", fast=True) as swarm:
        run = ("--min-peers", "3", "--max-epochs", str(EPOCHS), *swarm.ends_on_request())
        first = await swarm.add(*run, name="a")
        others = [await swarm.add(*run, name="b", ready=False),
                  await swarm.add(*run, "--task", "tests.tasks_for_tests:make_overclaiming_task", name="liar",
                                  ready=False)]
        await asyncio.gather(*(peer.ready() for peer in others))
        honest, liar = [first, others[0]], others[1]

        def of_liar(event: PeerExcluded) -> bool:
            return event.peer_id == liar.peer_id

        await asyncio.gather(*(peer.wait_for(PeerExcluded, of_liar, timeout=240, what="the over-claimer excluded")
                               for peer in honest))
        for peer in honest:  # for its claims: in groups of three nothing else can be told
            assert re.search(rf"excluding peer {liar.peer_id} .*\(weight-claim; last: claimed \d+ samples", peer.log())
        liar.terminate()
        await trained_below_their_start(honest)
        final_epoch = min(EPOCHS, swarm.end_soon(honest))
        assert await liar.exit_code(timeout=60) == 0, liar.log_tail()
        assert await swarm.all_exited(timeout=240, peers=honest) == [0, 0]

    for name in ("a", "b"):
        summary = json.loads((tmp_path / f"{name}.json").read_text())
        assert summary["excluded_peers"] == [liar.peer_id], summary
        assert summary["global_epoch"] == final_epoch and summary["val_loss_last"] < summary["val_loss_first"], summary
    states = [peer.model_state() for peer in honest]
    assert all(bool(torch.isfinite(tensor).all()) for tensor in states[0].values())
    assert max_parameter_difference(*states) <= 1e-4
