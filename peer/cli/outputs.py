"""What a peer writes, checked before it joins anything: its checkpoint directory and its summary file.

A peer that cannot write either would train, then lose its checkpoints or crash at exit. An unwritable
path given at start is bad input (exit 2), said in one line with the fix. Once the peer runs, a disk
that fills up or turns read-only only costs checkpoints (peer/runtime/trainer.py).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional


def check_writable_directory(directory: Path, flag: str) -> None:
    """Create `directory` if missing and write (then remove) a probe file in it.

    :raises ValueError: one line naming the flag, the path, why, and the fix
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {directory} is not a directory this peer can write to ({e.strerror or e}); "
                         f"choose a writable directory") from None


def check_output_file(path: Optional[Path], flag: str) -> None:
    """A file this peer will write (or append to): its directory writable, and not a FIFO or a device.

    :raises ValueError: one line naming the flag, the path, why, and the fix
    """
    if path is None:
        return
    check_writable_directory(Path(path).absolute().parent, f"{flag}: the directory of")
    if Path(path).exists() and not Path(path).is_file():
        raise ValueError(f"{flag} {path} exists and is not a regular file (a FIFO or a device would block or "
                         f"swallow what is written); give a file path")


def check_output_paths(checkpoint_dir: Path, summary_json: Optional[Path], events: Optional[Path] = None) -> None:
    """:raises ValueError: the first path this peer could not write"""
    check_writable_directory(Path(checkpoint_dir), "--checkpoint-dir")
    check_output_file(summary_json, "--summary-json")
    check_output_file(events, "--events")
