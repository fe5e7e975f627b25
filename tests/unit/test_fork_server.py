"""The fork server (peer/process/fork_server.py): a child forked on request runs its command line as `peer` would, with
its own environment, directory, threads and module path, and its requester learns its pid and exit code; its
signals reach it; and the server's children stop when the requester goes.

The tests share a server of their own (the suite's peers use another, tests/conftest.py); the last starts one to
close."""
from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from peer.exit_codes import ExitCode
from peer.process.fork_server import ForkServer, ServedProcess

TIMEOUT_SECONDS = 60.0

# a task whose factory reports what the child sees, then ends the process with a code of its own
PROBE_TASK = textwrap.dedent("""
    import json, os, sys, time
    import torch

    def make_task(**options):
        print(json.dumps({"threads": torch.get_num_threads(), "cwd": os.getcwd(),
                          "marker": os.environ.get("PROBE_MARKER"), "argv": sys.argv[:2]}), flush=True)
        if os.environ.get("PROBE_SLEEP"):
            time.sleep(float(os.environ["PROBE_SLEEP"]))
        os._exit(7)
""")


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    server = ForkServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def probe_env(tmp_path: Path) -> dict:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "probe_task.py").write_text(PROBE_TASK)
    return {**os.environ, "PYTHONPATH": str(modules), "PROBE_MARKER": "given"}


def exit_code(process: ServedProcess) -> int:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while process.poll() is None:
        assert time.monotonic() < deadline, f"pid {process.pid} still running after {TIMEOUT_SECONDS:.0f}s"
        time.sleep(0.05)
    return process.returncode


def wait_for_line(log: Path, text: str) -> None:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} within {TIMEOUT_SECONDS:.0f}s:\n{log.read_text()}"
        time.sleep(0.05)


def probe_args(tmp_path: Path) -> list:
    return ["start", "--task", "probe_task:make_task", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--metrics-port", "0"]


def test_a_child_runs_its_command_line_with_its_environment_threads_and_module_path(server, probe_env, tmp_path,
                                                                                   monkeypatch):
    """A new program would read OMP_NUM_THREADS and PYTHONPATH as it starts; the child is told them after the server
    has imported torch, and still runs with them. Its output is appended to the file given."""
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "probe.log"
    log.write_text("before\n")
    process = server.launch(probe_args(tmp_path), {**probe_env, "OMP_NUM_THREADS": "1"}, log)
    assert exit_code(process) == 7
    lines = log.read_text().splitlines()
    assert lines[0] == "before"
    seen = json.loads(next(line for line in lines if line.startswith("{")))
    assert seen == {"threads": 1, "cwd": str(tmp_path), "marker": "given", "argv": ["peer", "start"]}


def test_a_bad_flag_gets_its_one_line_and_exit_code_through_a_pipe(server):
    process = server.launch(["start", "--target-batch-size", "0"], dict(os.environ))
    assert exit_code(process) == ExitCode.BAD_INPUT
    lines = process.stdout.read().strip().splitlines()
    assert len(lines) == 1 and "--target-batch-size" in lines[0] and "'0'" in lines[0], lines


def test_the_child_leads_its_own_session_and_a_signal_reaches_it_and_its_death_is_reported(server, probe_env, tmp_path):
    log = tmp_path / "probe.log"
    process = server.launch(probe_args(tmp_path), {**probe_env, "PROBE_SLEEP": "600"}, log)
    wait_for_line(log, "threads")  # it reached the task, and sleeps there
    assert os.getsid(process.pid) == process.pid  # it leads a session of its own, as a started peer does
    process.send_signal(signal.SIGKILL)
    assert exit_code(process) == -signal.SIGKILL


def test_when_the_requester_closes_the_server_its_children_get_a_graceful_stop(probe_env, tmp_path):
    """SIGTERM, as a peer started with die_with_parent gets: the probe sits in its task's factory, where the peer
    says it received it (and would stop after its step), so the test kills it then."""
    log, server = tmp_path / "probe.log", ForkServer()
    process = server.launch(probe_args(tmp_path), {**probe_env, "PROBE_SLEEP": "600"}, log)
    child = psutil.Process(process.pid)
    try:
        wait_for_line(log, "threads")
        server.close()
        wait_for_line(log, "SIGTERM received")
        assert process.poll() is not None  # the server is gone: its code is lost, and said so
    finally:
        child.kill()
        server.close()
