"""build_swarm_optimizer: an AveragingConfig and a Replica in, the chosen strategy's SwarmOptimizer out.

sync, local-sgd and powersgd are configurations of SyncOptimizer (hivemind.Optimizer underneath);
diloco is DiLoCoOptimizer. Here the config's deadlines become what hivemind's processes fix at
start, and the hivemind adapter is installed before any averager process forks. It must not know
about metrics or the CLI: the caller connects the hooks.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager

from averaging import adapter
from averaging.api import Replica, SwarmOptimizer
from averaging.codecs.compression import codecs_from_config
from averaging.config import AveragingConfig
from averaging.deadlines import AdaptiveDeadlines
from averaging.pipeline.defence import Defence
from averaging.pipeline.error_feedback import ErrorFeedback
from averaging.pipeline.exclusion import ExclusionBook, ExclusionRule, ExclusionWatch
from averaging.pipeline.robust import RobustPolicy
from averaging.pipeline.round_pipeline import including
from averaging.strategies.diloco import DiLoCoOptimizer
from averaging.strategies.rounds import RoundKeeper
from averaging.strategies.sync import SyncOptimizer
from averaging.swarm import progress


def progress_record_ttl_seconds(config: AveragingConfig) -> float:
    """How long a peer's progress record (and its other swarm records) outlives it (upstream: 60 s):
    a peer that died stops counting toward the swarm's progress after this long."""
    longest_matchmaking = config.seconds("matchmaking_seconds") or config.matchmaking_seconds_max
    return max(15.0, 3 * longest_matchmaking)


def build_swarm_optimizer(
    config: AveragingConfig, replica: Replica, tracker_opts: Optional[dict] = None
) -> SwarmOptimizer:
    """The optimizer of config.strategy.

    :param tracker_opts: extra ProgressTracker options (tests give each in-process peer its own private_key)
    """
    adapter.install()  # before any averager process forks: they inherit the patched classes
    defence = Defence(RobustPolicy(
        norm_ratio=config.robust_norm_ratio, min_cosine=config.robust_min_cosine, rule=config.robust_aggregation,
        trim_fraction=config.robust_trim_fraction,
    ))
    book = ExclusionBook(ExclusionRule(config.exclude_after, config.exclude_window, config.exclusion_seconds))
    exclusion = ExclusionWatch(defence, book, on_drop=replica.hooks.contribution_dropped,
                               on_exclude=replica.hooks.peer_excluded)
    rounds = RoundKeeper(replica.hooks, _deadlines(config), exclusion=exclusion)
    try:
        with including(defence):  # every averager forked below carries it
            return _build(config, replica, tracker_opts, rounds)
    except BaseException:
        exclusion.close()
        raise


def _deadlines(config: AveragingConfig) -> AdaptiveDeadlines:
    return AdaptiveDeadlines(
        matchmaking_seconds=config.seconds("matchmaking_seconds"),
        averaging_timeout_seconds=config.seconds("averaging_timeout_seconds"),
        matchmaking_bounds=(config.matchmaking_seconds_min, config.matchmaking_seconds_max),
        timeout_bounds=(config.averaging_timeout_seconds_min, config.averaging_timeout_seconds_max),
    )


def _build(config: AveragingConfig, replica: Replica, tracker_opts: Optional[dict], rounds: RoundKeeper
           ) -> SwarmOptimizer:
    # what the averager processes fix at start: the matchmaking floor and the all-reduce timeout
    matchmaking_floor = config.seconds("matchmaking_seconds") or config.matchmaking_seconds_min
    allreduce_timeout = config.seconds("averaging_timeout_seconds") or config.averaging_timeout_seconds_max
    tracker_opts = dict(metadata_expiration=progress_record_ttl_seconds(config), **(tracker_opts or {}))
    # hivemind warns (and can deadlock) when a request may outlive the matchmaking window
    averager_opts = dict(request_timeout=min(3.0, matchmaking_floor / 2))
    feedback = ErrorFeedback() if config.uses_error_feedback else None
    if config.strategy == "diloco":
        return DiLoCoOptimizer(
            config, replica, rounds=rounds, tracker_opts=tracker_opts, averager_opts=averager_opts,
            matchmaking_floor=matchmaking_floor, allreduce_timeout=allreduce_timeout, error_feedback=feedback,
        )

    # upstream waits one matchmaking window for a peer's next chunk, then averages without it: a peer on a
    # busy CPU then silently keeps its own values for part of the model and drifts from the swarm (seen:
    # "received 75% of input tensors" with a 1 s window). A quarter of the round's timeout still drops a
    # stalled peer well within the round.
    next_chunk_timeout = max(matchmaking_floor, allreduce_timeout / 4)
    strategy_args = {}
    if config.strategy == "local-sgd":
        strategy_args = dict(use_local_updates=True, average_opt_statistics=tuple(config.average_opt_statistics))
    elif config.strategy == "powersgd":
        powersgd = partial(PowerSGDGradientAverager, averager_rank=config.powersgd_rank)
        strategy_args = dict(grad_averager_factory=powersgd)
    if config.average_opt_statistics and config.strategy != "local-sgd":
        strategy_args["average_opt_statistics"] = tuple(config.average_opt_statistics)
    signing_key = progress.signing_key(tracker_opts)
    return SyncOptimizer(
        keys=replica.keys,
        rounds=rounds,
        signing_key=signing_key,
        report_state_rounds=config.strategy == "local-sgd",
        error_feedback=feedback,
        dht=replica.dht,
        params=replica.params,
        optimizer=replica.optimizer_factory,
        scheduler=replica.scheduler_factory,
        target_batch_size=config.target_batch_size,
        batch_size_per_step=replica.batch_size,
        matchmaking_time=matchmaking_floor,
        averaging_timeout=allreduce_timeout,
        next_chunk_timeout=next_chunk_timeout,
        load_state_timeout=config.load_state_timeout_seconds,
        average_state_every=config.average_state_every,
        offload_optimizer=config.offload_optimizer,
        delay_optimizer_step=config.delay_updates,
        delay_grad_averaging=config.delay_updates,
        client_mode=replica.client_mode,
        tracker_opts=dict(tracker_opts, private_key=signing_key),
        averager_opts=averager_opts,
        verbose=False,
        **codecs_from_config(config),
        **strategy_args,
    )
