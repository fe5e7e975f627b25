"""`peer` commands forked on request from one process that has imported torch and hivemind: the test harness's peers.

A peer started as a new program spends about 5 of its 8-10 CPU seconds to `ready` importing torch and hivemind
(peer/process/preforked.py). `peer swarm` forks its peers from one parent that has imported them, but it forks them
all up front, before it starts a thread: a fork copies only the calling thread, and locks held by the others stay
held in the child. A test process runs threads and event loops and starts peers one at a time, so it cannot fork
them itself. It asks a fork server instead: a program of its own (`python -m peer.cli.fork_server SOCKET`) that
imports what a peer needs, starts no thread, and for each request forks a child that runs the command line as
`peer` would.

A request comes over a Unix socket with the descriptor the child's output goes to (a log file, or a pipe the
harness reads). Its connection stays open: the server answers with the child's pid, and, once it has collected the
child (the child is the server's, not the requester's), with its exit code. The server exits when its requester
closes its standard input or dies, and its children get SIGTERM (a graceful stop) when it dies.
"""
from __future__ import annotations

import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from peer.process import lifeline, preforked
from peer.process.fork_sharing import freeze_before_fork

SERVER_MODULE = "peer.cli.fork_server"  # its program: it imports the CLI, which this layer may not
START_TIMEOUT_SECONDS = 120.0  # its imports, on a loaded machine
REQUEST_TIMEOUT_SECONDS = 30.0
REAP_SECONDS = 0.05  # how often the server collects exited children between requests
HEADER = struct.Struct("!I")  # a request's length, before its JSON
LOST_EXIT_CODE = -signal.SIGKILL  # a child whose server died before telling its code (the child got SIGTERM)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # read when torch is imported: the child sets them itself


class ServedProcess:
    """A child of the fork server, as much of subprocess.Popen as the launcher uses: pid, returncode, poll,
    send_signal, stdout (its output, when it goes to a pipe)."""

    def __init__(self, pid: int, connection: socket.socket, stdout: Optional[io.TextIOBase], received: bytes = b""):
        self.pid, self.stdout = pid, stdout
        self.returncode: Optional[int] = None
        self._connection = connection
        self._received = received  # the start of the line with its exit code

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            while not self._received.endswith(b"\n"):
                try:
                    data = self._connection.recv(64)
                except BlockingIOError:
                    return None
                if not data:
                    self.returncode = LOST_EXIT_CODE
                    break
                self._received += data
            else:
                self.returncode = int(self._received)
            self._connection.close()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not reported collected: the pid is still this child's
            os.kill(self.pid, signum)


class ForkServer:
    """The requester's side: starts the server on the first launch, and stops it on close()."""

    def __init__(self) -> None:
        self._process: Optional[subprocess.Popen] = None
        self._directory: Optional[Path] = None

    @property
    def socket_path(self) -> Path:
        assert self._directory is not None
        return self._directory / "socket"

    def launch(self, argv: Sequence[str], env: Dict[str, str], output: Optional[Path] = None) -> ServedProcess:
        """Run `peer <argv>` in a child forked by the server, with `env` as its environment and this directory;
        its output is appended to `output`, or else goes to a pipe (`stdout` of what is returned)."""
        self._start()
        payload = json.dumps({"argv": list(argv), "env": env, "cwd": os.getcwd()}).encode()
        if output is not None:
            write_end, stdout = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), None
        else:
            read_end, write_end = os.pipe()
            stdout = open(read_end, "r", buffering=1, errors="replace")
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(REQUEST_TIMEOUT_SECONDS)
            connection.connect(str(self.socket_path))
            socket.send_fds(connection, [HEADER.pack(len(payload)) + payload], [write_end])
            line, received = _read_line(connection)
        except BaseException:
            connection.close()
            if stdout is not None:
                stdout.close()
            raise
        finally:
            os.close(write_end)  # the child has its own copy
        connection.setblocking(False)
        return ServedProcess(int(line), connection, stdout, received)

    def _start(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                return
            raise RuntimeError(f"the fork server exited with {self._process.returncode}:\n{self._log()}")
        # a Unix socket's path holds at most 107 bytes: a short directory of its own, not the test's
        self._directory = Path(tempfile.mkdtemp(prefix="swarmtrain-forks-"))
        env = {name: value for name, value in os.environ.items() if name not in THREAD_VARIABLES}
        with open(self._directory / "server.log", "w") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", SERVER_MODULE, str(self.socket_path)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
                preexec_fn=lifeline.die_with_parent)
        ready, _, _ = select.select([self._process.stdout], [], [], START_TIMEOUT_SECONDS)
        if not ready or self._process.stdout.readline() != b"ready\n":
            self.close()
            raise RuntimeError(f"the fork server was not ready within {START_TIMEOUT_SECONDS:.0f}s:\n{self._log()}")

    def _log(self) -> str:
        path = self._directory / "server.log" if self._directory is not None else None
        return path.read_text(errors="replace")[-4000:] if path is not None and path.exists() else ""

    def close(self) -> None:
        """Stop the server; the children it still has get SIGTERM."""
        if self._process is not None:
            self._process.stdin.close()  # it exits at once
            try:
                self._process.wait(REQUEST_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(REQUEST_TIMEOUT_SECONDS)
            self._process.stdout.close()
            self._process = None
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None


# --- the server ---------------------------------------------------------------------------------


def serve(socket_path: str, command: preforked.Command) -> None:
    """Fork a child for each request on `socket_path` that runs its command line with `command`, until standard
    input closes. Call it once what the children should share is imported, and with no thread but this one."""
    lifeline.die_with_parent()
    freeze_before_fork()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    children: Dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], REAP_SECONDS)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return  # the requester is gone: the children get SIGTERM as this process exits
        if listener in readable:
            connection, _ = listener.accept()
            try:
                _fork_one(connection, listener, children, command)
            except (OSError, ValueError) as e:  # a broken request harms no other child
                print(f"fork server: refused a request: {e!r}", file=sys.stderr, flush=True)
                connection.close()
        _collect(children)


def _fork_one(connection: socket.socket, listener: socket.socket, children: Dict[int, socket.socket],
              command: preforked.Command) -> None:
    connection.settimeout(REQUEST_TIMEOUT_SECONDS)
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 1)
    if len(fds) != 1 or len(data) < HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a request needs a length and one descriptor; got {len(data)} bytes, {len(fds)} fds")
    (length,) = HEADER.unpack_from(data)
    body = data[HEADER.size:]
    while len(body) < length:
        chunk = connection.recv(length - len(body))
        if not chunk:
            os.close(fds[0])
            raise ValueError("the request was cut short")
        body += chunk
    launch = json.loads(body)
    pid = os.fork()
    if pid == 0:
        for other in (listener, connection, *children.values()):
            other.close()  # a child must not hold its siblings' connections open
        _run_child(launch, fds[0], command)  # never returns
    os.close(fds[0])
    connection.sendall(f"{pid}\n".encode())
    children[pid] = connection


def _collect(children: Dict[int, socket.socket]) -> None:
    """Tell each exited child's requester its exit code."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if not pid:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the requester closed it: nobody waits for this code
            connection.close()


def _run_child(launch: Dict[str, Any], output: int, command: preforked.Command) -> None:
    code = 1
    try:
        os.setsid()
        lifeline.die_with_parent()  # the server: it dies with the requester
        preforked.redirect_output(output)
        code = preforked.run_launch(command, launch)
    except BaseException:  # noqa: B036 -- whatever happens, the child must not return into the server's loop
        traceback.print_exc()
    finally:
        preforked.exit_child(code)


def _read_line(connection: socket.socket) -> Tuple[bytes, bytes]:
    """The first line the server sent (the child's pid), and what came after it."""
    received = b""
    deadline = time.monotonic() + REQUEST_TIMEOUT_SECONDS
    while b"\n" not in received:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the fork server did not answer within {REQUEST_TIMEOUT_SECONDS:.0f}s")
        chunk = connection.recv(64)
        if not chunk:
            raise ConnectionError("the fork server closed the connection without starting the command")
        received += chunk
    line, _, rest = received.partition(b"\n")
    return line, rest
