"""The round pipeline (averaging/pipeline/round_pipeline.py) driven inside hivemind's averagers.

- Before an averager forks, in the training process: the stages included around it, and a Completeness stage
  for every averager, become its pipeline, which its process inherits.
- First thing in the averager's own process: that pipeline becomes the process's (refusals.py reads it).
- Each all-reduce: upstream's `_run_allreduce_inplace_`, with canonical replies (averaging/adapter/runner.py:
  each peer copies the average's exact bits), and the stages applied at their points: error feedback's inputs,
  part container and reply residuals (which the runner updates as it encodes), a robust runner when the averager
  carries a Defence (bounding the weights when it also carries a WeightBound: its weights are sample counts), the
  grace window of its reducer (averaging/adapter/grace.py: once this peer's round is over, the runner still
  answers the senders it left out for an all-reduce timeout), and the share of the average that never arrived,
  and of this peer's contribution that was left out, recorded by the completeness stage.
"""
from __future__ import annotations

from typing import Callable, Dict

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import aenumerate, as_aiter, azip

from averaging.adapter.grace import keep_for_latecomers
from averaging.adapter.reducer import RobustAllReduceRunner
from averaging.adapter.runner import CanonicalAllReduceRunner
from averaging.pipeline import round_pipeline
from averaging.pipeline.completeness import Completeness
from averaging.pipeline.defence import Defence
from averaging.pipeline.error_feedback import ErrorFeedback
from averaging.pipeline.robust import WeightBound
from averaging.pipeline.round_pipeline import RoundEnd
from averaging.pipeline.stragglers import GraceWindow, declared, late_arrivals

LATECOMERS_SECONDS = 60.0
"""How long a finished round answers its latecomers when the averager has no all-reduce timeout."""

plain_run_in_background = DecentralizedAverager.run_in_background
plain_run = DecentralizedAverager.run


def run_in_background_with_pipeline(self: DecentralizedAverager, *args, **kwargs):
    # before the fork: the averager's process inherits its pipeline (and the shared memory its stages made)
    round_pipeline.attach(self, self._averaged_tensors, always=[Completeness()])
    return plain_run_in_background(self, *args, **kwargs)


def run_with_pipeline(self: DecentralizedAverager):
    round_pipeline.run_here(self)  # in the averager's own process
    return plain_run(self)


async def run_allreduce_inplace_through_pipeline(self: DecentralizedAverager, tensors, group_info: GroupInfo,
                                                 group_id=None, **kwargs):
    # upstream's DecentralizedAverager._run_allreduce_inplace_, with the pipeline's stages. A group that a
    # leader unaware of an exclusion formed with an excluded peer is not left: this peer's reducers drop what
    # it sends, and a peer that has not excluded it yet gets to judge it (leaving such groups split the swarm:
    # the unaware peer averaged with the attacker alone). With error feedback, the runner averages
    # x = tensors + residuals.
    pipeline = round_pipeline.of(self)
    defence, feedback = pipeline.stage(Defence), pipeline.stage(ErrorFeedback)
    group_id = group_info.group_id if group_id is None else group_id
    grace = pipeline.stage(GraceWindow)
    runner_class, extra = CanonicalAllReduceRunner, {}
    if defence is not None:
        runner_class, extra = RobustAllReduceRunner, dict(defence=defence, weight_bound=pipeline.stage(WeightBound))
    if feedback is not None and not feedback.matches(tensors):
        feedback = None  # not this averager's own tensors
    inputs = tensors
    if feedback is not None:
        with feedback.lock:
            extra["carried"] = [residual.clone() for residual in feedback.residuals]
        extra["reply_feedback"] = feedback
        inputs = [tensor.detach().float() + residual for tensor, residual in zip(tensors, extra["carried"])]
    runner = runner_class(
        p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=inputs, group_id=group_id,
        ordered_peer_ids=group_info.peer_ids, lossless_replies=isinstance(self, TrainingStateAverager),
        grace=grace, **extra, **kwargs,
    )
    assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
    self._running_groups[group_id].set_result(runner)
    if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
        async for index, (tensor, average) in aenumerate(azip(as_aiter(*tensors), runner)):
            adopt(tensor, average, self._averaging_alpha)
            if feedback is not None:  # the residual of this tensor is now final
                with feedback.lock:
                    feedback.residuals[index].copy_(runner.tensor_part_container.kept[index])
            self.last_updated = get_dht_time()
            self._state_updated.set()
        container = runner.tensor_part_container
        pipeline.finish(RoundEnd(
            group_info.group_id, container.failed_size, container.total_size, runner.left_out_size,
            late_reducers=late_arrivals(runner.replied_after_seconds, grace) if grace is not None else frozenset(),
            judged_slow=judged_slow(self, group_info, kwargs.get("peer_fractions")),
        ))
        keep_for_latecomers(self, group_id, runner, self._allreduce_timeout or LATECOMERS_SECONDS)
    else:
        async for _ in runner:
            raise ValueError("aux peers should not receive averaged tensors")


def judged_slow(averager: DecentralizedAverager, group_info: GroupInfo, peer_fractions) -> bool:
    """Whether this peer declared a bandwidth but its group gave it nothing to reduce: more than half of the others
    found its replies late (averaging/pipeline/stragglers.py judged_bandwidths)."""
    if not peer_fractions or len(group_info.peer_ids) < 3:
        return False
    index = group_info.peer_ids.index(averager.peer_id)
    own_claim = averager.serializer.loads(group_info.gathered[index])[0]
    return peer_fractions[index] == 0 and declared(own_claim) != 0


def adopt(tensor, average, alpha: float) -> None:
    """Move `tensor` to the round's `average`: with alpha 1, take its exact bits (what makes peers equal)."""
    if alpha == 1:
        tensor.copy_(average)
    else:
        tensor.lerp_(average.to(tensor.dtype), alpha)


_AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
PATCHES: Dict[str, Callable] = {
    f"{_AVERAGER}.run_in_background": run_in_background_with_pipeline,
    f"{_AVERAGER}.run": run_with_pipeline,
    f"{_AVERAGER}._run_allreduce_inplace_": run_allreduce_inplace_through_pipeline,
}
