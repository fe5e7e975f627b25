"""Error feedback (averaging/pipeline/error_feedback.py):
the math, the part container, checkpoints, and real averagers."""
from __future__ import annotations

import asyncio

import hivemind
import pytest
import torch

from averaging import adapter
from averaging.adapter.partition import FeedbackPartContainer
from averaging.api import AveragingHooks, Replica
from averaging.codecs.compression import make_codec
from averaging.config import AveragingConfig
from averaging.pipeline import round_pipeline
from averaging.pipeline.error_feedback import ErrorFeedback, encode_with_feedback
from averaging.strategies.factory import build_swarm_optimizer
from benchmarks.diloco_recipes import allreduce_through_codec
from dht.keys import SwarmKeys
from tests.inprocess.test_averaging import make_diloco, run_in_threads, start_dhts
from tests.inprocess.test_lowbit import gradient_like, round_trip
from tests.inprocess.test_robust_allreduce import average_all, averagers
from tests.peers import wait_until


def accumulated_error(codec, rounds: int, feedback: bool) -> float:
    """Relative L2 error of the sum of what was received against the sum of what was meant, after `rounds`."""
    generator = torch.Generator().manual_seed(7)
    drift = torch.randn(4096, generator=generator)  # gradients share a direction from round to round
    meant, received, residual = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    for _ in range(rounds):
        values = drift + 2 * gradient_like(4096, seed=int(torch.randint(0, 2**31, (1,), generator=generator)))
        meant += values
        if feedback:
            decoded, residual = encode_with_feedback(values, residual, codec)
        else:
            decoded = round_trip(codec, values)
        received += decoded
    return float((received - meant).norm() / meant.norm())


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_error_feedback_drives_the_accumulated_error_of_many_rounds_toward_zero(name):
    codec = make_codec(name, topk_fraction=0.05)
    short, long = accumulated_error(codec, 20, feedback=True), accumulated_error(codec, 400, feedback=True)
    without = accumulated_error(codec, 400, feedback=False)
    # the residual stays bounded while the sum grows: the relative error of the sum falls with the rounds
    assert long < short / 5, (short, long)
    assert long < without / 10, (long, without)


def test_a_residual_never_holds_nan_or_inf():
    values = gradient_like(256)
    values[3], values[100] = float("nan"), float("inf")
    decoded, residual = encode_with_feedback(values, torch.zeros(256), make_codec("int4"))
    assert torch.isfinite(residual).all() and torch.isfinite(decoded).all()


def run(coroutine):
    return asyncio.new_event_loop().run_until_complete(coroutine)


def container_of_two(values, carried, codec):
    """A container for a group of two in which this peer (index 0) reduces the first tensor, its peer the second."""
    inputs = [value + residual for value, residual in zip(values, carried)]
    return inputs, FeedbackPartContainer(inputs, (0.5, 0.5), carried, own_index=0, compression=codec)


async def send_everything(container, peer_index: int):
    return [message async for message in container.iterate_input_parts_for(peer_index)]


async def outputs(container):
    return [tensor async for tensor in container.iterate_output_tensors()]


def test_a_delivered_part_ends_at_the_average_and_keeps_what_the_codec_lost():
    codec = make_codec("int4")
    values, carried = [gradient_like(512, seed=1), gradient_like(512, seed=2)], [torch.ones(512), torch.ones(512)]
    inputs, container = container_of_two(values, carried, codec)
    own = container.get_raw_input_parts(0)
    (message,) = run(send_everything(container, 1))  # the second tensor, in one part
    sent = codec.extract(message)
    average_of_second = sent / 2 + 0.25  # what the other reducer computed, its own values all 0.5
    container.register_processed_part(0, 0, own[0] / 2)  # this peer's reduction: an average with zeros
    container.register_processed_part(1, 0, average_of_second)  # the reply: the average itself
    first, second = run(outputs(container))
    assert torch.equal(first, inputs[0] / 2)
    assert torch.equal(second, average_of_second)  # not the average plus its residual
    assert torch.equal(container.kept[0], torch.zeros(512))  # reduced here: all of x went in, the residual too
    assert torch.allclose(container.kept[1], inputs[1] - sent, atol=1e-6)
    assert container.kept[1].abs().max() > 0


def test_a_part_whose_reducer_failed_keeps_this_peers_values_and_its_old_residual():
    codec = make_codec("int4")
    values, carried = [gradient_like(512, seed=1), gradient_like(512, seed=2)], [torch.zeros(512), torch.ones(512)]
    inputs, container = container_of_two(values, carried, codec)
    own = container.get_raw_input_parts(0)
    run(send_everything(container, 1))
    container.register_processed_part(0, 0, own[0])
    container.register_failed_reducer(1)
    _, second = run(outputs(container))
    assert torch.allclose(second, values[1])  # g, as without error feedback
    assert torch.equal(container.kept[1], carried[1])  # the residual it started with, for the next round
    assert container.failed_size == 512


@pytest.mark.parametrize("name", ["int4", "topk"])
def test_both_legs_carry_their_loss_so_that_many_rounds_apply_the_true_average(name):
    """Two senders and a reducer for 200 rounds, the daemon's all-reduce arithmetic in one process
    (benchmarks/diloco_recipes.py): what every member applies, summed over the rounds, tracks the sum of the
    true averages ever more closely, and neither leg's residual grows without bound."""
    codec = make_codec(name, topk_fraction=0.05) if name == "topk" else make_codec(name)
    size, peers, rounds = 4096, 2, 200
    sent = [torch.zeros(size) for _ in range(peers)]
    replied = [torch.zeros(size) for _ in range(peers)]
    applied, true, errors, residual_norms = torch.zeros(size), torch.zeros(size), {}, []
    for round_index in range(rounds):
        contributions = [gradient_like(size, seed=peers * round_index + i) for i in range(peers)]
        average, _ = allreduce_through_codec(contributions, codec, sent, replied)
        applied += average
        true += sum(contributions) / peers
        if round_index + 1 in (20, 200):
            errors[round_index + 1] = float((applied - true).norm() / true.norm())
        residual_norms.append(float(sum(r.norm() for r in [*sent, *replied])))
    assert errors[200] < errors[20] / 2, errors
    # what is owed never grows past a few rounds' worth of contributions
    assert max(residual_norms[100:]) < 2 * max(residual_norms[:100]), (residual_norms[:5], residual_norms[-5:])


def test_residuals_survive_a_checkpoint_and_a_bad_one_starts_from_zero():
    feedback = ErrorFeedback()
    feedback.prepare([torch.zeros(3), torch.zeros(2, 2)])
    feedback.residuals[0].fill_(0.5)
    saved = feedback.state_dict()
    restored = ErrorFeedback()
    restored.prepare([torch.zeros(3), torch.zeros(2, 2)])
    restored.load_state_dict(saved)
    assert torch.equal(restored.residuals[0], torch.full((3,), 0.5)) and restored.norm() > 0
    restored.load_state_dict([torch.tensor([float("nan"), 1.0, 2.0]), torch.zeros(2, 2)])
    assert torch.equal(restored.residuals[0], torch.tensor([0.0, 1.0, 2.0]))
    restored.load_state_dict([torch.zeros(4)])  # another model's
    assert restored.norm() == 0.0
    feedback.reply_residuals[1].fill_(0.25)
    restored.load_state_dict(feedback.state_dict())  # the reply residuals come back too
    assert torch.equal(restored.reply_residuals[1], torch.full((2, 2), 0.25))
    restored.load_state_dict(feedback.state_dict()[:2])  # a checkpoint from before replies had residuals
    assert torch.equal(restored.residuals[0], torch.full((3,), 0.5)) and restored.reply_norm() == 0.0
    feedback.reset()
    assert feedback.norm() == 0.0 and feedback.reply_norm() == 0.0


@pytest.mark.parametrize("strategy, codec, setting, expected", [
    ("sync", "int8", "auto", True), ("diloco", "int4", "auto", True), ("diloco", "topk", "auto", True),
    ("sync", "int8", "off", False), ("sync", "fp16", "auto", False), ("sync", "uint8", "auto", False),
    ("powersgd", "int8", "auto", False), ("local-sgd", "int4", "auto", False),
])
def test_auto_turns_error_feedback_on_for_our_lossy_codecs_with_gradient_averaging(strategy, codec, setting, expected):
    config = AveragingConfig(strategy=strategy, grad_compression=codec, error_feedback=setting)
    assert config.uses_error_feedback is expected


def two_rounds_with_int4_and_feedback(values, feedbacks):
    """Two real averagers run two rounds, each starting from `values`; what each peer held after each round."""
    results = []
    with averagers([[t.clone() for t in tensors] for tensors in values], prefix="feedback_int4",
                   feedbacks=feedbacks, compression=make_codec("int4")) as group:
        for _ in range(2):
            for averager, tensors in zip(group, values):
                with averager.get_tensors() as buffers:
                    for buffer, tensor in zip(buffers, tensors):
                        buffer.copy_(tensor)
            assert all(isinstance(result, dict) for result in average_all(group)), "the round failed"
            round_results = []
            for averager in group:
                with averager.get_tensors() as buffers:
                    round_results.append([buffer.clone() for buffer in buffers])
            results.append(round_results)
    return results


def a_reply_was_lost(results, values) -> bool:
    """Whether, in some round, a peer kept its own values for a tensor: hivemind ends a round partial when a
    reducer's reply does not arrive (seen under load in CI), and that part stays as the peer's own."""
    return any(torch.allclose(held, own, atol=1e-5) for round_results in results
               for peer_results, peer_values in zip(round_results, values)
               for held, own in zip(peer_results, peer_values))


@pytest.mark.timeout(240)
def test_two_averagers_with_int4_and_error_feedback_agree_and_carry_the_loss_into_the_next_round():
    # two tensors: each peer reduces one (hivemind's parts are larger than these)
    values = [[gradient_like(2**15, seed=2 * peer), gradient_like(2**15, seed=2 * peer + 1)] for peer in (0, 1)]
    mean = [(a + b) / 2 for a, b in zip(*values)]
    for _attempt in range(3):  # the arithmetic below holds for full rounds only; a lost reply is hivemind's, not ours
        feedbacks = [ErrorFeedback(), ErrorFeedback()]
        results = two_rounds_with_int4_and_feedback(values, feedbacks)
        if not a_reply_was_lost(results, values):
            break
    else:
        pytest.fail("every attempt lost a reducer's reply")

    for round_results in results:  # the peers agree to the last bit: both decoded the same int4 replies
        for mine, theirs in zip(*round_results):
            assert torch.equal(mine, theirs)
    for feedback in feedbacks:  # each peer reduced one tensor itself (nothing lost sending it) and sent the other
        norms = sorted(float(residual.norm()) for residual in feedback.residuals)
        assert norms[0] == 0.0 and norms[1] > 0.0
    for tensor_index in range(2):  # and whoever reduced a tensor replied in int4: what that lost is owed there
        assert any(float(feedback.reply_residuals[tensor_index].norm()) > 0 for feedback in feedbacks)
    # what was lost in round 1 was sent in round 2: the two rounds together are twice the mean, less what the
    # last round lost on both legs (without error feedback each round's loss would be applied for good)
    for tensor_index in range(2):
        together = results[0][0][tensor_index] + results[1][0][tensor_index]
        still_lost = sum(feedback.residuals[tensor_index] / 2 + feedback.reply_residuals[tensor_index]
                         for feedback in feedbacks)
        expected = 2 * mean[tensor_index] - still_lost
        assert float((together - expected).abs().max()) < 4e-3 * float(mean[tensor_index].abs().max())


@pytest.mark.timeout(240)
def test_diloco_peers_with_int4_and_error_feedback_agree_checkpoint_their_residuals_and_drop_them_on_download():
    config = AveragingConfig(strategy="diloco", target_batch_size=4, matchmaking_seconds=1.0,
                             averaging_timeout_seconds=20.0, grad_compression="int4")
    assert config.uses_error_feedback
    adapter.install()  # as build_swarm_optimizer does: our codecs' registration, error feedback's patch
    # a round that failed on both peers leaves each with its own pseudo-gradient, by design (seen in CI: both timed
    # out under load); what is checked here needs a round that both peers completed
    for _attempt in range(3):
        if one_outer_round_with_int4_and_feedback(config):
            return
    pytest.fail("every attempt's outer round failed")


def one_outer_round_with_int4_and_feedback(config: AveragingConfig) -> bool:
    """Two DiLoCo peers run one outer round, then one downloads the other's state; False if the round did not end
    ok on both (nothing checked then)."""
    outcomes = []
    hooks = AveragingHooks(round_finished=lambda report: outcomes.append(report.outcome))
    dhts = start_dhts(2)
    torch.manual_seed(0)
    models = [torch.nn.Linear(128, 128) for _ in dhts]
    models[1].load_state_dict(models[0].state_dict())
    start = [p.detach().clone() for p in models[0].parameters()]
    peers = []
    try:
        for dht, model in zip(dhts, models):
            peers.append(make_diloco(config, dht, model, hooks=hooks, error_feedback=ErrorFeedback()))
        wait_until(lambda: [peer.announce() for peer in peers] and all(peer.swarm_view().peers == 2 for peer in peers),
                   60, interval=1.0, message="both trackers to see both peers")
        for seed, model in enumerate(models):  # as if each peer's inner steps had moved it differently
            with torch.no_grad():
                for param, origin in zip(model.parameters(), start):
                    param.copy_(origin - 0.01 * gradient_like(origin.numel(), seed=seed).view_as(origin))
        run_in_threads(*(lambda peer=peer: peer.step(batch_size=4) for peer in peers))
        if outcomes != ["ok", "ok"]:
            return False

        assert [peer.local_epoch for peer in peers] == [1, 1]
        for mine, theirs in zip(models[0].parameters(), models[1].parameters()):
            # one outer step on the same average: both decoded the same int4 replies
            assert torch.equal(mine.detach(), theirs.detach())
        for peer in peers:
            # each sent one of the two tensors through int4, and replied through int4 for the other
            assert peer.error_feedback.norm() > 0 and peer.error_feedback.reply_norm() > 0
            saved = peer.state_dict()["diloco"]["error_feedback"]
            held = [*peer.error_feedback.residuals, *peer.error_feedback.reply_residuals]
            assert len(saved) == len(held) and all(torch.equal(a, b) for a, b in zip(saved, held))

        assert peers[1].load_state_from_peers()
        # its residuals belonged to the state it left
        assert peers[1].error_feedback.norm() == 0.0 and peers[1].error_feedback.reply_norm() == 0.0
        return True
    finally:
        for peer in peers:
            peer.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(120)
def test_the_sync_strategy_carries_residuals_on_its_gradient_averager_only_and_checkpoints_them():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    optimizer = None
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        config = AveragingConfig(target_batch_size=8, matchmaking_seconds=1.0, grad_compression="int8")
        optimizer = build_swarm_optimizer(config, Replica(
            dht=dht, keys=SwarmKeys.for_run("sync_feedback"), params=model.parameters(),
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=0.05), batch_size=8, client_mode=False,
        ))
        feedback = optimizer.error_feedback
        assert round_pipeline.of(optimizer.grad_averager).stage(ErrorFeedback) is feedback
        # parameters are averaged as they are
        assert round_pipeline.of(optimizer.state_averager).stage(ErrorFeedback) is None
        assert [r.shape for r in feedback.residuals] == [p.shape for p in model.parameters()]
        assert all(r.is_shared() for r in feedback.residuals)  # the averager's process writes them

        feedback.residuals[0].fill_(0.25)
        state = optimizer.state_dict()
        feedback.reset()
        optimizer.load_state_dict(state)
        assert torch.equal(feedback.residuals[0], torch.full_like(feedback.residuals[0], 0.25))
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()
