"""Forked processes share their parent's memory pages until one of them writes to a page, and Python's collector
writes to every object it visits: a child's collections would copy each page of objects that it shares with its
parent (torch's and hivemind's modules, the model's Python objects). Frozen, the objects that exist at a fork are
never visited again, in the parent or in its children.

`peer swarm` freezes before it forks the peers (peer/process/preforked.py), and each peer before it forks a helper:
its DHT, its averagers and its data workers (peer/runtime/builder.py). On a volunteer's peer (bytelm-tiny,
`python -m benchmarks.peer_memory --quick`) the DHT process's private memory fell from 86 to 56 MiB, and the peer
from 572 to 536 MiB PSS. The cost: cyclic garbage that exists at a freeze is never collected (a one-off, at start).
"""
from __future__ import annotations

import gc


def freeze_before_fork() -> None:
    """Leave the objects that exist now out of every later collection: call it just before a fork."""
    gc.freeze()
