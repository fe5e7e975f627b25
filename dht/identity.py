"""A peer's private key on disk (--identity), so that its peer ID survives restarts.

hivemind hands the key file to its p2pd daemon. Left to itself, hivemind creates a missing
file read-only (0400) and never checks an existing one, so a corrupt key only shows up as
a p2pd crash. This module creates a missing file itself (mode 0600, written atomically)
and validates an existing one before anything starts.

It must never replace, rewrite or delete an existing key file: a peer ID that changes
silently breaks every --initial-peers line that names it.
"""
from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import Dict

from dht.files import InputFileError, create_private_file, read_input_file


class IdentityError(ValueError):
    """The --identity file cannot be used; the message is one line naming the path."""


def read_identity(path: Path) -> str:
    """The peer ID (base58) stored in an existing key file; IdentityError if it is unusable."""
    from hivemind.p2p import PeerID

    path = Path(path)
    try:
        data = read_input_file(path)  # refuses directories, FIFOs and devices by their stat
    except InputFileError as e:
        raise IdentityError(f"identity file: {e}") from e
    try:
        return PeerID.from_identity(data).to_base58()
    except Exception as e:  # protobuf DecodeError, cryptography's ValueError, ...: all mean "not a key"
        raise IdentityError(
            f"identity file {path} is not a valid private key ({type(e).__name__}); the file was left untouched: "
            f"restore it from a backup, or pass a path that does not exist yet to create a new identity"
        ) from e


def check_identity_path(path: Path) -> None:
    """Config-time check: an existing file must hold a valid key; a missing one must be creatable."""
    path = Path(path)
    if path.exists():
        read_identity(path)
        return
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise IdentityError(
            f"identity file {path}: directory {parent} does not exist; create it or choose another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise IdentityError(f"identity file {path}: cannot create the key file in {parent} (not writable)")


def ensure_identity(path: Path) -> str:
    """Create the key file if it is missing (0600, atomically), then return its peer ID."""
    path = Path(path)
    if not path.exists():
        _create_key_file(path)
    return read_identity(path)


class IdentityInUse(IdentityError):
    """Another running process holds the key file: two peers with one identity would fight over one peer id."""


_held_identities: Dict[str, int] = {}  # resolved path -> the descriptor holding its lock, for the process's life


def lock_identity(path: Path) -> None:
    """Take the key file for this process (an exclusive flock, released when the process exits); idempotent.

    :raises IdentityInUse: another process holds it
    """
    key = str(Path(path).resolve())
    if key in _held_identities:
        return
    fd = os.open(key, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise IdentityInUse(f"identity file {path} is in use by another running peer on this machine; give each "
                            f"peer its own --identity (a path that does not exist yet creates a new one)") from None
    except OSError:  # a filesystem without locks: go on without this check
        os.close(fd)
        return
    _held_identities[key] = fd


def is_private(path: Path) -> bool:
    """Whether only the owner can read the key file (a group- or world-readable key is a leak)."""
    return not (Path(path).stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO))


def _create_key_file(path: Path) -> None:
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    # the same format hivemind's P2P.generate_identity writes, which p2pd reads
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    try:
        create_private_file(path, key.SerializeToString())
    except OSError as e:
        raise IdentityError(f"identity file {path}: cannot create the key file ({e.strerror or e})") from e
