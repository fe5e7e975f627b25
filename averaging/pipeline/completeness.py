"""Whether an all-reduce round delivered every part of the average to this peer.

hivemind finishes a round even when a reducer's averaged part never arrived in time: it logs
"Averaging: received X% results", keeps this peer's own values for that part, and returns as if the
round had succeeded. The peers that did receive the part hold the average there, so after such a
partial round this peer is apart from the swarm. Gradient and pseudo-gradient averaging never bring
peers back together by themselves: such a peer must download the state of one whose round was whole.

The averager's process runs the all-reduce and the training process reads its outcome, so every averager
carries a Completeness stage (averaging/pipeline/round_pipeline.py) with a value in shared memory: it is allocated
before the averager forks (`prepare`), the averager's process writes the fraction of values that never
arrived after every all-reduce it runs (`finish`), and the training process reads it once the round's result
is in (`missing_fraction`). Rounds of one averager run one at a time, so the value read after a round's result
is that round's. A round may run several all-reduces in one group (PowerSGD runs two): it counts as partial
if any was.

The same way, it records how the round's timing went (averaging/pipeline/stragglers.py): the share of this
peer's own contribution that reducers left out because it came after their grace window, whether its group gave
it nothing to reduce because its replies came late before (such rounds are whole for this peer: it received the
group's average, but it was too slow for its group), and the reducers whose replies came late to this peer (its
claim to its next group).
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
from typing import FrozenSet, Tuple

from averaging.api import RoundReport
from averaging.pipeline import round_pipeline
from averaging.pipeline.peer_set import SharedPeerSet
from averaging.pipeline.round_pipeline import RoundEnd, RoundStage


class Completeness(RoundStage):
    """The completeness stage: the share of the last round's average that never reached this peer."""

    def __init__(self):
        self._missing = self._left_out = self._judged_slow = None  # shared memory, allocated before the fork
        self._late_reducers = None
        self._last_group = None  # lives in the averager's process only

    def prepare(self, averaged_tensors) -> None:
        self._missing = mp.RawValue(ctypes.c_double, 0.0)
        self._left_out = mp.RawValue(ctypes.c_double, 0.0)
        self._judged_slow = mp.RawValue(ctypes.c_bool, False)
        self._late_reducers = SharedPeerSet()

    def finish(self, end: RoundEnd) -> None:
        if self._missing is None:
            return
        missing = end.failed_size / end.total_size if end.total_size else 0.0
        left_out = end.left_out_size / end.total_size if end.total_size else 0.0
        late, judged_slow = set(end.late_reducers), end.judged_slow
        if self._last_group == end.group_id:  # another all-reduce of the same round (PowerSGD's second phase)
            missing, left_out = max(missing, self._missing.value), max(left_out, self._left_out.value)
            late |= {peer.to_base58() for peer in self._late_reducers.get()}
            judged_slow = judged_slow or self._judged_slow.value
        self._last_group = end.group_id
        self._missing.value, self._left_out.value, self._judged_slow.value = missing, left_out, judged_slow
        self._late_reducers.set(late)

    def missing_fraction(self) -> float:
        return 0.0 if self._missing is None else float(self._missing.value)

    def left_out_fraction(self) -> float:
        return 0.0 if self._left_out is None else float(self._left_out.value)

    def judged_slow(self) -> bool:
        return self._judged_slow is not None and bool(self._judged_slow.value)

    def late_reducers(self) -> FrozenSet[str]:
        """Base58 ids of the reducers whose replies came late in the last round."""
        if self._late_reducers is None:
            return frozenset()
        return frozenset(peer.to_base58() for peer in self._late_reducers.get())


def missing_fraction(averager) -> float:
    """The fraction of values the averager's last all-reduce did not receive (0.0 when it was whole)."""
    stage = round_pipeline.of(averager).stage(Completeness)
    return 0.0 if stage is None else stage.missing_fraction()


def round_report(averager, seconds: float, group_size: int, peers: Tuple[str, ...] = ()) -> RoundReport:
    """The report of a round whose result is in: ok, or partial if some of the average never arrived; with the
    share of this peer's contribution that was left out as late, and the group's peer ids."""
    stage = round_pipeline.of(averager).stage(Completeness) or Completeness()
    timing = dict(left_out=stage.left_out_fraction(), judged_slow=stage.judged_slow(), peers=peers)
    missing = stage.missing_fraction()
    if not missing:
        return RoundReport("ok", seconds, group_size, **timing)
    return RoundReport("partial", seconds, group_size,
                       f"received {100 * (1 - missing):.1f}% of the average: a reducer's part arrived too late, "
                       f"so this peer kept its own values there", **timing)


def late_reducers(averager) -> FrozenSet[str]:
    """The reducers whose replies came late to the averager's last round (none for an averager without the stage)."""
    stage = round_pipeline.of(averager).stage(Completeness)
    return frozenset() if stage is None else stage.late_reducers()
