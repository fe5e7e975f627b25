"""The run owner: the key that signs a run's manifest, so that no other DHT client can replace or outvote it.

Any DHT client can store a manifest under a subkey of its own, and keys cost nothing to make, so a
manifest cannot be chosen by how many hold it. Instead the peer that starts a run makes an Ed25519
key (kept in its checkpoint directory as KEY_FILE_NAME, so that a restart keeps it) and signs the
manifest with it; every peer keeps a copy of that signed manifest alive. The key's fingerprint names
the run's owner: the run's first peer prints it in the command that joins the swarm
(`--run-owner`), and `peer status` shows it. A peer given --run-owner believes only manifests that
key signed. The signature covers the DHT key the manifest is stored under, so a manifest signed for
one run cannot be replayed into another.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dht.config import RUN_OWNER_CHARS
from dht.files import InputFileError, create_private_file, read_input_file
from dht.records import RunManifest

KEY_FILE_NAME = "run-owner.key"


class RunOwnerKeyError(ValueError):
    """The run owner's key file cannot be used; the message names the file and a fix."""


def fingerprint(public_key: bytes) -> str:
    """What names a run's owner: the first 128 bits of the SHA-256 of its public key, in hex."""
    return hashlib.sha256(public_key).hexdigest()[:RUN_OWNER_CHARS]


def signed_bytes(manifest_key: str, protocol: int, settings: Mapping[str, object], created: float) -> bytes:
    """What the owner signs: the manifest and the DHT key it belongs under, in one canonical encoding."""
    content = {"key": manifest_key, "protocol": protocol, "settings": dict(settings), "created": created}
    return json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def is_signed(manifest: RunManifest, manifest_key: str) -> bool:
    """Whether the key the manifest names as its owner signed it, for this DHT key."""
    try:
        Ed25519PublicKey.from_public_bytes(manifest.owner).verify(
            manifest.signature, signed_bytes(manifest_key, manifest.protocol, manifest.settings, manifest.created))
        return True
    except (InvalidSignature, ValueError):  # ValueError: not a public key at all
        return False


class RunOwnerKey:
    """The private key of a run's owner."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._private_key = private_key
        self.public_key = private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                                 serialization.PublicFormat.Raw)
        self.fingerprint = fingerprint(self.public_key)

    @classmethod
    def load_or_create(cls, directory: Path) -> "RunOwnerKey":
        """The key kept in `directory`, made (mode 0600, atomically) if there is none yet; an existing file is
        never replaced. :raises RunOwnerKeyError: it exists but is no key, or cannot be made"""
        path = Path(directory) / KEY_FILE_NAME
        if not path.exists():
            private_key = Ed25519PrivateKey.generate()
            pem = private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption())
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                create_private_file(path, pem)
            except OSError as e:
                raise RunOwnerKeyError(f"run owner key {path}: cannot create it ({e.strerror or e}); make "
                                       f"--checkpoint-dir writable") from None
        try:
            private_key = serialization.load_pem_private_key(read_input_file(path), password=None)
        except (InputFileError, ValueError, TypeError) as e:
            raise RunOwnerKeyError(f"run owner key {path} is not a usable Ed25519 key ({e}); the file was left "
                                   f"untouched: restore it from a backup, or move it away to start runs with a new "
                                   f"owner") from None
        if not isinstance(private_key, Ed25519PrivateKey):
            raise RunOwnerKeyError(f"run owner key {path} is not an Ed25519 key; move it away to start runs with a "
                                   f"new owner")
        return cls(private_key)

    def sign(self, manifest: RunManifest, manifest_key: str) -> RunManifest:
        """The manifest, owned and signed by this key for the DHT key it is stored under."""
        payload = signed_bytes(manifest_key, manifest.protocol, manifest.settings, manifest.created)
        return manifest.copy(update={"owner": self.public_key, "signature": self._private_key.sign(payload)})
