"""DHTConfig: how a peer joins the swarm's DHT.

Everything that can be checked before the DHT starts is checked here, at config load,
so that it is reported with the other config problems: multiaddrs parse, the
--initial-peers-file is readable and holds one multiaddr per line, and an existing
--identity file holds a valid key. Nothing here starts a process, touches the network or
writes a file (a missing identity file is created by dht.node.start_dht).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, List, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from dht.files import read_input_text

RUN_OWNER_CHARS = 32
"""A run owner's fingerprint: 128 bits of the SHA-256 of its public key, in hex (dht/run_owner.py)."""
MULTIADDR_EXAMPLE = "/ip4/1.2.3.4/tcp/31337/p2p/12D3..."


def split_commas(value):
    """Accept 'a,b' (flags, env) as well as ['a', 'b'] (config files)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def check_multiaddr(maddr: str) -> None:
    """Raise ValueError unless `maddr` parses as a multiaddr (/dns4/... included)."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        Multiaddr(maddr)
    except Exception as e:
        raise ValueError(f"malformed multiaddr {maddr!r} ({e}); expected e.g. {MULTIADDR_EXAMPLE}") from None


def check_initial_peer(maddr: str) -> None:
    """Raise ValueError unless `maddr` is a multiaddr that names its peer: hivemind cannot dial a peer without
    its id (it retries, then fails as if nobody were there)."""
    check_multiaddr(maddr)
    if "/p2p/" not in maddr:
        raise ValueError(f"{maddr} has no /p2p/<peer id> part, and a peer cannot be reached without it; "
                         f"copy the whole address from the first peer's 'join from another machine' line "
                         f"(e.g. {MULTIADDR_EXAMPLE})")


def read_initial_peers_file(path: Path) -> List[str]:
    """Multiaddrs from a file, one per line; '#' starts a comment; blank lines are ignored.

    :raises ValueError: one line naming the file (and the line, for a malformed address)
    """
    path = Path(path)
    text = read_input_text(path)
    maddrs = []
    for number, line in enumerate(text.splitlines(), start=1):
        maddr = line.split("#", 1)[0].strip()
        if not maddr:
            continue
        try:
            check_initial_peer(maddr)
        except ValueError as e:
            raise ValueError(f"{path} line {number}: {e}") from None
        maddrs.append(maddr)
    if not maddrs:
        raise ValueError(f"{path} lists no multiaddrs; add one per line (e.g. {MULTIADDR_EXAMPLE}) or drop the option")
    return maddrs


class DHTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    initial_peers: List[str] = Field(
        default_factory=list,
        description="Comma-separated multiaddrs of peers already in the swarm; empty starts a new swarm.",
    )
    initial_peers_file: Optional[Path] = Field(
        default=None,
        description="File with more initial peers, one multiaddr per line ('#' comments allowed); "
        "merged with --initial-peers.",
    )
    identity: Optional[Path] = Field(
        default=None,
        description="Private key file that keeps this peer's ID across restarts; created (mode 0600) if missing, "
        "never replaced.",
    )
    swarm_key: Optional[Path] = Field(
        default=None,
        description="File with a shared secret (at least 16 bytes); only peers holding the same secret average "
        "together.",
    )
    run_owner: Optional[str] = Field(
        default=None,
        description="The run owner's fingerprint, from the join command the run's first peer prints: only a run "
        "manifest that owner signed is believed.",
    )
    host_maddrs: List[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        description="Multiaddrs to listen on; tcp/0 picks a free port.",
    )
    announce_maddrs: List[str] = Field(
        default_factory=list,
        description="Public multiaddrs to advertise to others, when they differ from the listen addresses "
        "(NAT, containers).",
    )
    client_mode: bool = Field(
        default=False,
        description="Accept no incoming connections (for peers behind NAT); such peers cannot serve state to others.",
    )
    startup_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Bound on one start attempt (p2p daemon start and reaching an initial peer) before a retry.",
    )
    startup_attempts: int = Field(
        default=3, ge=1, description="Attempts to start the DHT and reach an initial peer, with exponential backoff."
    )

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs", mode="before")
    @classmethod
    def _split(cls, value):
        return split_commas(value)

    @field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _valid_multiaddrs(cls, value: List[str]) -> List[str]:
        for maddr in value:
            check_multiaddr(maddr)
        return value

    @field_validator("initial_peers")
    @classmethod
    def _reachable_peers(cls, value: List[str]) -> List[str]:
        for maddr in value:
            check_initial_peer(maddr)
        return value

    @field_validator("announce_maddrs")
    @classmethod
    def _announceable(cls, value: List[str]) -> List[str]:
        for maddr in value:
            parts = maddr.split("/")
            if len(parts) >= 5 and parts[3] in ("tcp", "udp") and parts[4] == "0":
                raise ValueError(f"{maddr} announces port 0, which nobody can connect to; announce the port this "
                                 f"peer listens on (give --host-maddrs a fixed port, e.g. /tcp/31337)")
        return value

    @field_validator("run_owner")
    @classmethod
    def _a_fingerprint(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not re.fullmatch(f"[0-9a-f]{{{RUN_OWNER_CHARS}}}", value):
            raise ValueError(f"must be the {RUN_OWNER_CHARS} hex characters of the run owner's fingerprint, as the "
                             f"run's first peer printed them in its join command (peer status shows them)")
        return value

    @field_validator("initial_peers_file", "identity", "swarm_key")
    @classmethod
    def _usable_file(cls, value: Optional[Path], info: ValidationInfo) -> Optional[Path]:
        # each check raises a ValueError (IdentityError, SwarmKeyError, ...): reported with the other problems
        if value is not None:
            _file_check(info.field_name)(value)
        return value

    @model_validator(mode="after")
    def _merge_peers_file(self) -> "DHTConfig":
        # Merged once here, so everything downstream (start-up, --client-mode checks, logs) sees one list.
        if self.initial_peers_file is None:
            return self
        merged = list(dict.fromkeys([*self.initial_peers, *read_initial_peers_file(self.initial_peers_file)]))
        return self.model_copy(update={"initial_peers": merged})


def _file_check(field: str) -> Callable[[Path], object]:
    """How a file named by `field` is checked at load; imported on use, as the checks pull in hivemind."""
    if field == "identity":
        from dht.identity import check_identity_path

        return check_identity_path
    if field == "swarm_key":
        from dht.swarm_key import read_swarm_key

        return read_swarm_key
    return read_initial_peers_file
