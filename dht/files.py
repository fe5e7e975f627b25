"""Reading the small files that flags name (--config, --swarm-key, --initial-peers-file, --identity), and
writing the private files a peer keeps (--identity, the run owner's key, its summary and pause state).

A path can name something that blocks on open (a FIFO with no writer), never ends (/dev/zero) or is
far too large to be a setting. Each is refused from its stat, before it is opened, in one line that
names the file and the fix; what is read is capped, in case the file grows meanwhile.
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Optional

MAX_INPUT_FILE_BYTES = 1 << 20  # a config, key or address list is a few KiB at most


class InputFileError(ValueError):
    """A file named by a flag cannot be used; the message names the file and a fix."""


def read_input_file(path: Path, max_bytes: int = MAX_INPUT_FILE_BYTES) -> bytes:
    """:raises InputFileError: missing or unreadable, not a regular file, or over max_bytes"""
    try:
        status = os.stat(path)
        mode, size = status.st_mode, status.st_size
        if stat.S_ISDIR(mode):
            raise InputFileError(f"{path} is a directory; give the path of a file")
        if not stat.S_ISREG(mode):
            raise InputFileError(f"{path} is not a regular file (a FIFO, device or socket); give the path of a file")
        if size > max_bytes:
            raise InputFileError(f"{path} holds {size} bytes, more than the {max_bytes} a setting file may; "
                                 f"check that this is the right file")
        with open(path, "rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as e:
        raise InputFileError(f"cannot read {path} ({e.strerror or e}); check the path and its permissions") from None
    if len(data) > max_bytes:
        raise InputFileError(f"{path} grew past {max_bytes} bytes while it was read; check that this is the right file")
    return data


def read_input_text(path: Path, max_bytes: int = MAX_INPUT_FILE_BYTES) -> str:
    """read_input_file, decoded as UTF-8. :raises InputFileError: also for binary content"""
    data = read_input_file(path, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(
            f"{path} is not a text file (byte {e.start} is not UTF-8); give the path of a text file") from None


PRIVATE_FILE_MODE = 0o600


def replace_private_json(path: Path, value, indent: Optional[int] = None) -> None:
    """Replace `path` with `value` as JSON, atomically (a reader sees the old file or the whole new one), readable
    and writable by its owner alone. :raises OSError: it cannot be written"""
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")  # mkstemp creates 0600
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(value, file, indent=indent)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def create_private_file(path: Path, data: bytes) -> None:
    """Write data to a new file only its owner can read, atomically; an existing file is kept, never replaced
    (another process that created it meanwhile wins). :raises OSError: the file cannot be created"""
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")  # mkstemp creates 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, PRIVATE_FILE_MODE)
        try:
            os.link(tmp, path)  # link, not rename: an existing file is never replaced
        except FileExistsError:
            pass
    finally:
        Path(tmp).unlink(missing_ok=True)
