"""Make every child process die with the peer, even when the peer is SIGKILLed.

hivemind forks a DHT process (which starts the p2pd daemon) and averager processes. If the
training process is killed, those would live on as orphans holding ports and memory. A
handler registered with os.register_at_fork starts a watchdog thread in every forked
child: when the child's parent disappears, the child kills its own descendants (p2pd)
and exits. This module must not be imported for its side effects: call install().
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import psutil

POLL_SECONDS = 0.5
PR_SET_PDEATHSIG = 1
_installed = False


def die_with_parent() -> None:
    """From now on, this process gets SIGTERM (a graceful stop) if the process that started it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def install() -> None:
    """Arm the watchdog for all children forked from now on (idempotent)."""
    global _installed
    if not _installed:
        os.register_at_fork(after_in_child=_start_watchdog)
        _installed = True


def _start_watchdog() -> None:
    # The peer's own SIGINT/SIGTERM handlers would run in the child too. Stopping is the parent's
    # job: children ignore Ctrl+C and die plainly on SIGTERM. A terminal sends Ctrl+C to its whole
    # foreground process group, and the p2pd daemon that the DHT process starts turns SIGINT back on
    # (a Go program that asks for it): so children leave that group, and take their own children out
    # of it too. Then only the peer hears Ctrl+C, and it stops the others in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        os.setpgid(0, 0)
    except OSError:  # already a group leader: nothing to leave
        pass
    parent_pid = os.getppid()
    threading.Thread(target=_watch, args=(parent_pid,), name="lifeline", daemon=True).start()


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_SECONDS)
    kill_descendants()
    os._exit(1)


def kill_descendants(pid: int | None = None) -> None:
    """SIGKILL every descendant of `pid` (default: this process), deepest first."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for child in reversed(children):
        try:
            child.kill()
        except psutil.Error:
            pass
