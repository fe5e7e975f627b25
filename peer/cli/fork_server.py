"""The fork server's program (peer/process/fork_server.py): `python -m peer.cli.fork_server SOCKET`.

It imports what a peer imports before it trains, as `peer swarm` does before it forks its peers, then forks each
requested `peer` command. What a new program reads from its environment as it starts is redone in each child:
torch's threads and PYTHONPATH.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import List

from peer.cli.main import exit_code_of
from peer.cli.swarm import forked_peer, preload_peer_modules
from peer.process import fork_server


def main() -> None:
    preload_peer_modules()
    fork_server.serve(sys.argv[1], served_peer)


def served_peer(argv: List[str]) -> int:
    """`peer <argv>` in a child of the server, with what its environment says set as a new program would have."""
    import torch  # preloaded

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch read the server's (none: a thread per core) when imported
        torch.set_num_threads(int(threads))
    search_path = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[1:1] = [os.path.abspath(entry) for entry in search_path if os.path.abspath(entry) not in sys.path]
    importlib.invalidate_caches()  # a test's task module may have been written since the server looked
    return forked_peer(exit_code_of, argv)


if __name__ == "__main__":
    main()
