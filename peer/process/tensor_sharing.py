"""How a peer's processes share tensors: by file descriptor, with no shared-memory manager process.

hivemind sets torch's sharing strategy to `file_system` as it is imported, unless HIVEMIND_MEMORY_SHARING_STRATEGY
names another. With `file_system`, every peer starts torch_shm_manager, a program that loads libtorch to keep the
names of shared segments: 56 MiB of memory of its own a peer, most of it libtorch's operator registry. With
`file_descriptor`, torch's own default on Linux, a process passes the segment's descriptor instead and needs no
manager; it costs an open descriptor per shared storage in each process that holds one (110 to 180 in each
process of a peer training a Llama of 20M parameters), so the soft limit on open files is raised to the hard one.
"""
from __future__ import annotations

import os
import resource

STRATEGY_VARIABLE = "HIVEMIND_MEMORY_SHARING_STRATEGY"


def share_tensors_by_descriptor() -> None:
    """Call before hivemind is imported; a strategy the user set in the environment stands."""
    os.environ.setdefault(STRATEGY_VARIABLE, "file_descriptor")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit the kernel refuses as a soft one (unlimited): keep the soft
            pass
