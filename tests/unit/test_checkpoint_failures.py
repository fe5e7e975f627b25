"""A full, read-only or deleted checkpoint disk does not take a peer out: the Trainer keeps training, warns once per
streak of failures, counts them (peer_checkpoint_failures_total), turns /healthz degraded until a checkpoint works
again; only a failing final checkpoint makes `peer start`'s exit code non-zero.

The disk breaks and heals at chosen epochs (a wrapper around the store's save), on the Trainer rig of
tests/unit/test_trainer.py, with the real metrics, health check and exporter that peer/runtime/builder.py wires.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List

import pytest
from prometheus_client import CollectorRegistry

from monitoring import BottleneckClassifier, HealthCheck, MetricsExporter, PeerMetrics
from peer.cli.outputs import check_output_paths
from peer.cli.start import PeerRun, finish
from peer.exit_codes import ExitCode
from peer.runtime.builder import MetricsObserver
from tests.peers import tmpfs
from tests.unit.test_trainer import BATCH, TARGET, Rig, make_rig

EPOCHS = 5
COMMAND_TIMEOUT_SECONDS = 30


@pytest.fixture
def wired(tmp_path):
    """rig(**flags) -> a Trainer rig whose observer is the builder's MetricsObserver (real metrics and health)."""
    def build(**flags) -> SimpleNamespace:
        rig = make_rig(tmp_path, max_epochs=EPOCHS, checkpoint_every_epochs=1, keep_checkpoints=10, **flags)
        registry, health = CollectorRegistry(), HealthCheck(window_seconds=3600.0)
        rig.trainer.observer = MetricsObserver(PeerMetrics(registry), BottleneckClassifier(), health)
        return SimpleNamespace(rig=rig, registry=registry, health=health)

    return build


def failures_counted(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("peer_checkpoint_failures_total")


def at_checkpoints(rig: Rig, actions: Dict[int, List[Callable[[], None]]]) -> None:
    """Run actions[epoch] just before the store writes the checkpoint of that epoch."""
    real_save = rig.store.save

    def save(state: dict, global_epoch: int):
        for action in actions.get(global_epoch, ()):
            action()
        return real_save(state, global_epoch=global_epoch)

    rig.store.save = save


def messages(caplog, level: int, text: str) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]


def disk_full(monkeypatch) -> Callable[[], None]:
    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return lambda: monkeypatch.setattr(os, "fsync", no_space)


@pytest.fixture
def read_only_switch(tmp_path):
    """(break, fix, errno name) making the rig's checkpoint directory read-only and writable again: a remount of a
    tmpfs as root (permissions do not stop root), chmod otherwise."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    if os.geteuid() != 0:
        yield lambda: directory.chmod(0o555), lambda: directory.chmod(0o755), "EACCES"
        directory.chmod(0o755)
        return

    def remount(mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(directory)], check=True, capture_output=True,
                       timeout=COMMAND_TIMEOUT_SECONDS)

    with tmpfs(directory, "16m"):
        yield lambda: remount("ro"), lambda: remount("rw"), "EROFS"


def get(url: str) -> tuple:
    try:
        with urllib.request.urlopen(url, timeout=COMMAND_TIMEOUT_SECONDS) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_failing_checkpoints_degrade_health_and_training_goes_on_until_one_works(
        wired, fault, monkeypatch, request, caplog):
    """Checkpoints of epochs 2 and 3 fail, the disk heals before 4: all 5 epochs are trained, 2 failures counted,
    one warning for the streak, /healthz 503 with the cause while it lasts, and healthy again after epoch 4's."""
    if fault == "full":
        break_disk, fix_disk, code = disk_full(monkeypatch), monkeypatch.undo, "ENOSPC"
    else:
        break_disk, fix_disk, code = request.getfixturevalue("read_only_switch")
    w = wired()
    rig, seen = w.rig, {}
    exporter = MetricsExporter(w.registry, port=0, host="127.0.0.1", health=w.health)
    port = exporter.start()

    def look() -> None:  # at epoch 4, before the disk heals
        seen.update(healthz=get(f"http://127.0.0.1:{port}/healthz"), failures=failures_counted(w.registry))

    at_checkpoints(rig, {2: [break_disk], 4: [look, fix_disk]})
    try:
        with caplog.at_level(logging.INFO, logger="peer"):
            assert rig.trainer.run() == "max_epochs"
    finally:
        exporter.stop()

    assert rig.summary.global_epoch == EPOCHS and len(rig.optimizer.steps) == EPOCHS * TARGET // BATCH
    assert rig.checkpoint_epochs() == [1, 4, 5]  # the first one and those after the disk healed, nothing else
    assert [name for name in os.listdir(rig.store.directory) if name.endswith(".tmp")] == []
    assert rig.summary.checkpoint_failures == 2 and failures_counted(w.registry) == 2 and seen["failures"] == 2
    status, body = seen["healthz"]
    assert status == 503 and body.count("\n") == 1, body
    assert body.startswith("degraded: checkpoints failing since epoch 2 (2 in a row), training goes on: cannot "
                           "write checkpoint "), body
    assert code in body
    warnings = messages(caplog, logging.WARNING, "checkpoint failed:")
    assert len(warnings) == 1 and code in warnings[0] and "checkpoint-000002-epoch000002:" in warnings[0]
    assert f"--checkpoint-dir {rig.config.checkpoint.checkpoint_dir}" in warnings[0]
    assert len(messages(caplog, logging.INFO, "checkpoints work again")) == 1
    healthy, body = w.health()
    assert healthy and re.fullmatch(r"ok: last training progress \d+s ago \(window 3600s\)", body), body
    assert rig.summary.last_checkpoint == str(rig.store.list()[-1])


def test_one_warning_per_streak_of_failures(wired, monkeypatch, caplog):
    """Failures at 1, then 3 and 4: two streaks, two warnings, two recoveries (at 2 and 5), three failures."""
    w = wired()
    break_disk = disk_full(monkeypatch)
    at_checkpoints(w.rig, {1: [break_disk], 2: [monkeypatch.undo], 3: [break_disk], 5: [monkeypatch.undo]})

    with caplog.at_level(logging.INFO, logger="peer"):
        assert w.rig.trainer.run() == "max_epochs"

    assert len(messages(caplog, logging.WARNING, "checkpoint failed:")) == 2
    assert len(messages(caplog, logging.INFO, "checkpoints work again")) == 2
    assert w.rig.summary.checkpoint_failures == 3 and failures_counted(w.registry) == 3
    assert w.rig.checkpoint_epochs() == [2, 5] and w.health()[0]


def test_a_deleted_checkpoint_directory_is_created_again_at_the_next_checkpoint(wired, caplog):
    w = wired()
    directory = w.rig.store.directory
    at_checkpoints(w.rig, {3: [lambda: shutil.rmtree(directory)]})

    with caplog.at_level(logging.WARNING, logger="peer"):
        assert w.rig.trainer.run() == "max_epochs"

    assert w.rig.checkpoint_epochs() == [3, 4, 5]
    assert w.rig.summary.checkpoint_failures == 0 and failures_counted(w.registry) == 0
    assert messages(caplog, logging.WARNING, f"checkpoint directory {directory} is gone; creating it again")


def test_health_is_degraded_with_its_reason_until_recovered_and_still_reports_a_stall():
    clock = SimpleNamespace(now=0.0)
    health = HealthCheck(window_seconds=60.0, clock=lambda: clock.now)
    health.beat()
    health.degrade("checkpoints failing:\n  No space left on device")
    assert health() == (False, "degraded: checkpoints failing: No space left on device")
    clock.now += 93
    assert health() == (False, "no training progress for 93s (window 60s); degraded: checkpoints failing: "
                               "No space left on device")
    health.recover()
    assert health() == (False, "no training progress for 93s (window 60s)")
    health.beat()
    assert health()[0] is True


def finished(rig: Rig) -> PeerRun:
    run = PeerRun(code=ExitCode.OK, reason="max_epochs", trainer=rig.trainer)
    finish(rig.config, run, ExitStack())
    return run


def test_a_failing_final_checkpoint_makes_the_exit_code_1_with_one_line(tmp_path, monkeypatch, caplog):
    rig = make_rig(tmp_path, max_epochs=2, checkpoint_every_epochs=1, summary_json=tmp_path / "summary.json")
    assert rig.trainer.run() == "max_epochs"
    newest = rig.store.list()[-1]
    disk_full(monkeypatch)()

    with caplog.at_level(logging.INFO, logger="peer"):
        run = finished(rig)
    monkeypatch.undo()

    assert (run.code, run.reason) == (ExitCode.FAILED, "final_checkpoint_failed")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith("final checkpoint failed: cannot write checkpoint ") and "ENOSPC" in errors[0]
    assert errors[0].endswith(f"the last checkpoint this peer wrote or resumed from is {newest}; free space on, "
                              f"or fix, --checkpoint-dir {rig.config.checkpoint.checkpoint_dir}")
    summary = json.loads(Path(tmp_path / "summary.json").read_text())
    assert summary["exit_reason"] == "final_checkpoint_failed" and summary["checkpoint_failures"] == 1
    assert rig.store.list()[-1] == newest  # the failed write left the earlier checkpoints as they were


def test_a_clean_run_whose_final_checkpoint_works_exits_0(tmp_path):
    rig = make_rig(tmp_path, max_epochs=2, checkpoint_every_epochs=1)
    assert rig.trainer.run() == "max_epochs"
    run = finished(rig)
    assert (run.code, run.reason) == (ExitCode.OK, "max_epochs")
    assert rig.checkpoint_epochs() == [1, 2, 2] and rig.summary.last_checkpoint == str(rig.store.list()[-1])


def test_a_checkpoint_dir_read_only_at_start_is_bad_input_named_before_joining(read_only_switch, tmp_path):
    """Mid-run a read-only disk only costs checkpoints (above); given at start, it is the user's to fix (exit 2)."""
    make_read_only, make_writable, _ = read_only_switch
    make_read_only()
    try:
        with pytest.raises(ValueError, match=r"--checkpoint-dir .*/ckpt is not a directory this peer can write to "
                                             r"\(.*\); choose a writable directory"):
            check_output_paths(tmp_path / "ckpt", None)
    finally:
        make_writable()
    check_output_paths(tmp_path / "ckpt", tmp_path / "ckpt" / "summary.json")  # and once writable, it passes
    assert list((tmp_path / "ckpt").iterdir()) == []  # the probe leaves nothing behind
