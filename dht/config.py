"""DHTConfig: how a peer joins the swarm's DHT."""
from __future__ import annotations

from typing import List

from pydantic import BaseModel, ConfigDict, Field, field_validator


def split_commas(value):
    """Accept 'a,b' (flags, env) as well as ['a', 'b'] (config files)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class DHTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    initial_peers: List[str] = Field(
        default_factory=list,
        description="Comma-separated multiaddrs of peers already in the swarm; empty starts a new swarm.",
    )
    host_maddrs: List[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        description="Multiaddrs to listen on; tcp/0 picks a free port.",
    )
    announce_maddrs: List[str] = Field(
        default_factory=list,
        description="Public multiaddrs to advertise to others, when they differ from the listen addresses (NAT, containers).",
    )
    client_mode: bool = Field(
        default=False,
        description="Accept no incoming connections (for peers behind NAT); such peers cannot serve state to others.",
    )
    startup_timeout_seconds: float = Field(
        default=30.0, gt=0, description="How long the p2p daemon may take to start before a retry."
    )
    startup_attempts: int = Field(
        default=3, ge=1, description="Attempts to start the DHT and reach an initial peer, with exponential backoff."
    )

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs", mode="before")
    @classmethod
    def _split(cls, value):
        return split_commas(value)

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs")
    @classmethod
    def _valid_multiaddrs(cls, value: List[str]) -> List[str]:
        from hivemind.utils.multiaddr import Multiaddr

        for maddr in value:
            try:
                Multiaddr(maddr)
            except Exception as e:
                raise ValueError(f"malformed multiaddr {maddr!r} ({e}); expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3...")
        return value
