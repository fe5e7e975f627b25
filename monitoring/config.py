"""MonitoringConfig: the metrics endpoint and health check of one peer."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MonitoringConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Port for /metrics and /healthz; 0 picks a free port."
    )
    metrics_host: str = Field(default="0.0.0.0", description="Address the metrics endpoint listens on.")
    health_window_seconds: float = Field(
        default=300.0,
        gt=0,
        description="/healthz turns 503 when the training loop made no progress for this long.",
    )
