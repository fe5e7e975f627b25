"""AveragingConfig: when and how peers average with each other."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AveragingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target_batch_size: int = Field(
        default=4096,
        ge=1,
        description="Samples the whole swarm accumulates per global epoch (one averaged optimizer step).",
    )
    matchmaking_seconds: float = Field(
        default=5.0,
        gt=0,
        description="How long to gather a group before averaging. Raise it if rounds often have fewer peers than "
        "the swarm; lower it on fast local networks to cut the time per epoch.",
    )
    averaging_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Give up on a round after this long and continue with local gradients. About 2x the normal "
        "round time; raise it if rounds time out on a slow link.",
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
