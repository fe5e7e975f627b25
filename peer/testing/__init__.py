"""The asyncio test harness: real `peer start` processes, awaited through their events (peer/testing/harness.py).

- harness.py: Swarm, the peers of one test on 127.0.0.1 or in network namespaces, torn down on every path;
- faults.py: the fault plan a test hands one peer (`peer start --inject-faults`), and the injector the peer
  consults at fixed points;
- forgery.py: run manifests stored by a squatter (bare DHT clients), against the run owner's signature.
Processes themselves are started and supervised by peer/process/launcher.py, which `peer swarm` uses too.
This package imports no torch: a test that only starts processes does not pay for it.
"""
from peer.process.launcher import (
    Peer,
    PeerFailed,
    load_model_state,
    session_processes,
    signal_session,
    until,
)
from peer.testing.harness import FAST_ARGS, FAST_ENV, Swarm, max_parameter_difference

__all__ = ["FAST_ARGS", "FAST_ENV", "Peer", "PeerFailed", "Swarm", "load_model_state", "max_parameter_difference",
           "session_processes", "signal_session", "until"]
