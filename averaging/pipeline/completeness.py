"""Whether an all-reduce round delivered every part of the average to this peer.

hivemind finishes a round even when a reducer's averaged part never arrived in time: it logs
"Averaging: received X% results", keeps this peer's own values for that part, and returns as if the
round had succeeded. The peers that did receive the part hold the average there, so after such a
partial round this peer is apart from the swarm. Gradient and pseudo-gradient averaging never bring
peers back together by themselves: such a peer must download the state of one whose round was whole.

The averager's process runs the all-reduce and the training process reads its outcome, so each
averager carries a value in shared memory: `attach` creates it before the averager forks, the
averager's process writes the fraction of values that never arrived after every all-reduce it
runs (`record`), and the training process reads it once the round's result is in (`missing_fraction`).
Rounds of one averager run one at a time, so the value read after a round's result is that round's.
A round may run several all-reduces in one group (PowerSGD runs two): it counts as partial if any was.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp

from averaging.api import RoundReport

_ATTRIBUTE = "_swarmtrain_missing_fraction"
_LAST_GROUP = "_swarmtrain_last_recorded_group"  # lives in the averager's process only


def attach(averager) -> None:
    """Called in the training process before the averager's process starts."""
    setattr(averager, _ATTRIBUTE, mp.RawValue(ctypes.c_double, 0.0))


def record(averager, group_id: bytes, failed_size: int, total_size: int) -> None:
    """Called in the averager's process after each all-reduce of group `group_id`; sizes in tensor elements."""
    shared = getattr(averager, _ATTRIBUTE, None)
    if shared is None:
        return
    fraction = failed_size / total_size if total_size else 0.0
    if getattr(averager, _LAST_GROUP, None) == group_id:
        fraction = max(fraction, shared.value)
    setattr(averager, _LAST_GROUP, group_id)
    shared.value = fraction


def missing_fraction(averager) -> float:
    """The fraction of values the averager's last all-reduce did not receive (0.0 when it was whole)."""
    shared = getattr(averager, _ATTRIBUTE, None)
    return 0.0 if shared is None else float(shared.value)


def round_report(averager, seconds: float, group_size: int) -> RoundReport:
    """The report of a round whose result is in: ok, or partial if some of the average never arrived."""
    missing = missing_fraction(averager)
    if not missing:
        return RoundReport("ok", seconds, group_size)
    return RoundReport("partial", seconds, group_size,
                       f"received {100 * (1 - missing):.1f}% of the average: a reducer's part arrived too late, "
                       f"so this peer kept its own values there")
