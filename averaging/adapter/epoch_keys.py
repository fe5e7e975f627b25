"""Rounds of one epoch: the epoch a round leads to is part of the key its peers meet under.

hivemind groups every peer that looks for a group under the averager's key, whatever epoch each is at. A
peer one epoch behind that joins the others' next round averages another epoch's gradients into its own
and leaves it one epoch behind them, with other parameters; the others' round counted it, so none of them
knows. (Seen in the swarm tests on loaded machines: a peer that stayed a step out and downloaded the
swarm's state at every epoch after a partition healed.)

So every round carries the epoch it leads to as the data its group gathers: the state averager's rounds
already do (upstream gathers the new `local_epoch`), and the gradient and outer rounds get it from
`gather_epochs`. The averager process reads it back from the round and looks for a group under
`<prefix>_e<epoch>.0b<bits>` instead of `<prefix>.0b<bits>`: peers of different epochs never meet, and
a lagging peer's round fails instead (the strategy then downloads the swarm's state). A round that gathers
no epoch keeps upstream's key.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.utils import MSGPackSerializer

_looking_for_group = Matchmaking.looking_for_group


def round_epoch(step: StepControl) -> Optional[int]:
    """The epoch a round leads to, as it gathers it (None: it gathers something else, or nothing)."""
    try:
        # DecentralizedAverager.step packs [bandwidth, mode, the user's gathered data serialized]
        _bandwidth, _mode, gathered = MSGPackSerializer.loads(step.data_for_gather)
        epoch = MSGPackSerializer.loads(gathered)
    except (TypeError, ValueError):
        return None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


@contextlib.asynccontextmanager
async def looking_for_group_in_epoch(self: Matchmaking, step_control: StepControl):
    # inside upstream's lock: one round looks for a group at a time, so the key is that round's for its whole search
    async with _looking_for_group(self, step_control):
        self.group_key_manager.round_epoch = round_epoch(step_control)
        try:
            yield
        finally:
            self.group_key_manager.round_epoch = None


def epoch_group_key(self: GroupKeyManager) -> str:
    epoch = getattr(self, "round_epoch", None)
    prefix = self.prefix if epoch is None else f"{self.prefix}_e{epoch}"  # no dot: hivemind's key pattern
    return f"{prefix}.0b{self.group_bits}"


def gather_epochs(averager: DecentralizedAverager, next_epoch: Callable[[], int]) -> None:
    """Make every round this averager schedules gather `next_epoch()`, the epoch it leads to (unless the caller
    gathers something else). Upstream's gradient rounds, pre-scheduled or not, all pass through schedule_step."""
    schedule_step = averager.schedule_step

    def schedule_step_in_epoch(*args, **kwargs):
        if kwargs.get("gather") is None:
            kwargs["gather"] = next_epoch()
        return schedule_step(*args, **kwargs)

    averager.schedule_step = schedule_step_in_epoch


PATCHES: Dict[str, Callable] = {
    "hivemind.averaging.matchmaking.Matchmaking.looking_for_group": looking_for_group_in_epoch,
    "hivemind.averaging.key_manager.GroupKeyManager.current_key": property(epoch_group_key),
}
