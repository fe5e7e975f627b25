"""The strategy registry: every averaging strategy, declared once, for everything that names one.

A Strategy record is all that the rest of the daemon knows of a strategy: its name (the value of
--averaging) and help line; its config section (the AveragingConfig fields only it reads); the
settings every peer of a run must share with it (the run manifest, peer/runtime/manifest.py); the
settings it refuses, and why (the config's rules, averaging/config.py); what one of its rounds sends
(payload accounting, averaging/codecs/compression.py); and its builder, named "module:function" and
imported only when a peer builds its optimizer (averaging/strategies/factory.py). The config's
choices and help, the manifest, `peer start`, the composition root and the benchmarks read this
table; no other module spells a strategy's name.

This module must import nothing heavy (torch, hivemind, a strategy): averaging/config.py reads it
before anything else is loaded, so that `peer --help` stays fast.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Tuple

GRADIENTS = "gradients"
"""Payload: one tensor per parameter (the gradients, or DiLoCo's pseudo-gradients)."""
STATE = "state"
"""Payload: the parameters, and each optimizer statistic averaged along with them (--average-opt-statistics)."""
LOW_RANK = "low-rank"
"""Payload: PowerSGD's factors, P (m x r) and Q (n x r) for each matrix it compresses, the other tensors whole."""
PAYLOAD_TENSORS = (GRADIENTS, STATE, LOW_RANK)


@dataclass(frozen=True)
class Payload:
    """What one averaging round of a strategy sends, relative to the model."""

    tensors: str
    """One of PAYLOAD_TENSORS."""
    codec_setting: str
    """The AveragingConfig field that names the codec they are sent in."""


@dataclass(frozen=True)
class Strategy:
    """One averaging strategy, as the rest of the daemon sees it."""

    name: str
    """The value of --averaging."""
    help: str
    """What it does, in a few words, for the help of --averaging."""
    builder: str
    """"module:function" that builds its optimizer: function(config, replica, parts) -> SwarmOptimizer
    (averaging/api.py, averaging/strategies/parts.py)."""
    payload: Optional[Payload]
    """What one of its rounds sends; None: it sends nothing."""
    settings: Tuple[str, ...] = ()
    """Its config section: the AveragingConfig fields that only it reads. A switch among them (a bool) turned on
    while another strategy is chosen is an error."""
    shared_settings: Tuple[str, ...] = ()
    """The AveragingConfig fields every peer of a run must share with it, checked through the run manifest."""
    refuses: Mapping[str, str] = field(default_factory=dict)
    """Settings it cannot work with (of averaging/config.py's REFUSABLE) -> why; the config's error says it."""
    one_state: bool = False
    """Whether its peers end each global epoch with one state, bit for bit, which they check by digest
    (averaging/swarm/digests.py); with delayed updates, no strategy's state is checked."""

    def uses(self, setting: str) -> bool:
        """Whether `setting` is in its config section."""
        return setting in self.settings

    def load_builder(self) -> Callable:
        module, function = self.builder.split(":")
        return getattr(importlib.import_module(module), function)


_CODECS = ("grad_compression", "state_compression", "load_state_compression")
_STATE_ROUNDS = ("average_state_every", "average_opt_statistics")
_NOT_GRADIENTS = "it delays gradient averaging, which {} does not do"

_DECLARED = (
    Strategy(
        name="sync",
        help="average gradients, same update everywhere",
        builder="averaging.strategies.sync:build_sync",
        payload=Payload(GRADIENTS, "grad_compression"),
        shared_settings=(*_CODECS, *_STATE_ROUNDS),
        one_state=True,
    ),
    Strategy(
        name="local-sgd",
        help="local steps, average parameters every --average-state-every epochs",
        builder="averaging.strategies.sync:build_local_sgd",
        payload=Payload(STATE, "state_compression"),
        # groups suit parameter rounds alone: a group's gradient or pseudo-gradient round gives its peers an
        # update of their own, which the per-epoch state digests would then send them downloading to undo
        settings=("target_group_size",),
        shared_settings=(*_CODECS[1:], *_STATE_ROUNDS, "target_group_size"),
        refuses={
            "delay_updates": _NOT_GRADIENTS.format("local-sgd"),
            "offload_optimizer": "hivemind 1.1.12 never feeds local gradients to an offloaded optimizer with local "
                                 "updates",
            "error_feedback": "it averages parameters, not gradients",
        },
    ),
    Strategy(
        name="powersgd",
        help="low-rank gradient averaging",
        builder="averaging.strategies.sync:build_powersgd",
        payload=Payload(LOW_RANK, "grad_compression"),
        settings=("powersgd_rank",),
        shared_settings=(*_CODECS, *_STATE_ROUNDS, "powersgd_rank"),
        refuses={"error_feedback": "PowerSGD carries its own error feedback"},
        one_state=True,
    ),
    Strategy(
        name="diloco",
        help="--diloco-inner-steps local steps, then an outer Nesterov step on averaged deltas",
        builder="averaging.strategies.diloco:build_diloco",
        payload=Payload(GRADIENTS, "grad_compression"),
        settings=("diloco_inner_steps", "diloco_overlap", "outer_lr", "outer_momentum", "max_upload_mbit",
                  "max_round_factor"),
        # --max-upload-mbit is each peer's own: the swarm agrees on the round factor it asks for (averaging/budget.py)
        shared_settings=(*_CODECS, "diloco_inner_steps", "outer_lr", "outer_momentum", "max_round_factor"),
        refuses={
            "delay_updates": _NOT_GRADIENTS.format("diloco"),
            "offload_optimizer": "its outer state already lives in host memory and the inner optimizer steps every "
                                 "batch",
            "average_opt_statistics": "it averages pseudo-gradients, not state",
        },
        one_state=True,
    ),
    Strategy(
        name="none",
        help="no averaging: each peer trains alone, a baseline",
        builder="averaging.strategies.solo:build_solo",
        payload=None,
        refuses={
            "delay_updates": "it never averages",
            "offload_optimizer": "it steps the task's own optimizer where the model is",
            "error_feedback": "it sends nothing to lose",
            "average_opt_statistics": "it never averages",
        },
    ),
)

STRATEGIES: Dict[str, Strategy] = {strategy.name: strategy for strategy in _DECLARED}
"""Every strategy by name, in the order --averaging lists them."""
STRATEGY_NAMES = tuple(STRATEGIES)
DEFAULT_STRATEGY = _DECLARED[0].name


def accepting(setting: str) -> Tuple[str, ...]:
    """The strategies that do not refuse `setting`."""
    return tuple(name for name, strategy in STRATEGIES.items() if setting not in strategy.refuses)
