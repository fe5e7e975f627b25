"""One peer per --checkpoint-dir (peer/checkpoint/lock.py): a second one is refused with the first one's pid, a dead
one's lock is taken over (with real peers: tests/swarm/test_checkpoint_lock.py)."""
from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path

import pytest

from peer.checkpoint import lock as checkpoint_lock
from peer.checkpoint.lock import LOCK_FILE_NAME, CheckpointDirInUse, CheckpointDirLock
from peer.config import load_config
from peer.exit_codes import BadInput
from peer.process.signals import StopRequest
from peer.runtime.builder import PeerBuilder
from tests.peers import REPO_ROOT

CHILD_TIMEOUT_SECONDS = 60

# Takes the lock, forks a child that inherits every descriptor (as hivemind's averagers do), prints
# "<its pid> <the child's pid>" and waits for stdin to close.
HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from peer.checkpoint.lock import CheckpointDirLock

    lock = CheckpointDirLock.acquire(Path(sys.argv[1]))
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(os.getpid(), child, flush=True)
    sys.stdin.read()
    lock.release()
    os.kill(child, 9)
    """
)


@pytest.fixture
def holder(tmp_path):
    """start(directory) -> (holder pid, its forked child's pid): another process holding the directory's lock."""
    started = []

    def start(directory: Path):
        process = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                   start_new_session=True)
        started.append(process)
        line = process.stdout.readline()  # the pipe closes if the child dies: never blocks forever
        assert line, f"the lock holder exited with {process.wait(CHILD_TIMEOUT_SECONDS)}"
        holder_pid, child_pid = map(int, line.split())
        return process, holder_pid, child_pid

    try:
        yield start
    finally:
        for process in started:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the holder and its forked child
            except ProcessLookupError:
                pass
            process.wait(CHILD_TIMEOUT_SECONDS)


def test_a_second_lock_in_one_process_is_refused_and_the_first_release_frees_it(tmp_path):
    """flock conflicts between two opens even in one process; the message names the directory, pid and the fix."""
    first = CheckpointDirLock.acquire(tmp_path / "ckpt")
    assert first.held and (tmp_path / "ckpt" / LOCK_FILE_NAME).read_text().split()[0] == str(os.getpid())

    with pytest.raises(CheckpointDirInUse) as refused:
        CheckpointDirLock.acquire(tmp_path / "ckpt")

    message = str(refused.value)
    assert isinstance(refused.value, BadInput) and "\n" not in message  # exit code 2, one line
    assert f"--checkpoint-dir {tmp_path / 'ckpt'} is in use by another peer (pid {os.getpid()})" in message
    assert message.endswith("give this one its own directory with --checkpoint-dir")
    first.release()
    first.release()  # idempotent
    CheckpointDirLock.acquire(tmp_path / "ckpt").release()


def test_a_lock_held_by_another_process_is_refused_with_its_pid_until_it_releases(tmp_path, holder):
    process, holder_pid, _ = holder(tmp_path)

    with pytest.raises(CheckpointDirInUse, match=f"in use by another peer \\(pid {holder_pid}\\)"):
        CheckpointDirLock.acquire(tmp_path)

    process.stdin.close()  # the holder releases and exits
    assert process.wait(CHILD_TIMEOUT_SECONDS) == 0
    lock = CheckpointDirLock.acquire(tmp_path)
    assert (tmp_path / LOCK_FILE_NAME).read_text().split()[0] == str(os.getpid())
    lock.release()


def test_the_lock_of_a_killed_peer_is_taken_over_even_while_its_forked_child_lives(tmp_path, holder):
    """SIGKILL leaves the lock file with a dead pid in it; the kernel dropped the lock, and the child the peer
    forked (which inherited the descriptor) closed its copy at the fork, so the lock is free at once."""
    process, holder_pid, child_pid = holder(tmp_path)
    os.kill(holder_pid, signal.SIGKILL)
    assert process.wait(CHILD_TIMEOUT_SECONDS) == -signal.SIGKILL
    os.kill(child_pid, 0)  # still alive (raises if not)
    assert (tmp_path / LOCK_FILE_NAME).read_text().split()[0] == str(holder_pid)  # stale, left behind

    lock = CheckpointDirLock.acquire(tmp_path)

    assert lock.held and (tmp_path / LOCK_FILE_NAME).read_text().split()[0] == str(os.getpid())
    lock.release()


def test_a_directory_where_no_lock_file_can_be_created_runs_unlocked_with_a_warning(tmp_path, monkeypatch, caplog):
    """A read-only directory without a lock file: nothing can be written there, by this peer or another, so the
    peer runs (its checkpoints will fail and say so) instead of refusing to start."""
    def read_only(path, flags, mode=0o777):
        raise OSError(errno.EROFS if flags & os.O_CREAT else errno.ENOENT, "Read-only file system", str(path))

    monkeypatch.setattr(checkpoint_lock.os, "open", read_only)
    with caplog.at_level(logging.WARNING, logger="peer.checkpoint.lock"):
        lock = CheckpointDirLock.acquire(tmp_path)
    monkeypatch.undo()

    assert not lock.held
    assert [r.getMessage() for r in caplog.records if "running without the lock" in r.getMessage()]
    lock.release()


def test_the_builder_holds_the_lock_until_its_exit_stack_closes(tmp_path):
    config = load_config(flags={"checkpoint_dir": tmp_path / "ckpt", "metrics_port": "off"})
    with ExitStack() as stack:
        builder = PeerBuilder(config, StopRequest(), stack)
        builder.lock_checkpoint_dir()
        builder.lock_checkpoint_dir()  # idempotent: training() takes it again before reading a checkpoint
        with pytest.raises(CheckpointDirInUse):
            CheckpointDirLock.acquire(tmp_path / "ckpt")
    CheckpointDirLock.acquire(tmp_path / "ckpt").release()
