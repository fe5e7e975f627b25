"""What pauses a peer: --active-hours on a fake clock, --yield-when-busy's rule and readings, `peer pause` requests,
and the leaving rules that must not wait for a paused peer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from monitoring.metrics import PAUSE_REASONS
from peer.active_hours import ActiveHoursError, parse_active_hours
from peer.runtime.busy import BusyRule, MachineUse, Use
from peer.runtime.leaving import DONE, PAUSED, Need, everyone_else_done, leave_record, needs_of_others
from peer.runtime.pausing import (
    BUSY,
    OUTSIDE_HOURS,
    REQUEST_FILE,
    REQUESTED,
    PauseGate,
    PauseWatch,
    request,
)

MONDAY = datetime(2026, 11, 23)  # a Monday


def at(day: int, hour: int, minute: int = 0) -> datetime:
    return MONDAY.replace(day=MONDAY.day + day, hour=hour, minute=minute)


def test_the_reasons_are_the_metrics_labels():
    assert (REQUESTED, OUTSIDE_HOURS, BUSY) == PAUSE_REASONS


@pytest.mark.parametrize("text, active, inactive", [
    ("22:00-07:00", [at(0, 22), at(1, 0, 30), at(6, 6, 59)], [at(0, 7), at(0, 12), at(0, 21, 59)]),
    ("Mon-Fri 18:00-23:30", [at(0, 18), at(4, 23, 29)], [at(0, 23, 30), at(5, 19), at(6, 20), at(2, 17, 59)]),
    ("Fri 22:00-07:00", [at(4, 23), at(5, 6)], [at(5, 23), at(3, 23), at(4, 6)]),  # Friday night into Saturday
    ("Sat-Mon 00:00-24:00", [at(5, 0), at(6, 23, 59), at(0, 12)], [at(1, 12), at(4, 23)]),  # a range over Sunday
    ("Mon-Fri 18:00-23:30, Sat-Sun 00:00-24:00", [at(5, 9), at(2, 19)], [at(2, 9)]),
])
def test_active_hours_follow_the_local_clock(text, active, inactive):
    hours = parse_active_hours(text)
    assert all(hours.active(when) for when in active), [when for when in active if not hours.active(when)]
    assert not any(hours.active(when) for when in inactive), [when for when in inactive if hours.active(when)]


@pytest.mark.parametrize("text, message", [
    ("", "an empty window"),
    ("22:00-07:00,", "an empty window"),
    ("10pm-7am", "'10pm-7am' is no window"),
    ("25:00-07:00", "25:00 is no time of day"),
    ("22:60-07:00", "22:60 is no time of day"),
    ("Mon-Fry 18:00-20:00", "'fry' is no day"),
    ("09:00-09:00", "starts and ends at the same time"),
    ("24:00-07:00", "cannot start at 24:00"),
])
def test_bad_active_hours_say_what_is_wrong(text, message):
    with pytest.raises(ActiveHoursError, match=message):
        parse_active_hours(text)


def test_the_watch_pauses_outside_the_active_hours_and_resumes_inside(tmp_path: Path):
    clock = [at(0, 12)]
    gate = PauseGate()
    watch = PauseWatch(gate, tmp_path, parse_active_hours("22:00-07:00"), now=lambda: clock[0])
    watch.poll()
    assert gate.reasons() == {OUTSIDE_HOURS: "outside --active-hours 22:00-07:00"}
    clock[0] = at(0, 22, 1)
    watch.poll()
    assert not gate.paused


def test_busy_needs_a_sustained_load_and_quiet_needs_a_sustained_calm():
    now = [0.0]
    rule = BusyRule(cpu_share=0.5, gpu_share=0.1, after_seconds=5, quiet_seconds=30, clock=lambda: now[0])

    def observe(cpu: float, gpu=None, seconds: float = 1.0) -> bool:
        now[0] += seconds
        return rule.observe(Use(cpu, gpu))

    assert not observe(0.9) and not observe(0.9, seconds=3)  # a burst shorter than 5 s is no reason
    assert not observe(0.2)  # and a dip starts the count again
    assert not observe(0.9) and observe(0.9, seconds=5)
    assert observe(0.2, seconds=20) and observe(0.9)  # a short calm does not resume: no flapping
    assert observe(0.1) and not observe(0.1, seconds=30)
    assert not observe(0.0, gpu=0.5) and observe(0.0, gpu=0.5, seconds=5)  # the GPU alone counts too


def _burner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _cpu_share(process: psutil.Process, before: float, seconds: float) -> float:
    times = process.cpu_times()
    return (times.user + times.system - before) / (seconds * (psutil.cpu_count() or 1))


@pytest.mark.parametrize("inside", [False, True])
def test_a_burner_counts_as_another_program_only_outside_the_peers_process_tree(inside: bool):
    """Accounting, not timing: the machine's busy time includes the burner's, and the peer's tree (here, a process
    that stands for the peer, with the burner as its child or not) is taken out, whatever else the machine runs."""
    peer = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             "children = [subprocess.Popen([sys.executable, '-c', 'while True: pass'])] "
                             "if sys.argv[1] == 'inside' else []\ntime.sleep(60)", "inside" if inside else "outside"])
    burner = None
    try:
        machine = MachineUse(root_pid=peer.pid)
        deadline = time.monotonic() + 10
        while inside and len(psutil.Process(peer.pid).children()) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        burner = psutil.Process(peer.pid).children()[0] if inside else psutil.Process(_burner().pid)
        time.sleep(0.3)
        machine.read()
        started, before = time.monotonic(), sum(burner.cpu_times()[:2])
        time.sleep(1.5)
        use = machine.read()
        share = _cpu_share(burner, before, time.monotonic() - started)
        assert share > 0.05, share  # it ran
        tolerance = 0.05  # tick granularity of the kernel's accounting
        if inside:
            assert use.cpu <= 1.0 - share + tolerance, (use, share)
        else:
            assert use.cpu >= share - tolerance, (use, share)
    finally:
        for process in (psutil.Process(peer.pid).children(recursive=True) if peer.poll() is None else []):
            process.kill()
        if burner is not None and burner.is_running():
            burner.kill()
        peer.kill()
        peer.wait(10)


def test_a_request_pauses_and_resumes_only_the_peer_it_names(tmp_path: Path):
    gate = PauseGate()
    watch = PauseWatch(gate, tmp_path)
    request(tmp_path, os.getpid() + 1, paused=True)  # for an earlier peer in this directory
    watch.poll()
    assert not gate.paused and watch.request_seen is None
    stamp = request(tmp_path, os.getpid(), paused=True)
    watch.poll()
    assert gate.reasons() == {REQUESTED: "requested by peer pause"} and watch.request_seen == stamp
    assert (tmp_path / REQUEST_FILE).stat().st_mode & 0o777 == 0o600
    stamp = request(tmp_path, os.getpid(), paused=False)
    watch.poll()
    assert not gate.paused and watch.request_seen == stamp


def test_a_request_others_may_write_is_ignored_with_a_warning(tmp_path: Path, caplog):
    gate = PauseGate()
    watch = PauseWatch(gate, tmp_path)
    (tmp_path / REQUEST_FILE).write_text(json.dumps({"pid": os.getpid(), "paused": True, "at": 1.0}))
    os.chmod(tmp_path / REQUEST_FILE, 0o666)
    watch.poll()
    watch.poll()
    assert not gate.paused
    assert [record.message for record in caplog.records].count(
        f"ignoring {tmp_path / REQUEST_FILE}: it is not owned by this peer's user or others may write to it; only "
        f"`peer pause` and `peer resume`, run by this user, control this peer") == 1


def test_the_gate_trains_only_when_no_reason_holds():
    gate = PauseGate()
    gate.hold(REQUESTED, "requested by peer pause")
    gate.hold(BUSY, "--yield-when-busy: other programs use CPU 90%")
    assert gate.wait_for_change(0) and not gate.wait_for_change(0)
    gate.release(REQUESTED)
    assert gate.paused and gate.wait_for_change(0)
    gate.release(BUSY)
    assert not gate.paused


def test_nobody_leaving_waits_for_a_paused_peer():
    me, paused, done = b"me", b"paused", b"done"
    progress = {me: {"epoch": 9}, paused: {"epoch": 7}, done: {"epoch": 9}}
    leaving = {paused: leave_record(7, PAUSED), done: leave_record(9, DONE)}
    assert needs_of_others(9, progress, leaving, me)[paused] is Need.NOTHING
    assert everyone_else_done(progress, leaving, me)
    assert needs_of_others(9, progress, {done: leave_record(9, DONE)}, me)[paused] is Need.SERVE  # once resumed


@pytest.mark.parametrize("command", ["pause", "resume"])
def test_controlling_a_directory_no_peer_holds_is_bad_input_in_one_line(tmp_path: Path, capsys, command: str):
    from peer.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main([command, "--checkpoint-dir", str(tmp_path)])
    output = capsys.readouterr()
    assert exited.value.code == 2 and output.out == ""
    assert output.err == (f"error: --checkpoint-dir {tmp_path}: no running peer holds this directory; name the "
                          f"--checkpoint-dir of a peer started on this machine with peer start\n")
