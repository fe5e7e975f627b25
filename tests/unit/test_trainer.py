"""The Trainer's epoch, stop, non-finite-loss and checkpoint logic, fast: a fake SwarmOptimizer, no swarm, no network.

FakeOptimizer implements averaging.api.SwarmOptimizer deterministically: each step applies a real SGD update and
counts its samples, and the epoch advances whenever they reach the target batch. So every decision of the loop
(when to validate, checkpoint, stop, skip a batch, download the swarm's state or give up) can be checked exactly.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterable, List, Optional, Tuple

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

import peer.runtime.trainer as trainer_module
from averaging.api import AveragingHooks, RoundReport, SwarmOptimizer, SwarmView
from averaging.deadlines import Deadlines
from averaging.pipeline.update_check import UpdateCheck, UpdateCheckRule
from monitoring import BottleneckClassifier, HealthCheck, PeerMetrics, PhaseTimer
from peer.checkpoint.store import CheckpointStore
from peer.config import PeerConfig, load_config
from peer.exit_codes import BadInput
from peer.process.signals import StopRequest
from peer.runtime.precision import MixedPrecision
from peer.runtime.resume import restore_model, restore_optimizer
from peer.runtime.tally import RoundTally
from peer.runtime.trainer import NONFINITE_LOSS_LIMIT, Trainer, TrainingDiverged
from peer.tasks import Task, load_task
from peer.tasks.data import make_loader
from peer.tasks.order import DataOrder, resume_position
from peer.telemetry.events import EventLog, UpdatesRefused, read_events
from peer.telemetry.observers import EventsObserver, MetricsObserver, Observers
from peer.telemetry.reports import EpochReport, TrainingObserver
from peer.telemetry.summary import PeerSummary
from tests.tasks_for_tests import FEATURES, SyntheticDataset, mse_loss, sgd

BATCH = 8
TARGET = 2 * BATCH  # two local steps per global epoch
PAYLOAD_BYTES = 1234
LIMIT = NONFINITE_LOSS_LIMIT
RUNAWAY = 10 * LIMIT  # more steps or batches than any test needs: a loop that fails to stop fails fast, not hangs


# --- the fakes -----------------------------------------------------------------------------------------------------


class FakeOptimizer:
    """SwarmOptimizer without a swarm: a real SGD step per batch; a new epoch each time the samples reach the target."""

    def __init__(self, params: Iterable[torch.Tensor], *, target_batch_size: int, peers: int = 1,
                 scheduler_factory: Optional[Callable] = None, hooks: Optional[AveragingHooks] = None,
                 outcomes: Tuple[str, ...] = ("ok",), group_size: int = 2):
        self.inner = torch.optim.SGD(list(params), lr=0.01, momentum=0.9)  # momentum: inner state to checkpoint
        self._scheduler = scheduler_factory(self.inner) if scheduler_factory is not None else None
        self.target_batch_size, self.peers = target_batch_size, peers
        self.hooks = hooks or AveragingHooks()
        self.outcomes, self.group_size = itertools.cycle(outcomes), group_size  # one round per epoch
        self._epoch = 0
        self.samples_accumulated = 0
        self.steps: List[Optional[int]] = []  # the batch size of every step
        self.bad_gradient_steps = 0  # steps taken with a missing or non-finite gradient
        self.load_calls = 0
        self.download_succeeds = True  # False: as if no peer sent its state
        self.epoch_increments: Iterable[int] = itertools.repeat(1)  # > 1: a download jumped over epochs
        self.calls: List[str] = []  # the order of the calls around checkpoints and downloads

    @property
    def local_epoch(self) -> int:
        return self._epoch

    @property
    def scheduler(self):
        return self._scheduler

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(1.0, 5.0)

    @property
    def apart(self) -> bool:
        return False

    averages_in_groups = averages_after_epoch = False

    @property
    def downloaded_at_epoch(self) -> Optional[int]:
        return None

    def step(self, batch_size: Optional[int] = None) -> None:
        assert len(self.steps) < RUNAWAY, "the training loop did not stop"
        grads = [p.grad for group in self.inner.param_groups for p in group["params"]]
        if any(g is None or not bool(torch.isfinite(g).all()) for g in grads):
            self.bad_gradient_steps += 1
        self.inner.step()
        self.steps.append(batch_size)
        self.samples_accumulated += batch_size
        if self.samples_accumulated >= self.target_batch_size:
            self.samples_accumulated -= self.target_batch_size
            self._epoch += next(self.epoch_increments)
            if self._scheduler is not None:
                self._scheduler.step()
            self.hooks.round_finished(RoundReport(next(self.outcomes), seconds=0.1, group_size=self.group_size))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def swarm_view(self, refresh_timeout_seconds: Optional[float] = None) -> SwarmView:
        return SwarmView(peers=self.peers, samples_per_second=100.0, samples_accumulated=self.samples_accumulated,
                         target_batch_size=self.target_batch_size, global_epoch=self._epoch)

    def announce(self) -> None:
        self.calls.append("announce")

    def load_state_from_peers(self) -> bool:
        self.load_calls += 1
        self.calls.append("load_state_from_peers")
        if self.download_succeeds:
            self.hooks.state_loaded(self._epoch)
        return self.download_succeeds

    def load_state_from_donor_ahead(self) -> bool:
        return False

    def await_state_comparison(self, timeout_seconds: float, expected_peers=None) -> None:
        self.calls.append("await_state_comparison")

    def state_apart_now(self) -> bool:
        return False

    def download_swarm_state(self) -> bool:
        return False

    def offer_final_state(self) -> bool:
        self.calls.append("offer_final_state")
        return True

    def download_final_state(self) -> bool:
        return self.load_state_from_peers()

    def better_final_offer(self) -> bool:
        return False

    def wait_for_background_updates(self) -> None:
        self.calls.append("wait_for_background_updates")

    def refuse(self, peers) -> None:
        self.calls.append(("refuse", sorted(peers)))

    @property
    def task_optimizer(self) -> torch.optim.Optimizer:
        return self.inner

    def pause(self) -> None:
        self.calls.append("pause")
        self.samples_accumulated = 0

    def resume(self) -> None:
        self.calls.append("resume")

    def state_dict(self) -> dict:
        self.calls.append("state_dict")
        return {"epoch": self._epoch, "samples_accumulated": self.samples_accumulated, "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self._epoch, self.samples_accumulated = state_dict["epoch"], state_dict["samples_accumulated"]
        self.inner.load_state_dict(state_dict["inner"])

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        self.calls.append("shutdown")


class FakeSession:
    """The two calls the Trainer makes on its SwarmSession, recorded."""

    def __init__(self):
        self.leaving_began = 0
        self.left_at_last_epoch: List[Optional[str]] = []

    def begin_leaving(self) -> None:
        self.leaving_began += 1

    def leave_at_last_epoch(self, last_round_outcome: Optional[str]) -> None:
        self.left_at_last_epoch.append(last_round_outcome)


class RecordingObserver(TrainingObserver):
    """Records every report; after_step(n) runs after the n-th step's report (to stop or move a clock mid-run)."""

    def __init__(self):
        self.steps: List[Tuple[int, float]] = []
        self.epochs: List[Tuple[int, Optional[float]]] = []
        self.rounds: List[Tuple[RoundReport, int]] = []
        self.swarm_peers: List[int] = []
        self.after_step: Callable[[int], None] = lambda n: None

    def on_step(self, samples: int, loss: float) -> None:
        self.steps.append((samples, loss))
        self.after_step(len(self.steps))

    def on_joined(self, epoch: int, peers: int, val_loss: Optional[float]) -> None:
        self.epochs.append((epoch, val_loss))

    def on_epoch(self, report: EpochReport) -> None:
        self.epochs.append((report.epoch, report.val_loss))

    def on_round(self, report: RoundReport, payload_bytes: int) -> None:
        self.rounds.append((report, payload_bytes))

    def on_swarm(self, peers: int, samples_per_second: float, progress_ratio: float) -> None:
        self.swarm_peers.append(peers)


class ScriptedLoss:
    """mse_loss, NaN on the training batches (numbered from 1) where is_nan(n); validation batches stay finite.

    before_batch() runs before each training batch: tests record there what the optimizer had done by then."""

    def __init__(self, is_nan: Callable[[int], bool]):
        self.is_nan, self.batches = is_nan, 0
        self.before_batch: Callable[[], None] = lambda: None

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        loss = mse_loss(model, batch)
        if not torch.is_grad_enabled():  # peer.tasks.data.evaluate validates under no_grad
            return loss
        assert self.batches < RUNAWAY, "the training loop did not stop"
        self.before_batch()
        self.batches += 1
        return loss * float("nan") if self.is_nan(self.batches) else loss


def mlp_task(loss_fn: Callable = mse_loss) -> Task:
    """A regression MLP small enough that a step costs well under a millisecond."""
    return Task(
        name="unit-mlp",
        build_model=lambda: nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 1)),
        build_train_dataset=lambda: SyntheticDataset(256),
        build_val_dataset=lambda: SyntheticDataset(32),
        loss_fn=loss_fn,
        build_optimizer=sgd,
        batch_size=BATCH,
    )


# --- the rig: what peer/runtime/builder.py assembles, with the fakes ------------------------------------------


@dataclass
class Rig:
    config: PeerConfig
    task: Task
    model: nn.Module
    optimizer: FakeOptimizer
    summary: PeerSummary
    observer: RecordingObserver
    session: FakeSession
    store: CheckpointStore
    stop: StopRequest
    trainer: Trainer

    def checkpoint_epochs(self) -> List[int]:
        return [int(path.stem.split("epoch")[1]) for path in self.store.list()]


def make_config(tmp_path: Path, task: Task, **flags) -> PeerConfig:
    return load_config(flags={
        "run_id": "unit", "task": task.name, "batch_size": BATCH, "target_batch_size": TARGET,
        "checkpoint_dir": tmp_path / "ckpt", "val_batches": 2, "data_workers": 0, "metrics_port": "off", **flags,
    })


def make_rig(tmp_path: Path, task: Optional[Task] = None, *, peers: int = 1, outcomes: Tuple[str, ...] = ("ok",),
             seed: int = 0, resume: bool = False, precision: Optional[Callable[[nn.Module], MixedPrecision]] = None,
             **flags) -> Rig:
    """A Trainer over task (default: mlp_task()) and a FakeOptimizer; resume=True restores as
    peer/runtime/builder.py does;
    precision(model) builds the loop's MixedPrecision (default: fp32)."""
    task = task or mlp_task()
    config = make_config(tmp_path, task, **flags)
    summary = PeerSummary(run_id=config.training.run_id, task=task.name)
    observer, timer = RecordingObserver(), PhaseTimer()
    rounds = RoundTally(summary, observer, PAYLOAD_BYTES)
    store = CheckpointStore(config.checkpoint.checkpoint_dir, keep=config.checkpoint.keep_checkpoints)
    torch.manual_seed(seed)
    model = task.build_model()
    checkpoint = restore_model(store, config, task.name, model) if resume else None
    optimizer = FakeOptimizer(model.parameters(), target_batch_size=TARGET, peers=peers, outcomes=outcomes,
                              scheduler_factory=task.build_scheduler, hooks=rounds.hooks(timer))
    mixed_precision = precision(model) if precision is not None else None
    restore_optimizer(checkpoint, optimizer, summary, mixed_precision)
    train_set = task.build_train_dataset()
    position = resume_position(checkpoint.state.get("data") if checkpoint is not None else None, 0, 0)
    train_loader = make_loader(train_set, batch_size=BATCH, workers=0, collate_fn=task.collate_fn,
                               order=DataOrder(len(train_set), position.seed, position.samples_read))
    val_loader = make_loader(task.build_val_dataset(), batch_size=BATCH, workers=0, collate_fn=task.collate_fn)
    session, stop = FakeSession(), StopRequest()
    trainer = Trainer(config, task, model, optimizer, train_loader, val_loader, device=torch.device("cpu"),
                      session=session, rounds=rounds, store=store, stop=stop, timer=timer, data_position=position,
                      precision=mixed_precision)
    return Rig(config, task, model, optimizer, summary, observer, session, store, stop, trainer)


def parameters_of(model: nn.Module) -> List[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same_tensors(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    a, b = list(a), list(b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def momentum_buffers(optimizer: FakeOptimizer) -> List[torch.Tensor]:
    return [state["momentum_buffer"] for state in optimizer.inner.state_dict()["state"].values()]


@pytest.fixture(scope="module")
def bytelm_tiny() -> Task:
    return load_task("bytelm-tiny")


# --- the fake itself -----------------------------------------------------------------------------------------------


def test_the_fake_optimizer_implements_the_swarm_optimizer_protocol():
    """FakeOptimizer passes the runtime Protocol check, which an object lacking one of its methods fails."""
    assert isinstance(FakeOptimizer(nn.Linear(2, 1).parameters(), target_batch_size=TARGET), SwarmOptimizer)

    class NoSwarmView(FakeOptimizer):
        swarm_view = None  # how a Protocol member is blocked: as if the method were missing

    assert not isinstance(NoSwarmView(nn.Linear(2, 1).parameters(), target_batch_size=TARGET), SwarmOptimizer)


# --- epochs --------------------------------------------------------------------------------------------------------


def test_run_stops_at_max_epochs_after_validating_each_epoch_and_leaves_with_the_last_round_outcome(tmp_path):
    """--max-epochs 3: validate at 0..3, count every step, checkpoint at epoch 2 only, leave with the last outcome."""
    rig = make_rig(tmp_path, peers=3, outcomes=("ok", "timeout", "failed"), max_epochs=3, checkpoint_every_epochs=2)
    initial = parameters_of(rig.model)

    assert rig.trainer.run() == "max_epochs"

    assert rig.session.left_at_last_epoch == ["failed"]  # the round that ended epoch 3, as the tally saw it
    assert rig.session.leaving_began == 1
    assert [epoch for epoch, _ in rig.observer.epochs] == [0, 1, 2, 3]
    assert all(math.isfinite(val_loss) for _, val_loss in rig.observer.epochs)
    assert rig.summary.val_loss_first == rig.observer.epochs[0][1]
    assert rig.summary.val_loss_last == rig.observer.epochs[-1][1] != rig.summary.val_loss_first
    steps = 3 * TARGET // BATCH
    assert rig.optimizer.steps == [BATCH] * steps and rig.optimizer.bad_gradient_steps == 0
    assert rig.summary.global_epoch == 3
    assert (rig.summary.local_steps, rig.summary.samples) == (steps, steps * BATCH)
    assert rig.summary.train_loss == rig.observer.steps[-1][1]
    assert rig.observer.swarm_peers == [3] * (steps + 1)  # once as it joins, then after every step
    assert rig.summary.averaging_rounds == {"ok": 1, "partial": 0, "failed": 1, "timeout": 1, "skipped": 0}
    assert not same_tensors(parameters_of(rig.model), initial)  # the optimizer's steps trained the model
    assert rig.checkpoint_epochs() == [2]
    state = rig.store.load_latest().state
    assert (state["local_epoch"], state["local_steps"], state["samples"]) == (2, 2 * TARGET // BATCH, 2 * TARGET)


def test_a_peer_that_downloads_the_final_state_as_it_leaves_reports_the_validation_loss_of_that_state(tmp_path):
    """Its last epoch validated its own state, and it leaves with the swarm's (a peer a round behind downloads it at
    the last epoch): the summary's last validation loss is that of the state its final checkpoint holds."""
    rig = make_rig(tmp_path, max_epochs=2)

    def leave_with_the_swarms_state(last_round_outcome: Optional[str]) -> None:
        with torch.no_grad():
            for parameter in rig.model.parameters():
                parameter.add_(1.0)
        rig.optimizer.hooks.state_loaded(rig.optimizer.local_epoch)

    rig.session.leave_at_last_epoch = leave_with_the_swarms_state
    assert rig.trainer.run() == "max_epochs"
    assert rig.summary.state_downloads == 1
    assert rig.summary.val_loss_last == rig.trainer.validate() != rig.observer.epochs[-1][1]


def test_a_peer_whose_last_round_lands_after_its_last_epoch_reports_the_validation_loss_of_the_landed_state(
        tmp_path):
    """Overlapped DiLoCo and local-sgd land their last round after the epoch it leads to began, and delayed updates
    apply the last step as it is waited for: the last epoch validated another model than the final checkpoint's."""
    rig = make_rig(tmp_path, max_epochs=2)

    def land_the_last_round() -> None:
        rig.optimizer.calls.append("wait_for_background_updates")
        with torch.no_grad():
            for parameter in rig.model.parameters():
                parameter.add_(1.0)

    rig.optimizer.wait_for_background_updates = land_the_last_round
    assert rig.trainer.run() == "max_epochs"
    assert rig.summary.state_downloads == 0
    assert rig.summary.val_loss_last == rig.trainer.validate() != rig.observer.epochs[-1][1]


def test_an_epoch_jump_over_a_multiple_of_k_still_writes_the_checkpoint(tmp_path):
    """Epochs 1, 3, 4 (a download jumped over 2) with every 2 epochs: checkpoints at 3 and 4, not at 4 alone."""
    rig = make_rig(tmp_path, max_epochs=4, checkpoint_every_epochs=2, keep_checkpoints=5)
    rig.optimizer.epoch_increments = iter([1, 2, 1])
    assert rig.trainer.run() == "max_epochs"
    assert [epoch for epoch, _ in rig.observer.epochs] == [0, 1, 3, 4]
    assert rig.checkpoint_epochs() == [3, 4]


@pytest.mark.parametrize("every, expected", [(1, [1, 2, 3]), (2, [2]), (3, [3]), (4, [])])
def test_the_loop_writes_a_checkpoint_every_k_epochs(tmp_path, every, expected):
    """A checkpoint at each epoch that is a multiple of --checkpoint-every-epochs, never at the initial epoch 0."""
    rig = make_rig(tmp_path, max_epochs=3, checkpoint_every_epochs=every, keep_checkpoints=5)
    assert rig.trainer.run() == "max_epochs"
    assert rig.checkpoint_epochs() == expected


def test_a_peer_resumed_at_max_epochs_takes_no_step(tmp_path):
    """A peer whose checkpoint is already at --max-epochs validates once and leaves without training."""
    assert make_rig(tmp_path, max_epochs=2, checkpoint_every_epochs=2).trainer.run() == "max_epochs"

    rig = make_rig(tmp_path, resume=True, max_epochs=2, checkpoint_every_epochs=2)
    assert rig.trainer.run() == "max_epochs"
    assert rig.optimizer.steps == []
    assert rig.observer.epochs == [(2, rig.summary.val_loss_first)]
    assert rig.session.left_at_last_epoch == [None]  # no round this session


# --- stopping ------------------------------------------------------------------------------------------------------


def test_a_stop_requested_before_run_ends_it_before_any_step(tmp_path):
    """A stop already set: validate once, return signal:<name>, no step, no checkpoint, and begin leaving."""
    rig = make_rig(tmp_path, max_epochs=3)
    rig.stop.set("SIGINT")

    assert rig.trainer.run() == "signal:SIGINT"

    assert rig.optimizer.steps == [] and rig.summary.local_steps == 0
    assert [epoch for epoch, _ in rig.observer.epochs] == [0]
    assert rig.session.leaving_began == 1
    assert rig.session.left_at_last_epoch == []  # only --max-epochs waits for stragglers
    assert rig.store.list() == []


def test_a_stop_during_a_step_ends_the_run_after_that_whole_step(tmp_path):
    """A stop set inside step 2 lets that step finish, epoch 1 included (validated, checkpointed), then ends."""
    rig = make_rig(tmp_path, max_epochs=10, checkpoint_every_epochs=1)
    rig.observer.after_step = lambda n: rig.stop.set("SIGTERM") if n == 2 else None

    assert rig.trainer.run() == "signal:SIGTERM"

    assert rig.summary.local_steps == len(rig.optimizer.steps) == 2
    assert [epoch for epoch, _ in rig.observer.epochs] == [0, 1]
    assert rig.summary.global_epoch == 1
    assert rig.checkpoint_epochs() == [1]
    assert rig.session.leaving_began == 1 and rig.session.left_at_last_epoch == []


def test_max_seconds_ends_the_run_at_the_first_step_boundary_past_it(tmp_path, monkeypatch):
    """--max-seconds 2.5 with steps of one (fake) second each: three steps, then max_seconds."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(monotonic=lambda: clock.now))
    rig = make_rig(tmp_path, max_seconds=2.5, max_epochs=100)
    rig.observer.after_step = lambda n: setattr(clock, "now", clock.now + 1.0)

    assert rig.trainer.run() == "max_seconds"

    assert len(rig.optimizer.steps) == 3
    assert rig.summary.longest_step_seconds == 1.0
    assert rig.session.leaving_began == 1 and rig.session.left_at_last_epoch == []


# --- non-finite losses ---------------------------------------------------------------------------------------------


def test_a_lone_peer_whose_loss_stays_nonfinite_stops_after_the_limit_without_a_download(tmp_path):
    """peers == 1: no swarm to take weights from, so TrainingDiverged after LIMIT NaN batches, none stepped."""
    loss = ScriptedLoss(lambda n: True)
    rig = make_rig(tmp_path, mlp_task(loss), peers=1, max_epochs=3, checkpoint_every_epochs=1)

    diverged = f"non-finite for {LIMIT} batches in a row (last: non-finite loss (nan)): training diverged"
    with pytest.raises(TrainingDiverged, match=re.escape(diverged)) as error:
        rig.trainer.run()

    assert "even with the swarm's weights" not in str(error.value)
    assert loss.batches == LIMIT
    assert rig.optimizer.load_calls == 0
    assert rig.summary.nonfinite_batches == LIMIT
    assert rig.optimizer.steps == [] and rig.summary.local_steps == 0 and rig.summary.samples == 0
    assert rig.session.leaving_began == 1
    assert rig.store.list() == []  # diverged weights are not checkpointed


def test_a_nonfinite_streak_takes_the_swarm_state_once_then_stops_if_it_goes_on(tmp_path):
    """peers > 1: after LIMIT NaN batches one download, after LIMIT more TrainingDiverged 'even with the swarm's'."""
    loss = ScriptedLoss(lambda n: True)
    rig = make_rig(tmp_path, mlp_task(loss), peers=2, max_epochs=3)
    downloads_before_batch: List[int] = []
    loss.before_batch = lambda: downloads_before_batch.append(rig.optimizer.load_calls)

    with pytest.raises(TrainingDiverged, match="even with the swarm's weights"):
        rig.trainer.run()

    assert downloads_before_batch == [0] * LIMIT + [1] * LIMIT
    assert rig.summary.state_downloads == 1  # reported through the hooks to the tally
    assert rig.summary.nonfinite_batches == 2 * LIMIT
    assert rig.optimizer.steps == [] and rig.summary.local_steps == 0
    assert rig.session.leaving_began == 1


def test_a_nonfinite_streak_whose_download_gets_nothing_stops_and_says_so(tmp_path):
    """peers > 1 but no peer sends its state: stop after LIMIT batches, without claiming the swarm's weights failed."""
    loss = ScriptedLoss(lambda n: True)
    rig = make_rig(tmp_path, mlp_task(loss), peers=2, max_epochs=3)
    rig.optimizer.download_succeeds = False

    with pytest.raises(TrainingDiverged, match="and no peer sent its state to start over from") as error:
        rig.trainer.run()

    assert "even with the swarm's weights" not in str(error.value)
    assert loss.batches == LIMIT and rig.optimizer.load_calls == 1
    assert rig.summary.state_downloads == 0


def test_a_finite_batch_resets_the_nonfinite_streak(tmp_path):
    """LIMIT - 1 NaN batches, a finite one, LIMIT - 1 NaN, a finite one: no download, no error, two clean steps."""
    loss = ScriptedLoss(lambda n: n % LIMIT != 0)
    rig = make_rig(tmp_path, mlp_task(loss), peers=2, max_epochs=1)

    assert rig.trainer.run() == "max_epochs"

    assert loss.batches == 2 * LIMIT
    assert rig.optimizer.load_calls == 0
    assert rig.summary.nonfinite_batches == 2 * (LIMIT - 1)
    assert rig.optimizer.steps == [BATCH, BATCH] and rig.summary.local_steps == 2
    assert rig.optimizer.bad_gradient_steps == 0  # the NaN gradients were cleared, not added to the next batch's
    assert math.isfinite(rig.summary.train_loss)


def test_a_finite_batch_after_a_swarm_reset_allows_another_reset(tmp_path):
    """NaN x LIMIT, finite, NaN x LIMIT, finite: the recovery in between earns the second streak a second download."""
    loss = ScriptedLoss(lambda n: n not in (LIMIT + 1, 2 * LIMIT + 2))
    rig = make_rig(tmp_path, mlp_task(loss), peers=2, max_epochs=1)

    assert rig.trainer.run() == "max_epochs"

    assert rig.optimizer.load_calls == 2
    assert rig.summary.nonfinite_batches == 2 * LIMIT
    assert rig.optimizer.steps == [BATCH, BATCH] and rig.optimizer.bad_gradient_steps == 0


# --- checkpoints ---------------------------------------------------------------------------------------------------


def test_save_checkpoint_writes_model_optimizer_scheduler_epoch_and_counters(tmp_path, bytelm_tiny):
    """The checkpoint holds the weights, optimizer and scheduler state, epoch and counters, after background updates."""
    rig = make_rig(tmp_path, bytelm_tiny, max_epochs=2, checkpoint_every_epochs=100)
    assert rig.trainer.run() == "max_epochs" and rig.store.list() == []

    rig.trainer.save_checkpoint()

    assert rig.checkpoint_epochs() == [2]
    state = rig.store.load_latest().state
    model_state = rig.model.state_dict()
    assert state["model"].keys() == model_state.keys()
    assert all(torch.equal(state["model"][name], model_state[name]) for name in model_state)
    assert (state["optimizer"]["epoch"], state["optimizer"]["samples_accumulated"]) == (2, 0)
    saved_buffers = [entry["momentum_buffer"] for entry in state["optimizer"]["inner"]["state"].values()]
    assert same_tensors(saved_buffers, momentum_buffers(rig.optimizer))
    assert state["scheduler"]["last_epoch"] == 2  # bytelm's LambdaLR, stepped once per epoch
    assert (state["local_epoch"], state["local_steps"], state["samples"]) == (2, 4, 4 * BATCH)
    assert (state["run_id"], state["task"], state["swarm_hash"]) == ("unit", "bytelm-tiny", rig.config.swarm_hash())
    calls = rig.optimizer.calls
    assert calls.index("wait_for_background_updates") < calls.index("state_dict")


def test_a_checkpoint_restores_into_a_fresh_model_and_optimizer(tmp_path, bytelm_tiny):
    """restore_model + restore_optimizer give back the weights, epoch, optimizer and scheduler state and counters."""
    rig = make_rig(tmp_path, bytelm_tiny, max_epochs=2, checkpoint_every_epochs=2)
    assert rig.trainer.run() == "max_epochs"
    torch.manual_seed(1)
    model, summary = bytelm_tiny.build_model(), PeerSummary(run_id="unit", task=bytelm_tiny.name)
    assert not same_tensors(parameters_of(model), parameters_of(rig.model))

    checkpoint = restore_model(rig.store, rig.config, bytelm_tiny.name, model)
    optimizer = FakeOptimizer(model.parameters(), target_batch_size=TARGET,
                              scheduler_factory=bytelm_tiny.build_scheduler)
    restore_optimizer(checkpoint, optimizer, summary)

    assert same_tensors(parameters_of(model), parameters_of(rig.model))
    assert optimizer.local_epoch == rig.optimizer.local_epoch == 2
    assert same_tensors(momentum_buffers(optimizer), momentum_buffers(rig.optimizer))
    assert optimizer.scheduler.last_epoch == 2
    assert optimizer.scheduler.get_last_lr() == rig.optimizer.scheduler.get_last_lr()
    assert (summary.local_steps, summary.samples) == (rig.summary.local_steps, rig.summary.samples) == (4, 4 * BATCH)
    assert summary.resumed_from == str(rig.store.list()[-1])


def test_a_resumed_peer_continues_its_epochs_and_counters(tmp_path):
    """Resumed at epoch 2 with --max-epochs 3: one more epoch, counters continuing from the checkpoint's."""
    assert make_rig(tmp_path, max_epochs=2, checkpoint_every_epochs=2).trainer.run() == "max_epochs"

    rig = make_rig(tmp_path, resume=True, max_epochs=3, checkpoint_every_epochs=1)
    assert rig.trainer.run() == "max_epochs"

    assert [epoch for epoch, _ in rig.observer.epochs] == [2, 3]
    assert len(rig.optimizer.steps) == TARGET // BATCH
    assert (rig.summary.local_steps, rig.summary.samples) == (3 * TARGET // BATCH, 3 * TARGET)
    assert rig.checkpoint_epochs() == [2, 3]


def test_an_empty_checkpoint_directory_restores_nothing(tmp_path):
    """No checkpoint: restore_model returns None and leaves the model; restore_optimizer(None) changes nothing."""
    task = mlp_task()
    config, model = make_config(tmp_path, task), task.build_model()
    before, summary = parameters_of(model), PeerSummary(run_id="unit", task=task.name)
    optimizer = FakeOptimizer(model.parameters(), target_batch_size=TARGET)

    checkpoint = restore_model(CheckpointStore(tmp_path / "ckpt"), config, task.name, model)
    restore_optimizer(checkpoint, optimizer, summary)

    assert checkpoint is None
    assert same_tensors(parameters_of(model), before)
    assert optimizer.local_epoch == 0 and summary.resumed_from is None


@pytest.mark.parametrize("field, value", [("run_id", "another-run"), ("task", "another-task")])
def test_a_checkpoint_of_another_run_or_task_is_refused(tmp_path, field, value):
    """Resuming from another run's (or task's) checkpoint raises a RuntimeError naming --checkpoint-dir."""
    rig = make_rig(tmp_path, max_epochs=1, checkpoint_every_epochs=1)
    assert rig.trainer.run() == "max_epochs" and rig.checkpoint_epochs() == [1]
    task = mlp_task()
    if field == "task":
        task = dataclasses.replace(task, name=value)
    config = make_config(tmp_path, task, **({"run_id": value} if field == "run_id" else {}))
    torch.manual_seed(0)
    model = task.build_model()
    before = parameters_of(model)

    with pytest.raises(RuntimeError, match="use another --checkpoint-dir") as error:
        restore_model(rig.store, config, task.name, model)

    assert repr(value) in str(error.value)
    assert same_tensors(parameters_of(model), before)  # not a single weight loaded


def test_a_checkpoint_of_another_model_of_the_same_task_is_refused_in_one_line(tmp_path):
    """Restarted with options that build another model (hf-causal-lm with another --model-config): one line naming
    the first mismatched tensor and --checkpoint-dir, exit 2, not torch's list of every mismatch."""
    rig = make_rig(tmp_path, max_epochs=1, checkpoint_every_epochs=1)
    assert rig.trainer.run() == "max_epochs"
    wider = dataclasses.replace(mlp_task(), build_model=lambda: nn.Sequential(
        nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1)))

    with pytest.raises(BadInput, match="use another --checkpoint-dir") as error:
        restore_model(rig.store, make_config(tmp_path, wider), wider.name, wider.build_model())

    assert "\n" not in str(error.value) and "size mismatch for 0.weight" in str(error.value)


def test_a_checkpoint_trained_with_other_task_files_is_refused_though_its_weights_fit(tmp_path):
    """hf-causal-lm records digests of the files its options name; a config.json changed since, in a way no shape
    shows (a rotary base), would train another model on these weights in silence: refused in one line. The
    starting weights (--init-from) may differ: the checkpoint's weights replace them."""
    digests = {"model_config": "aaaa", "tokenizer": "bbbb", "init_from": "seeded"}
    task = dataclasses.replace(mlp_task(), shared_digests=digests)
    rig = make_rig(tmp_path, task, max_epochs=1, checkpoint_every_epochs=1)
    assert rig.trainer.run() == "max_epochs"
    assert rig.store.load_latest().state["task_digests"] == digests

    resumed = restore_model(rig.store, rig.config, task.name, task.build_model(), {**digests, "init_from": "cccc"})
    assert resumed is not None  # other starting weights: resumed all the same
    with pytest.raises(BadInput, match="use another --checkpoint-dir") as error:
        restore_model(rig.store, rig.config, task.name, task.build_model(), {**digests, "model_config": "dddd"})
    assert "\n" not in str(error.value) and "model_config (digest aaaa then, dddd now)" in str(error.value)


# --- the round tally -----------------------------------------------------------------------------------------------


def test_the_round_tally_counts_outcomes_and_the_largest_successful_group():
    """on_round counts every outcome, keeps the largest group of ok or partial rounds, the last outcome, and reports
    on."""
    summary, observer = PeerSummary(run_id="unit", task="unit-mlp"), RecordingObserver()
    tally = RoundTally(summary, observer, PAYLOAD_BYTES)
    reports = [RoundReport("ok", 1.0, 3), RoundReport("failed", 2.0, 5, "peer left"), RoundReport("ok", 1.0, 2),
               RoundReport("skipped", 0.0, 9), RoundReport("partial", 2.0, 4, "late part"),
               RoundReport("timeout", 5.0, 7)]
    assert tally.last_outcome is None

    for report in reports:
        tally.on_round(report)

    assert summary.averaging_rounds == {"ok": 2, "partial": 1, "failed": 1, "timeout": 1, "skipped": 1}
    assert summary.largest_group == 4  # a partial round averaged in its group; the failed, skipped and timed-out
    # rounds' larger groups do not count
    assert tally.last_outcome == "timeout"
    assert observer.rounds == [(report, PAYLOAD_BYTES) for report in reports]


def test_the_round_tally_hooks_feed_the_tally_and_time_phases_on_the_timer():
    """hooks(timer): round_finished -> on_round, state_loaded -> state_downloads, phase -> the timer's phase."""
    clock = SimpleNamespace(now=0.0)
    timer = PhaseTimer(clock=lambda: clock.now)
    summary = PeerSummary(run_id="unit", task="unit-mlp")
    tally = RoundTally(summary, RecordingObserver(), PAYLOAD_BYTES)
    hooks = tally.hooks(timer)

    hooks.round_finished(RoundReport("ok", 1.0, 4))
    hooks.state_loaded(7)
    hooks.state_loaded(8)
    with hooks.phase("averaging"):
        clock.now += 2.0

    assert (summary.averaging_rounds["ok"], summary.largest_group, tally.last_outcome) == (1, 4, "ok")
    assert summary.state_downloads == 2
    assert timer.totals()["averaging"] == 2.0



def test_the_round_tally_refuses_the_peers_of_harmful_updates_and_reports_it(tmp_path):
    """judge_update: after repeated harmful averaged updates, the optimizer refuses their peers, the summary lists
    them, the metrics count them and the events file says so, once."""
    registry = CollectorRegistry()
    events = EventLog(tmp_path / "events.jsonl")
    observer = Observers(MetricsObserver(PeerMetrics(registry), BottleneckClassifier(), HealthCheck(60)),
                         EventsObserver(events))
    summary = PeerSummary(run_id="unit", task="unit-mlp")
    tally = RoundTally(summary, observer, PAYLOAD_BYTES, UpdateCheck(UpdateCheckRule(0.02, 2, 3), "me"))
    refused = []
    optimizer = SimpleNamespace(refuse=lambda peers: refused.append(sorted(peers)))
    tally.judge_update(0, 5.0, optimizer)
    for epoch, loss in enumerate([5.5, 6.0, 7.0], start=1):
        tally.on_round(RoundReport("ok", 1.0, 3, peers=("me", "b", "c")))
        tally.judge_update(epoch, loss, optimizer)
    assert refused == [["b", "c"]] and summary.refused_peers == ["b", "c"]
    assert registry.get_sample_value("peer_harmful_updates_total") == 2
    assert registry.get_sample_value("peer_refused_peers_total") == 2
    written = [event for event in read_events(tmp_path / "events.jsonl")[0] if isinstance(event, UpdatesRefused)]
    assert [(event.peers, event.epochs, event.losses) for event in written] == [
        (["b", "c"], [1, 2], [[5.0, 5.5], [5.5, 6.0]])]


# --- fp16 with its loss scaler ---------------------------------------------------------------------------------------


def fp16(init_scale: float) -> Callable[[nn.Module], MixedPrecision]:
    """fp16 autocast and loss scaling on the CPU (peer start allows fp16 only on a GPU; the logic is the same)."""
    return lambda model: MixedPrecision("fp16", torch.device("cpu"), model.parameters(), init_scale=init_scale)


def test_fp16_batches_that_overflow_are_skipped_before_the_swarm_counts_them(tmp_path):
    """A loss scale far too large overflows the fp16 backward: those batches never reach the optimizer (no samples
    counted, no epoch moved, no inf gradient sent), the scale halves each time, then training goes on normally."""
    loss = ScriptedLoss(lambda n: False)  # counts the training batches
    rig = make_rig(tmp_path, mlp_task(loss), max_epochs=3, precision=fp16(init_scale=2.0 ** 24))

    assert rig.trainer.run() == "max_epochs"

    overflowed = rig.summary.overflow_batches
    assert 1 <= overflowed < LIMIT
    assert loss.batches == overflowed + len(rig.optimizer.steps)
    assert rig.optimizer.steps == [BATCH] * (3 * TARGET // BATCH)  # exactly the batches of 3 epochs, none twice
    assert rig.summary.samples == 3 * TARGET and rig.summary.local_steps == len(rig.optimizer.steps)
    assert rig.optimizer.bad_gradient_steps == 0 and rig.summary.nonfinite_batches == 0
    assert rig.trainer.precision.scale < 2.0 ** 24
    assert [p.dtype for p in rig.model.parameters()] == [torch.float32] * 4  # master weights stay fp32


def test_fp16_overflow_that_never_ends_is_divergence(tmp_path):
    """Twenty overflows in a row have lowered the scale a million times: the gradients are not finite at any scale."""
    rig = make_rig(tmp_path, mlp_task(), peers=1, max_epochs=3, precision=fp16(init_scale=2.0 ** 40))

    with pytest.raises(TrainingDiverged, match=re.escape(f"non-finite for {LIMIT} batches in a row (last: fp16 "
                                                         f"gradients overflowed (loss scale now {2 ** 20:g}))")):
        rig.trainer.run()

    assert rig.summary.overflow_batches == LIMIT and rig.optimizer.steps == []


def test_the_loss_scale_survives_a_checkpoint(tmp_path):
    rig = make_rig(tmp_path, max_epochs=2, checkpoint_every_epochs=1, precision=fp16(init_scale=2.0 ** 24))
    rig.trainer.run()
    found = rig.trainer.precision.scale
    assert found < 2.0 ** 24

    resumed = make_rig(tmp_path, resume=True, precision=fp16(init_scale=2.0 ** 24))

    assert resumed.trainer.precision.scale == found


class RecordingDataset(torch.utils.data.Dataset):
    """A dataset that notes each index read (with no loader worker, the loop takes exactly what is read)."""

    def __init__(self, dataset, read: List[int]):
        self.dataset, self.read = dataset, read

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.read.append(index)
        return self.dataset[index]


def test_a_resumed_peer_reads_its_data_on_from_where_its_checkpoint_stood(tmp_path):
    """The checkpoint records how far the loop has read; the resumed loop reads the samples that came next in the
    same order (across pass boundaries: 3 epochs read more than twice the 20 samples), not the first pass again."""
    read: List[int] = []
    task = dataclasses.replace(mlp_task(), build_train_dataset=lambda: RecordingDataset(SyntheticDataset(20), read))
    assert make_rig(tmp_path, task, max_epochs=2, checkpoint_every_epochs=2).trainer.run() == "max_epochs"
    taken = len(read)
    checkpoint = CheckpointStore(tmp_path / "ckpt").load_latest()
    assert checkpoint.state["data"] == {"seed": 0, "samples_read": taken}

    read.clear()
    assert make_rig(tmp_path, task, resume=True, max_epochs=3).trainer.run() == "max_epochs"
    stream = list(itertools.islice(iter(DataOrder(20, seed=0)), taken + len(read)))
    assert taken + len(read) > 2 * 20 and read == stream[taken:]
