"""DiLoCo's outer round: the all-reduce of the pseudo-gradients, and the outer Nesterov step on its result.

An OuterRound is launched with this peer's pseudo-gradient, and collected either at once or, with
--diloco-overlap, once it has landed. Collecting never raises: a round that failed, timed out or
returned NaN/Inf gives back this peer's own pseudo-gradient, with a report that says why; alone in
the swarm, there is nothing to average. The round start, the epochs and the state are
averaging/strategies/diloco.py's; this module must not know about them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl

from averaging.api import RoundReport
from averaging.pipeline import completeness
from averaging.pipeline.guards import all_finite

logger = logging.getLogger(__name__)


@torch.no_grad()
def outer_nesterov_step_(
    params: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    lr: float, momentum: float,
) -> None:
    """In place, what torch.optim.SGD(lr, momentum, nesterov=True, dampening=0) does with these grads."""
    for param, velocity, grad in zip(params, momenta, grads):
        velocity.mul_(momentum).add_(grad)
        param.sub_(grad.add(velocity, alpha=momentum), alpha=lr)


@dataclass
class OuterRound:
    """An outer round under way: its all-reduce, and this peer's pseudo-gradient to fall back on."""

    pseudo_grads: List[torch.Tensor]
    started: float
    deadline: float
    control: Optional[StepControl] = None
    outcome: Optional[Tuple[RoundReport, List[torch.Tensor]]] = None  # known at launch: skipped, or failed

    def landed(self) -> bool:
        return self.outcome is not None or self.control.done()

    def cancel(self) -> None:
        """Stop waiting for its all-reduce (the state that replaces this peer's makes it moot)."""
        if self.control is not None and not self.control.done():
            self.control.cancel()


def launch_round(averager: DecentralizedAverager, pseudo_grads: List[torch.Tensor], *, epoch: int, weight: float,
           timeout_seconds: float, alone: bool, before_round: Callable[[], None]) -> OuterRound:
    """Start averaging `pseudo_grads` with a group through `averager` (its tensors: one buffer per parameter), with
    the peers whose round leads to `epoch` too (averaging/adapter/epoch_keys.py)."""
    started = time.monotonic()
    flight = OuterRound(pseudo_grads, started, started + timeout_seconds)
    if alone:
        flight.outcome = RoundReport("skipped", 0.0, 1, "no other peers"), pseudo_grads
        return flight
    with torch.no_grad(), averager.get_tensors() as buffers:
        for buffer, grad in zip(buffers, pseudo_grads):
            buffer.copy_(grad)
    try:
        before_round()
        flight.control = averager.step(gather=epoch, weight=weight, timeout=timeout_seconds, wait=False)
    except BaseException as e:  # hivemind raises many kinds; all of them mean "use the local delta"
        flight.outcome = _failed(flight, e)
    return flight


def collect_round(averager: DecentralizedAverager, flight: OuterRound) -> Tuple[RoundReport, List[torch.Tensor]]:
    """The round's report and the average, waiting at most until its deadline; on any failure, this peer's
    own pseudo-gradient."""
    if flight.outcome is not None:
        return flight.outcome
    try:
        gathered = flight.control.result(timeout=max(0.0, flight.deadline - time.monotonic()))
        with torch.no_grad(), averager.get_tensors() as buffers:
            averaged = [buffer.clone() for buffer in buffers]
    except BaseException as e:
        flight.cancel()
        return _failed(flight, e)
    seconds = time.monotonic() - flight.started
    if not all_finite(averaged):  # a peer sent NaN/Inf: never apply it
        logger.warning("the averaged pseudo-gradients hold NaN or Inf; using this peer's own")
        return RoundReport("failed", seconds, len(gathered), "non-finite result"), flight.pseudo_grads
    report = completeness.round_report(averager, seconds, len(gathered), tuple(peer.to_base58() for peer in gathered))
    if report.outcome == "partial":  # still nearer the swarm's than this peer's own
        logger.warning(f"outer averaging round partial ({report.reason})")
    return report, averaged


def _failed(flight: OuterRound, error: BaseException) -> Tuple[RoundReport, List[torch.Tensor]]:
    outcome = "timeout" if isinstance(error, TimeoutError) else "failed"
    logger.warning(f"outer averaging round {outcome} ({error!r}); using this peer's pseudo-gradient")
    return RoundReport(outcome, time.monotonic() - flight.started, 1, repr(error)), flight.pseudo_grads
