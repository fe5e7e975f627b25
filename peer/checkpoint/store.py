"""Local checkpoints that survive crashes, full disks and bit rot, with weights other tools read.

A checkpoint is a directory ``checkpoint-<sequence>-epoch<global epoch>/`` holding the model's weights as
safetensors, the rest of the state beside them and an index with each part's length and sha256
(peer/checkpoint/parts.py documents the layout). It is built in a temporary directory beside its final
name, every part flushed and fsynced, the temporary directory fsynced, renamed into place with
os.replace, and only then is the checkpoint directory fsynced and old checkpoints pruned. A crash at any
point therefore leaves every earlier checkpoint intact. A truncated, corrupted or missing part is detected
on load, logged, and the checkpoint skipped in favour of the next older one. A write that fails (a full
or read-only disk) removes its temporary directory and raises CheckpointError; save() creates a directory
deleted under it again, so the next save can succeed.

A checkpoint of the format before this one, a single framed file ``checkpoint-<sequence>-epoch<epoch>.pt``
(peer/checkpoint/framed.py), still loads, and the two formats are ordered and pruned as one sequence. The
sequence number only grows, and recency is decided by it, never by modification times.

This module must not decide when to checkpoint, what goes into a checkpoint, or move tensors between
devices: that is the training loop's job. One store writes to a directory at a time: a new store deletes
temporary files it finds there, including those of a writer that is still running (a peer locks its
directory: peer/checkpoint/lock.py). read_newest() only reads, so it may run beside a peer (`peer export`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from peer.checkpoint import framed
from peer.checkpoint.files import (
    CheckpointError,
    Damaged,
    describe,
    fsync_directory,
    remove_quietly,
)
from peer.checkpoint.parts import read_parts, write_parts

logger = logging.getLogger(__name__)

HEADER_SIZE_BYTES = framed.HEADER_SIZE_BYTES

_NAME_RE = re.compile(r"^checkpoint-(\d{6,})-epoch(\d{6,})(\.pt)?$")  # with .pt: a single framed file
_TEMP_PREFIX = ".checkpoint-"
_TEMP_SUFFIX = ".tmp"
_RESCANS = 3  # a peer pruning the checkpoint a reader was reading: read its newer ones instead

__all__ = ["CheckpointError", "CheckpointStore", "DamagedCheckpoint", "LoadedCheckpoint", "read_newest"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    path: Path
    """The checkpoint the state was read from: a directory, or a file of the earlier format."""
    state: dict
    """Exactly what was passed to save(), with every tensor on the CPU."""
    global_epoch: Optional[int] = None
    """The global epoch in its name."""
    sha256: Optional[str] = None
    """The digest that pins its contents: of its index (which holds every part's), or of the whole earlier-format
    file."""


@dataclass(frozen=True)
class DamagedCheckpoint:
    path: Path
    reason: str


def read_newest(directory: Path) -> Tuple[Optional[LoadedCheckpoint], List[DamagedCheckpoint]]:
    """The newest checkpoint in `directory` that reads back and verifies (None if none does), and the newer ones
    skipped as damaged. It only reads: no lock, no cleanup, no directory created.

    :raises OSError: the directory cannot be listed
    """
    damaged: List[DamagedCheckpoint] = []
    for _ in range(_RESCANS):
        vanished = False
        damaged = []
        for (_, epoch), path in reversed(_scan(directory)):
            try:
                state, digest = _read(path)
            except Damaged as exc:
                if not os.path.lexists(path):  # pruned by the peer writing there, while it was read
                    vanished = True
                    continue
                damaged.append(DamagedCheckpoint(path, str(exc)))
                continue
            return LoadedCheckpoint(path=path, state=state, global_epoch=epoch, sha256=digest), damaged
        if not vanished:
            break
    return None, damaged


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
            raise CheckpointError(f"cannot create checkpoint directory {self.directory}: {describe(exc)}") from exc
        self._remove_stale_temp_files()

    def list(self) -> List[Path]:
        """Complete checkpoints (by name; contents are verified only on load), oldest first."""
        return [path for _, path in _scan(self.directory)]

    def save(self, state: dict, global_epoch: int) -> Path:
        """Writes `state` durably as the newest checkpoint and returns its path (a directory).

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
            final_path = self.directory / f"checkpoint-{sequence:06d}-epoch{global_epoch:06d}"
            size = self._write_atomically(final_path, state, global_epoch)
            self._prune()
        logger.info("saved checkpoint %s (%d bytes)", final_path, size)
        return final_path

    def load_latest(self) -> Optional[LoadedCheckpoint]:
        """The newest checkpoint that reads back and verifies, or None if there is none.

        Damaged checkpoints are skipped with a warning and left in place for inspection.
        """
        loaded, damaged = read_newest(self.directory)
        for skipped in damaged:
            logger.warning("skipping checkpoint %s: %s", skipped.path, skipped.reason)
        if loaded is not None:
            logger.info("loaded checkpoint %s", loaded.path)
        return loaded

    def _scan_for_save(self) -> List[Tuple[Tuple[int, int], Path]]:
        # A directory deleted under a running peer is recreated: the peer keeps checkpointing.
        try:
            if not self.directory.is_dir():
                logger.warning("checkpoint directory %s is gone; creating it again", self.directory)
                self.directory.mkdir(parents=True, exist_ok=True)
            return _scan(self.directory)
        except OSError as exc:
            raise CheckpointError(f"cannot use checkpoint directory {self.directory}: {describe(exc)}") from exc

    def _write_atomically(self, final_path: Path, state: dict, global_epoch: int) -> int:
        # The random token keeps two attempts from ever sharing a temporary directory.
        temp_path = self.directory / f"{_TEMP_PREFIX}{final_path.name}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
        try:
            os.mkdir(temp_path, 0o755)
            size = write_parts(temp_path, state, global_epoch, final_path.name)
            fsync_directory(temp_path)  # the parts' names must be on disk before the rename publishes them
            os.replace(temp_path, final_path)
        except OSError as exc:
            remove_quietly(temp_path)
            raise CheckpointError(f"cannot write checkpoint {final_path}: {describe(exc)}") from exc
        except BaseException:  # a state that cannot be serialized, or an interrupt: leave no temporary directory
            remove_quietly(temp_path)
            raise
        try:
            fsync_directory(self.directory)
        except OSError as exc:
            # The checkpoint is in place but its name may not survive a power loss, so report the
            # failure and skip pruning: older checkpoints stay as the fallback.
            raise CheckpointError(
                f"wrote checkpoint {final_path} but cannot fsync its directory: {describe(exc)}"
            ) from exc
        return size

    def _prune(self) -> None:
        try:
            complete = _scan(self.directory)
        except OSError as exc:  # the new checkpoint is written; pruning can wait for the next one
            logger.warning("cannot list %s to remove old checkpoints: %s", self.directory, describe(exc))
            return
        for _, path in complete[: -self.keep]:
            # Renamed out of the sequence first: a crash halfway through deleting a directory then leaves a
            # temporary name the next store removes, never a checkpoint with parts missing.
            doomed = path.with_name(f"{_TEMP_PREFIX}{path.name}.{secrets.token_hex(4)}{_TEMP_SUFFIX}")
            try:
                os.rename(path, doomed)
            except FileNotFoundError:
                continue
            except OSError as exc:
                # The new checkpoint is safe; a leftover old one only costs disk space.
                logger.warning("cannot remove old checkpoint %s: %s", path, describe(exc))
                continue
            remove_quietly(doomed)

    def _remove_stale_temp_files(self) -> None:
        with os.scandir(self.directory) as entries:
            stale = [Path(e.path) for e in entries if e.name.startswith(_TEMP_PREFIX) and e.name.endswith(_TEMP_SUFFIX)]
        for path in stale:
            logger.warning("removing %s left by an interrupted checkpoint write", path)
            remove_quietly(path)


def _scan(directory: Path) -> List[Tuple[Tuple[int, int], Path]]:
    """((sequence, epoch), path) of complete checkpoints of both formats, oldest first; other entries are ignored."""
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _NAME_RE.match(entry.name)
            # a directory of the current format, or a file of the earlier one: never the other way round
            if match and (entry.is_file() if match.group(3) else entry.is_dir()):
                found.append(((int(match.group(1)), int(match.group(2))), Path(entry.path)))
    # Numeric sort, so that sequence 1000000 still sorts after 999999.
    found.sort(key=lambda item: item[0])
    return found


def _read(path: Path) -> Tuple[dict, str]:
    """(the state, its pinning sha256) of a checkpoint of either format. :raises Damaged:"""
    if path.suffix != ".pt":
        return read_parts(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise Damaged(f"cannot read: {describe(exc)}") from exc
    return framed.unframe(data), hashlib.sha256(data).hexdigest()


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
