"""Whether this machine can listen where --host-maddrs says, checked before anything starts (p2pd included)."""
from __future__ import annotations

import errno
import socket
from typing import Sequence


def check_listen_addresses(maddrs: Sequence[str]) -> None:
    """Bind each /ip4|ip6/<address>/tcp|udp/<port> address for a moment, before p2pd is started: an address this
    machine does not have, or a port in use, is bad input, not a network failure to retry.

    :raises ValueError: one line naming the address, why, and the fix
    """
    for maddr in maddrs:
        parts = maddr.split("/")  # "", "ip4", address, "tcp", port, ...
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] not in ("tcp", "udp") or not parts[4].isdigit():
            continue
        family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM if parts[3] == "tcp" else socket.SOCK_DGRAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((parts[2], int(parts[4])))
            except OSError as e:
                raise ValueError(f"--host-maddrs {maddr}: {_why_not_bindable(e, parts[2], parts[4])}") from None


def _why_not_bindable(error: OSError, address: str, port: str) -> str:
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"{address} is not an address of this machine; listen on 0.0.0.0 (every interface) or one of its "
                f"own addresses, and pass a public address with --announce-maddrs")
    if error.errno == errno.EADDRINUSE:
        return f"port {port} is already in use; choose another port, or 0 for any free one"
    if error.errno == errno.EACCES:
        return f"port {port} needs root (ports below 1024 are privileged); choose a port above 1023"
    return f"cannot listen there ({error.strerror or error}); fix the address"
