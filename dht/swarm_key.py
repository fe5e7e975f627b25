"""--swarm-key: a shared secret that decides who may average together.

Every key a run stores for progress and averaging (hivemind derives them from a prefix)
is namespaced by HMAC-SHA256(secret, run_id). A peer without the secret computes other
keys, so it never finds the swarm's groups, never counts toward its progress and cannot
be picked to send state; the peers that hold the secret train on undisturbed. The
secret itself never leaves the machine. This separates honest-but-misconfigured and
casual outsiders; it is not encryption of the traffic.
"""
from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Optional

from dht.files import InputFileError, read_input_file

MIN_SECRET_BYTES = 16


class SwarmKeyError(ValueError):
    """The swarm key file cannot be used; the message names the file and a fix."""


def read_swarm_key(path: Path) -> bytes:
    try:
        secret = read_input_file(Path(path)).strip()
    except InputFileError as e:
        raise SwarmKeyError(f"swarm key: {e}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise SwarmKeyError(
            f"swarm key {path} holds {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}; "
            f"create one with: head -c 32 /dev/urandom | base64 > {path}"
        )
    return secret


def training_namespace(run_id: str, swarm_key: Optional[Path]) -> str:
    """The prefix of the run's progress and averaging keys: the run id, or a keyed digest of it."""
    if swarm_key is None:
        return run_id
    digest = hmac.new(read_swarm_key(swarm_key), run_id.encode(), hashlib.sha256).hexdigest()[:24]
    return f"{run_id}-{digest}"  # hivemind forbids "." in its prefixes
