"""Start and supervise `peer` processes: what `peer swarm` and the test harness (peer/testing/) both use.

A Peer is one `peer` command in its own session (so that a kill reaches its DHT, p2pd and averager processes),
whose output goes to a log file or a callback and whose events file is read as it grows. Every wait has a timeout
and says what it waited for; a process that exits while awaited fails the wait at once, with the tail of its log.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Deque, Dict, List, Optional, Sequence, Type, TypeVar, Union

import psutil

from peer.process import lifeline
from peer.process.fork_server import ForkServer, ServedProcess
from peer.process.preforked import ForkedProcess, Preforked
from peer.telemetry.events import Event, Exited, Ready, latest_epoch, read_events

if TYPE_CHECKING:  # torch is imported only where a checkpoint is read: the harness runs without it
    import torch

POLL_SECONDS = 0.1
KILL_WAIT_SECONDS = 10.0
RECENT_OUTPUT_LINES = 200
RELAY_DRAIN_SECONDS = 1.0  # a child that outlived the process may hold its output open: wait no longer
EVENT_WRITERS = ("start", "bootstrap")  # the commands that take --events

E = TypeVar("E", bound=Event)
Process = Union[subprocess.Popen, ForkedProcess, ServedProcess]  # what runs a peer: a new program, or a forked child
T = TypeVar("T")


class PeerFailed(AssertionError):
    """A peer exited, or did not do in time, what a test awaited; the message ends with its log's tail."""


class Peer:
    """One `peer` process (`start`, `bootstrap`, or any other command) of a Swarm, or of `peer swarm`."""

    def __init__(self, name: str, command: str, args: Sequence[str], workdir: Path,
                 env: Optional[Dict[str, str]] = None, prefix: Sequence[str] = (), *, events: bool = True,
                 output: Optional[Callable[[str], None]] = None, events_path: Optional[Path] = None,
                 die_with_parent: bool = False, preforked: Optional[Preforked] = None,
                 fork_server: Optional[ForkServer] = None):
        """
        :param prefix: what the command runs under, such as `ip netns exec NAME` or `taskset -c 0`
        :param events: pass --events (`peer start` and `peer bootstrap` write them; other commands do not)
        :param output: called with each line the process prints, instead of writing <workdir>/<name>.log
        :param die_with_parent: the process gets SIGTERM (a graceful stop) if this one dies
        :param preforked: run the command in this child, forked with torch and hivemind already imported
            (peer/process/preforked.py), instead of a new program; it needs `output`, and starts once
        :param fork_server: run the command in a child that this server forks, with torch and hivemind already
            imported (peer/process/fork_server.py), instead of a new program; not with a prefix. Such a child dies
            with the server, which dies with this process.
        """
        if preforked is not None and (output is None or prefix):
            raise ValueError("a preforked peer relays its output to a callback and runs under no prefix")
        if fork_server is not None and prefix:
            raise ValueError("a peer from the fork server runs under no prefix")
        self.name, self.command, self.args = name, command, list(args)
        self.workdir, self.prefix = workdir, list(prefix)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.events_path = (events_path or workdir / f"{name}.events.jsonl") if events else None
        self.log_path = workdir / f"{name}.log"
        self.checkpoint_dir = workdir / name
        self.output, self.die_with_parent, self.preforked = output, die_with_parent, preforked
        self.fork_server = fork_server
        self.process: Optional[Process] = None
        self._left_behind: List[psutil.Process] = []  # its session's other processes when its exit was collected
        self._exit_seen = False
        self._recent_output: Deque[str] = deque(maxlen=RECENT_OUTPUT_LINES)  # when relayed: for failure messages
        self._relay: Optional[threading.Thread] = None
        self._events: List[Event] = []  # this life's (since the last start)
        self._offset = self._events_size()  # a reused workdir: only what is appended from now on counts

    # --- processes ---------------------------------------------------------------------------

    def start(self) -> "Peer":
        """Start the process (again, after it exited: same arguments, same checkpoint directory)."""
        if self.process is not None and self._poll() is None:
            raise RuntimeError(f"{self.name} is still running")
        self._refresh()
        self._events = []  # the events file is appended to: what an earlier life wrote stays behind the offset
        argv = [self.command, *self.args]
        if self.events_path is not None:
            argv += ["--events", str(self.events_path)]
        if self.preforked is not None:
            self.process = self.preforked.launch(argv, self.env)  # its own session, and it dies with this one
        elif self.fork_server is not None:
            self.process = self.fork_server.launch(argv, self.env, None if self.output else self.log_path)
        else:
            self.process = self._new_program(argv)
        if self.output is not None:
            self._relay = threading.Thread(target=self._relay_output, args=(self.process,),
                                           name=f"{self.name}-output", daemon=True)
            self._relay.start()
        self._left_behind, self._exit_seen = [], False
        return self

    def _new_program(self, argv: List[str]) -> subprocess.Popen:
        """`peer <argv>` as a new program in its own session, its output to the log file or to a pipe."""
        command = [*self.prefix, sys.executable, "-m", "peer", *argv]
        options = dict(stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=os.getcwd(), env=self.env,
                       start_new_session=True, preexec_fn=lifeline.die_with_parent if self.die_with_parent else None)
        if self.output is None:
            with open(self.log_path, "a") as log:
                return subprocess.Popen(command, stdout=log, **options)
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1, **options)

    def _poll(self) -> Optional[int]:
        """Its exit code, or None while it runs.

        Collecting the exit frees its pid, and with it the session id, for any new process (a test suite goes
        through Linux's 32768 pids in minutes: every thread takes one). So the processes its session still
        holds are remembered then, and from then on only they are signalled, never whoever has the pid now.
        """
        code = self.process.poll()
        if code is not None and not self._exit_seen:  # just collected (here or by Popen.send_signal's own poll):
            self._exit_seen = True  # a pid goes back to a new process only after all the others were used
            self._left_behind = session_processes(self.process.pid)
        return code

    def _relay_output(self, process: Process) -> None:
        for line in process.stdout:
            line = line.rstrip("\n")
            self._recent_output.append(line)
            self.output(line)

    @property
    def pid(self) -> int:
        return self._running_process().pid

    def send(self, signum: int) -> None:
        """Send a signal to the peer process alone (SIGTERM or SIGINT: it stops cleanly)."""
        if self.process is not None and self._poll() is None:
            self.process.send_signal(signum)

    def terminate(self) -> None:
        self.send(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the peer and everything it started: a machine that lost power."""
        self._signal_session(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP the peer and its children: a machine that froze (resume() thaws it)."""
        self._signal_session(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_session(signal.SIGCONT)

    def _signal_session(self, signum: int) -> None:
        if self.process is None:
            return
        if self._poll() is None:  # not collected yet (at worst a zombie): its pid and session are still its own
            signal_session(self.process.pid, signum)
            return
        for process in self.session_processes():
            try:
                process.send_signal(signum)  # psutil checks that the pid still names this very process
            except psutil.Error:
                pass

    async def stop(self, grace_seconds: float) -> Optional[int]:
        """SIGTERM (a graceful stop), up to `grace_seconds` for it to exit, then SIGKILL whatever of its session
        is left; its exit code, or None if it had to be killed."""
        self.terminate()
        try:
            code: Optional[int] = await self.exit_code(grace_seconds)
        except PeerFailed:
            code = None
        self.kill()
        return code

    async def exit_code(self, timeout: float) -> int:
        """Wait for the process to exit; its exit code. `timeout` may be math.inf (`peer swarm` waits for good)."""
        process = self._running_process()
        deadline = time.monotonic() + timeout
        while self._poll() is None:
            if time.monotonic() >= deadline:
                raise PeerFailed(f"{self.name} still running after {timeout:.0f}s\n{self.log_tail()}")
            await asyncio.sleep(POLL_SECONDS)
        if self._relay is not None:  # its last lines are relayed before its exit is told
            self._relay.join(RELAY_DRAIN_SECONDS)
        return process.returncode

    async def restart(self, *args: str, timeout: float = 90.0) -> Ready:
        """Start again with the same checkpoint directory once the process has exited, with `args` added from now
        on; its new `ready` event."""
        await self.exit_code(timeout)
        self.args += args
        self.start()
        return await self.ready(timeout)

    def _running_process(self) -> Process:
        if self.process is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.process

    def session_processes(self) -> List[psutil.Process]:
        """Live processes of this peer's session: the peer and everything it started."""
        if self.process is None:
            return []
        if self._poll() is None:
            return session_processes(self.process.pid)
        return [process for process in self._left_behind if _alive(process)]

    # --- events ------------------------------------------------------------------------------

    @property
    def events(self) -> List[Event]:
        """Every event this life of the peer has written so far."""
        self._refresh()
        return list(self._events)

    def _refresh(self) -> None:
        if self.events_path is not None:
            new, self._offset = read_events(self.events_path, self._offset)
            self._events += new

    def _events_size(self) -> int:
        return self.events_path.stat().st_size if self.events_path is not None and self.events_path.is_file() else 0

    async def wait_for(self, kind: Type[E], where: Callable[[E], bool] = lambda event: True, *, timeout: float,
                       what: str = "") -> E:
        """The first event of `kind` (in this life) for which `where` holds."""
        def found() -> Optional[E]:
            return next((event for event in self.events if isinstance(event, kind) and where(event)), None)

        return await self._until(found, timeout, what or f"a {kind.__name__} event")

    async def _until(self, condition: Callable[[], Optional[T]], timeout: float, what: str) -> T:
        deadline = time.monotonic() + timeout
        while True:
            exited = self.process is not None and self._poll() is not None
            result = condition()  # after the exit check: what it wrote just before it exited counts
            if result is not None:
                return result
            if exited:
                raise PeerFailed(f"{self.name} exited with code {self.process.returncode} while awaited for {what}"
                                 f"\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise PeerFailed(f"{self.name}: timed out after {timeout:.0f}s waiting for {what}\n{self.log_tail()}")
            await asyncio.sleep(POLL_SECONDS)

    async def ready(self, timeout: float = 90.0) -> Ready:
        return await self.wait_for(Ready, timeout=timeout, what="it to be ready (a member of the swarm)")

    def _ready(self) -> Ready:
        """Its newest `ready` event (this life's)."""
        ready = [event for event in self.events if isinstance(event, Ready)]
        if not ready:
            raise RuntimeError(f"{self.name} is not ready yet: await ready() first")
        return ready[-1]

    @property
    def run_owner(self) -> Optional[str]:
        """The fingerprint of the run owner it trains with, once ready (what others pass as --run-owner)."""
        return self._ready().run_owner

    @property
    def address(self) -> str:
        """The first multiaddr it listens on, once ready (what others pass as --initial-peers)."""
        ready = self._ready()
        if not ready.multiaddrs:
            raise RuntimeError(f"{self.name} listens on no address")
        return ready.multiaddrs[0]

    @property
    def peer_id(self) -> str:
        """Its peer id, once ready."""
        return self._ready().peer_id

    @property
    def metrics_url(self) -> Optional[str]:
        """Where it serves /metrics and /healthz, once ready (None with --metrics-port off)."""
        return self._ready().metrics_url

    @property
    def short_id(self) -> str:
        """The last 8 characters of its peer id: how `peer status`, the monitor and the metrics name it."""
        return self.peer_id[-8:]

    @property
    def epoch(self) -> int:
        """The newest global epoch it reported (joined at, ended, or downloaded); -1 before it joined."""
        return latest_epoch(self.events)

    async def reach(self, epoch: int, timeout: float) -> int:
        """Wait until it is at `epoch` or later; the epoch it is at."""
        return await self._until(lambda: self.epoch if self.epoch >= epoch else None, timeout,
                                 f"epoch {epoch}")

    async def exited(self, timeout: float) -> Exited:
        """Its `exit` event, once it has exited (a killed peer writes none: this fails, naming its code)."""
        code = await self.exit_code(timeout)
        return await self.wait_for(Exited, timeout=1.0, what=f"an exit event (exit code {code})")

    # --- results -----------------------------------------------------------------------------

    def model_state(self) -> Dict[str, torch.Tensor]:
        """The model tensors of its newest checkpoint."""
        try:
            return load_model_state(self.checkpoint_dir)
        except FileNotFoundError as e:
            raise PeerFailed(f"{self.name}: {e}\n{self.log_tail()}") from None

    def log(self) -> str:
        """Its output so far (its last lines, when relayed): for people, and for failure messages."""
        if self.output is not None:
            return "\n".join(self._recent_output)
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def warnings(self, last: int = 30) -> str:
        """Its last warnings and errors: what a failure message about its rounds or state should show."""
        lines = [line for line in self.log().splitlines() if " WARN " in line or " ERROR " in line]
        return f"--- the last warnings of {self.name} ---\n" + "\n".join(lines[-last:])

    def log_tail(self, characters: int = 3000) -> str:
        source = f"the output of {self.name}" if self.output is not None else self.log_path
        return f"--- the end of {source} ---\n{self.log()[-characters:]}"




async def until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Await something that no event tells (a metrics endpoint, a file): the first truthy value of `condition`."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


def signal_session(session_id: int, signum: int) -> None:
    """Send `signum` to the leader of a session, then to every other live process of it, one by one: a peer's
    children lead process groups of their own, out of a terminal's Ctrl+C (peer/process/lifeline.py), so signalling the
    peer's process group would reach the peer alone."""
    for pid in dict.fromkeys([session_id, *(process.pid for process in session_processes(session_id))]):
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def session_processes(session_id: int) -> List[psutil.Process]:
    """Live processes of a session (a process started with start_new_session leads the session of its pid)."""
    alive = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == session_id and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return alive


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE  # is_running: the same process
    except psutil.Error:
        return False


def load_model_state(checkpoint_dir: Path) -> Dict[str, torch.Tensor]:
    """The model tensors of the newest checkpoint in a checkpoint directory (FileNotFoundError if none). It only
    reads, so it may run beside the peer that writes there."""
    from peer.checkpoint.store import read_newest

    loaded, _ = read_newest(Path(checkpoint_dir))
    if loaded is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoint_dir}")
    return loaded.state["model"]
