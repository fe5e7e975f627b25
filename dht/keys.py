"""Every DHT key and averager prefix of a run, derived in one place from the run id and the swarm key.

Two namespaces:
- open: "<run_id>_peers", the signed PeerInfo records that `peer status` and `peer monitor` read
  with nothing but the run id;
- training: the run manifest, progress, the start gate, leave records and every averager. Its prefix is the run id,
  or with --swarm-key a keyed digest of it (dht/swarm_key.py), so that a peer without the secret
  never finds the swarm's groups nor counts toward its progress.

hivemind derives some of these names itself from the prefix it is given (the progress key from a
ProgressTracker's prefix, "<prefix>_grad_averager" inside hivemind.Optimizer); the names here
spell out what it derives, and tests/unit/test_keys.py checks that they agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dht.swarm_key import training_namespace


def peers_key(run_id: str) -> str:
    """Where every peer of the run publishes its signed PeerInfo."""
    return f"{run_id}_peers"


@dataclass(frozen=True)
class SwarmKeys:
    run_id: str
    namespace: str
    """Prefix of every training key: the run id, or a keyed digest of it."""

    @classmethod
    def for_run(cls, run_id: str, swarm_key: Optional[Path] = None) -> "SwarmKeys":
        """:raises SwarmKeyError: the swarm key file cannot be used"""
        return cls(run_id=run_id, namespace=training_namespace(run_id, swarm_key))

    @property
    def peers(self) -> str:
        return peers_key(self.run_id)

    @property
    def progress(self) -> str:
        """hivemind's training progress records (a ProgressTracker with prefix=namespace)."""
        return f"{self.namespace}_progress"

    @property
    def manifest(self) -> str:
        """The run manifest (dht/manifest.py): keyed too, so that outsiders cannot read or claim it."""
        return f"{self.namespace}_manifest"

    @property
    def clock(self) -> str:
        """Every peer's clock record (dht/clock.py)."""
        return f"{self.namespace}_clock"

    @property
    def digests(self) -> str:
        """Every peer's state digests of its recent epochs (averaging/swarm/digests.py)."""
        return f"{self.namespace}_digests"

    @property
    def round_factors(self) -> str:
        """Every DiLoCo peer's round factors for its next epochs, and the one it asks for
        (averaging/swarm/round_factor.py)."""
        return f"{self.namespace}_round_factor"

    @property
    def start_gate(self) -> str:
        """When each waiting peer saw the --min-peers quorum."""
        return f"{self.progress}_start"

    @property
    def leaving(self) -> str:
        """Leave records of peers stopping at --max-epochs."""
        return f"{self.progress}_leaving"

    @property
    def state_averager(self) -> str:
        return f"{self.namespace}_state_averager"

    @property
    def grad_averager(self) -> str:
        return f"{self.namespace}_grad_averager"

    @property
    def diloco_state(self) -> str:
        return f"{self.namespace}_diloco_state"

    @property
    def diloco_outer(self) -> str:
        return f"{self.namespace}_diloco_outer"
