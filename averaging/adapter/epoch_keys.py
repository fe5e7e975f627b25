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

Grouped rounds (--target-group-size) meet under `<prefix>_e<epoch>g<group>.0b<bits>`: the training process
chooses the round's group (averaging/swarm/groups.py) and writes it, with the epoch it is for, to a small array
shared with the averager process (`ChosenGroup`); the averager process reads it when the round starts looking for
a group, and uses it if it is for that round's epoch.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
from typing import Callable, Dict, Optional

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.utils import MSGPackSerializer

_looking_for_group = Matchmaking.looking_for_group
_NONE = -1


class ChosenGroup:
    """The group an averager's next round looks for, chosen in the training process and read in the averager's own
    process: make it before the averager process forks, and `use` it in that process."""

    def __init__(self):
        self._shared = mp.RawArray(ctypes.c_longlong, [_NONE, _NONE])  # the epoch, the group

    def choose(self, epoch: int, group: int) -> None:
        self._shared[0], self._shared[1] = epoch, group

    def of_round(self, epoch: Optional[int]) -> Optional[int]:
        """The group chosen for the round that leads to `epoch`, if one was."""
        chosen_epoch, group = self._shared[0], self._shared[1]
        return group if epoch is not None and chosen_epoch == epoch and group != _NONE else None

    def use(self) -> None:
        """In the averager's process (one averager a process): its rounds look for the groups chosen here."""
        global _chosen_group
        _chosen_group = self


_chosen_group: Optional[ChosenGroup] = None


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
        epoch = round_epoch(step_control)
        self.group_key_manager.round_epoch = epoch
        self.group_key_manager.round_group = _chosen_group.of_round(epoch) if _chosen_group is not None else None
        try:
            yield
        finally:
            self.group_key_manager.round_epoch = self.group_key_manager.round_group = None


def epoch_group_key(self: GroupKeyManager) -> str:
    epoch, group = getattr(self, "round_epoch", None), getattr(self, "round_group", None)
    prefix = self.prefix if epoch is None else f"{self.prefix}_e{epoch}"  # no dot: hivemind's key pattern
    if epoch is not None and group is not None:
        prefix += f"g{group}"
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
