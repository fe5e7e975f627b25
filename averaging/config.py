"""AveragingConfig: when and how peers average with each other.

Every rule that one field, or two fields together, must obey is checked here, at load
time, as a ValueError, so that the CLI reports it next to every other problem (exit 2).
This module must not import torch or hivemind: it is loaded before anything heavy.
"""
from __future__ import annotations

import importlib.util
from typing import List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from averaging.registry import DEFAULT_STRATEGY, STRATEGIES, STRATEGY_NAMES, accepting

CODECS = ("none", "fp16", "scaled-fp16", "uint8", "quantile8", "blockwise8", "int8", "int4", "topk", "adaptive")
FEEDBACK_CODECS = ("int8", "int4", "topk")  # ours, whose losses both legs of a round carry (pipeline/error_feedback.py)
TOPK_VALUE_BITS_CHOICES = (2, 4, 8, 16)
TOPK_CHUNK_CHOICES = tuple(2**power for power in range(4, 17))  # 65536 at most: an index fits in two bytes
MAX_ROUND_FACTOR = 64
"""The longest --max-round-factor: a round of 64 target batches is longer than any volunteer would wait for."""
BITSANDBYTES_INSTALL = "pip install 'swarmtrain[bitsandbytes]'"
AUTO = "auto"
REFUSABLE = {
    "delay_updates": ("--delay-updates does not work with", "drop --delay-updates or use"),
    "offload_optimizer": ("--offload-optimizer does not work with", "drop --offload-optimizer or use"),
    "error_feedback": ("--error-feedback on does not apply to", "use --error-feedback auto or"),
    "average_opt_statistics": ("--average-opt-statistics does not apply to", "drop --average-opt-statistics or use"),
}
"""The settings a strategy may refuse (Strategy.refuses, averaging/registry.py): how the error names each one
once it is switched on, and its way out."""
_FEEDBACK_STRATEGIES = tuple(name for name in accepting("error_feedback") if STRATEGIES[name].payload is not None)
"""The strategies error feedback applies to: those that send rounds and do not refuse it."""


def _sharing(setting: str):
    """The strategies whose runs share `setting` (the ones that read it), for help texts."""
    return [name for name, strategy in STRATEGIES.items() if setting in strategy.shared_settings]


Seconds = Union[float, Literal["auto"]]


def bitsandbytes_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def _seconds_or_auto(value, rule: str = "a number of seconds > 0 or 'auto'"):
    """Parse a float or 'auto' with one readable error (a plain Union would report one error per member)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"must be {rule}") from None
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"must be {rule}")
    return seconds


class AveragingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    target_batch_size: int = Field(
        default=4096,
        ge=1,
        description="Samples the whole swarm accumulates per global epoch (one averaged optimizer step).",
    )
    strategy: Literal[STRATEGY_NAMES] = Field(
        default=DEFAULT_STRATEGY,
        json_schema_extra={"cli_name": "averaging"},
        description="How peers combine their work: "
        + ", ".join(f"{strategy.name} ({strategy.help})" for strategy in STRATEGIES.values()) + ".",
    )
    matchmaking_seconds: Seconds = Field(
        default=5.0,
        description="How long to gather a group before averaging, or 'auto' (derived from the swarm's epoch time "
        "within --matchmaking-seconds-min/max). Raise it if rounds often have fewer peers than the swarm; lower it "
        "on fast local networks to cut the time per epoch.",
    )
    matchmaking_seconds_min: float = Field(
        default=1.0, gt=0, description="Lower bound for --matchmaking-seconds auto."
    )
    matchmaking_seconds_max: float = Field(
        default=30.0, gt=0, description="Upper bound for --matchmaking-seconds auto."
    )
    averaging_timeout_seconds: Seconds = Field(
        default=60.0,
        description="Give up on a round after this long and continue with local gradients, or 'auto' (about 2x the "
        "recent round times, within --averaging-timeout-seconds-min/max). Raise it if rounds time out on a slow link.",
    )
    averaging_timeout_seconds_min: float = Field(
        default=5.0, gt=0, description="Lower bound for --averaging-timeout-seconds auto."
    )
    averaging_timeout_seconds_max: float = Field(
        default=120.0, gt=0, description="Upper bound for --averaging-timeout-seconds auto; also the first value used."
    )
    load_state_timeout_seconds: float = Field(
        default=120.0, gt=0, description="How long to wait for peers to send their state when catching up."
    )
    min_peers: int = Field(
        default=1,
        ge=1,
        description="Wait until this many peers (this one included) are visible before the first step.",
    )
    min_peers_timeout_seconds: float = Field(
        default=300.0, gt=0, description="Give up waiting for --min-peers after this long (exit code 1)."
    )
    average_state_every: int = Field(
        default=1,
        ge=1,
        description="Average parameters (and --average-opt-statistics) every this many global epochs "
        f"({', '.join(_sharing('average_state_every'))}). Raise it to save bandwidth with local-sgd; lower it if peers "
        "drift apart.",
    )
    target_group_size: Optional[int] = Field(
        default=None,
        ge=2,
        description="local-sgd: average parameters in groups of about this many peers (this many to twice as many "
        "less one), not the whole swarm. The groups are dealt anew in every round, so the swarm mixes across "
        "rounds; at --max-epochs, every peer takes one peer's state before it leaves. A round then waits for its "
        "group, not for the slowest of many peers (until they are all in, or for three --matchmaking-seconds): for "
        "swarms of more than about 8 peers, or on slow links. Unset: every round averages the whole swarm.",
    )
    average_opt_statistics: List[str] = Field(
        default_factory=list,
        description="Comma-separated optimizer state names averaged with the parameters, e.g. exp_avg,exp_avg_sq.",
    )
    powersgd_rank: int = Field(
        default=4, ge=1, description="Rank of the PowerSGD gradient factors: lower sends less but approximates more."
    )
    diloco_inner_steps: int = Field(
        default=500,
        ge=1,
        description="DiLoCo: at most this many local optimizer steps per peer per outer round (a round ends when "
        "the swarm reaches --target-batch-size; later batches of the round only count samples).",
    )
    diloco_overlap: bool = Field(
        default=False,
        description="DiLoCo: average each outer round in the background while the next round's inner steps go on, "
        "and apply its outer update when it lands (one round late, as Streaming DiLoCo does); training waits only "
        "if a round has not landed by the end of the next.",
    )
    outer_lr: float = Field(default=0.7, gt=0, description="DiLoCo outer (Nesterov SGD) learning rate.")
    outer_momentum: float = Field(
        default=0.9, ge=0, lt=1, description="DiLoCo outer Nesterov momentum, in [0, 1)."
    )
    max_upload_mbit: Optional[float] = Field(
        default=None,
        gt=0,
        description="DiLoCo: cap this peer's averaging upload at this many Mbit/s, over a minute. The peer "
        "measures what its rounds send and how long its epochs take, and asks the swarm for outer rounds of up to "
        "--max-round-factor target batches (docs/strategies.md, an upload budget); if not even the longest is "
        "enough, it says so once. Unset: no budget.",
    )
    max_round_factor: int = Field(
        default=8,
        ge=1,
        le=MAX_ROUND_FACTOR,
        description="DiLoCo: the longest outer round the swarm allows, in target batches. Peers with "
        "--max-upload-mbit may ask for rounds of up to this many times --target-batch-size, and every peer applies "
        "the swarm's choice at the same epoch; 1 keeps every round at the target batch.",
    )
    grad_compression: str = Field(
        default="none",
        description="Codec for averaging gradients (DiLoCo: pseudo-gradients): none, fp16, scaled-fp16, uint8, "
        "quantile8, blockwise8, int8, int4 (blockwise absmax), topk (the largest values), adaptive.",
    )
    state_compression: str = Field(
        default="none", description="Codec for averaging parameters and optimizer statistics (same choices)."
    )
    load_state_compression: str = Field(
        default="none", description="Codec for sending state to peers that download it (same choices)."
    )
    topk_fraction: float = Field(
        default=0.01, gt=0, le=1,
        description="topk codec: the fraction of each tensor's values sent (the largest in magnitude; the rest "
        "go as zeros).",
    )
    topk_value_bits: int = Field(
        default=4,
        description="topk codec: bits per value sent, 2, 4, 8 or 16 (fp16). With error feedback, 4 does about as "
        "well as 16 at about half the bytes per value sent (docs/strategies.md); 2 sends 16% fewer bytes than 4 and "
        "loses more.",
    )
    topk_chunk: int = Field(
        default=256,
        description="topk codec: each chunk of this many values (a power of two from 16 to 65536) sends its "
        "--topk-fraction largest, with indices of one byte up to 256 and two beyond. A smaller chunk spreads the "
        "values sent more evenly over the tensor; at least one is sent per chunk.",
    )
    error_feedback: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Carry what a lossy --grad-compression loses in one round into the next (int8, int4 and topk, "
        f"with --averaging {' or '.join(_FEEDBACK_STRATEGIES)}): auto turns it on for those codecs, off applies each "
        "peer's loss at once, "
        "which leaves peers apart by it.",
    )
    adaptive_compression_threshold: int = Field(
        default=2**16,
        ge=1,
        description="adaptive codec: tensors with fewer elements than this go as fp16, larger ones as "
        "--adaptive-large-codec.",
    )
    adaptive_large_codec: Literal["uint8", "quantile8", "blockwise8"] = Field(
        default="uint8", description="adaptive codec: the 8-bit codec for large tensors."
    )
    offload_optimizer: bool = Field(
        default=False,
        description="ZeRO-Offload: keep a master copy of the parameters and the optimizer state in host memory and "
        "run the optimizer step on the CPU; only parameters and gradients stay on the device.",
    )
    robust_aggregation: Literal["mean", "trimmed-mean", "centered-clip"] = Field(
        default="trimmed-mean",
        description="How a reducer combines what it kept: trimmed-mean (per coordinate, without the highest and "
        "lowest; of 3, the median), mean (weighted by samples) or centered-clip. With trimmed-mean, "
        "--robust-trim-fraction of each end is left out, and at least one value of each with 3 or more contributions: "
        "of 3, the median outvotes one hostile peer; of 2, it is their weighted mean. mean is hivemind's own (any "
        "sender can move it anywhere); with centered-clip, no sender moves the result far. Contributions that hold "
        "NaN/Inf, or are far out by norm or direction, are dropped first.",
    )
    robust_max_weight_share: float = Field(
        default=2.0,
        ge=1,
        description="Cap a sender's weight at this many fair shares. A reducer counts the samples each sender "
        "claims (its weight in gradient and DiLoCo rounds) as at most this many times --target-batch-size / "
        "the number of senders of its part, and at most twice what its own progress records account for (never "
        "below one share), so that a peer cannot outweigh the others by claiming samples it never trained on; a "
        "claim above twice --target-batch-size is an offence (--exclude-after). Raise it if some honest peers are "
        "more than this many times as fast as the swarm's average.",
    )
    robust_norm_ratio: float = Field(
        default=20.0,
        gt=1,
        description="Drop a contribution whose norm is more than this many times the median of the others' (needs "
        "3 or more senders). Raise it if honest peers' updates differ a lot in size.",
    )
    robust_min_cosine: float = Field(
        default=-0.2,
        ge=-1,
        le=1,
        description="Drop a contribution whose cosine similarity to the others' coordinate-wise median is below "
        "this (it points against the swarm, e.g. sign-flipped; needs 4 or more senders); -1 turns this off.",
    )
    robust_trim_fraction: float = Field(
        default=0.25, ge=0, lt=0.5,
        description="trimmed-mean: the fraction cut from each end, per coordinate (rounded down, but at least one "
        "value of each end with 3 or more contributions).",
    )
    exclude_after: int = Field(
        default=3,
        ge=1,
        description="Exclude a peer once this many of its last --exclude-window rounds held an offence for this "
        "peer's reducers (a dropped contribution, or an implausible weight claim): it is then refused in matchmaking "
        "and state sharing.",
    )
    exclude_window: int = Field(
        default=10, ge=1, description="How many of a peer's most recent rounds --exclude-after counts in."
    )
    exclusion_seconds: Optional[float] = Field(
        default=None,
        gt=0,
        description="How long an excluded peer stays excluded; unset: for the rest of the run.",
    )
    harmful_update_rise: float = Field(
        default=0.02,
        ge=0,
        description="An averaged update that raises this peer's held-out (validation) loss by more than this "
        "fraction is harmful; after --harmful-updates of the last --harmful-update-window, this peer stops averaging "
        "with the peers of those rounds (a hostile majority). 0 turns the check off.",
    )
    harmful_updates: int = Field(
        default=3, ge=1, description="How many harmful averaged updates (see --harmful-update-rise) make this peer "
        "refuse the peers it averaged with in them."
    )
    harmful_update_window: int = Field(
        default=5, ge=1, description="How many of the most recent averaged updates --harmful-updates counts in."
    )
    straggler_grace_ratio: float = Field(
        default=1.0,
        ge=0,
        description="Stragglers: once more than half of a group has delivered a part of the average, its reducer "
        "waits for the rest at most this many times as long as they took (at least --straggler-grace-min-seconds); "
        "later contributions are left out of the round and their senders still get its result, and a peer left out "
        "stops reducing for others until it is in time again. Groups of two never leave anyone out. 0: wait for "
        "every member up to the averaging timeout.",
    )
    straggler_grace_min_seconds: float = Field(
        default=0.1, gt=0, description="The shortest grace window a reducer gives a group's last contributions."
    )
    delay_updates: bool = Field(
        default=False,
        description="Delayed parameter updates: average and run the (offloaded) optimizer step in the background "
        "during the next forward/backward, applying the result one step later. Needs --offload-optimizer.",
    )

    @field_validator("matchmaking_seconds", "averaging_timeout_seconds", mode="before")
    @classmethod
    def _seconds(cls, value):
        return _seconds_or_auto(value)

    @field_validator("max_upload_mbit", mode="before")
    @classmethod
    def _mbit(cls, value):
        if value is None:
            return None
        try:
            mbit = float(value)
        except (TypeError, ValueError):
            mbit = float("nan")
        if isinstance(value, bool) or not 0 < mbit < float("inf"):
            raise ValueError("must be an upload rate in Mbit/s, a finite number > 0 such as 10; leave it unset for "
                             "no budget")
        return mbit

    @field_validator("average_opt_statistics", mode="before")
    @classmethod
    def _split_names(cls, value):
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if isinstance(value, list):
            for name in value:
                if not isinstance(name, str) or not name.isidentifier():
                    raise ValueError(f"each name must be an optimizer state key such as exp_avg (got {name!r})")
        return value

    @field_validator("grad_compression", "state_compression", "load_state_compression", mode="before")
    @classmethod
    def _codec(cls, value):
        name = str(value).strip().lower()
        if name not in CODECS:
            raise ValueError(f"unknown codec; choose one of {', '.join(CODECS)}")
        if name == "blockwise8" and not bitsandbytes_available():
            raise ValueError(f"blockwise8 needs bitsandbytes; run {BITSANDBYTES_INSTALL} or pick another codec")
        return name

    @field_validator("topk_value_bits")
    @classmethod
    def _value_bits(cls, value: int) -> int:
        if value not in TOPK_VALUE_BITS_CHOICES:
            raise ValueError("must be 2 or 4 (blockwise low-bit values), 8 (blockwise int8) or 16 (fp16)")
        return value

    @field_validator("topk_chunk")
    @classmethod
    def _chunk(cls, value: int) -> int:
        if value not in TOPK_CHUNK_CHOICES:
            raise ValueError("must be a power of two from 16 to 65536, such as 256 (one-byte indices)")
        return value

    @field_validator("adaptive_large_codec", mode="after")
    @classmethod
    def _large_codec(cls, value):
        if value == "blockwise8" and not bitsandbytes_available():
            raise ValueError(f"blockwise8 needs bitsandbytes; run {BITSANDBYTES_INSTALL} or pick uint8/quantile8")
        return value

    @field_validator("average_opt_statistics")
    @classmethod
    def _statistic_names(cls, value: List[str]) -> List[str]:
        for name in value:
            if not name.isidentifier():
                raise ValueError(f"{name!r} is not an optimizer state name; use names such as exp_avg,exp_avg_sq")
        return value

    @property
    def checks_state(self) -> bool:
        """Whether peers check by digest that they hold one state (averaging/swarm/digests.py): with a strategy whose
        peers end each epoch with one state, and no delayed updates (which land in the background)."""
        return STRATEGIES[self.strategy].one_state and not self.delay_updates

    @model_validator(mode="after")
    def _no_conflicts(self) -> "AveragingConfig":
        for name, low, high in (
            ("matchmaking-seconds", self.matchmaking_seconds_min, self.matchmaking_seconds_max),
            ("averaging-timeout-seconds", self.averaging_timeout_seconds_min, self.averaging_timeout_seconds_max),
        ):
            if low > high:
                raise ValueError(
                    f"--{name}-min ({low}) is larger than --{name}-max ({high}); lower the first or raise the second"
                )
        if self.exclude_after > self.exclude_window:
            raise ValueError(
                f"--exclude-after ({self.exclude_after}) is larger than --exclude-window ({self.exclude_window}), so "
                f"nobody could ever be excluded; lower the first or raise the second"
            )
        if self.harmful_updates > self.harmful_update_window:
            raise ValueError(
                f"--harmful-updates ({self.harmful_updates}) is larger than --harmful-update-window "
                f"({self.harmful_update_window}), so no update could ever count as enough; lower the first or raise "
                f"the second"
            )
        if self.delay_updates and not self.offload_optimizer:
            raise ValueError(
                "--delay-updates needs --offload-optimizer (the delayed step runs on the offloaded host copy); "
                "add --offload-optimizer or drop --delay-updates"
            )
        if self.checks_state and self.load_state_compression != "none":
            raise ValueError(
                f"--load-state-compression {self.load_state_compression} loses precision, but with --averaging "
                f"{self.strategy} a downloaded state must equal its donor's bit for bit (peers check it against the "
                f"donor's digest); use --load-state-compression none"
            )
        if self.error_feedback == "on" and self.grad_compression not in FEEDBACK_CODECS:
            lossless = self.grad_compression == "none"
            why = "it loses nothing" if lossless else "error feedback is built for the codecs here"
            raise ValueError(
                f"--error-feedback on needs --grad-compression int8, int4 or topk "
                f"(got {self.grad_compression}: {why}); "
                f"pick one of those codecs or use --error-feedback auto"
            )
        for setting, (says, way_out) in REFUSABLE.items():
            why = STRATEGIES[self.strategy].refuses.get(setting)
            if why is not None and self._switched_on(setting):
                raise ValueError(f"{says} --averaging {self.strategy} ({why}); {way_out} --averaging "
                                 f"{'/'.join(accepting(setting))}")
        for owner in STRATEGIES.values():  # a switch, or an optional value, of another strategy's section
            for setting in owner.settings:
                if owner.name != self.strategy and self._set_in_section(setting):
                    flag = "--" + setting.replace("_", "-")
                    value = getattr(self, setting)
                    given = flag if value is True else f"{flag} {value:g}"
                    raise ValueError(f"{given} needs --averaging {owner.name} (got {self.strategy}: only {owner.name} "
                                     f"reads it); add --averaging {owner.name} or drop {flag}")
        return self

    @property
    def uses_error_feedback(self) -> bool:
        """Whether the gradient (DiLoCo: pseudo-gradient) averager carries its codec's loss between rounds."""
        return (self.error_feedback != "off" and self.grad_compression in FEEDBACK_CODECS
                and "error_feedback" not in STRATEGIES[self.strategy].refuses)

    def _set_in_section(self, setting: str) -> bool:
        """Whether a setting of a strategy's section asks for something: a switch turned on, or an optional value
        (unset by default, such as --max-upload-mbit) given."""
        value = getattr(self, setting)
        return value is True or (type(self).model_fields[setting].default is None and value is not None)

    def _switched_on(self, setting: str) -> bool:
        value = getattr(self, setting)
        return value == "on" if isinstance(value, str) else bool(value)

    def seconds(self, name: str) -> Optional[float]:
        """A deadline as a float, or None when it is 'auto'."""
        value = getattr(self, name)
        return None if value == AUTO else float(value)
