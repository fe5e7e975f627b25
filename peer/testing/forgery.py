"""Forged run manifests, as a squatter stores them: bare DHT clients that train nothing (tests and benchmarks).

Each client has a key pair of its own, as any DHT client can make for free, and stores a manifest that a run
owner key of the squatter's signed: the signature holds, the owner is not the run's (dht/run_owner.py)."""
from __future__ import annotations

from pathlib import Path

from dht.keys import SwarmKeys


def forge_manifests(address: str, keys: SwarmKeys, settings: dict, copies: int, owner_key_dir: Path) -> None:
    """`copies` bare DHT clients (no training), each with a key pair of its own, storing a run manifest with
    `settings` that a squatter's run owner key signed: the signature holds, the owner is not the run's."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from dht.manifest import PROTOCOL_VERSION
    from dht.records import RunManifest, record_validators
    from dht.run_owner import RunOwnerKey

    unsigned = RunManifest(protocol=PROTOCOL_VERSION, settings=settings, created=get_dht_time() - 3600)
    forged = RunOwnerKey.load_or_create(owner_key_dir).sign(unsigned, keys.manifest)
    for _ in range(copies):
        signer = RSASignatureValidator(RSAPrivateKey())
        validators = [check for check in record_validators(keys) if not isinstance(check, RSASignatureValidator)]
        client = hivemind.DHT(start=True, client_mode=True, initial_peers=[address],
                              record_validators=[*validators, signer])
        try:
            if not client.store(keys.manifest, forged.dict(), get_dht_time() + 300, subkey=signer.local_public_key):
                raise RuntimeError(f"a forged manifest could not be stored through {address}")
        finally:
            client.shutdown()
