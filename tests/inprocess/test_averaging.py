"""DiLoCo's outer step, ZeRO-Offload placement, state downloads, training with no averaging, and which averagers bound
their weights, with real hivemind DHTs in this process."""
from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from averaging import adapter
from averaging.api import AveragingHooks, Replica, SwarmOptimizer
from averaging.codecs.compression import round_payload_bytes
from averaging.config import AveragingConfig
from averaging.pipeline import round_pipeline
from averaging.pipeline.robust import WeightBound
from averaging.strategies.diloco import DiLoCoOptimizer
from averaging.strategies.factory import build_swarm_optimizer
from averaging.strategies.outer import outer_nesterov_step_
from averaging.swarm import progress
from dht.keys import SwarmKeys
from dht.records import read_by_owner
from tests.peers import wait_until

LOCALHOST = ["/ip4/127.0.0.1/tcp/0"]


def start_dhts(count: int) -> List[hivemind.DHT]:
    first = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    others = [hivemind.DHT(start=True, host_maddrs=LOCALHOST, initial_peers=first.get_visible_maddrs())
              for _ in range(count - 1)]
    return [first, *others]


def make_diloco(config, dht, model, hooks: Optional[AveragingHooks] = None, **options) -> DiLoCoOptimizer:
    adapter.install()  # as build_swarm_optimizer does: the strategies' averagers rely on it
    return DiLoCoOptimizer(
        config,
        Replica(dht=dht, keys=SwarmKeys.for_run("diloco_math"), params=model.parameters(),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),  # inner steps change nothing
                batch_size=4, client_mode=False, hooks=hooks or AveragingHooks()),
        # progress records are keyed by a signing key that is process-wide by default: one per peer here
        tracker_opts=dict(private_key=RSAPrivateKey(), metadata_expiration=30.0),
        averager_opts=dict(request_timeout=0.5), matchmaking_floor=1.0, allreduce_timeout=20.0, **options,
    )


def lone_optimizer(dht: hivemind.DHT, strategy: str, run_id: str, hooks: Optional[AveragingHooks] = None,
                   model: Optional[torch.nn.Module] = None, **config) -> SwarmOptimizer:
    """A peer of `strategy` over `model` (by default one linear layer), with its own signing key, on `dht`."""
    model = torch.nn.Linear(4, 1) if model is None else model
    return build_swarm_optimizer(AveragingConfig(
        strategy=strategy, target_batch_size=8, matchmaking_seconds=1.0, averaging_timeout_seconds=5.0, **config,
    ), Replica(
        dht=dht, keys=SwarmKeys.for_run(run_id), params=model.parameters(),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1), batch_size=4, client_mode=False,
        hooks=hooks or AveragingHooks(),
    ), tracker_opts=dict(private_key=RSAPrivateKey()))


def run_in_threads(*calls, timeout: float = 60.0) -> None:
    errors = []

    def guarded(call):
        try:
            call()
        except BaseException as e:  # surfaced below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(call,), daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a peer's step did not return"
    assert not errors, errors


def test_nesterov_step_matches_torch_sgd():
    generator = torch.Generator().manual_seed(1)
    params = [torch.randn(3, 2, generator=generator)]
    reference = [p.clone().requires_grad_() for p in params]
    sgd = torch.optim.SGD(reference, lr=0.3, momentum=0.8, nesterov=True)
    momenta = [torch.zeros_like(p) for p in params]
    for _ in range(4):
        grads = [torch.randn(3, 2, generator=generator)]
        outer_nesterov_step_(params, momenta, grads, lr=0.3, momentum=0.8)
        reference[0].grad = grads[0].clone()
        sgd.step()
    assert torch.allclose(params[0], reference[0].detach(), atol=1e-6)
    assert torch.allclose(momenta[0], sgd.state[reference[0]]["momentum_buffer"], atol=1e-6)


@pytest.mark.timeout(180)
def test_two_diloco_peers_apply_exactly_the_outer_nesterov_update_and_a_newcomer_downloads_it():
    config = AveragingConfig(strategy="diloco", target_batch_size=4, matchmaking_seconds=1.0,
                             averaging_timeout_seconds=20.0, outer_lr=0.5, outer_momentum=0.9)
    start = torch.tensor([1.0, -2.0])  # weight and bias of a 1 -> 1 linear model: 2 parameters
    dhts = start_dhts(3)
    peers, models, reports = [], [], []
    try:
        for dht in dhts[:2]:
            model = torch.nn.Linear(1, 1)
            with torch.no_grad():
                model.weight.fill_(float(start[0])), model.bias.fill_(float(start[1]))
            hooks = AveragingHooks(round_finished=reports.append)
            peers.append(make_diloco(config, dht, model, hooks))
            models.append(model)
        assert all(isinstance(peer, DiLoCoOptimizer) for peer in peers)

        def visible() -> bool:
            for peer in peers:  # visible to the others before it has any samples, as at the start gate
                peer.announce()
            return all(peer.swarm_view().peers == 2 for peer in peers)

        wait_until(visible, 60, interval=1.0, message="both trackers to see both peers")

        # the reference: torch's own Nesterov SGD on the mean pseudo-gradient of each round
        reference = start.clone().requires_grad_()
        sgd = torch.optim.SGD([reference], lr=0.5, momentum=0.9, nesterov=True)
        rounds = [(torch.tensor([0.2, -0.4]), torch.tensor([0.6, 0.0])),
                  (torch.tensor([-0.1, 0.3]), torch.tensor([0.5, 0.1]))]
        for deltas in rounds:
            round_start = torch.cat([models[0].weight.detach().flatten(), models[0].bias.detach()])
            for model, delta in zip(models, deltas):  # as if the inner steps had moved the replica by -delta
                with torch.no_grad():
                    model.weight.fill_(float(round_start[0] - delta[0]))
                    model.bias.fill_(float(round_start[1] - delta[1]))
            run_in_threads(*(lambda peer=peer: peer.step(batch_size=4) for peer in peers))
            reference.grad = (deltas[0] + deltas[1]) / 2  # equal weights: both stepped on 4 samples
            sgd.step()
            expected = reference.detach()
            for model, peer in zip(models, peers):
                got = torch.cat([model.weight.detach().flatten(), model.bias.detach()])
                assert torch.allclose(got, expected, atol=1e-6), (got, expected)
                assert torch.allclose(torch.cat([p.flatten() for p in peer.global_params]), expected, atol=1e-6)
        assert [r.outcome for r in reports] == ["ok"] * 4 and all(r.group_size == 2 for r in reports)
        assert [peer.local_epoch for peer in peers] == [2, 2]
        momentum = sgd.state[reference]["momentum_buffer"]

        # a newcomer gets the round-start params, the outer momentum and the epoch
        newcomer_model = torch.nn.Linear(1, 1)
        newcomer = make_diloco(config, dhts[2], newcomer_model)
        peers.append(newcomer)
        newcomer.load_state_from_peers()
        assert newcomer.local_epoch == 2
        got = torch.cat([newcomer_model.weight.detach().flatten(), newcomer_model.bias.detach()])
        assert torch.allclose(got, expected, atol=1e-6)
        assert torch.allclose(torch.cat([m.flatten() for m in newcomer.outer_momentum]), momentum, atol=1e-6)
    finally:
        for peer in peers:
            peer.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [False, True])
def test_offloaded_optimizer_state_is_in_host_memory_and_updates_reach_the_model(delay: bool):
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    optimizer = None
    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
        config = AveragingConfig(target_batch_size=8, matchmaking_seconds=1.0, averaging_timeout_seconds=10.0,
                                 offload_optimizer=True, delay_updates=delay)
        optimizer = build_swarm_optimizer(config, Replica(
            dht=dht, keys=SwarmKeys.for_run("offload"), params=model.parameters(),
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=0.05), batch_size=8, client_mode=False,
        ))
        inner = optimizer.state_averager.optimizer
        model_params = list(model.parameters())
        offloaded = [p for group in inner.param_groups for p in group["params"]]
        assert all(p.device == device for p in model_params)
        # the optimizer works on a separate fp32 master copy in host (shared) memory
        assert all(o.device.type == "cpu" and o.is_shared() for o in offloaded)
        assert not any(o is p for o, p in zip(offloaded, model_params))
        for o in offloaded:
            assert {"exp_avg", "exp_avg_sq"} <= set(inner.state[o])
            assert all(t.device.type == "cpu" for t in inner.state[o].values() if torch.is_tensor(t))

        generator = torch.Generator().manual_seed(0)
        inputs, targets = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
        before = [p.detach().clone() for p in model_params]
        losses = []
        for _ in range(12):
            loss = torch.nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
            loss.backward()
            optimizer.step(batch_size=8)
            optimizer.zero_grad()
            losses.append(float(loss))
        optimizer.wait_for_background_updates()
        assert optimizer.local_epoch >= 10
        assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model_params))
        assert losses[-1] < losses[0]
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["sync", "diloco"])
def test_a_state_download_that_gets_nothing_is_a_failure_not_a_success(strategy: str, caplog):
    """hivemind's state averager returns None whether or not a peer sent state: alone, it must not pass."""
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    optimizer = None
    loaded_epochs: List[int] = []
    try:
        model = torch.nn.Linear(4, 1)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = lone_optimizer(dht, strategy, f"alone_{strategy}",
                                   AveragingHooks(state_loaded=loaded_epochs.append), model=model,
                                   load_state_timeout_seconds=5.0)
        with caplog.at_level(logging.WARNING):
            assert optimizer.load_state_from_peers() is False
        assert loaded_epochs == []  # nobody is told that state arrived
        assert "no peer sent a usable state in 3 attempts" in caplog.text
        assert caplog.text.count("attempt ") == 3
        assert all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["sync", "powersgd", "diloco"])
def test_every_averager_answers_matchmaking_requests_within_the_matchmaking_window(strategy: str):
    """hivemind warns that a request timeout as long as the matchmaking window can deadlock matchmaking; its
    Optimizer gave our request timeout to the state averager only, and the gradient averager kept 3 s against 1 s."""
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    optimizer = None
    try:
        optimizer = lone_optimizer(dht, strategy, f"windows_{strategy}")
        averagers = [optimizer.state_averager, optimizer.grad_averager]
        assert all(averager is not None for averager in averagers)
        for averager in averagers:
            window = averager.matchmaking_kwargs
            assert window["request_timeout"] < window["min_matchmaking_time"] == 1.0, window
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["sync", "diloco"])
def test_a_peer_that_spends_longer_than_its_records_life_downloading_stays_visible_to_the_swarm(strategy: str):
    """A peer that fell behind and spends its attempts downloading accumulates no samples, and hivemind's tracker
    stops storing its progress record. Peers leaving at --max-epochs stay only for the peers they see behind
    (peer/runtime/leaving.py): its record must outlive the download, or they leave it with its own state."""
    dhts = start_dhts(2)
    downloader_dht, leaving_peers_view = dhts
    leaving_peers_view.add_validators([RSASignatureValidator(RSAPrivateKey())])  # reads signed records, as peers do
    optimizer = None
    seen: List[Optional[int]] = []
    try:
        optimizer = lone_optimizer(downloader_dht, strategy, f"downloading_{strategy}", load_state_timeout_seconds=5.0)
        ttl = optimizer.tracker.metadata_expiration
        attempt_seconds = ttl / 2.5  # three attempts outlast a record stored before the first

        def slow_failing_download(**kwargs):
            time.sleep(attempt_seconds)  # a donor that times out, or whose state is refused after a wait
            raise TimeoutError("no usable state")

        optimizer.state_averager.load_state_from_peers = slow_failing_download
        optimizer.announce()  # visible once, as a peer that trained with the swarm was
        me, key = progress.owner(optimizer.signing_key), optimizer.tracker.training_progress_key
        wait_until(lambda: me in read_by_owner(leaving_peers_view, key), timeout=10, message="the first record")

        download = threading.Thread(target=optimizer.load_state_from_peers, daemon=True)
        started = time.monotonic()
        download.start()
        while download.is_alive() and time.monotonic() - started < 5 * ttl:
            record = read_by_owner(leaving_peers_view, key).get(me)
            seen.append(record.get("epoch") if isinstance(record, dict) else None)
            time.sleep(1.0)
        download.join(timeout=10)
        assert not download.is_alive(), "the download did not return"
        assert time.monotonic() - started > ttl  # the download outlasted the record stored before it
        assert seen and all(epoch == optimizer.local_epoch for epoch in seen), seen
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy, bounded", [("sync", True), ("local-sgd", False), ("diloco", True)])
def test_only_the_averagers_weighted_by_samples_bound_their_weights(strategy: str, bounded: bool):
    """Gradients (sync, powersgd) and DiLoCo's pseudo-gradients are weighted by the samples each peer claims;
    parameter rounds (local-sgd's, and the state averagers') weigh each peer 1, which no target bounds."""
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    optimizer = None
    try:
        config = AveragingConfig(strategy=strategy, target_batch_size=8, matchmaking_seconds=1.0,
                                 robust_max_weight_share=3.0)
        optimizer = build_swarm_optimizer(config, Replica(
            dht=dht, keys=SwarmKeys.for_run(f"bounds_{strategy}"), params=torch.nn.Linear(4, 1).parameters(),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1), batch_size=4, client_mode=False,
        ))
        assert round_pipeline.of(optimizer.state_averager).stage(WeightBound) is None
        if bounded:
            assert round_pipeline.of(optimizer.grad_averager).stage(WeightBound) == WeightBound(8, 3.0)
        else:
            assert optimizer.grad_averager is None  # local-sgd averages parameters only
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


@pytest.mark.timeout(60)
def test_a_busy_peer_gets_a_quarter_of_the_round_timeout_per_chunk_not_one_matchmaking_window():
    """Upstream drops a peer whose next chunk takes longer than the matchmaking window (here 1 s) and
    averages without it, so a peer on a loaded CPU keeps its own values for part of the model."""
    dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST)
    optimizer = None
    try:
        config = AveragingConfig(target_batch_size=8, matchmaking_seconds=1.0, averaging_timeout_seconds=10.0)
        optimizer = build_swarm_optimizer(config, Replica(
            dht=dht, keys=SwarmKeys.for_run("chunks"), params=torch.nn.Linear(4, 1).parameters(),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1), batch_size=4, client_mode=False,
        ))
        for averager in (optimizer.grad_averager, optimizer.state_averager):
            assert averager.next_chunk_timeout == 2.5
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        dht.shutdown()


@pytest.mark.timeout(180)
def test_with_overlap_the_outer_update_lands_one_round_late_and_the_model_keeps_its_progress_meanwhile():
    config = AveragingConfig(strategy="diloco", target_batch_size=4, matchmaking_seconds=1.0,
                             averaging_timeout_seconds=20.0, outer_lr=0.5, outer_momentum=0.9, diloco_overlap=True)
    start = torch.tensor([1.0, -2.0])
    dhts = start_dhts(2)
    peers, models, reports = [], [], []

    def flat(model) -> torch.Tensor:
        return torch.cat([model.weight.detach().flatten(), model.bias.detach()])

    def move(model, to: torch.Tensor) -> None:
        with torch.no_grad():
            model.weight.fill_(float(to[0])), model.bias.fill_(float(to[1]))

    try:
        for dht in dhts:
            model = torch.nn.Linear(1, 1)
            move(model, start)
            peers.append(make_diloco(config, dht, model, AveragingHooks(round_finished=reports.append)))
            models.append(model)
        wait_until(lambda: [peer.announce() for peer in peers] and all(peer.swarm_view().peers == 2 for peer in peers),
                   60, interval=1.0, message="both trackers to see both peers")
        assert all(peer.averages_after_epoch for peer in peers)  # a launched round still meets latecomers
        reference = start.clone().requires_grad_()
        sgd = torch.optim.SGD([reference], lr=0.5, momentum=0.9, nesterov=True)

        deltas = (torch.tensor([0.2, -0.4]), torch.tensor([0.6, 0.0]))
        for model, delta in zip(models, deltas):  # round 1: as if the inner steps had moved each by -delta
            move(model, start - delta)
        run_in_threads(*(lambda peer=peer: peer.step(batch_size=4) for peer in peers))
        assert [peer.local_epoch for peer in peers] == [1, 1]
        for model, peer, delta in zip(models, peers, deltas):  # launched, not applied: training went on from here
            assert torch.equal(flat(model), start - delta)
            assert torch.equal(torch.cat([p.flatten() for p in peer.global_params]), start)

        # a newcomer asking now is served once the round has landed, not the start that lacks it
        newcomer_dht = hivemind.DHT(start=True, host_maddrs=LOCALHOST, initial_peers=dhts[0].get_visible_maddrs())
        dhts.append(newcomer_dht)
        newcomer_model = torch.nn.Linear(1, 1)
        move(newcomer_model, torch.zeros(2))
        newcomer = make_diloco(config, newcomer_dht, newcomer_model)
        peers.append(newcomer)
        download = threading.Thread(target=newcomer.load_state_from_peers, daemon=True)
        download.start()
        time.sleep(1.0)
        assert download.is_alive()  # the donors wait for their round to land

        progress = (torch.tensor([0.01, 0.02]), torch.tensor([-0.03, 0.0]))  # round 2's inner steps so far
        for model, delta, made in zip(models, deltas, progress):
            move(model, start - delta + made)
        run_in_threads(*(lambda peer=peer: peer.wait_for_background_updates() for peer in peers[:2]))
        reference.grad = (deltas[0] + deltas[1]) / 2
        sgd.step()
        landed = reference.detach().clone()
        for model, peer, made in zip(models, peers, progress):
            assert torch.allclose(torch.cat([p.flatten() for p in peer.global_params]), landed, atol=1e-6)
            assert torch.allclose(flat(model), landed + made, atol=1e-6)  # the update, and its own progress
        assert [r.outcome for r in reports] == ["ok", "ok"]
        download.join(timeout=30)
        assert not download.is_alive()
        assert newcomer.local_epoch == 1 and newcomer.rounds.downloaded_at_epoch == 1
        assert torch.allclose(torch.cat([p.flatten() for p in newcomer.global_params]), landed, atol=1e-6)
        assert torch.allclose(flat(newcomer_model), landed, atol=1e-6)  # the swarm's round start
        peers.pop().shutdown()  # round 2 is the two peers' own

        # round 2 is measured from the landed start: its pseudo-gradient is minus each peer's progress
        run_in_threads(*(lambda peer=peer: peer.step(batch_size=4) for peer in peers))
        run_in_threads(*(lambda peer=peer: peer.wait_for_background_updates() for peer in peers))
        reference.grad = -(progress[0] + progress[1]) / 2
        sgd.step()
        for model in models:
            assert torch.allclose(flat(model), reference.detach(), atol=1e-6)
        assert [peer.local_epoch for peer in peers] == [2, 2]
    finally:
        for peer in peers:
            peer.shutdown()
        for dht in dhts:
            dht.shutdown()


@pytest.mark.timeout(120)
def test_with_no_averaging_peers_count_toward_the_swarms_epochs_but_each_trains_alone():
    config = AveragingConfig(strategy="none", target_batch_size=16, matchmaking_seconds=1.0)
    dhts = start_dhts(2)
    peers, models, reports = [], [], []
    try:
        for dht in dhts:
            model = torch.nn.Linear(4, 1)
            peers.append(build_swarm_optimizer(config, Replica(
                dht=dht, keys=SwarmKeys.for_run("solo"), params=model.parameters(),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.05), batch_size=4, client_mode=False,
                hooks=AveragingHooks(round_finished=reports.append),
            ), tracker_opts=dict(private_key=RSAPrivateKey())))  # one signing key per peer, as between processes
            models.append(model)
        assert all(isinstance(peer, SwarmOptimizer) for peer in peers)
        wait_until(lambda: [peer.announce() for peer in peers] and all(peer.swarm_view().peers == 2 for peer in peers),
                   60, interval=1.0, message="both trackers to see both peers")

        generator = torch.Generator().manual_seed(0)
        inputs = [torch.randn(4, 4, generator=generator) for _ in peers]  # each peer its own data
        targets = [x @ torch.tensor([[1.0], [2.0], [-1.0], [0.5]]) for x in inputs]
        losses = [[], []]
        for _ in range(24):
            for index, (peer, model) in enumerate(zip(peers, models)):
                loss = torch.nn.functional.mse_loss(model(inputs[index]), targets[index])
                loss.backward()
                peer.step(batch_size=4)
                peer.zero_grad()
                losses[index].append(float(loss.detach()))
        assert all(curve[-1] < 0.5 * curve[0] for curve in losses), losses
        assert all(peer.local_epoch >= 3 for peer in peers)  # 192 samples, a target of 16
        before = [p.detach().clone() for p in models[0].parameters()]
        assert peers[0].load_state_from_peers() is False  # it shares no state
        assert all(torch.equal(b, p.detach()) for b, p in zip(before, models[0].parameters()))
        assert reports == [] and round_payload_bytes(config, before) == 0  # no round, no byte
    finally:
        for peer in peers:
            peer.shutdown()
        for dht in dhts:
            dht.shutdown()
