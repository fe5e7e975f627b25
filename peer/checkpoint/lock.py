"""One peer per checkpoint directory: an OS lock held for as long as the peer process lives.

Two peers started on the same --checkpoint-dir would resume from the same file and then prune
each other's checkpoints. The first peer takes an exclusive `fcntl.flock` on `<dir>/peer.lock`
and keeps that file open until it stops; a second finds the lock held and stops with exit code 2,
naming the directory and the first peer's pid (written into the file only for that message).

Why there is no stale-lock handling: the kernel holds a flock for an open file, not for the
file's existence, and drops it when the last descriptor of that open file is closed, which
happens when the holder exits, however it exits (SIGKILL and crashes included). A lock file left
by a dead peer is therefore just a file: the next peer locks it at once and writes its own pid.
There is no "is that pid still alive?" guess to race with a reused pid, and two peers starting
at the same instant cannot both win. The file is never deleted: a peer that deleted it on exit
would let a newcomer lock a fresh file while a third peer still waits on the old one.

Forked children (hivemind's averagers, DataLoader workers) inherit every descriptor, and with
it the lock: a SIGKILLed peer's lock would outlive it until its children notice
(peer/process/lifeline.py). Each child closes its copy right after the fork (os.register_at_fork), so
the lock lives exactly as long as the peer process. Children started with exec never see it:
Python opens the file close-on-exec.

A checkpoint directory deleted mid-run takes its lock file with it; the store recreates the
directory for the next checkpoint, but not the lock (this peer still holds the deleted file's).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional, Set

from peer.checkpoint.store import CheckpointError
from peer.exit_codes import BadInput

logger = logging.getLogger(__name__)

LOCK_FILE_NAME = "peer.lock"
HOLDER_READ_SECONDS = 1.0
"""How long a refused peer re-reads the holder's pid while it looks unwritten or dead: a peer that has
just won the lock writes its pid a moment later, over the pid of the dead peer before it."""

_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)
_held_fds: Set[int] = set()  # closed in every forked child (see the module docstring)
_fork_hook_installed = False


class CheckpointDirInUse(BadInput):
    """Another live process holds the checkpoint directory's lock (exit code 2)."""


class CheckpointDirLock:
    """The lock of one checkpoint directory, held from acquire() until release()."""

    def __init__(self, directory: Path, fd: Optional[int]) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE_NAME
        self._fd = fd

    @property
    def held(self) -> bool:
        """False when the directory is not writable and the peer runs without a lock (acquire() says why)."""
        return self._fd is not None

    @classmethod
    def acquire(cls, directory: Path) -> "CheckpointDirLock":
        """Lock `directory` (created if missing) for this process, without waiting for a holder to let go.

        :raises CheckpointDirInUse: another process holds it; the message names the directory, its pid and the fix
        :raises CheckpointError: the directory cannot be created (as CheckpointStore would report it)
        """
        _install_fork_hook()
        directory = Path(directory).absolute()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {directory}: {exc.strerror or exc}") from exc
        path = directory / LOCK_FILE_NAME
        fd = _open(path)
        if fd is None:
            return cls(directory, None)
        deadline = time.monotonic() + HOLDER_READ_SECONDS
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _read_holder(fd)
                if _looks_current(holder) or time.monotonic() >= deadline:
                    os.close(fd)
                    raise CheckpointDirInUse(_in_use_message(directory, holder)) from None
                time.sleep(0.05)
            except OSError as exc:  # a filesystem without locks (some network mounts)
                os.close(fd)
                logger.warning(f"cannot lock {path}: {exc.strerror}; running without the lock that keeps a "
                               f"second peer out of this --checkpoint-dir")
                return cls(directory, None)
        _held_fds.add(fd)
        _write_holder(fd, path)
        return cls(directory, fd)

    def release(self) -> None:
        """Unlock and close; idempotent. Exiting the process releases the lock just as well."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _held_fds.discard(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _open(path: Path) -> Optional[int]:
    """A descriptor of the lock file, created if missing; None if the directory cannot hold one."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno not in _UNWRITABLE:
            raise
        create_error = exc
    try:  # a directory we may not write to can still hold a lock file from an earlier run; flock needs no write
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        pass
    # Nothing can be written there now, so a second peer could not prune anything either: training goes on,
    # and each checkpoint that fails says so (peer/runtime/trainer.py).
    logger.warning(f"cannot create the lock file {path}: {create_error.strerror}; running without the lock "
                   f"that keeps a second peer out of this --checkpoint-dir")
    return None


def _write_holder(fd: int, path: Path) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError as exc:  # read-only or full: the lock holds all the same, only the message loses the pid
        logger.debug(f"cannot write this peer's pid into {path}: {exc}")


def _read_holder(fd: int) -> tuple:
    """(pid or None, host or None) as the holder wrote them."""
    try:
        fields = os.pread(fd, 256, 0).decode(errors="replace").split()
    except OSError:
        return None, None
    pid = int(fields[0]) if fields and fields[0].isdigit() else None
    return pid, (fields[1] if len(fields) > 1 else None)


def _looks_current(holder: tuple) -> bool:
    """Whether the pid read can be the holder's: written, and alive if it is a pid of this host."""
    pid, host = holder
    if pid is None:
        return False
    if host != socket.gethostname():
        return True  # another machine's pid (a shared filesystem): nothing to check it against
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_use_message(directory: Path, holder: tuple) -> str:
    pid, host = holder
    who = "pid unknown" if pid is None else f"pid {pid}" + ("" if host in (None, socket.gethostname()) else
                                                            f" on {host}")
    return (f"--checkpoint-dir {directory} is in use by another peer ({who}): two peers on one directory "
            f"resume from the same checkpoint and prune each other's; stop that peer, or give this one its own "
            f"directory with --checkpoint-dir")


def _install_fork_hook() -> None:
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=_close_in_child)
        _fork_hook_installed = True


def _close_in_child() -> None:
    # Closing the child's copy leaves the lock with the parent: a flock is dropped by LOCK_UN or by the
    # last close of the open file, and the parent's descriptor stays open.
    for fd in list(_held_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()


def running_peer(directory: Path) -> Optional[int]:
    """The pid of the live peer that holds `directory`'s lock (0 if it wrote none); None if no peer holds it.

    For commands that control a running peer (peer pause, peer resume): it takes the lock for an instant
    to find out, and lets go at once."""
    path = Path(directory).absolute() / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, _ = _read_holder(fd)
        return pid or 0
    except OSError:  # a filesystem without locks: nothing tells whether a peer runs there
        return None
    finally:
        os.close(fd)
    return None
