"""How much garbage p2pd, the Go daemon under each peer's DHT and averagers, keeps before it collects.

hivemind starts p2pd with the peer's environment, so Go's `GOGC` set here reaches it. Go's default (100) lets the
heap grow to twice what is live before each collection, so up to half of it is garbage; at 50 the heap grows to 1.5
times what is live, and p2pd's CPU stayed where it was (0.02 s/s while training, peer_memory). Measured with 16
peers of bytelm-tiny on one 2-core machine (BENCHMARKS.md, swarm_size): p2pd took 92 MiB a peer with Go's default,
77 with 50 and 71 with 25. 50, not 25: a peer averaging a large model streams its tensors through p2pd, and each
halving of GOGC doubles how often Go collects under that load.
"""
from __future__ import annotations

import os

GC_PERCENT_VARIABLE = "GOGC"
GC_PERCENT = "50"


def bound_p2p_daemon_heap() -> None:
    """Call before the peer's p2pd starts; a GOGC the user set in the environment stands."""
    os.environ.setdefault(GC_PERCENT_VARIABLE, GC_PERCENT)
