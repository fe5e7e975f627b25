"""build_swarm_optimizer: an AveragingConfig and a Replica in, the chosen strategy's SwarmOptimizer out.

It prepares what every strategy is built with (StrategyParts), then calls the builder that the
strategy registry (averaging/registry.py) names for config.strategy: it knows no strategy itself.
Here the config's deadlines become what hivemind's processes fix at start, and the hivemind adapter
is installed before any averager process forks. It must not know about metrics or the CLI: the
caller connects the hooks.
"""
from __future__ import annotations

from typing import Optional

from averaging import adapter
from averaging.api import Replica, SwarmOptimizer
from averaging.config import AveragingConfig
from averaging.deadlines import AdaptiveDeadlines
from averaging.pipeline.defence import Defence
from averaging.pipeline.error_feedback import ErrorFeedback
from averaging.pipeline.evidence import SampleEvidence
from averaging.pipeline.exclusion import ExclusionBook, ExclusionRule, ExclusionWatch
from averaging.pipeline.robust import RobustPolicy, WeightBound
from averaging.pipeline.round_pipeline import including
from averaging.pipeline.stragglers import GraceWindow
from averaging.registry import STRATEGIES
from averaging.strategies.agreement import StateAgreement
from averaging.strategies.parts import StrategyParts
from averaging.strategies.rounds import RoundKeeper


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
    hooks = replica.hooks
    exclusion = ExclusionWatch(defence, book, on_drop=hooks.contribution_dropped, on_exclude=hooks.peer_excluded,
                               on_credit=lambda credits: [
                                   hooks.contribution_accepted(credit.peer, credit.samples * rounds.samples_per_weight)
                                   for credit in credits])
    rounds = RoundKeeper(replica.hooks, _deadlines(config), exclusion=exclusion)
    strategy = STRATEGIES[config.strategy]
    agreement = None
    if config.checks_state:
        agreement = StateAgreement(replica.dht, replica.keys.digests, replica.hooks, defence,
                                   ttl_seconds=progress_record_ttl_seconds(config))
    parts = _parts(config, tracker_opts, rounds, agreement)
    try:
        # every averager forked below carries them
        grace = GraceWindow(config.straggler_grace_ratio, config.straggler_grace_min_seconds)
        with including(defence), including(grace), including(agreement.donor_filter if agreement else None):
            return strategy.load_builder()(config, replica, parts)
    except BaseException:
        if agreement is not None:
            agreement.close()
        exclusion.close()
        raise


def _deadlines(config: AveragingConfig) -> AdaptiveDeadlines:
    return AdaptiveDeadlines(
        matchmaking_seconds=config.seconds("matchmaking_seconds"),
        averaging_timeout_seconds=config.seconds("averaging_timeout_seconds"),
        matchmaking_bounds=(config.matchmaking_seconds_min, config.matchmaking_seconds_max),
        timeout_bounds=(config.averaging_timeout_seconds_min, config.averaging_timeout_seconds_max),
    )


def _parts(config: AveragingConfig, tracker_opts: Optional[dict], rounds: RoundKeeper,
           agreement: Optional[StateAgreement]) -> StrategyParts:
    # what the averager processes fix at start: the matchmaking floor and the all-reduce timeout
    matchmaking_floor = config.seconds("matchmaking_seconds") or config.matchmaking_seconds_min
    return StrategyParts(
        rounds=rounds,
        tracker_opts=dict(metadata_expiration=progress_record_ttl_seconds(config), **(tracker_opts or {})),
        # hivemind warns (and can deadlock) when a request may outlive the matchmaking window
        averager_opts=dict(request_timeout=min(3.0, matchmaking_floor / 2)),
        matchmaking_floor=matchmaking_floor,
        allreduce_timeout=config.seconds("averaging_timeout_seconds") or config.averaging_timeout_seconds_max,
        error_feedback=ErrorFeedback() if config.uses_error_feedback else None,
        weight_bound=WeightBound(config.target_batch_size, config.robust_max_weight_share, SampleEvidence()),
        agreement=agreement,
    )
