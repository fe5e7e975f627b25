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

The same way, it records the share of this peer's own contribution that reducers left out because it arrived
after their grace window (averaging/pipeline/stragglers.py): such a round is whole for this peer (it received the
group's average), but this peer was too slow for its group.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp

from averaging.api import RoundReport
from averaging.pipeline import round_pipeline
from averaging.pipeline.round_pipeline import RoundStage


class Completeness(RoundStage):
    """The completeness stage: the share of the last round's average that never reached this peer."""

    def __init__(self):
        self._missing = self._left_out = None  # shared memory, allocated before the averager forks
        self._last_group = None  # lives in the averager's process only

    def prepare(self, averaged_tensors) -> None:
        self._missing = mp.RawValue(ctypes.c_double, 0.0)
        self._left_out = mp.RawValue(ctypes.c_double, 0.0)

    def finish(self, group_id: bytes, failed_size: int, total_size: int, left_out_size: int = 0) -> None:
        if self._missing is None:
            return
        missing = failed_size / total_size if total_size else 0.0
        left_out = left_out_size / total_size if total_size else 0.0
        if self._last_group == group_id:
            missing, left_out = max(missing, self._missing.value), max(left_out, self._left_out.value)
        self._last_group = group_id
        self._missing.value, self._left_out.value = missing, left_out

    def missing_fraction(self) -> float:
        return 0.0 if self._missing is None else float(self._missing.value)

    def left_out_fraction(self) -> float:
        return 0.0 if self._left_out is None else float(self._left_out.value)


def missing_fraction(averager) -> float:
    """The fraction of values the averager's last all-reduce did not receive (0.0 when it was whole)."""
    stage = round_pipeline.of(averager).stage(Completeness)
    return 0.0 if stage is None else stage.missing_fraction()


def round_report(averager, seconds: float, group_size: int) -> RoundReport:
    """The report of a round whose result is in: ok, or partial if some of the average never arrived; with the
    share of this peer's contribution that was left out as late."""
    stage = round_pipeline.of(averager).stage(Completeness)
    missing, left_out = (0.0, 0.0) if stage is None else (stage.missing_fraction(), stage.left_out_fraction())
    if not missing:
        return RoundReport("ok", seconds, group_size, left_out=left_out)
    return RoundReport("partial", seconds, group_size,
                       f"received {100 * (1 - missing):.1f}% of the average: a reducer's part arrived too late, "
                       f"so this peer kept its own values there", left_out=left_out)
