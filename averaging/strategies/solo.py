"""SoloOptimizer: the "none" strategy. No averaging: each peer trains its own replica alone, a baseline.

Every batch is one step of the task's own optimizer on this peer's model; nothing is ever sent to
another peer. The peer still keeps a signed progress record in hivemind's ProgressTracker, so the
swarm view, the start gate (--min-peers), `peer status` and the epochs work as with any strategy: an
epoch ends when the swarm as a whole has accumulated --target-batch-size samples, and a peer behind
the swarm's epoch takes it at its next step (the LR schedule follows the epoch).

What it does not do: it shares no state. A peer that joins late, or whose loss diverges, keeps its
own weights (every peer starts from the same ones, seeded by the run id); load_state_from_peers
loads nothing, and no peer offers a final state when it leaves.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

from hivemind.optim.progress_tracker import ProgressTracker

from averaging.api import Replica
from averaging.config import AveragingConfig
from averaging.deadlines import Deadlines
from averaging.strategies.membership import ReportsProgress, step_scheduler_to
from averaging.strategies.parts import StrategyParts
from averaging.swarm import progress

logger = logging.getLogger(__name__)


class SoloOptimizer(ReportsProgress):
    """The Protocols of averaging/api.py without averaging."""

    def __init__(self, config: AveragingConfig, replica: Replica, parts: StrategyParts):
        self.rounds, self.batch_size = parts.rounds, replica.batch_size
        self.parameters = list(replica.params)
        self.optimizer = replica.optimizer_factory(self.parameters)
        self.scheduler = replica.scheduler_factory(self.optimizer) if replica.scheduler_factory else None
        client_mode = replica.dht.client_mode if replica.client_mode is None else replica.client_mode
        self.signing_key = progress.signing_key(parts.tracker_opts)
        self.tracker = ProgressTracker(
            dht=replica.dht, prefix=replica.keys.namespace, target_batch_size=config.target_batch_size,
            client_mode=client_mode, start=True, **dict(parts.tracker_opts, private_key=self.signing_key),
        )
        progress.believe_plausible_claims(self.tracker, self.signing_key, parts.matchmaking_floor,
                                          excluded=self.rounds.excluded_peer_ids)
        self.local_epoch, self._samples = 0, 0

    # --- what the training loop uses -----------------------------------------------------------

    def step(self, batch_size: Optional[int] = None) -> None:
        self.optimizer.step()
        self._samples += batch_size if batch_size is not None else self.batch_size
        self.tracker.report_local_progress(self.local_epoch, self._samples)
        if self.tracker.ready_to_update_epoch:
            with self.tracker.pause_updates():
                self.local_epoch = max(self.local_epoch + 1, self.tracker.global_epoch)
                step_scheduler_to(self.scheduler, self.local_epoch)
                self._samples = 0
                self.tracker.update_epoch(new_epoch=self.local_epoch)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def wait_for_background_updates(self) -> None:
        """Nothing runs in the background."""

    @property
    def task_optimizer(self):
        return self.optimizer

    def pause(self) -> None:
        with self.tracker.pause_updates():
            self._samples = 0
            progress.stand_idle(self.tracker, self.local_epoch)

    def refuse(self, peers: Iterable[str]) -> None:
        """It averages with nobody, so there is nothing to refuse (and no averaged update is ever judged)."""

    def state_dict(self) -> dict:
        """The optimizer's state, with the epoch inside it, where hivemind.Optimizer keeps it too (so that a
        checkpoint of any strategy resumes with any other)."""
        state = self.optimizer.state_dict()
        state["state"]["local_epoch"] = self.local_epoch
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        inner_state = dict(state_dict["state"])
        self.local_epoch = inner_state.pop("local_epoch", self.local_epoch)
        self.optimizer.load_state_dict(dict(state_dict, state=inner_state))
        self.tracker.report_local_progress(self.local_epoch, 0)

    # --- what the swarm session uses -----------------------------------------------------------

    @property
    def deadlines(self) -> Deadlines:
        """Never used for a round: they bound how long the session waits for the others while leaving."""
        return self.rounds.deadlines.current

    @property
    def apart(self) -> bool:
        return False

    @property
    def averages_in_groups(self) -> bool:
        return False

    @property
    def averages_after_epoch(self) -> bool:
        return False

    def await_state_comparison(self, timeout_seconds: float,
                               expected_peers: Optional[Callable[[], int]] = None) -> None:
        """No state to compare."""

    def state_apart_now(self) -> bool:
        return False

    def download_swarm_state(self) -> bool:
        return False

    @property
    def downloaded_at_epoch(self) -> Optional[int]:
        return None

    def load_state_from_peers(self) -> bool:
        logger.info("--averaging none shares no state: this peer goes on with its own")
        return False

    def load_state_from_donor_ahead(self) -> bool:
        return False

    def offer_final_state(self) -> bool:
        return False

    def download_final_state(self) -> bool:
        return self.load_state_from_peers()

    def better_final_offer(self) -> bool:
        return False

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        self.tracker.shutdown(min(5.0, timeout_seconds))
        self.rounds.close()


def build_solo(config: AveragingConfig, replica: Replica, parts: StrategyParts) -> SoloOptimizer:
    return SoloOptimizer(config, replica, parts)
