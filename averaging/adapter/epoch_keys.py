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
deals the round's group (averaging/swarm/groups.py) and writes it, with the epoch it is for and how many peers were
dealt into it, to a small array shared with the averager process (`ChosenGroup`); the averager process reads it
when the round starts looking for a group, and uses it if it is for that round's epoch. Such a round knows whom it
waits for, so its leader closes the group as soon as all of them have joined (hivemind's target group size, set for
the round), and until then waits GROUP_WINDOW_FACTOR times the matchmaking window. With one window, the members of
a dealt group that reached the epoch's end a few seconds apart met in pairs, or not at all: 16 peers in groups of 4
on one 2-core machine averaged in pairs in 49 of 64 peer-rounds, never in fours. A peer that comes after its group
has closed finds nobody under its key; it stops looking after GROUP_SEARCH_WINDOWS of those windows (the round
fails, and the peer takes a group's state), where it waited for the round's whole timeout (60 s). A round of the
whole swarm knows no such count and keeps the window.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
from typing import Callable, Dict, Optional, Tuple

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.utils import MSGPackSerializer, get_dht_time

_looking_for_group = Matchmaking.looking_for_group
_NONE = -1
GROUP_WINDOW_FACTOR = 3.0
GROUP_SEARCH_WINDOWS = 2


class ChosenGroup:
    """The group an averager's next round looks for, chosen in the training process and read in the averager's own
    process: make it before the averager process forks, and `use` it in that process."""

    def __init__(self):
        self._shared = mp.RawArray(ctypes.c_longlong, [_NONE, _NONE, _NONE])  # the epoch, the group, its size

    def choose(self, epoch: int, group: int, size: int) -> None:
        """The round that leads to `epoch` looks for `group`, into which `size` peers were dealt."""
        self._shared[:] = [epoch, group, size]

    def of_round(self, epoch: Optional[int]) -> Optional[Tuple[int, int]]:
        """The group chosen for the round that leads to `epoch` and its size, if one was."""
        chosen_epoch, group, size = self._shared[:]
        return (group, size) if epoch is not None and chosen_epoch == epoch and group != _NONE else None

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
        dealt = _chosen_group.of_round(epoch) if _chosen_group is not None else None
        group, size = dealt if dealt is not None else (None, None)
        self.group_key_manager.round_epoch, self.group_key_manager.round_group = epoch, group
        upstream = self.target_group_size, self.min_matchmaking_time
        if size is not None:
            self.target_group_size = size  # the leader closes the group once they are all in
            # the round's own window: the floor, or until its scheduled start (how an 'auto' window reaches it)
            window = GROUP_WINDOW_FACTOR * max(self.min_matchmaking_time, step_control.scheduled_time - get_dht_time())
            self.min_matchmaking_time = self.potential_leaders.min_matchmaking_time = window
            # a peer that came after its group closed waits for nobody: it stops looking after two windows
            step_control._deadline = min(step_control.deadline, get_dht_time() + GROUP_SEARCH_WINDOWS * window)
        try:
            yield
        finally:
            self.group_key_manager.round_epoch = self.group_key_manager.round_group = None
            self.target_group_size, self.min_matchmaking_time = upstream
            self.potential_leaders.min_matchmaking_time = self.min_matchmaking_time


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
