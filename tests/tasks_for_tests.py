"""Tasks with a known bottleneck, for tests that run real peers (`--task tests.tasks_for_tests:...`)."""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from peer.tasks import Task

FEATURES = 32


class SyntheticDataset(Dataset):
    """Random regression points; optionally slow (preprocessing-bound) or stalling after some items."""

    def __init__(self, size: int, seconds_per_item: float = 0.0, stall_after_items: int = -1):
        generator = torch.Generator().manual_seed(size)
        self.x = torch.randn(size, FEATURES, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.seconds_per_item = seconds_per_item
        self.stall_after_items = stall_after_items
        self.items_served = 0  # per process: each DataLoader worker counts its own

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        self.items_served += 1
        if 0 <= self.stall_after_items < self.items_served:
            time.sleep(3600)  # a hung data source: the training loop stalls in data_wait
        if self.seconds_per_item:
            time.sleep(self.seconds_per_item)
        return self.x[index], self.y[index]


def mse_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def _mlp(hidden: int, layers: int) -> nn.Module:
    blocks = [nn.Linear(FEATURES, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 1))


def _task(name: str, model_factory, train: Dataset, batch_size: int) -> Task:
    return Task(
        name=name,
        build_model=model_factory,
        build_train_dataset=lambda: train,
        build_val_dataset=lambda: SyntheticDataset(64),
        loss_fn=mse_loss,
        build_optimizer=sgd,
        batch_size=batch_size,
    )


def make_slow_data_task() -> Task:
    """Each sample takes 20 ms to 'decode' with a tiny model: preprocessing dominates."""
    return _task("slow-data", lambda: _mlp(16, 1), SyntheticDataset(4096, seconds_per_item=0.02), batch_size=8)


def make_heavy_model_task() -> Task:
    """A wide, deep MLP on instant data: compute dominates."""
    return _task("heavy-model", lambda: _mlp(1024, 4), SyntheticDataset(4096), batch_size=256)


def make_stalling_task() -> Task:
    """Trains for a few steps, then the data source hangs (after STALL_AFTER_ITEMS items, default 64)."""
    stall_after = int(os.environ.get("STALL_AFTER_ITEMS", "64"))
    return _task("stalling", lambda: _mlp(16, 1), SyntheticDataset(4096, stall_after_items=stall_after), batch_size=8)


def make_nan_loss_task() -> Task:
    """A task whose training loss is always NaN while the weights stay finite: a broken loss function or data.
    In eval mode it is finite, so that it passes the start-up check of the first batch (peer/tasks/contract.py)
    and breaks only once training."""
    import dataclasses

    base = _task("nan-loss", lambda: _mlp(16, 1), SyntheticDataset(4096), batch_size=8)
    return dataclasses.replace(
        base, loss_fn=lambda model, batch: mse_loss(model, batch) * (float("nan") if model.training else 1.0))


def make_diverging_task() -> Task:
    """SGD with a learning rate so large that the weights overflow to Inf/NaN within a few steps."""
    import dataclasses

    base = _task("diverging", lambda: _mlp(16, 1), SyntheticDataset(4096), batch_size=8)
    return dataclasses.replace(base, build_optimizer=lambda params: torch.optim.SGD(params, lr=1e30))


OVERCLAIM_FACTOR = 10


def make_overclaiming_task() -> Task:
    """bytelm-tiny on a hostile peer that claims OVERCLAIM_FACTOR times the samples it trains on, and ascends its
    loss: each step takes (and reports to the swarm) a batch of OVERCLAIM_FACTOR x 16 windows, computes the loss on
    the first 16 only, and flips its sign. In eval mode the loss is the honest one (its validation is not the
    attack). Built only through the Task API, under the built-in's name, so that it passes the run manifest."""
    import dataclasses

    from peer.tasks import load_task

    base = load_task("bytelm-tiny")
    computed = base.batch_size

    def flipped_loss_of_a_tenth(model, batch):
        if not model.training:
            return base.loss_fn(model, batch)
        return -base.loss_fn(model, [part[:computed] for part in batch])

    return dataclasses.replace(base, batch_size=OVERCLAIM_FACTOR * computed, loss_fn=flipped_loss_of_a_tenth)


class _ActOnPass(Dataset):
    """A validation set that runs actions[k] at the start of its pass number k (1 = the first)."""

    def __init__(self, base: Dataset, actions: dict):
        self.base, self.actions, self.passes = base, actions, 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        if index == 0:  # the validation loader does not shuffle: every pass starts here
            self.passes += 1
            for action in self.actions.get(self.passes, ()):
                action()
        return self.base[index]


def _fill_disk(path: str) -> None:
    """Write zeros to `path` until its filesystem is full."""
    chunk = bytes(64 * 1024)
    with open(path, "wb", buffering=0) as ballast:
        try:
            while True:
                ballast.write(chunk)
        except OSError:
            pass


def _probe_own_endpoints(record_path: str) -> None:
    """Append what this peer's /healthz and its checkpoint failure counter say now, as one JSON line."""
    import json
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{os.environ['PEER_METRICS_PORT']}"
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as response:
            health = [response.status, response.read().decode()]
    except urllib.error.HTTPError as e:
        health = [e.code, e.read().decode()]
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        metrics = response.read().decode()
    failures = [line.split()[-1] for line in metrics.splitlines() if line.startswith("peer_checkpoint_failures_total")]
    with open(record_path, "a") as record:
        record.write(json.dumps({"healthz": health, "checkpoint_failures": float(failures[0])}) + "\n")


def make_checkpoint_fault_task() -> Task:
    """bytelm-tiny on a peer whose checkpoint disk is full from global epoch FULL_FROM_EPOCH until FREED_AT_EPOCH:
    a ballast file fills DISK_BALLAST's filesystem before the checkpoint of FULL_FROM_EPOCH and is deleted before
    the one of FREED_AT_EPOCH. Just before the ballast goes, and one epoch later, the peer records its own
    /healthz and peer_checkpoint_failures_total (port: PEER_METRICS_PORT) in PROBE_RECORD. Without DISK_BALLAST,
    plain bytelm-tiny.

    The peer acts between its own steps (the validation pass after global epoch k comes just before the
    checkpoint of epoch k), so which checkpoints fail does not depend on timing; epochs are counted by
    validation passes, one per epoch as long as the peer stays in lock-step with its swarm."""
    import dataclasses

    from peer.tasks import load_task

    base = load_task("bytelm-tiny")
    ballast = os.environ.get("DISK_BALLAST")
    if not ballast:
        return base
    full_from, freed_at = int(os.environ["FULL_FROM_EPOCH"]), int(os.environ["FREED_AT_EPOCH"])

    def probe() -> None:
        _probe_own_endpoints(os.environ["PROBE_RECORD"])

    # pass 1 is the validation before training starts, pass k + 1 the one after global epoch k
    actions = {full_from + 1: [lambda: _fill_disk(ballast)],
               freed_at + 1: [probe, lambda: os.remove(ballast)],
               freed_at + 2: [probe]}
    return dataclasses.replace(base, build_val_dataset=lambda: _ActOnPass(base.build_val_dataset(), actions))


def make_clock_ahead_task() -> Task:
    """bytelm-tiny on a peer whose clock jumps CLOCK_AHEAD_SECONDS ahead once the file CLOCK_JUMP_FILE exists
    (hivemind refuses a peer whose clock is off when it joins). Loaded before the peer starts its DHT, whose
    process inherits the jumping clock."""
    import sys

    import hivemind.utils.timed_storage

    from peer.tasks import load_task

    true_time = hivemind.utils.timed_storage.get_dht_time
    ahead, jump_file = float(os.environ.get("CLOCK_AHEAD_SECONDS", "3600")), os.environ["CLOCK_JUMP_FILE"]
    jumped = []

    def jumping_time() -> float:
        if not jumped and os.path.exists(jump_file):
            jumped.append(True)
        return true_time() + (ahead if jumped else 0.0)

    for module in list(sys.modules.values()):  # every module that imported hivemind's clock by name
        if getattr(module, "get_dht_time", None) is true_time:
            module.get_dht_time = jumping_time
    return load_task("bytelm-tiny")


class StageFailure(RuntimeError):
    """Raised on purpose by make_failing_task."""


def make_failing_task() -> Task:
    """bytelm-tiny raising at FAIL_AT: "scheduler" (while hivemind builds its state averager) or "first_step"
    (the first training batch, after the averagers have started; the contract check's call is let through)."""
    import dataclasses

    from peer.tasks import load_task

    stage, base = os.environ["FAIL_AT"], load_task("bytelm-tiny")
    calls = []

    def failing_scheduler(optimizer):
        raise StageFailure("failing at scheduler")

    def failing_loss(model, batch):
        calls.append(1)
        if len(calls) > 1:
            raise StageFailure("failing at first_step")
        return base.loss_fn(model, batch)

    if stage == "scheduler":
        return dataclasses.replace(base, build_scheduler=failing_scheduler)
    return dataclasses.replace(base, loss_fn=failing_loss)


class TiedLM(nn.Module):
    """Embedding and output layer share one weight (as a Llama with tie_word_embeddings), with buffers beside."""

    def __init__(self, vocab: int = 13, width: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)))


def make_tied_task() -> Task:
    """A small model with tied weights and buffers, for `peer export` and checkpoint tests (it is not trained)."""
    return _task("tied", TiedLM, SyntheticDataset(64), batch_size=8)


def write_weights_as_text(model: nn.Module, directory) -> None:
    """A task's own export: one line per tensor, name and sum (what make_self_exporting_task writes)."""
    with open(os.path.join(directory, "weights.txt"), "w") as file:
        for name, tensor in model.state_dict().items():
            file.write(f"{name} {float(tensor.double().sum())!r}\n")


def make_self_exporting_task() -> Task:
    """make_tied_task with its own export_model: `peer export` must call it instead of writing safetensors."""
    import dataclasses

    return dataclasses.replace(make_tied_task(), name="self-exporting", export_model=write_weights_as_text)


def make_failing_export_task() -> Task:
    """make_tied_task whose export_model writes a file, then raises: the export must leave nothing behind."""
    import dataclasses

    def fail(model: nn.Module, directory) -> None:
        write_weights_as_text(model, directory)
        raise StageFailure("failing in export_model")

    return dataclasses.replace(make_tied_task(), name="failing-export", export_model=fail)
