"""Local checkpoints that survive crashes, full disks and bit rot.

A checkpoint is written to a temporary file in the target directory, flushed and
fsynced, renamed into place with os.replace, and only then is the directory fsynced and
old checkpoints pruned. A crash at any point therefore leaves every earlier checkpoint
intact. Each file carries its own length and sha256, so a truncated or corrupted file
is detected on load, logged, and skipped in favour of the next older one. A write that fails
(a full or read-only disk) removes its temp file and raises CheckpointError; save() creates a
directory deleted under it again, so the next save can succeed.

File layout (all integers little-endian):

    offset  size  field
    0       8     magic b"SWRMCKPT"
    8       4     format version (uint32, currently 1)
    12      8     payload length in bytes (uint64)
    20      32    sha256 of the payload
    52      n     payload: torch.save() of the state dict

Names are ``checkpoint-<sequence>-epoch<global epoch>.pt``; the sequence number only
grows, and recency is decided by it, never by modification times.

This module must not decide when to checkpoint, what goes into a checkpoint, or move
tensors between devices: that is the training loop's job. One store writes to a
directory at a time: a new store deletes temp files it finds there, including those of
a writer that is still running (a peer locks its directory: peer/checkpoint/lock.py).
"""
from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import re
import secrets
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

MAGIC = b"SWRMCKPT"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, sha256
HEADER_SIZE_BYTES = _HEADER.size

_NAME_RE = re.compile(r"^checkpoint-(\d{6,})-epoch(\d{6,})\.pt$")
_TEMP_PREFIX = ".checkpoint-"
_TEMP_SUFFIX = ".tmp"


class CheckpointError(RuntimeError):
    """The store could not write: the message names the path and the cause."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    """The checkpoint file the state was read from."""
    state: dict
    """Exactly what was passed to save(), with every tensor on the CPU."""


def _first_non_finite(value, where: str = "state") -> Optional[str]:
    """Where the first floating-point tensor holding NaN or Inf sits in a nested state, or None."""
    if isinstance(value, torch.Tensor):
        return where if value.is_floating_point() and not bool(torch.isfinite(value).all()) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _first_non_finite(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


class _Corrupt(Exception):
    """A checkpoint file failed verification; the message is the reason."""


class CheckpointStore:
    """Saves and loads checkpoints in one directory, keeping the newest `keep`."""

    def __init__(self, directory: Path, keep: int = 3) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1 (got {keep!r}); use 1 to keep only the newest checkpoint")
        self.directory = Path(directory)
        self.keep = keep
        self._lock = threading.Lock()  # the training loop may save from a background thread
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {self.directory}: {_describe(exc)}") from exc
        self._remove_stale_temp_files()

    def list(self) -> List[Path]:
        """Complete checkpoints (by name; contents are verified only on load), oldest first."""
        return [path for _, path in self._scan()]

    def save(self, state: dict, global_epoch: int) -> Path:
        """Writes `state` durably as the newest checkpoint and returns its path.

        Raises CheckpointError if it cannot be written; earlier checkpoints are then untouched.
        """
        if not isinstance(state, dict):
            raise TypeError(f"checkpoint state must be a dict (got {type(state).__name__})")
        if isinstance(global_epoch, bool) or not isinstance(global_epoch, int) or global_epoch < 0:
            raise ValueError(f"global_epoch must be an integer >= 0 (got {global_epoch!r})")
        bad = _first_non_finite(state)
        if bad is not None:  # resuming from it would only carry the divergence on
            raise CheckpointError(f"refusing to write a checkpoint holding NaN or Inf (in {bad}); "
                                  f"the earlier checkpoints are kept")
        with self._lock:
            existing = self._scan_for_save()
            sequence = existing[-1][0][0] + 1 if existing else 1
            final_path = self.directory / f"checkpoint-{sequence:06d}-epoch{global_epoch:06d}.pt"
            payload = _serialize(state, final_path)
            header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest())
            self._write_atomically(final_path, header, payload)
            self._prune()
        logger.info("saved checkpoint %s (%d bytes)", final_path, HEADER_SIZE_BYTES + len(payload))
        return final_path

    def load_latest(self) -> Optional[LoadedCheckpoint]:
        """The newest checkpoint that reads back and verifies, or None if there is none.

        Damaged files are skipped with a warning and left in place for inspection.
        """
        for _, path in reversed(self._scan()):
            try:
                state = _read_verified(path)
            except _Corrupt as exc:
                logger.warning("skipping checkpoint %s: %s", path, exc)
                continue
            logger.info("loaded checkpoint %s", path)
            return LoadedCheckpoint(path=path, state=state)
        return None

    def _scan(self) -> List[Tuple[Tuple[int, int], Path]]:
        """((sequence, epoch), path) of complete checkpoints, oldest first; other files are ignored."""
        found = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                match = _NAME_RE.match(entry.name)
                if match and entry.is_file():
                    found.append(((int(match.group(1)), int(match.group(2))), Path(entry.path)))
        # Numeric sort, so that sequence 1000000 still sorts after 999999.
        found.sort(key=lambda item: item[0])
        return found

    def _scan_for_save(self) -> List[Tuple[Tuple[int, int], Path]]:
        # A directory deleted under a running peer is recreated: the peer keeps checkpointing.
        try:
            if not self.directory.is_dir():
                logger.warning("checkpoint directory %s is gone; creating it again", self.directory)
                self.directory.mkdir(parents=True, exist_ok=True)
            return self._scan()
        except OSError as exc:
            raise CheckpointError(f"cannot use checkpoint directory {self.directory}: {_describe(exc)}") from exc

    def _write_atomically(self, final_path: Path, header: bytes, payload: memoryview) -> None:
        # The random token keeps two attempts from ever sharing a temp file.
        temp_path = self.directory / f"{_TEMP_PREFIX}{final_path.name}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
        try:
            fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with open(fd, "wb") as file:
                file.write(header)
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())  # data must be on disk before the rename makes it visible
            os.replace(temp_path, final_path)
        except OSError as exc:
            _remove_quietly(temp_path)
            raise CheckpointError(f"cannot write checkpoint {final_path}: {_describe(exc)}") from exc
        try:
            _fsync_directory(self.directory)
        except OSError as exc:
            # The file is in place but its name may not survive a power loss, so report the
            # failure and skip pruning: older checkpoints stay as the fallback.
            raise CheckpointError(
                f"wrote checkpoint {final_path} but cannot fsync its directory: {_describe(exc)}"
            ) from exc

    def _prune(self) -> None:
        try:
            complete = self._scan()
        except OSError as exc:  # the new checkpoint is written; pruning can wait for the next one
            logger.warning("cannot list %s to remove old checkpoints: %s", self.directory, _describe(exc))
            return
        for _, path in complete[: -self.keep]:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                # The new checkpoint is safe; a leftover old one only costs disk space.
                logger.warning("cannot remove old checkpoint %s: %s", path, _describe(exc))

    def _remove_stale_temp_files(self) -> None:
        with os.scandir(self.directory) as entries:
            stale = [Path(e.path) for e in entries if e.name.startswith(_TEMP_PREFIX) and e.name.endswith(_TEMP_SUFFIX)]
        for path in stale:
            logger.warning("removing temp file %s left by an interrupted checkpoint write", path)
            _remove_quietly(path)


def _serialize(state: dict, final_path: Path) -> memoryview:
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
    except Exception as exc:
        raise CheckpointError(f"cannot serialize checkpoint {final_path}: {_describe(exc)}") from exc
    # Refuse now what load_latest() would refuse later: a checkpoint that cannot be loaded
    # with weights_only=True is lost. Loading onto the meta device reads no tensor data.
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True, map_location="meta")
    except Exception as exc:
        raise CheckpointError(
            f"cannot save checkpoint {final_path}: state holds a type that weights_only loading rejects: "
            f"{_first_line(exc)}"
        ) from exc
    return buffer.getbuffer()


def _read_verified(path: Path) -> dict:
    try:
        with open(path, "rb") as file:
            header = file.read(HEADER_SIZE_BYTES)
            if len(header) < HEADER_SIZE_BYTES:
                raise _Corrupt(f"file is {len(header)} bytes, shorter than the {HEADER_SIZE_BYTES}-byte header")
            magic, version, length, digest = _HEADER.unpack(header)
            if magic != MAGIC:
                raise _Corrupt(f"bad magic {magic!r} (expected {MAGIC!r}); not a checkpoint or damaged header")
            if version != FORMAT_VERSION:
                raise _Corrupt(f"unsupported format version {version} (this build reads {FORMAT_VERSION})")
            payload = file.read(length)
            trailing = len(file.read(1))
    except OSError as exc:
        raise _Corrupt(f"cannot read: {_describe(exc)}") from exc
    if len(payload) < length:
        raise _Corrupt(f"truncated: payload is {len(payload)} bytes, header says {length}")
    if trailing:
        raise _Corrupt(f"file is longer than the {length}-byte payload its header declares")
    if hashlib.sha256(payload).digest() != digest:
        raise _Corrupt("sha256 of the payload does not match the header (corrupted)")
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise _Corrupt(f"verified but torch.load failed: {_first_line(exc)}") from exc
    if not isinstance(state, dict):
        raise _Corrupt(f"payload is a {type(state).__name__}, not a dict")
    return state


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems cannot fsync a directory at all; there is nothing more to do there.
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove temp file %s: %s", path, _describe(exc))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")
