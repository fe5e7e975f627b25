"""Tests for peer/checkpoint/store.py: round trips, retention, corruption, crashes, full disks.

The on-disk formats themselves (tied and strided tensors, damage to each part, the earlier single-file format)
are tested in test_checkpoint_format.py.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

from benchmarks.common import child_env
from peer.checkpoint import framed, parts
from peer.checkpoint.store import HEADER_SIZE_BYTES, CheckpointError, CheckpointStore

CHILD_TIMEOUT_SECONDS = 120
pytestmark = pytest.mark.timeout(150)


def small_state(epoch: int) -> dict:
    return {"model": {"weights": torch.full((16,), float(epoch))}, "global_epoch": epoch, "config_hash": "abc123",
            "note": None}


def assert_nested_equal(actual, expected, where="state"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, dict):
        assert type(actual) is type(expected) and list(actual) == list(expected), where
        assert getattr(actual, "_metadata", None) == getattr(expected, "_metadata", None), where
        for key in expected:
            assert_nested_equal(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_nested_equal(a, e, f"{where}[{index}]")
    else:
        assert type(actual) is type(expected) and actual == expected, where


def temp_files(directory: Path) -> list:
    return sorted(name for name in os.listdir(directory) if name.endswith(".tmp"))


def warnings_about(caplog, path: Path) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and path.name in r.getMessage()]


def test_round_trip_model_adamw_and_lambda_lr(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    inputs = torch.randn(5, 4)
    model(inputs).pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    assert optimizer.state_dict()["state"], "AdamW must have per-parameter state after a step"
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "local_epoch": 3,
        "global_epoch": 7,
        "loss_history": [1.5, 0.25],
        "config_hash": "0123abcd",
        "parent": None,
    }

    saved = CheckpointStore(tmp_path).save(state, global_epoch=7)
    loaded = CheckpointStore(tmp_path).load_latest()

    assert loaded is not None and loaded.path == saved and loaded.global_epoch == 7
    assert loaded.sha256 == hashlib.sha256((saved / "checkpoint.json").read_bytes()).hexdigest()
    assert_nested_equal(loaded.state, state)  # an OrderedDict with torch's module versions, as model.state_dict()

    # The loaded state must restore training exactly: one more step from each copy agrees.
    restored_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    restored_model.load_state_dict(loaded.state["model"])
    restored_optimizer = torch.optim.AdamW(restored_model.parameters(), lr=1e-2, weight_decay=0.1)
    # Build the scheduler before loading states: its constructor rewrites the group lr.
    restored_scheduler = torch.optim.lr_scheduler.LambdaLR(restored_optimizer, lambda step: 0.5**step)
    restored_optimizer.load_state_dict(loaded.state["optimizer"])
    restored_scheduler.load_state_dict(loaded.state["scheduler"])
    for m, opt, sched in ((model, optimizer, scheduler), (restored_model, restored_optimizer, restored_scheduler)):
        opt.zero_grad()
        m(inputs).pow(2).mean().backward()
        opt.step()
        sched.step()
    for original, restored in zip(model.parameters(), restored_model.parameters()):
        assert torch.equal(original, restored)
    assert scheduler.get_last_lr() == restored_scheduler.get_last_lr()


def test_a_checkpoint_is_a_directory_of_safetensors_weights_framed_training_state_and_an_index(tmp_path):
    path = CheckpointStore(tmp_path).save(small_state(1), global_epoch=1)
    assert path.name == "checkpoint-000001-epoch000001" and path.is_dir()
    assert sorted(os.listdir(path)) == ["checkpoint.json", "model.safetensors", "training.pt"]
    index = json.loads((path / "checkpoint.json").read_text())
    assert index["format"] == "swarmtrain-checkpoint" and index["version"] == 2 and index["global_epoch"] == 1
    for name, entry in index["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    # other tools read the weights with safetensors alone
    assert torch.equal(safetensors.torch.load_file(path / "model.safetensors")["weights"], torch.full((16,), 1.0))
    training = (path / "training.pt").read_bytes()
    magic, version, length, _ = framed.HEADER.unpack(training[:HEADER_SIZE_BYTES])
    assert magic == b"SWRMCKPT" and version == 1 and length == len(training) - HEADER_SIZE_BYTES


def test_empty_directory_loads_none_and_directory_is_created(tmp_path):
    directory = tmp_path / "a" / "b"
    store = CheckpointStore(directory)
    assert directory.is_dir()
    assert store.list() == []
    assert store.load_latest() is None


def test_retention_keeps_newest_and_sequence_continues_across_stores(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for epoch in range(10, 15):
        store.save(small_state(epoch), global_epoch=epoch)
    assert [p.name for p in store.list()] == ["checkpoint-000004-epoch000013", "checkpoint-000005-epoch000014"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000004-epoch000013", "checkpoint-000005-epoch000014"]

    # A restarted peer may be at a lower global epoch; the sequence still orders it newest.
    restarted = CheckpointStore(tmp_path, keep=2)
    path = restarted.save(small_state(3), global_epoch=3)
    assert path.name == "checkpoint-000006-epoch000003"
    assert [p.name for p in restarted.list()] == ["checkpoint-000005-epoch000014", path.name]
    loaded = restarted.load_latest()
    assert loaded.path == path and loaded.state["global_epoch"] == 3


def test_ordering_is_numeric_and_unrelated_files_are_ignored(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    first = store.save(small_state(1), global_epoch=1)
    older = tmp_path / "checkpoint-999999-epoch000001"
    first.rename(older)
    newer = tmp_path / "checkpoint-1000000-epoch000002"
    shutil.copytree(older, newer)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "checkpoint-latest").mkdir()
    (tmp_path / "checkpoint-000005-epoch000005.bak").mkdir()
    (tmp_path / "checkpoint-2000000-epoch000009").write_text("a file, not a checkpoint directory")
    (tmp_path / "checkpoint-2000001-epoch000009.pt").mkdir()  # a directory, not a checkpoint of the earlier format

    assert store.list() == [older, newer]
    assert store.load_latest().path == newer
    assert store.save(small_state(3), global_epoch=3).name == "checkpoint-1000001-epoch000003"
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "checkpoint-latest").exists()


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_below_one_is_rejected(tmp_path, keep):
    with pytest.raises(ValueError, match="keep must be"):
        CheckpointStore(tmp_path, keep=keep)


def test_all_checkpoints_damaged_loads_none(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    first = store.save(small_state(1), global_epoch=1)
    second = store.save(small_state(2), global_epoch=2)
    (first / "checkpoint.json").write_bytes(b"")
    (second / "model.safetensors").write_bytes(b"x" * 1000)
    with caplog.at_level(logging.WARNING, logger="peer.checkpoint.store"):
        assert store.load_latest() is None
    assert warnings_about(caplog, first) and warnings_about(caplog, second)


# The child dies (SIGKILL) at one step of a save: `when` names the step, `patch` makes that step kill it.
KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import torch
    from peer.checkpoint import parts, store as store_module
    from peer.checkpoint.store import CheckpointStore

    directory, when = Path(sys.argv[1]), sys.argv[2]
    store = CheckpointStore(directory, keep=1)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if when == "after_the_first_part":
        real_write = parts.write_synced
        def write_one_then_die(path, *chunks):
            real_write(path, *chunks)
            die()
        parts.write_synced = write_one_then_die
    elif when == "before_the_rename":
        os.replace = die
    elif when == "before_the_directory_fsync":
        real_fsync = store_module.fsync_directory
        store_module.fsync_directory = lambda path: die() if path == directory else real_fsync(path)
    elif when == "while_pruning":
        store_module.remove_quietly = die
    store.save({"model": {"weights": torch.full((4096,), 99.0)}, "global_epoch": 99}, global_epoch=99)
    """
)


# what each crash leaves: the checkpoints in the sequence (oldest first), once a new store has cleaned up
SURVIVORS = {
    "after_the_first_part": ["previous"],
    "before_the_rename": ["previous"],
    "before_the_directory_fsync": ["previous", "newest"],  # in place, and complete: only a power loss could undo it
    "while_pruning": ["newest"],  # the old one was renamed out of the sequence before its deletion began
}


@pytest.mark.parametrize("when", list(SURVIVORS))
def test_a_writer_killed_at_any_step_leaves_complete_checkpoints_only(tmp_path, when):
    previous = CheckpointStore(tmp_path).save(small_state(1), global_epoch=1)
    result = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path), when],
        env=child_env(),
        capture_output=True,
        timeout=CHILD_TIMEOUT_SECONDS,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode(errors="replace")
    if when != "before_the_directory_fsync":
        leftovers = temp_files(tmp_path)
        assert len(leftovers) == 1 and os.listdir(tmp_path / leftovers[0]), "it must die with a part on disk"

    store = CheckpointStore(tmp_path)
    assert temp_files(tmp_path) == []
    paths = {"previous": previous, "newest": tmp_path / "checkpoint-000002-epoch000099"}
    survivors = [paths[name] for name in SURVIVORS[when]]
    assert store.list() == survivors
    states = {"previous": small_state(1),
              "newest": {"model": {"weights": torch.full((4096,), 99.0)}, "global_epoch": 99}}
    for name in SURVIVORS[when]:
        assert_nested_equal(parts.read_parts(paths[name])[0], states[name])
    assert store.load_latest().path == survivors[-1]
    sequence = 3 if "newest" in SURVIVORS[when] else 2
    assert store.save(small_state(2), global_epoch=2).name == f"checkpoint-{sequence:06d}-epoch000002"


@pytest.fixture
def small_filesystem(tmp_path):
    """A 256 KiB tmpfs if we may mount one (root on Linux), else None; always unmounted."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        yield None
        return
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        yield None
        return
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield mount_point
    finally:
        unmounted = subprocess.run(["umount", str(mount_point)], capture_output=True, timeout=30)
        if unmounted.returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


def test_disk_full_raises_and_keeps_previous_checkpoint(tmp_path, small_filesystem, monkeypatch):
    directory = small_filesystem if small_filesystem is not None else tmp_path / "fallback"
    store = CheckpointStore(directory, keep=1)  # keep=1: pruning before the rename would lose `previous`
    previous = store.save(small_state(1), global_epoch=1)
    too_big = {"model": {"weights": torch.zeros(256 * 1024)}, "global_epoch": 2}  # 1 MiB of float32

    if small_filesystem is None:

        def disk_full(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", disk_full)

    with pytest.raises(CheckpointError) as raised:
        store.save(too_big, global_epoch=2)

    message = str(raised.value)
    assert "\n" not in message and "checkpoint-000002-epoch000002" in message and "ENOSPC" in message
    monkeypatch.undo()
    assert temp_files(directory) == []
    assert store.list() == [previous]
    loaded = CheckpointStore(directory).load_latest()
    assert loaded.path == previous
    assert_nested_equal(loaded.state, small_state(1))
    # The failed attempt released its space: a small checkpoint still fits.
    assert store.save(small_state(3), global_epoch=3).name == "checkpoint-000002-epoch000003"


def test_disk_full_on_the_second_part_removes_the_first_and_keeps_previous(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    previous = store.save(small_state(1), global_epoch=1)
    written = []
    real_write = parts.write_synced

    def full_after_one(path, *chunks):
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(path.name)
        real_write(path, *chunks)

    monkeypatch.setattr(parts, "write_synced", full_after_one)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*checkpoint-000002-epoch000002: .*ENOSPC"):
        store.save(small_state(2), global_epoch=2)
    monkeypatch.undo()

    assert written == ["model.safetensors"]
    assert os.listdir(tmp_path) == [previous.name]  # no temp directory, no half-written checkpoint
    assert_nested_equal(store.load_latest().state, small_state(1))


def test_failed_rename_removes_temp_and_keeps_previous(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    previous = store.save(small_state(1), global_epoch=1)

    def denied(src, dst):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dst))

    monkeypatch.setattr(os, "replace", denied)
    with pytest.raises(CheckpointError, match="EACCES"):
        store.save(small_state(2), global_epoch=2)
    monkeypatch.undo()

    assert temp_files(tmp_path) == []
    assert store.list() == [previous]
    assert store.load_latest().path == previous


class Opaque:
    """Picklable, but not a type that torch.load(weights_only=True) accepts."""


def test_state_that_weights_only_load_rejects_is_refused_at_save(tmp_path):
    store = CheckpointStore(tmp_path)
    previous = store.save(small_state(1), global_epoch=1)
    with pytest.raises(CheckpointError, match="weights_only"):
        store.save({"weights": torch.ones(2), "extra": Opaque()}, global_epoch=2)
    assert os.listdir(tmp_path) == [previous.name]


def test_save_creates_a_deleted_directory_again(tmp_path, caplog):
    directory = tmp_path / "a" / "ckpt"
    store = CheckpointStore(directory)
    store.save(small_state(1), global_epoch=1)
    shutil.rmtree(tmp_path / "a")

    with caplog.at_level(logging.WARNING, logger="peer.checkpoint.store"):
        path = store.save(small_state(2), global_epoch=2)

    assert path.name == "checkpoint-000001-epoch000002" and store.list() == [path]
    assert_nested_equal(store.load_latest().state, small_state(2))
    assert any("is gone; creating it again" in r.getMessage() for r in caplog.records)


def test_a_directory_that_cannot_be_created_again_raises_checkpoint_error(tmp_path):
    store = CheckpointStore(tmp_path / "a" / "ckpt")
    shutil.rmtree(tmp_path / "a")
    (tmp_path / "a").write_text("a file where the directory's parent was")

    with pytest.raises(CheckpointError, match=r"cannot use checkpoint directory .*ckpt: .*\(ENOTDIR\)") as raised:
        store.save(small_state(1), global_epoch=1)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_state_holding_nan_or_inf_is_never_written(tmp_path, poison):
    store = CheckpointStore(tmp_path)
    good = store.save({"model": {"w": torch.ones(3)}, "step": 1}, global_epoch=1)
    bad_weights = torch.ones(3)
    bad_weights[1] = poison
    with pytest.raises(CheckpointError, match=r"NaN or Inf \(in state\['optimizer'\]\['state'\]\[0\]\['exp_avg'\]\)"):
        store.save({"model": {"w": torch.ones(3)}, "optimizer": {"state": [{"exp_avg": bad_weights}]}}, global_epoch=2)
    assert store.list() == [good]
    assert torch.equal(store.load_latest().state["model"]["w"], torch.ones(3))
