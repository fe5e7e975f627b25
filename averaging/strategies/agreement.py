"""StateAgreement: what a strategy whose peers end each epoch with one state does with state digests.

The rules are averaging/swarm/digests.py's; this wires them to a strategy: the digest of each epoch's state
is recorded and published, a peer apart from the swarm's state downloads (the strategy asks `apart()`), the
averager processes skip refused donors (the DonorFilter stage), and each downloaded state is checked before
it is applied (`check_download`, given to the guarded state averager). A donor that served another state
than it published is reported to the exclusion book as an offence that excludes at once.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional

import torch

from averaging.adapter.refusals import SERVED_BY
from averaging.adapter.state_averager import DownloadRejected
from averaging.api import AveragingHooks
from averaging.pipeline.defence import Defence, Verdict
from averaging.pipeline.donors import DonorFilter
from averaging.pipeline.exclusion import BAD_STATE
from averaging.pipeline.state_digest import state_digest
from averaging.swarm.digests import DIGEST_MISMATCH, DigestBook, DigestWatch, records_reader

logger = logging.getLogger(__name__)


class StateAgreement:
    """One per optimizer; `select` picks, from what a state averager serves, the tensors peers agree on."""

    def __init__(self, dht, key: str, hooks: AveragingHooks, defence: Optional[Defence], ttl_seconds: float):
        self.hooks, self.defence = hooks, defence
        self.donor_filter = DonorFilter()
        self.peer_id = dht.peer_id.to_base58()
        self.book = DigestBook(self.peer_id, records_reader(dht, key), on_check=self._checked,
                               on_refused=lambda peers: self.donor_filter.refuse(sorted(peers)))
        self.watch = DigestWatch(self.book, dht, key, expected_peers=lambda: 1, ttl_seconds=ttl_seconds)
        self.select = slice(None)

    def start(self, select: slice, expected_peers: Callable[[], int], serves: Callable[[], bool]) -> None:
        """:param serves: whether this peer serves its state now (on a tie, a state nobody can download loses)"""
        self.select, self.watch.expected_peers, self.book.serves = select, expected_peers, serves
        self.watch.start()

    def record(self, epoch: int, digest: str) -> None:
        self.book.record(epoch, digest)
        self.watch.publish_now()

    def apart(self) -> bool:
        return self.book.apart()

    def state_left_behind(self, epoch: int) -> None:
        self.book.state_left_behind(epoch)

    def forgive_unpublished(self) -> None:
        """Before a final state's download: donors refused for want of a digest may be asked again."""
        self.book.forgive_unpublished()

    def refresh(self) -> None:
        """Compare with the swarm's digests as they are now (before a download: see DigestWatch.check_now)."""
        self.watch.check_now()

    def await_comparison(self, epoch: int, timeout_seconds: float,
                         expected_peers: Optional[Callable[[], int]] = None, poll_seconds: float = 0.2) -> bool:
        """Wait until this peer's state at `epoch` has been compared with every peer it counts, or with the
        `expected_peers` (this one included) where that is fewer (at most `timeout_seconds`; alone, not at all);
        whether it was compared with some.

        Not with the first peers to publish: at the last epoch, a peer that compared with the few there and left
        took a state that the peers after it outvoted (16 peers on one machine reach their last epoch up to a
        minute and a half apart)."""
        deadline = time.monotonic() + timeout_seconds
        counted = self.watch.expected_peers
        if expected_peers is not None:  # the watch compares once these have published, not every peer it counts
            self.watch.expected_peers = lambda: min(counted(), expected_peers())
        try:
            while time.monotonic() < deadline:
                peers = self.watch.expected_peers()
                if peers <= 1 or (self.book.compared_since(epoch) and self.book.compared_with_all(peers)):
                    break
                time.sleep(poll_seconds)
        finally:
            self.watch.expected_peers = counted
        return self.book.compared_since(epoch)

    def check_download(self, metadata: dict, tensors: List[torch.Tensor]) -> None:
        """:raises DownloadRejected: the state must not be applied (see averaging/swarm/digests.py)"""
        donor, epoch = metadata.get(SERVED_BY), metadata.get("epoch")
        if not isinstance(epoch, int):
            raise DownloadRejected(f"the state from {donor} names no epoch")
        digest = state_digest(tensors[self.select])
        reason = self.book.judge_download(donor, epoch, digest)
        if reason is None:
            self.book.record(epoch, digest, downloaded=True)  # what this peer holds once it is applied
            return
        logger.warning(f"refused the state downloaded from {donor} at epoch {epoch}: {reason.replace('_', ' ')}")
        self.hooks.download_rejected(str(donor), reason)
        if reason == DIGEST_MISMATCH and self.defence is not None and donor is not None:
            self.defence.report([Verdict(donor, f"download-{epoch}", BAD_STATE,
                                         f"it served a state at epoch {epoch} other than the one it published")])
        raise DownloadRejected(f"the state from {donor} at epoch {epoch}: {reason}")

    def _checked(self, check) -> None:
        if not check.agrees:
            logger.warning(f"this peer's state at epoch {check.epoch} is not the swarm's ({check.peers} peers "
                           f"compared): downloading the swarm's state")
        elif check.others:
            logger.info(f"state at epoch {check.epoch} agrees with the swarm's; apart from it: "
                        f"{', '.join(sorted(check.others))}")
        self.hooks.state_checked(check)

    def close(self) -> None:
        self.watch.close()
