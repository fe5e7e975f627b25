"""`peer` processes forked from one parent that has imported torch and hivemind: what `peer swarm` runs on the CPU.

A peer started as a new program imports torch and hivemind itself: about 5 of the 8-10 CPU seconds it takes to be
ready, and about 180 MiB of memory that only it uses (torch's operator registry, Python's objects), in each of its
processes. N peers forked from one parent that has imported them share those pages (copy-on-write) and skip the
import, so N peers on one machine join sooner and cost less memory each.

A fork copies only the thread that calls it, and the locks other threads held stay held in the child. So every
child is forked at once, before the parent starts its event loop or any thread of its own, and then waits for its
command line on a pipe: `peer swarm` learns peer 0's address only once peer 0 is up. The parent is each child's
parent, so it collects their exit codes itself (ForkedProcess, what the launcher uses in place of a Popen).
Not for CUDA: a process that has touched a GPU cannot fork a working child.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import sys
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

from peer.process import lifeline
from peer.process.fork_sharing import freeze_before_fork

COMMAND_LIMIT_BYTES = 1 << 20

Command = Callable[[List[str]], int]  # runs `peer <argv>` in this process: its exit code


class ForkedProcess:
    """A forked child, as much of subprocess.Popen as the launcher uses: pid, returncode, poll, send_signal,
    stdout (its output)."""

    def __init__(self, pid: int, stdout: io.TextIOBase):
        self.pid, self.stdout = pid, stdout
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not collected: the pid is still this child's
            os.kill(self.pid, signum)


class Preforked:
    """A child forked now, that waits for its command line (launch), runs it with `command`, and exits with its code;
    or exits at once (discard).

    Its output (stdout and stderr) goes to a pipe the parent reads as `process.stdout`. It leads a session of its
    own, as a peer started with start_new_session does, and gets SIGTERM (a graceful stop) if the parent dies.
    """

    _parent_ends: Set[int] = set()  # every child's pipe ends that the parent keeps: no other child may hold them

    def __init__(self, command: Command) -> None:
        command_read, self._command_write = os.pipe()
        output_read, output_write = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # what is buffered now would be written twice
            stream.flush()
        parent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            # a sibling's command pipe held open here would never tell that sibling it was discarded
            for descriptor in (*Preforked._parent_ends, self._command_write, output_read):
                os.close(descriptor)
            _run_child(command, parent_pid, command_read, output_write)  # never returns
        os.close(command_read)
        os.close(output_write)
        Preforked._parent_ends.update((self._command_write, output_read))
        self.process = ForkedProcess(pid, open(output_read, "r", buffering=1, errors="replace"))
        self._used = False

    def _release_command_pipe(self) -> None:
        self._used = True
        Preforked._parent_ends.discard(self._command_write)

    def launch(self, argv: Sequence[str], env: Dict[str, str]) -> ForkedProcess:
        """Run `argv` in the child with its `command`, with `env` as its environment and this directory."""
        if self._used:
            raise RuntimeError("a preforked child runs one command: fork another")
        self._release_command_pipe()
        payload = json.dumps({"argv": list(argv), "env": env, "cwd": os.getcwd()}).encode()
        if len(payload) > COMMAND_LIMIT_BYTES:
            raise ValueError(f"the command line for a preforked peer is {len(payload)} bytes; at most "
                             f"{COMMAND_LIMIT_BYTES} fit")
        with os.fdopen(self._command_write, "wb") as pipe:
            pipe.write(payload)
        return self.process

    def discard(self) -> None:
        """The child was not needed: it exits without running anything, and is collected."""
        if self._used:
            return
        self._release_command_pipe()
        os.close(self._command_write)  # the child reads an empty command and exits 0
        self.process.returncode = os.waitstatus_to_exitcode(os.waitpid(self.process.pid, 0)[1])
        Preforked._parent_ends.discard(self.process.stdout.fileno())
        self.process.stdout.close()


def prefork(count: int, command: Command) -> List[Preforked]:
    """`count` children forked now, each to run one command line with `command`: call this once what the children
    should share is imported, and before starting any thread or event loop."""
    if threading.active_count() > 1:
        raise RuntimeError(f"{threading.active_count()} Python threads run: fork the peers before starting any")
    freeze_before_fork()
    return [Preforked(command) for _ in range(count)]


def _run_child(command: Command, parent_pid: int, command_read: int, output_write: int) -> None:
    """The child: read the command, run it as `peer` would, and exit with its code without returning into the
    parent's stack."""
    code = 1
    try:
        os.setsid()
        lifeline.die_with_parent()
        if os.getppid() != parent_pid:  # it died before the line above: no signal will come
            os._exit(1)
        redirect_output(output_write)
        with os.fdopen(command_read, "rb") as pipe:
            payload = pipe.read(COMMAND_LIMIT_BYTES + 1)
        if not payload:  # discarded
            os._exit(0)
        code = run_launch(command, json.loads(payload))
    except BaseException:  # noqa: B036 -- whatever happens, the child must not return into the parent's code
        traceback.print_exc()
    finally:
        exit_child(code)


def run_launch(command: Command, launch: Dict[str, Any]) -> int:
    """Run a launch's command line (`argv`) with `command`, in its directory (`cwd`) and environment (`env`), as
    the one program of this process; its exit code."""
    os.chdir(launch["cwd"])
    os.environ.clear()
    os.environ.update(launch["env"])
    sys.argv = ["peer", *launch["argv"]]
    return command(launch["argv"])


def redirect_output(output_write: int) -> None:
    """Standard input from /dev/null, standard output and error to `output_write` (closed here), line by line."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(output_write, 1)
    os.dup2(output_write, 2)
    os.close(output_write)
    for stream in (sys.stdout, sys.stderr):  # a line at a time, as PYTHONUNBUFFERED gives a started peer
        stream.reconfigure(line_buffering=True, write_through=True)


def exit_child(code: int) -> None:
    """Leave as the interpreter would at exit (threading's exit hooks, such as the thread pools' stop, then a join
    of every thread that is not a daemon; then the exit handlers: multiprocessing stops its children, logging
    flushes), but without unwinding into the parent's frames, which the child inherited and must never run."""
    try:
        threading._shutdown()  # what Py_FinalizeEx calls first
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)
