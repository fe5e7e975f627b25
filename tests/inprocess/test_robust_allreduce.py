"""Robust reducers and exclusion inside hivemind's all-reduce: real averagers on 127.0.0.1 in this process."""
from __future__ import annotations

import contextlib
import time
from typing import List, Optional, Sequence, Union

import hivemind
import pytest
import torch

from averaging import adapter
from averaging.pipeline.defence import Defence
from averaging.pipeline.error_feedback import ErrorFeedback
from averaging.pipeline.robust import RobustPolicy, WeightBound
from averaging.pipeline.round_pipeline import RoundStage, including
from tests.inprocess.test_averaging import run_in_threads, start_dhts

PEERS = 4
SIZE = PEERS * 2**17  # hivemind splits in parts of 2**17 float32 values: one part for each reducer
# hivemind's default is no bound: a group whose member gave up matchmaking as the leader began (a loaded machine)
# waited for its part forever; with a bound, each step raises instead, as the daemon's do (averaging_timeout_seconds)
ALLREDUCE_TIMEOUT = 40.0


def honest_values(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.ones(SIZE) + 0.5 * torch.randn(SIZE, generator=generator)


@contextlib.contextmanager
def averagers(values: List[Union[torch.Tensor, List[torch.Tensor]]], defences: Optional[List[Defence]] = None,
              prefix: str = "robust_test", feedbacks: Optional[List[ErrorFeedback]] = None,
              averager_class=hivemind.averaging.DecentralizedAverager, stages: Sequence[RoundStage] = (), **options):
    """One real averager (of `averager_class`) per tensor (or list of tensors), each on its own DHT in this
    process, with its Defence and ErrorFeedback if given, and `stages` for all; `options` go to every averager."""
    adapter.install()
    defences = defences or [None] * len(values)
    feedbacks = feedbacks or [None] * len(values)
    dhts = start_dhts(len(values))
    built = []
    try:
        for dht, tensors, defence, feedback in zip(dhts, values, defences, feedbacks):
            with contextlib.ExitStack() as included:
                for stage in (defence, feedback, *stages):
                    included.enter_context(including(stage))
                built.append(averager_class(
                    tensors if isinstance(tensors, list) else [tensors], dht, prefix=prefix,
                    target_group_size=len(values), min_group_size=2, min_matchmaking_time=2.0, request_timeout=1.0,
                    start=True, **{"allreduce_timeout": ALLREDUCE_TIMEOUT, **options},
                ))
        yield built
    finally:
        for averager in built:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
        for defence in defences:
            if defence is not None:
                defence.close()


def average_all(group: List, timeout: float = 30.0, timeouts: Optional[List[float]] = None,
                weights: Optional[List[float]] = None) -> List:
    """Every averager steps at once (with its own of `timeouts` and `weights` if given); each result is what step()
    returned or the exception it raised."""
    results = [None] * len(group)
    timeouts = timeouts or [timeout] * len(group)
    weights = weights or [None] * len(group)

    def step(index):
        def run():
            try:
                results[index] = group[index].step(timeout=timeouts[index], weight=weights[index])
            # nobody would group with it, or its group's all-reduce outlasted ALLREDUCE_TIMEOUT
            except (hivemind.averaging.allreduce.AllreduceException, TimeoutError) as e:
                results[index] = e
        return run

    run_in_threads(*(step(index) for index in range(len(group))), timeout=max(timeouts) + ALLREDUCE_TIMEOUT + 15)
    return results


@pytest.mark.timeout(120)
def test_honest_averagers_leave_a_scaled_contribution_out_report_it_and_refuse_the_sender_once_excluded():
    honest = [honest_values(seed) for seed in range(PEERS - 1)]
    values = [tensor.clone() for tensor in honest] + [honest_values(99) * 1e4]
    defences = [Defence(RobustPolicy(rule="mean")) for _ in range(PEERS)]  # what is left is the honest mean
    with averagers(values, defences) as group:
        assert all(isinstance(result, dict) for result in average_all(group))
        honest_mean = sum(honest) / len(honest)
        for averager, own in zip(group, honest):
            with averager.get_tensors() as tensors:
                assert_parts_averaged_or_kept(tensors[0], honest_mean, own)

        attacker = group[-1].peer_id.to_base58()
        for defence in defences[:PEERS - 1]:
            offences = {verdict.peer: verdict.offence for verdict in defence.take_verdicts(timeout=10.0)}
            assert offences.get(attacker) == "norm", offences
            assert all(offence == "" for peer, offence in offences.items() if peer != attacker), offences
        own = defences[-1].take_verdicts(timeout=10.0)
        assert attacker not in {verdict.peer for verdict in own}  # a peer never accuses itself

        for defence in defences[:PEERS - 1]:
            defence.set_excluded([attacker])
        for averager, tensor in zip(group, [*honest, None]):
            if tensor is not None:
                with averager.get_tensors() as tensors:
                    tensors[0].copy_(tensor)
        # the excluded one, alone, finds no group: it gives up after its own shorter timeout
        results = average_all(group, timeouts=[20.0] * (PEERS - 1) + [5.0])
        honest_peers = {averager.peer_id for averager in group[:PEERS - 1]}
        for gathered in results[:PEERS - 1]:
            assert set(gathered) == honest_peers  # the attacker was not in the group
        assert isinstance(results[-1], Exception)  # alone, it found no group
        for averager, own in zip(group, honest):
            with averager.get_tensors() as tensors:
                assert_parts_averaged_or_kept(tensors[0], honest_mean, own)


@pytest.mark.timeout(120)
def test_a_sign_flipped_over_claimer_of_three_is_outvoted_capped_and_reported():
    """The default rule and the weight bound: the median of three leaves the honest peers' result among their own
    values, and the liar's claim (ten times a batch, with a target of three batches) is an offence at every honest
    reducer, though its capped contribution was used."""
    honest = [honest_values(seed) for seed in range(2)]
    liar = -honest_values(2)  # flipped, of an honest norm: no check drops it
    batch = 16.0
    defences = [Defence(RobustPolicy()) for _ in range(3)]
    with averagers([*[tensor.clone() for tensor in honest], liar], defences, prefix="robust_weights",
                   stages=[WeightBound(target_batch_size=3 * int(batch))]) as group:
        results = average_all(group, weights=[batch, batch, 10 * batch])
        assert all(isinstance(result, dict) for result in results), results
        low, high = torch.minimum(*honest), torch.maximum(*honest)
        for averager in group[:2]:
            with averager.get_tensors() as tensors:
                # each part is the median, or where hivemind's round was partial the peer's own: honest either way
                assert bool(((low <= tensors[0]) & (tensors[0] <= high)).all())

        liar_id = group[-1].peer_id.to_base58()
        for index, defence in enumerate(defences[:2]):
            verdicts = {verdict.peer: verdict for verdict in defence.take_verdicts(timeout=10.0)}
            claim = verdicts.get(liar_id)
            assert claim is not None and claim.offence == "weight-claim" and not claim.dropped, verdicts
            assert claim.detail == "claimed 160 samples, counted 32, at most 96 plausible", claim
            # a group of three cannot tell a sign flip: the other honest sender's round is clean for the norm check
            # only, which its exclusion window for directions does not count (averaging/pipeline/exclusion.py)
            other_honest = group[1 - index].peer_id.to_base58()
            assert set(verdicts) == {liar_id, other_honest}, verdicts
            assert verdicts[other_honest].offence == "" and not verdicts[other_honest].direction_judged
            assert not claim.direction_judged
        # what each honest reducer credits the others with: the liar's capped weight, never its claim, and never
        # its own samples (a reducer whose part failed under load credits nothing: one of the two must have)
        credited = [credits_of(defence) for defence in defences[:2]]
        expected = [{liar_id: 32.0, group[1 - index].peer_id.to_base58(): batch} for index in range(2)]
        assert all(credits in ({}, wanted) for credits, wanted in zip(credited, expected)), credited
        assert any(credited), credited


def credits_of(defence: Defence, wait_seconds: float = 5.0) -> dict:
    """The credits a defence's reducer sent for the round (they follow its verdicts), by peer."""
    deadline, taken = time.monotonic() + wait_seconds, []
    while not taken and time.monotonic() < deadline:
        taken = defence.take_credits()
        time.sleep(0.05)
    return {credit.peer: credit.samples for credit in taken}


def assert_parts_averaged_or_kept(result: torch.Tensor, mean: torch.Tensor, own: torch.Tensor) -> None:
    """Each part is the mean, or, where hivemind's round was partial, the peer's own values: a part whose
    reducer failed is left as it was (CI: a reducer answered a request before it knew the group, under load).
    Either way, nothing of a peer outside the group reached it."""
    parts = zip(result.split(2**17), mean.split(2**17), own.split(2**17))
    kept = [torch.allclose(part, own_part) for part, mean_part, own_part in parts
            if not torch.allclose(part, mean_part, atol=1e-4)]
    assert all(kept) and len(kept) < PEERS, f"{len(kept)} parts not averaged, of which {kept.count(False)} not own"

