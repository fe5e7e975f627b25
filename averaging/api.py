"""What the training loop and the swarm session may ask of an optimizer, whatever its averaging strategy.

This is the bottom of the averaging package: plain data (RoundReport, SwarmView), the callbacks
an optimizer reports through (AveragingHooks), what it is built for (Replica), and two narrow
Protocols: LoopOptimizer, what the training loop uses, and SessionOptimizer, what the swarm session
uses (both read SwarmProgress). peer/ uses these names and nothing else of averaging's internals: no
tracker, no averager, no hivemind object. Every strategy (averaging/registry.py) implements both,
as SwarmOptimizer; tests implement them with fakes.

This module imports no hivemind and no strategy.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, List, Optional, Protocol, Tuple, runtime_checkable

import torch

from averaging.deadlines import Deadlines
from dht.keys import SwarmKeys

OUTCOMES = ("ok", "partial", "failed", "timeout", "skipped")
APART = ("partial", "failed", "timeout")
"""Outcomes after which this peer may hold a different state from peers that averaged without it: a partial
round kept this peer's own values where a part of the average never arrived (averaging/pipeline/completeness.py);
a failed or timed-out one applied only this peer's own update."""


@dataclass(frozen=True)
class RoundReport:
    """One averaging round as this peer saw it."""

    outcome: str
    """One of OUTCOMES."""
    seconds: float
    group_size: int
    reason: str = ""
    left_out: float = 0.0
    """The share of this peer's contribution that its group's reducers left out because it arrived after their
    grace window (averaging/pipeline/stragglers.py); this peer still received the group's average."""
    judged_slow: bool = False
    """Its group found this peer's replies late in earlier rounds and gave it nothing to reduce in this one."""
    peers: Tuple[str, ...] = ()
    """The group's peer ids (base58), this peer's among them, where the round formed one."""

    @property
    def late(self) -> bool:
        """Whether this peer was too slow for its group in this round (averaging/pipeline/stragglers.py)."""
        return self.left_out > 0 or self.judged_slow


@dataclass(frozen=True)
class SwarmView:
    """The swarm's progress toward its next global epoch, as this peer last saw it."""

    peers: int
    """Training peers visible (this one included once it has reported)."""
    samples_per_second: float
    """This peer's own rate."""
    samples_accumulated: int
    """Samples the swarm has accumulated toward the target in the current global epoch."""
    target_batch_size: int
    global_epoch: int

    @property
    def swarm_samples_per_second(self) -> float:
        """The swarm's rate, estimated as this peer's rate times the visible peers."""
        return self.samples_per_second * max(1, self.peers)

    @property
    def progress_ratio(self) -> float:
        return self.samples_accumulated / max(1, self.target_batch_size)


@dataclass(frozen=True)
class RoundLength:
    """How long this peer's outer rounds are as it enters an epoch (DiLoCo: averaging/strategies/round_length.py)."""

    epoch: int
    factor: int
    """The swarm's round factor at `epoch`: the round is factor x --target-batch-size samples long."""
    requested: int
    """The factor this peer asks the swarm for (1 without an upload budget)."""
    max_factor: int
    """--max-round-factor, the run's longest round."""
    budget_mbit: Optional[float] = None
    """--max-upload-mbit; None: no budget."""
    meets_budget: bool = True
    """False while even the longest round would send more than the budget."""
    needed_mbit: Optional[float] = None
    """What averaging sends, in Mbit/s, at the factor it asks for (None until a round with others is measured)."""


@dataclass
class AveragingHooks:
    """Callbacks from the optimizer to whoever is watching; all optional."""

    phase: Callable[[str], ContextManager] = lambda name: nullcontext()
    """Context manager timing a blocking phase on the training thread (averaging, state_sync)."""
    round_finished: Callable[[RoundReport], None] = lambda report: None
    state_loaded: Callable[[int], None] = lambda epoch: None
    """Called with the new local epoch after state was downloaded from peers."""
    contribution_dropped: Callable[[str], None] = lambda reason: None
    """A reducer of this peer left another peer's contribution out (reason: averaging/pipeline/robust.py's Drop)."""
    peer_excluded: Callable[[str], None] = lambda peer_id: None
    """This peer excluded another one (base58 id) after repeated dropped contributions."""
    contribution_accepted: Callable[[str, float], None] = lambda peer_id, samples: None
    """A reducer of this peer used another peer's (base58) contribution to a round, weighing `samples` (after any
    cap): what this peer observed that peer give. Only for rounds whose weights are sample counts; called from a
    background thread."""
    state_checked: Callable[[Any], None] = lambda check: None
    """This peer compared its state with the swarm's (averaging/swarm/digests.py StateCheck): once per change,
    and at each epoch it is found apart. Called from a background thread."""
    download_rejected: Callable[[str, str], None] = lambda donor, reason: None
    """A downloaded state from `donor` (base58) was refused, for `reason` (averaging/swarm/digests.py)."""
    reducing_changed: Callable[[bool], None] = lambda reduces: None
    """This peer stopped (False) or resumed (True) reducing parts of the average for its groups: its contributions
    came too late for them, or are in time again (averaging/pipeline/stragglers.py)."""
    before_round: Callable[[int], None] = lambda epoch: None
    """Called as this peer's averaging round at local `epoch` begins (sync, diloco); an exception it raises fails
    the round like any other failure. For fault injection in tests (peer/testing/faults.py)."""
    serve_state: Optional[Callable[[List[torch.Tensor]], List[torch.Tensor]]] = None
    """What this peer serves to a peer downloading its state, instead of its state (None: its state). For fault
    injection in tests: a hostile donor (peer/testing/faults.py)."""
    round_length: Callable[[RoundLength], None] = lambda length: None
    """As this peer enters an epoch: its round factor, what it asks for and its upload budget (DiLoCo)."""
    guards_gradients: Callable[[], bool] = lambda: True
    """Whether a batch whose gradients hold NaN or Inf is dropped before it reaches the swarm (sync). Always, but
    for fault injection in tests: a hostile peer that sends them on purpose."""


@dataclass
class Replica:
    """What an optimizer of any strategy is built for: this peer's model and the swarm it trains with."""

    dht: Any
    """A started hivemind.DHT."""
    keys: SwarmKeys
    params: Iterable[torch.Tensor]
    optimizer_factory: Callable
    scheduler_factory: Optional[Callable] = None
    batch_size: int = 1
    client_mode: Optional[bool] = None
    """None: the DHT's mode."""
    hooks: AveragingHooks = field(default_factory=AveragingHooks)


@runtime_checkable
class SwarmProgress(Protocol):
    """What both callers read: the epoch, the swarm's progress, and a state download."""

    @property
    def local_epoch(self) -> int:
        """The global epoch this peer's parameters belong to."""

    def swarm_view(self, refresh_timeout_seconds: Optional[float] = None) -> SwarmView:
        """The swarm's progress; with a timeout, fetched afresh first (waiting at most that long)."""

    def load_state_from_peers(self) -> bool:
        """Download the swarm's newest state, with bounded attempts; True if a peer's state was loaded."""


@runtime_checkable
class LoopOptimizer(SwarmProgress, Protocol):
    """What the training loop uses (peer/runtime/trainer.py, and its checkpoints: peer/runtime/resume.py)."""

    @property
    def scheduler(self) -> Optional[Any]:
        """The task's LR scheduler (stepped once per global epoch), or None."""

    def step(self, batch_size: Optional[int] = None) -> None:
        """Account one local batch (gradients are in the parameters' .grad); may average or download."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    @property
    def task_optimizer(self) -> torch.optim.Optimizer:
        """The task's torch optimizer as this strategy steps it (DiLoCo: the inner one); its state lives with the
        parameters, or on the host with --offload-optimizer."""

    def pause(self) -> None:
        """Stand aside, after the current step: rounds scheduled ahead go on without this peer's weight, the
        samples it accumulated toward this epoch are dropped, and its progress record says it accumulates
        nothing, so that no peer waits on it or counts on its rate. Its process, identity and state stay."""

    def resume(self) -> None:
        """Count samples again (whether the swarm moved on meanwhile is the session's to find out)."""

    def refuse(self, peers: Iterable[str]) -> None:
        """Stop averaging with these peers (base58) and taking state from them, for the rest of the run (this peer
        found the updates of their groups harmful: averaging/pipeline/update_check.py)."""

    def wait_for_background_updates(self) -> None:
        """Apply any in-flight background update, so that the parameters are final (before a checkpoint)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


@runtime_checkable
class SessionOptimizer(SwarmProgress, Protocol):
    """What the swarm session uses (peer/runtime/session.py): joining, the deadlines, leaving with the swarm's state."""

    @property
    def deadlines(self) -> Deadlines:
        """The matchmaking window and round timeout in force now (they adapt with 'auto')."""

    @property
    def apart(self) -> bool:
        """Whether a round that went wrong (APART) may have left this peer's state different from the swarm's, or
        its state digest was found apart from the swarm's, and it has not downloaded since."""

    @property
    def averages_after_epoch(self) -> bool:
        """Whether its rounds run once the epoch they lead to has begun (local-sgd's parameter rounds, in the
        background): a peer already at that epoch may still join one."""

    @property
    def averages_in_groups(self) -> bool:
        """Whether its rounds average groups of the swarm, not all of it (--target-group-size): peers whose rounds
        were whole may still hold different states, so at their last epoch all of them take one peer's state."""

    def await_state_comparison(self, timeout_seconds: float,
                               expected_peers: Optional[Callable[[], int]] = None) -> None:
        """Where peers check state digests: wait (at most `timeout_seconds`) until this peer's state at its epoch
        has been compared with every peer's it counts, so that `apart` tells (a peer leaving at its last epoch).
        `expected_peers`: how many peers, this one included, may still publish a digest there, where the caller
        knows better than the swarm's progress (a peer whose last round failed publishes none)."""

    def state_apart_now(self) -> bool:
        """Compare this peer's state digest with the swarm's as they are now; whether it is apart. Between epochs the
        comparison rests once it has seen every peer it counts, but the digests at a last epoch go on changing as
        the peers there download. False for a strategy that checks no digests."""

    def download_swarm_state(self) -> bool:
        """If this peer's state digest was found apart from the swarm's, download the swarm's state now, from a peer
        that holds it; True if one was loaded. A strategy that checks no digests downloads nothing."""

    @property
    def downloaded_at_epoch(self) -> Optional[int]:
        """The epoch of the last state this peer downloaded (None if it never did)."""

    def announce(self) -> None:
        """Publish this peer's progress record now, even with no samples yet, so that others count it."""

    def load_state_from_donor_ahead(self) -> bool:
        """If another peer offers a state at this peer's epoch or later, download it now; True if one was loaded.
        For a peer apart from the swarm at its last epoch: the peers that are done may have stopped reporting
        progress, but they still offer their state."""

    def offer_final_state(self) -> bool:
        """Rank this peer's state first among donors at its epoch, once its updates are applied; True once
        the swarm can see that (leaving peers whose last round failed then download from this one). Offers rank
        among themselves by peer id (averaging/swarm/donor.py)."""

    def download_final_state(self) -> bool:
        """Download the state of the best-ranked donor at this peer's epoch (an offer, if one is declared); True if
        one was loaded. It remembers the best offer it saw, loaded or not, for `better_final_offer`."""

    def better_final_offer(self) -> bool:
        """Whether a final state is offered at this peer's epoch that ranks above the one it holds (its own offer,
        or the best one offered when it downloaded): with grouped rounds, two peers that saw different parts of
        the swarm may each offer a state of their own."""

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        """Leave the swarm: stop the background processes, with bounded waits."""


@runtime_checkable
class SwarmOptimizer(LoopOptimizer, SessionOptimizer, Protocol):
    """Both sides: what every strategy builds (averaging/registry.py), and the composition root hands each caller
    the side it uses."""
