"""The order in which a peer reads its training data: its own, and continued across restarts.

The order used to come from --seed, default 0, and the join command a peer prints carries no seed, so every
volunteer who followed it walked the same permutation of the same samples: the swarm computed one batch several
times over. Now each peer draws its own order (from its peer ID unless --seed fixes it), and its checkpoints
record the seed and how many samples it has read, so that a restarted peer reads on from where it stood instead
of from the start of its first pass again.

The order is an endless stream of sample indices, pass after pass over the dataset, each pass its own
permutation drawn from (seed, pass): any position in it is reached without replaying what came before.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.utils.data import Sampler

SEED_LIMIT = 2**32
"""Seeds lie in [0, 2^32), as --seed's."""


def seed_for_peer(run_id: str, peer_id: str) -> int:
    """A peer's own data seed, from its identity: two peers of a run read in different orders, and a peer with a
    fixed --identity reads in the same order each time it starts afresh."""
    digest = hashlib.sha256(f"{run_id}/{peer_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _pass_seed(seed: int, pass_index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{pass_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch seeds are signed 64-bit


class DataOrder(Sampler[int]):
    """Sample indices for ever: pass p is a permutation of range(size) drawn from (seed, p); the stream starts
    `start` samples in.

    A peer counts the samples its loop has taken (not those the loader's workers prefetched) and resumes with
    that count as `start`."""

    def __init__(self, size: int, seed: int, start: int = 0) -> None:
        if size < 1:
            raise ValueError(f"a data order needs at least one sample (the dataset holds {size})")
        if start < 0:
            raise ValueError(f"a data order starts at sample 0 or later (got {start})")
        self.size, self.seed, self.start = size, seed, start

    def __iter__(self) -> Iterator[int]:
        pass_index, offset = divmod(self.start, self.size)
        while True:
            generator = torch.Generator().manual_seed(_pass_seed(self.seed, pass_index))
            yield from torch.randperm(self.size, generator=generator)[offset:].tolist()
            pass_index, offset = pass_index + 1, 0


@dataclass
class DataPosition:
    """Where a peer stands in its data order; what its checkpoints record."""

    seed: int
    samples_read: int = 0
    """Samples the training loop has taken from the loader, batches skipped for a non-finite loss included."""

    def state_dict(self) -> dict:
        return {"seed": self.seed, "samples_read": self.samples_read}


def resume_position(recorded: Optional[dict], chosen_seed: Optional[int], own_seed: int) -> DataPosition:
    """The position a peer starts at.

    :param recorded: what its newest checkpoint holds (None: no checkpoint, or one written before data positions
        were recorded)
    :param chosen_seed: --seed, when given: a seed other than the recorded one starts that order from its start
    :param own_seed: the peer's own seed (seed_for_peer), for a peer with neither
    """
    if recorded is not None and chosen_seed in (None, recorded["seed"]):
        return DataPosition(int(recorded["seed"]), int(recorded["samples_read"]))
    return DataPosition(own_seed if chosen_seed is None else chosen_seed)
