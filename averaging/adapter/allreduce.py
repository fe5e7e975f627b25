"""The round pipeline (averaging/pipeline/round_pipeline.py) driven inside hivemind's averagers.

- Before an averager forks, in the training process: the stages included around it, and a Completeness stage
  for every averager, become its pipeline, which its process inherits.
- First thing in the averager's own process: that pipeline becomes the process's (refusals.py reads it).
- Each all-reduce: upstream's `_run_allreduce_inplace_`, with the stages applied at their points: error
  feedback's inputs and part container, a robust runner when the averager carries a Defence, and the share
  of the average that never arrived recorded by the completeness stage.
"""
from __future__ import annotations

from typing import Callable, Dict

from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import aenumerate, as_aiter, azip

from averaging.adapter.partition import FeedbackPartContainer
from averaging.adapter.reducer import RobustAllReduceRunner
from averaging.pipeline import round_pipeline
from averaging.pipeline.completeness import Completeness
from averaging.pipeline.defence import Defence
from averaging.pipeline.error_feedback import ErrorFeedback

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
    runner_class, extra = AllReduceRunner, {}
    if defence is not None:
        runner_class, extra = RobustAllReduceRunner, dict(defence=defence)
    if feedback is not None and not feedback.matches(tensors):
        feedback = None  # not this averager's own tensors
    if feedback is not None:
        with feedback.lock:
            carried = [residual.clone() for residual in feedback.residuals]
        inputs = [tensor.detach().float() + residual for tensor, residual in zip(tensors, carried)]
    runner = runner_class(
        p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=inputs if feedback else tensors,
        group_id=group_id, ordered_peer_ids=group_info.peer_ids, **extra, **kwargs,
    )
    if feedback is not None:
        _carry_residuals(runner, inputs, carried, kwargs)
    assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
    self._running_groups[group_id].set_result(runner)
    if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
        async for index, (tensor, update) in aenumerate(azip(as_aiter(*tensors), runner)):
            if feedback is None:
                tensor.add_(update, alpha=self._averaging_alpha)
            else:  # x + update is the average; the residual of this tensor is now final
                tensor.add_(inputs[index] + update - tensor, alpha=self._averaging_alpha)
                with feedback.lock:
                    feedback.residuals[index].copy_(runner.tensor_part_container.kept[index])
            self.last_updated = get_dht_time()
            self._state_updated.set()
        container = runner.tensor_part_container
        pipeline.finish(group_info.group_id, container.failed_size, container.total_size)
    else:
        async for _ in runner:
            raise ValueError("aux peers should not receive averaged tensors")


def _carry_residuals(runner: AllReduceRunner, inputs, carried, kwargs) -> None:
    """Replace the runner's part container (built in its __init__) by one that carries the residuals."""
    own_index = runner.ordered_peer_ids.index(runner.peer_id)
    container_options = {key: kwargs[key] for key in ("compression", "part_size_bytes") if key in kwargs}
    runner.tensor_part_container = FeedbackPartContainer(
        inputs, runner.peer_fractions, carried, own_index, **container_options)
    runner.parts_for_local_averaging = runner.tensor_part_container.get_raw_input_parts(own_index)


_AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
PATCHES: Dict[str, Callable] = {
    f"{_AVERAGER}.run_in_background": run_in_background_with_pipeline,
    f"{_AVERAGER}.run": run_with_pipeline,
    f"{_AVERAGER}._run_allreduce_inplace_": run_allreduce_inplace_through_pipeline,
}
