"""Durable file writes and the errors of the checkpoint modules, shared by the store and its formats.

This module must not know what a checkpoint holds: it writes, syncs and removes files, and words errors.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """The store could not write: the message names the path and the cause."""


class Damaged(Exception):
    """A checkpoint, or a part of one, failed verification; the message is the reason."""


def write_synced(path: Path, *chunks: bytes) -> None:
    """Create `path` (it must not exist) holding `chunks`, flushed and fsynced before it returns.

    :raises OSError: the file could not be created, written or synced; a partial file may remain
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with open(fd, "wb") as file:
        for chunk in chunks:
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())  # data must be on disk before a rename makes it visible


def read_bounded(path: Path, limit_bytes: int) -> bytes:
    """The whole file, or Damaged if it is longer than `limit_bytes` (a damaged length must not exhaust memory)."""
    try:
        with open(path, "rb") as file:
            data = file.read(limit_bytes + 1)
    except OSError as exc:
        raise Damaged(f"cannot read {path.name}: {describe(exc)}") from exc
    if len(data) > limit_bytes:
        raise Damaged(f"{path.name} is longer than {limit_bytes} bytes")
    return data


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems cannot fsync a directory at all; there is nothing more to do there.
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def remove_quietly(path: Path) -> None:
    """Remove a file or a directory tree; a failure only costs disk space, so it is logged, not raised."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove %s: %s", path, describe(exc))


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return first_line(exc)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
