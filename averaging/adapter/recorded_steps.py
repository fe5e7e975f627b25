"""Open rounds: every round started in this process is recorded, so that a leaving peer can drop the rounds
nobody will join (averaging/swarm/open_rounds.py)."""
from __future__ import annotations

import weakref
from typing import Callable, Dict

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import StepControl

open_rounds: "weakref.WeakSet[StepControl]" = weakref.WeakSet()
"""Every round started in this process with wait=False that is still referenced somewhere."""
unrecorded_step = DecentralizedAverager.step


def recorded_step(self: DecentralizedAverager, *args, **kwargs):
    result = unrecorded_step(self, *args, **kwargs)
    if isinstance(result, StepControl):  # wait=False: the round goes on in the background
        open_rounds.add(result)
    return result


PATCHES: Dict[str, Callable] = {"hivemind.averaging.averager.DecentralizedAverager.step": recorded_step}
