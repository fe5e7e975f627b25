"""Faults that a test injects into one real peer, on purpose, at points the peer itself chooses.

`peer start --inject-faults JSON` takes a FaultPlan; the option is for tests only, and `peer start
--help` does not list it. The trainer and the averaging rounds consult a FaultInjector at fixed
points, so a test says what goes wrong and when, instead of patching private methods:

- `nan_loss_at_steps`: the loss of these local batches (1 = the first) is NaN: each is skipped as any
  non-finite batch is, and a long enough run of them ends in TrainingDiverged;
- `nan_gradients_at_steps`: the loss of these batches is finite but their gradients are NaN: the
  optimizer's own guard must drop them before they reach a round;
- `fail_round_at_epoch`: this peer's averaging round at that local epoch fails as it begins (sync and
  diloco): reported as `failed`, and handled as any failed round (local gradients, then a resync);
- `stall_after_epoch` / `stall_seconds`: after reporting that global epoch, the loop stalls between two
  steps (a stop request ends the stall): past the averaging timeout, the peer misses the next round;
- `perturb_params_at_epoch`: after reporting that global epoch (or the first past it, where a download
  skipped it), every parameter moves by noise of
  `perturb_scale` times its own scale: the peer drifts from the swarm without any round telling it. A state
  download that replaces the perturbed state before a digest comparison has found it apart (a failed round's,
  under load) takes the drift with it: the next epoch perturbs again, until a comparison finds it.

Each of those happens once. Two more are not faults but a test's control over the run:

- `end_at_epoch_file`: once this file exists, the epoch it holds ends the run as --max-epochs would
  (the lower of the two wins). A test that has made its checks ends a swarm sized for the worst load
  with Swarm.end_soon(), and every peer still leaves at the same epoch, with the same weights.
- `join_when_file_exists`: the peer imports, builds its task and serves its metrics, then waits until
  this file exists before it starts its DHT and joins (a stop request ends the wait). A test that lets
  peers in one at a time starts the next one early, and its turn costs only the joining.

Three more make this peer a hostile one, for all of its run:

- `gradient_factor`: every gradient it computes is multiplied by this (1e4: far too large; -1:
  sign-flipped, as large as an honest one and pointing the other way), and sent to the swarm;
- `send_nan_gradients`: every gradient it computes is NaN, and sent past its own guard (which would
  drop such a batch), as a broken or malicious peer's would be;
- `serve_corrupted_state`: it trains honestly, but a peer that downloads its state gets every tensor
  negated, and it claims a priority nearly two steps ahead of its epoch so that downloading peers pick it first.

And one keeps a peer out of the others' way:

- `serve_no_state`: it declares itself no donor and refuses every state download, as upstream's
  `allow_state_sharing=False` does; it still downloads. A drifter that serves its perturbed state is
  refused by digest and excluded by whoever took it (the state differs from the one it published), and an
  excluded peer is served no state: a test of what the drifter itself refuses keeps it from serving.

Every injected fault is logged as a warning that says it was injected.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Callable, Iterable, List, Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class FaultPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    nan_loss_at_steps: List[PositiveInt] = Field(default_factory=list)
    nan_gradients_at_steps: List[PositiveInt] = Field(default_factory=list)
    fail_round_at_epoch: Optional[int] = Field(default=None, ge=0)
    stall_after_epoch: Optional[int] = Field(default=None, ge=0)
    stall_seconds: float = Field(default=0.0, ge=0, le=3600)
    perturb_params_at_epoch: Optional[int] = Field(default=None, ge=0)
    perturb_scale: float = Field(default=1e-2, gt=0, le=1)
    serve_corrupted_state: bool = False
    serve_no_state: bool = False
    gradient_factor: Optional[float] = None
    send_nan_gradients: bool = False
    end_at_epoch_file: Optional[str] = None
    join_when_file_exists: Optional[str] = None


HOSTILE_PEERS = {
    "nan": FaultPlan(send_nan_gradients=True),
    "scaled-1e4": FaultPlan(gradient_factor=1e4),
    "sign-flipped": FaultPlan(gradient_factor=-1.0),
}
"""The attackers that the robustness test and benchmark send against honest peers, by name."""


def _scaled_gradient(loss: torch.Tensor, factor: float) -> torch.Tensor:
    """The identity on the loss; its gradient is multiplied by `factor` (NaN: the gradients are NaN)."""
    return _scaled_gradient_function().apply(loss, factor)


@functools.lru_cache(maxsize=None)
def _scaled_gradient_function():
    import torch  # here, not at the top: `peer swarm` and the test harness read a FaultPlan without torch

    class ScaledGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, loss, factor: float):
            ctx.factor = factor
            return loss.view_as(loss)

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.factor, None

    return ScaledGradient


class InjectedFault(RuntimeError):
    """Raised where a FaultPlan makes a round fail."""


class FaultInjector:
    """Consulted by the trainer (losses, epochs) and the averaging hooks (rounds); does nothing without a plan."""

    def __init__(self, plan: Optional[FaultPlan] = None, wait: Callable[[float], object] = lambda seconds: None):
        self.plan = plan or FaultPlan()
        self.wait = wait  # a stop-aware sleep: a stop request ends a stall
        self._batches = 0
        self._round_failed = self._stalled = self._perturbed = self._drift_found = False
        # a hostile peer's factor on every gradient (NaN: sent past its own guard)
        self._hostile_factor = float("nan") if self.plan.send_nan_gradients else self.plan.gradient_factor
        if self._hostile_factor is not None:
            logger.warning(f"injected fault: every gradient this peer sends is multiplied by {self._hostile_factor:g}")

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of the next local batch, NaN (or with NaN or scaled gradients) where the plan says so."""
        self._batches += 1
        if self._batches in self.plan.nan_loss_at_steps:
            logger.warning(f"injected fault: the loss of local batch {self._batches} is NaN")
            return loss * float("nan")
        if self._batches in self.plan.nan_gradients_at_steps:
            logger.warning(f"injected fault: the gradients of local batch {self._batches} are NaN")
            return _scaled_gradient(loss, float("nan"))
        if self._hostile_factor is not None:
            return _scaled_gradient(loss, self._hostile_factor)
        return loss

    def max_epochs(self, configured: Optional[int]) -> Optional[int]:
        """--max-epochs, or the epoch in the plan's end_at_epoch_file once it exists, whichever is lower."""
        if self.plan.end_at_epoch_file is None:
            return configured
        try:
            with open(self.plan.end_at_epoch_file) as file:
                requested = int(file.read())
        except (OSError, ValueError):  # not written yet (Swarm.end_soon writes it whole, with a rename)
            return configured
        return requested if configured is None else min(configured, requested)

    def hold_before_joining(self) -> None:
        """Wait until the plan's join_when_file_exists exists, or a stop request comes."""
        path = self.plan.join_when_file_exists
        if path is None:
            return
        logger.warning(f"injected: waiting for {path} to exist before joining the swarm")
        while not os.path.exists(path) and not self.wait(0.1):
            pass

    def guards_gradients(self) -> bool:
        """Whether the optimizer may drop this peer's non-finite gradients before they reach a round."""
        return not self.plan.send_nan_gradients

    def before_round(self, epoch: int) -> None:
        """:raises InjectedFault: at the plan's epoch, once"""
        if epoch != self.plan.fail_round_at_epoch or self._round_failed:
            return
        self._round_failed = True
        logger.warning(f"injected fault: failing this peer's averaging round at epoch {epoch}")
        raise InjectedFault(f"injected: the round at epoch {epoch} fails")

    def serve_state_hook(self) -> Optional[Callable[[List[torch.Tensor]], List[torch.Tensor]]]:
        """What this peer serves instead of its state, when the plan makes it a hostile donor (else None)."""
        if not self.plan.serve_corrupted_state:
            return None
        logger.warning("injected fault: this peer serves its state negated to peers that download it")

        def negated(tensors):
            return [-tensor if tensor.is_floating_point() else tensor for tensor in tensors]
        return negated

    def shares_state(self) -> bool:
        """Whether this peer serves its state to peers that download it."""
        if self.plan.serve_no_state:
            logger.warning("injected fault: this peer serves no state to peers that download it")
        return not self.plan.serve_no_state

    def after_epoch(self, epoch: int, parameters: Iterable[torch.Tensor] = ()) -> None:
        at = self.plan.perturb_params_at_epoch
        if at is not None and epoch >= at and not self._perturbed:
            self._perturb(epoch, parameters)
        if epoch != self.plan.stall_after_epoch or self._stalled:
            return
        self._stalled = True
        logger.warning(f"injected fault: stalling {self.plan.stall_seconds:g}s after epoch {epoch}")
        self.wait(self.plan.stall_seconds)

    def state_loaded(self, epoch: int) -> None:
        """A download replaced this peer's state: a perturbation no comparison has found yet went with it."""
        if self._perturbed and not self._drift_found:
            logger.warning(f"injected fault: a download at epoch {epoch} replaced the perturbed state before the "
                           f"digests found it; perturbing again after the next epoch")
            self._perturbed = False

    def state_checked(self, check) -> None:
        if self._perturbed and not check.agrees:
            self._drift_found = True

    def _perturb(self, epoch: int, parameters: Iterable[torch.Tensor]) -> None:
        import torch

        self._perturbed = True
        logger.warning(f"injected fault: perturbing this peer's parameters after epoch {epoch}")
        generator = torch.Generator().manual_seed(epoch)
        with torch.no_grad():
            for param in parameters:
                noise = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
                param.add_(noise * self.plan.perturb_scale * (param.float().std().item() if param.numel() > 1 else 1.0))
