"""hivemind's process-wide locks, made anew in a peer forked from a parent that has imported hivemind.

hivemind makes three multiprocessing locks as it is imported (MPFuture's two, which guard every result sent
between a peer's processes, and the one of its context executor), and every process forked from the importing
one shares them: meant for a peer and the DHT and averager processes it forks. Peers forked from one parent
(`peer swarm`, peer/process/preforked.py) would share them across peers: every peer's futures would queue on
one lock, and a peer killed while holding it would stall all the others.
"""
from __future__ import annotations

import multiprocessing as mp

from hivemind.utils.asyncio import _AsyncContextWrapper
from hivemind.utils.mpfuture import MPFuture


def make_own_locks() -> None:
    """Give this process (and what it forks from now on) hivemind locks of its own; before it uses hivemind."""
    MPFuture.reset_backend()
    _AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()
